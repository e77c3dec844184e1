"""The lowering pass is driven by its rule table (quantbridge.patterns patterns → builders).

Pins the structure: the table is what the pass uses (a rule removed → its ops stay
reference, with the reason), a third-party rule added to the table lowers a new op, rule
order decides between rules on the same op, module classes match subclasses, a shared
dequantize is an input constraint (not a matched operator), and bad rules fail clearly.
"""

from __future__ import annotations

import copy
import operator
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

import quantbridge.lowering as L
from quantbridge.lowering import (
    LoweringContext,
    LoweringError,
    LoweringRule,
    NotLowerableError,
    RuleMatch,
    default_lowering_rules,
    lower_to_kernels,
    lowering_report,
)
from quantbridge.patterns import MatchAllNode, Nested

if str(Path(__file__).parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))
from lowering_zoo import ALL_CASES, Case, reference_model

_Q = torch.ops.quantbridge.quantize_per_tensor.tensor
_DQ = torch.ops.quantbridge.dequantize_per_tensor.tensor
TARGET = "generic"
BACKEND = L.get_backend("numba_generic")


def _case(name: str) -> Case:
    return next(c for c in ALL_CASES if c.name == name)


@pytest.fixture(scope="module")
def refs() -> dict[str, GraphModule]:
    names = ["pools", "unsupported_layer_norm", "depthwise", "residual_add_mul", "activations"]
    return {n: reference_model(_case(n), BACKEND) for n in names}


def _lower(ref: GraphModule, rules: Any = None) -> GraphModule:
    return lower_to_kernels(copy.deepcopy(ref), TARGET, rules=rules)


def _kernels(gm: GraphModule) -> list[str]:
    return [m.kernel for m in gm.modules() if isinstance(m, L.LoweredModule)]


def _float_ops(gm: GraphModule, *targets: Any) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.target in targets]


def test_default_table_lists_every_family_in_matching_order() -> None:
    names = [r.name for r in default_lowering_rules()]
    assert names == [
        "requantize",
        "linear / conv + clamp",
        "linear / conv (+relu)",
        "matmul",
        "add / mul",
        "add / mul + relu",
        "lookup table",
        "max_pool2d",
        "avg_pool2d",
        "adaptive_avg_pool2d",
        "cat",
        "identity in eval",
        "shape ops",
        "linear, float output",
        "dynamic linear",
        "dynamic lstm / gru",
        "embedding",
        "conv + add (+relu)",
        "linear + float columns",
        "conv / linear + activation",
        "dynamic linear + GELU",
        "float layer_norm (+ residual add)",
        "float softmax (+ scale, mask)",
        "attention on codes",
        "multi-head attention on codes",
        "layer_norm reads codes",
        "layer_norm + quantize",
        "float linear + quantize",
    ]
    by_name = {r.name: r for r in default_lowering_rules()}
    assert Nested(nn.ReLU, operator.add) in by_name["add / mul + relu"].ops
    assert {nn.MaxPool2d, F.max_pool2d} <= set(by_name["max_pool2d"].ops)
    assert by_name["dynamic linear"].kind == by_name["embedding"].kind == "float_output"


def test_the_table_is_what_the_pass_uses_a_removed_rule_keeps_its_ops(
    refs: dict[str, GraphModule],
) -> None:
    ref = refs["pools"]
    full = _lower(ref)
    assert "max_pool2d" in " ".join(_kernels(full))
    assert lowering_report(full).kept == []

    table = tuple(r for r in default_lowering_rules() if r.name != "max_pool2d")
    partial = _lower(ref, table)
    kept = dict(lowering_report(partial).kept)
    # Pools has one MaxPool2d module (maxp) and one F.max_pool2d call
    assert kept == {
        "maxp": "no kernel for module MaxPool2d",
        "max_pool2d": "no kernel for max_pool2d",
    }
    assert not any("max_pool2d" in k for k in _kernels(partial))
    # the float max pools run between a Dequantize and a Quantize module: reference form
    for name in ("maxp", "max_pool2d"):
        node = next(n for n in partial.graph.nodes if n.name == name)
        assert isinstance(node.args[0], Node)
        assert isinstance(partial.get_submodule(str(node.args[0].target)), L.LoweredModule)
        assert "Dequantize" in type(partial.get_submodule(str(node.args[0].target))).__name__
    # everything else is lowered as with the full table
    assert len(lowering_report(partial).lowered) < len(lowering_report(full).lowered)
    x = _case("pools").inputs(5)
    torch.testing.assert_close(partial(*x), ref(*x), atol=0.2, rtol=0)


def test_an_empty_table_lowers_nothing_and_keeps_every_op(refs: dict[str, GraphModule]) -> None:
    gm = _lower(refs["depthwise"], ())
    report = lowering_report(gm)
    assert report.lowered == []
    # dw is conv + relu fused (ConvReLU2d holding a reference Conv2d)
    assert report.kept == [
        ("dw", "no kernel for module ConvReLU2d"),
        ("pw", "no kernel for module Conv2d"),
    ]


# --- a third-party rule ----------------------------------------------------------------------


class MyLayerNorm(nn.Module):
    """A backend's own runtime op on uint8 codes: dequantize, layer_norm, quantize."""

    def __init__(self, shape: Any, in_qp: tuple[float, int], out_qp: tuple[float, int]) -> None:
        super().__init__()
        self.shape, self.in_qp, self.out_qp = tuple(shape), in_qp, out_qp

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        s_in, z_in = torch.tensor(self.in_qp[0]), torch.tensor(self.in_qp[1])
        s_out, z_out = torch.tensor(self.out_qp[0]), torch.tensor(self.out_qp[1])
        x = _DQ(codes, s_in, z_in, 0, 255, torch.uint8)
        return _Q(F.layer_norm(x, self.shape), s_out, z_out, 0, 255, torch.uint8)


def build_layer_norm(ctx: LoweringContext, match: RuleMatch) -> Node:
    node = match.node
    qin = ctx.quantized_input(node.args[0])
    if qin is None:
        raise NotLowerableError("layer_norm input is not a static uint8 value")
    if any(node.kwargs.get(k) is not None for k in ("weight", "bias")):
        raise NotLowerableError("affine layer_norm")
    codes, in_qp = qin
    mod = MyLayerNorm(node.args[1], in_qp, match.out_qparams)
    new = ctx.add_module(f"{node.name}_mine", mod, (codes,))
    ctx.record(new, "my_runtime.layer_norm")
    return new


LAYER_NORM_RULE = LoweringRule("my layer_norm", (F.layer_norm,), build_layer_norm)


def test_an_added_rule_lowers_a_new_op_and_keeps_the_chain_uint8(
    refs: dict[str, GraphModule],
) -> None:
    ref = refs["unsupported_layer_norm"]
    default = _lower(ref)
    assert dict(lowering_report(default).kept) == {"layer_norm": "no kernel for layer_norm"}

    extended = _lower(ref, (*default_lowering_rules(), LAYER_NORM_RULE))
    report = lowering_report(extended)
    assert report.kept == []
    assert ("layer_norm_mine", "my_runtime.layer_norm") in report.lowered
    assert report.origins["layer_norm_mine"] == "quantize_per_tensor_tensor_2"
    assert _float_ops(extended, F.layer_norm) == []
    # fc1 -> layer_norm -> fc2 on uint8: one Quantize at the input, one Dequantize at the output
    kinds = [type(m).__name__ for m in extended.modules() if isinstance(m, L.LoweredModule)]
    assert kinds.count("Quantize") == 1
    assert kinds.count("Dequantize") == 1
    ln = next(n for n in extended.graph.nodes if n.name == "layer_norm_mine")
    # its input is lowered fc1's uint8 output, its user lowered fc2 (node names survive)
    (fc1,), (fc2,) = ln.all_input_nodes, list(ln.users)
    assert report.origins[fc1.name] == "quantize_per_tensor_tensor_1"
    assert report.origins[fc2.name] == "quantize_per_tensor_tensor_3"
    # the same numbers as the default lowering, which runs layer_norm between a Dequantize
    # and a Quantize module (kernels' quantize/dequantize equal fx_quant's reference ops)
    for seed in range(3):
        x = _case("unsupported_layer_norm").inputs(seed)
        assert torch.equal(extended(*x), default(*x))


def test_a_builder_refusing_a_match_keeps_it_with_its_reason(
    refs: dict[str, GraphModule],
) -> None:
    def refuse(ctx: LoweringContext, match: RuleMatch) -> Node:
        raise NotLowerableError("my backend keeps layer_norm in float")

    rule = LoweringRule("my layer_norm", (F.layer_norm,), refuse)
    gm = _lower(refs["unsupported_layer_norm"], (*default_lowering_rules(), rule))
    assert lowering_report(gm).kept == [("layer_norm", "my backend keeps layer_norm in float")]


def test_an_earlier_rule_takes_precedence_on_a_shared_op(refs: dict[str, GraphModule]) -> None:
    def keep_sigmoid(ctx: LoweringContext, match: RuleMatch) -> Node:
        raise NotLowerableError("sigmoid stays float here")

    ref = refs["activations"]
    assert ("sig_lut", "kernels.apply_lut (Sigmoid)") in lowering_report(_lower(ref)).lowered
    first = LoweringRule("keep sigmoid", (nn.Sigmoid,), keep_sigmoid)
    report = lowering_report(_lower(ref, (first, *default_lowering_rules())))
    assert report.kept == [("sig", "sigmoid stays float here")]
    assert "sig_lut" not in dict(report.lowered)
    # placed last, the built-in lookup-table rule wins
    report = lowering_report(_lower(ref, (*default_lowering_rules(), first)))
    assert report.kept == []
    assert ("sig_lut", "kernels.apply_lut (Sigmoid)") in report.lowered


def _insert_quantize_dequantize(
    ref: GraphModule, value: Node, user: Node, name: str, scale: float, zero_point: int
) -> Node:
    """``user`` reads ``dequantize(quantize(value))`` with new constant qparams; the quantize."""
    g = ref.graph
    ref.register_buffer(f"{name}_scale", torch.tensor(scale))
    ref.register_buffer(f"{name}_zp", torch.tensor(zero_point))
    with g.inserting_before(user):
        s, z = g.get_attr(f"{name}_scale"), g.get_attr(f"{name}_zp")
        q = g.call_function(_Q, (value, s, z, 0, 255, torch.uint8))
        dq = g.call_function(_DQ, (q, s, z, 0, 255, torch.uint8))
    user.replace_input_with(value, dq)
    g.lint()
    ref.recompile()
    return q


# --- matching semantics --------------------------------------------------------------------


class MyHardswish(nn.Hardswish):
    """A subclass: the table names nn.Hardswish, which means isinstance."""


class MyReLU(nn.ReLU):
    pass


def test_module_classes_in_the_table_match_their_subclasses(refs: dict[str, GraphModule]) -> None:
    ref = copy.deepcopy(refs["activations"])
    ref.hs = MyHardswish()
    report = lowering_report(_lower(ref))
    assert report.kept == []
    assert ("hs_lut", "kernels.apply_lut (MyHardswish)") in report.lowered
    # inside a nested pattern too: relu(add) with the relu module subclassed → add_relu
    res = copy.deepcopy(refs["residual_add_mul"])
    res.relu = MyReLU()
    report = lowering_report(_lower(res))
    assert report.kept == []
    # the add_relu then fuses into the conv that feeds it (``kernels.conv2d_add``)
    assert any(what.endswith("conv + add_relu") for _, what in report.lowered)


def test_requantize_after_a_shared_dequantize(refs: dict[str, GraphModule]) -> None:
    """quantize(dequantize(x)) where the dequantize has other users: the dequantize is an
    input constraint of the rule, not a matched operator, so it may be shared."""
    ref = copy.deepcopy(refs["residual_add_mul"])
    g = ref.graph
    dq = next(n for n in g.nodes if n.target is _DQ and len(n.users) > 1)
    user = next(iter(dq.users))
    q2 = _insert_quantize_dequantize(ref, dq, user, "extra", 0.05, 100)

    gm = _lower(ref)
    report = lowering_report(gm)
    assert report.kept == []
    requant = [n for n, kernel in report.lowered if kernel == "kernels.requantize"]
    assert [report.origins[n] for n in requant] == [q2.name]
    assert _float_ops(gm, _Q, _DQ) == []
    x = _case("residual_add_mul").inputs(1)
    torch.testing.assert_close(gm(*x), ref(*x), atol=0.2, rtol=0)


def test_a_quantize_after_a_lowered_float_output_op_is_reported_not_lowered() -> None:
    """Embedding → static Linear: matched on the reference graph, the quantize's op is the
    embedding module; once the embedding is lowered (float output) the quantize reads the
    lowered module, which no rule lowers."""
    from quantbridge.fx_quant import convert_to_reference_fx, prepare_fx
    from quantbridge.qconfig import QConfigMapping, float_qparams_weight_only_qconfig

    class EmbLinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = nn.EmbeddingBag(10, 4, mode="sum")
            self.fc = nn.Linear(4, 4)

        def forward(self, idx: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
            return self.fc(self.bag(idx, off))

    torch.manual_seed(0)
    mapping = (
        QConfigMapping()
        .set_object_type(nn.EmbeddingBag, float_qparams_weight_only_qconfig)
        .set_object_type(nn.Linear, BACKEND.qconfig_mapping().global_qconfig)
    )
    idx, off = torch.randint(0, 10, (6,)), torch.tensor([0, 2])
    prepared = prepare_fx(
        EmbLinear().eval(), mapping, (idx, off), backend_config=BACKEND.backend_config
    )
    prepared(idx, off)
    ref = convert_to_reference_fx(prepared, backend_config=BACKEND.backend_config)
    gm = _lower(ref)
    report = lowering_report(gm)
    assert report.kept == [("bag_lowered", "no kernel for module QuantizedEmbeddingBag")]
    assert any(k.startswith("kernels.embedding_bag") for _, k in report.lowered)
    assert any(k.startswith("kernels.linear") for _, k in report.lowered)
    torch.testing.assert_close(gm(idx, off), ref(idx, off), atol=0.1, rtol=0)


def test_a_static_match_whose_op_was_lowered_as_float_output_is_reported() -> None:
    """quantize(dynamic Linear): both the static linear rule and the dynamic rule match the
    Linear on the reference graph; graph order lowers the dynamic one first, and the
    quantize then reads the lowered module, which no rule lowers (as the hand-walked pass
    did: the dynamic lowering wins)."""
    from quantbridge.fx_quant import convert_to_reference_fx, prepare_fx
    from quantbridge.qconfig import QConfigMapping, default_dynamic_qconfig

    class DynThenStatic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dyn = nn.Linear(8, 8)
            self.st = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.st(self.dyn(x))

    torch.manual_seed(0)
    mapping = (
        QConfigMapping()
        .set_global(BACKEND.qconfig_mapping().global_qconfig)
        .set_module_name("dyn", default_dynamic_qconfig)
    )
    x = torch.randn(4, 8)
    prepared = prepare_fx(
        DynThenStatic().eval(), mapping, (x,), backend_config=BACKEND.backend_config
    )
    prepared(x)
    ref = convert_to_reference_fx(prepared, backend_config=BACKEND.backend_config)
    # a static uint8 quantize/dequantize pair between the two Linears
    g = ref.graph
    dyn = next(n for n in g.nodes if n.target == "dyn")
    st = next(n for n in g.nodes if n.target == "st")
    _insert_quantize_dequantize(ref, dyn, st, "mid", 0.02, 128)

    gm = _lower(ref)
    report = lowering_report(gm)
    assert report.kept == [("dyn_dynamic", "no kernel for module QuantizedDynamicLinear")]
    kernels = dict(report.lowered)
    assert kernels["dyn_dynamic"].startswith("kernels.linear_dynamic")
    assert any(k.startswith("kernels.linear (") for k in kernels.values())
    torch.testing.assert_close(gm(x), ref(x), atol=0.1, rtol=0)


# --- errors --------------------------------------------------------------------------------


def test_bad_rules_raise_lowering_errors_naming_the_rule() -> None:
    def build(ctx: LoweringContext, match: RuleMatch) -> Node:
        raise AssertionError("never built")

    with pytest.raises(LoweringError, match=r"'bad'\.ops\[1\]: got an instance of ReLU"):
        LoweringRule("bad", (F.relu, nn.ReLU()), build)  # an instance, not the class
    with pytest.raises(LoweringError, match="MatchAllNode alone"):
        LoweringRule("all", (MatchAllNode,), build, kind="float_output")
    with pytest.raises(LoweringError, match="non-empty tuple of patterns"):
        LoweringRule("empty", (), build)
    with pytest.raises(LoweringError, match="kind must be 'static', 'float_output' or 'fusion'"):
        LoweringRule("kind", (nn.ReLU,), build, kind="dynamic")  # type: ignore[arg-type]
    with pytest.raises(LoweringError, match="build must be callable"):
        LoweringRule("nobuild", (nn.ReLU,), None)  # type: ignore[arg-type]
    rule = LoweringRule("list ops", [nn.ReLU, F.relu], build)  # type: ignore[arg-type]
    assert rule.ops == (nn.ReLU, F.relu)


def test_bad_tables_and_builders_raise_lowering_errors(refs: dict[str, GraphModule]) -> None:
    ref = refs["depthwise"]
    with pytest.raises(LoweringError, match="got one rule"):
        _lower(ref, LAYER_NORM_RULE)
    with pytest.raises(LoweringError, match=r"rules\[1\] is str"):
        _lower(ref, (LAYER_NORM_RULE, "relu"))

    def returns_nothing(ctx: LoweringContext, match: RuleMatch) -> Any:
        return None

    rule = LoweringRule("broken", (nn.Sigmoid,), returns_nothing)
    with pytest.raises(LoweringError, match=r"rule 'broken'.*returned None for node"):
        _lower(refs["activations"], (rule,))


def test_float_output_matches_have_no_output_qparams() -> None:
    def build(ctx: LoweringContext, match: RuleMatch) -> Node:
        return match.node

    x = torch.fx.Graph().placeholder("x")
    rule = LoweringRule("emb", (nn.Embedding,), build, kind="float_output")
    with pytest.raises(LoweringError, match="float-output match has no output qparams"):
        _ = RuleMatch(rule, x, (), x, None).out_qparams
