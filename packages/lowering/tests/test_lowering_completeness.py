"""Nothing stays float silently: after the numba lowering, every part of the reference model
that carries quantization is either lowered or listed in ``lowering_report(model).kept``.

Checked on the lowered graph (node names survive lowering), for the lowering zoo and the
transformer models under the backend's static mapping and a dynamic one (the real CNNs:
tests/test_real_models_completeness.py):

- a call of a reference quantized module (or of a fused module holding one) is kept;
- a reference quantize/dequantize/choose_qparams op left in the graph belongs to a kept op;
- a float op whose output is quantized (by a reference quantize op or a kernel module: the
  op was to be quantized, or feeds a quantized op and runs float itself) is kept;
- every name the report lists exists in the lowered graph, with a reason for each kept one.

Also: dynamic ``LinearReLU`` (the feed-forward ``linear1`` of relu transformer layers) runs as
``kernels.linear_dynamic`` followed by a float relu, exactly relu of the dynamic linear.
"""

from __future__ import annotations

import copy
import operator
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx import GraphModule, Node

if str(Path(__file__).parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))
import lowering_zoo as zoo
import test_lowering_transformer as tt

import quantbridge.lowering as L
from quantbridge.fx_quant import calibrate, convert_to_reference_fx, prepare_fx
from quantbridge.fx_quant.nn.reference import ReferenceQuantizedModule
from quantbridge.lowering._modules import Quantize
from quantbridge.qconfig import QConfigMapping, default_dynamic_qconfig

pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")

_Q = torch.ops.quantbridge.quantize_per_tensor.tensor


def _dynamic_mapping() -> QConfigMapping:
    return QConfigMapping().set_global(default_dynamic_qconfig)


# --- the invariant -------------------------------------------------------------------------


def _is_quant_op(node: Node) -> bool:
    """A reference quantization op (torch.ops.quantbridge.*) still in the graph."""
    return node.op == "call_function" and getattr(node.target, "namespace", "") == "quantbridge"


def _module(gm: GraphModule, node: Node) -> nn.Module | None:
    return gm.get_submodule(str(node.target)) if node.op == "call_module" else None


def _holds_reference_module(gm: GraphModule, node: Node) -> bool:
    mod = _module(gm, node)
    return mod is not None and any(isinstance(m, ReferenceQuantizedModule) for m in mod.modules())


def _quantizes(gm: GraphModule, node: Node) -> bool:
    """``node`` is a static quantize: a kernel module (lowered boundary) or a reference op."""
    return isinstance(_module(gm, node), Quantize) or (
        node.op == "call_function" and node.target is _Q
    )


def _float_op(gm: GraphModule, node: Node) -> bool:
    if node.op not in ("call_module", "call_function", "call_method"):
        return False
    return not _is_quant_op(node) and not isinstance(_module(gm, node), L.LoweredModule)


def unreported(lowered: GraphModule) -> list[str]:
    """What the lowered model keeps in reference form without the report saying so."""
    report = L.lowering_report(lowered)
    kept = dict(report.kept)
    nodes = {n.name: n for n in lowered.graph.nodes}
    problems = [f"{name}: listed as {what!r} but not in the graph"
                for name, what in [*report.lowered, *report.kept] if name not in nodes]  # fmt: skip
    problems += [f"{name}: kept without a reason" for name, why in report.kept if not why.strip()]

    def quantized_out(n: Node) -> bool:
        return any(_quantizes(lowered, u) for u in n.users)

    def belongs_to_kept(op: Node) -> bool:
        """A reference quantization op next to a kept op (through other such ops)."""
        seen, todo = {op}, [op]
        while todo:
            n = todo.pop()
            for m in [*n.all_input_nodes, *n.users]:
                if m.name in kept:
                    return True
                if m not in seen and (_is_quant_op(m) or m.target is operator.getitem):
                    seen.add(m)
                    todo.append(m)
        return False

    for n in lowered.graph.nodes:
        if n.name in kept:
            continue
        if _holds_reference_module(lowered, n):
            problems.append(f"{n.name}: reference module {type(_module(lowered, n)).__name__}")
        elif _is_quant_op(n) and not belongs_to_kept(n):
            problems.append(f"{n.name}: reference op {n.target}")
        elif _float_op(lowered, n) and quantized_out(n):
            problems.append(f"{n.name}: float op {n.target} with a quantized output")
    return problems


def _lower(
    model: nn.Module,
    mapping: QConfigMapping,
    example: tuple[Tensor, ...],
    data: Sequence[tuple[Tensor, ...]],
    rules: tuple[L.LoweringRule, ...] | None = None,
) -> tuple[GraphModule, GraphModule]:
    """(reference model, lowered model) with the numba backend."""
    backend = L.get_backend("numba")
    prepared = prepare_fx(model.eval(), mapping, example, backend_config=backend.backend_config)
    calibrate(prepared, data, progress=False)
    reference = convert_to_reference_fx(prepared, backend_config=backend.backend_config)
    if rules is None:
        return reference, backend.lower(copy.deepcopy(reference))
    target = L.lowering_report(backend.lower(copy.deepcopy(reference))).target
    return reference, L.lower_to_kernels(copy.deepcopy(reference), target, rules=rules)


def _mappings(case: zoo.Case) -> dict[str, Callable[[], QConfigMapping]]:
    backend = L.get_backend("numba")
    return {
        "static": backend.qconfig_mapping,
        "dynamic": _dynamic_mapping,
        "case": lambda: zoo.qconfig_mapping_for(case, backend),
    }


# "case": the zoo's own mapping where it is not the static one (dynamic Linear only, embeddings)
_ZOO = [
    (c, m) for c in zoo.ALL_CASES for m in ("static", "dynamic", "case")
    if m != "case" or c.mode != "static"
]  # fmt: skip


@pytest.mark.parametrize(("case", "mapping"), _ZOO, ids=[f"{c.name}-{m}" for c, m in _ZOO])
def test_zoo_nothing_left_float_silently(case: zoo.Case, mapping: str) -> None:
    torch.manual_seed(0)
    data = [case.inputs(100 + i) for i in range(2)]
    _, lowered = _lower(case.model(), _mappings(case)[mapping](), case.inputs(0), data)
    assert unreported(lowered) == [], str(L.lowering_report(lowered))


_TRANSFORMERS = [
    (name, act, mode)
    for name, acts in (("encoder", ("relu", "gelu")), ("seq2seq", ("gelu",)))
    for act in acts
    for mode in ("static", "dynamic")
]


@pytest.mark.parametrize(
    ("name", "activation", "mode"), _TRANSFORMERS, ids=["-".join(t) for t in _TRANSFORMERS]
)
def test_transformers_nothing_left_float_silently(name: str, activation: str, mode: str) -> None:
    cls = tt.MODELS[name][0]
    torch.manual_seed(0)
    model = cls(activation) if name == "encoder" else cls()
    mapping = L.get_backend("numba").qconfig_mapping() if mode == "static" else _dynamic_mapping()
    data = [(x,) for x in tt._data(0)]
    _, lowered = _lower(model, mapping, data[0], data)
    assert unreported(lowered) == [], str(L.lowering_report(lowered))


# --- dynamic LinearReLU --------------------------------------------------------------------


class _FeedForward(nn.Module):
    """Linear -> relu (F.relu or nn.ReLU: both fuse to LinearReLU) -> Linear."""

    def __init__(self, relu_module: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 24)
        self.act: Callable[[Tensor], Tensor] = nn.ReLU() if relu_module else F.relu
        self.fc2 = nn.Linear(24, 6)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.fc2(self.act(self.fc1(x)))
        return out


class _FirstLayer(nn.Module):
    """``fc1`` of a _FeedForward alone: the same weights without the relu."""

    def __init__(self, fc1: nn.Linear) -> None:
        super().__init__()
        self.fc1 = copy.deepcopy(fc1)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.fc1(x)
        return out


def _ffn_data(seed: int, n: int = 3) -> list[tuple[Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 7, 12, generator=g),) for _ in range(n)]


_DYNAMIC_RELU_MAPPINGS = {
    "global": _dynamic_mapping,
    # torch.ao refuses a fused pattern whose members have different qconfigs: name both
    "object_types": lambda: (
        QConfigMapping()
        .set_object_type(nn.Linear, default_dynamic_qconfig)
        .set_object_type(nn.ReLU, default_dynamic_qconfig)
        .set_object_type(F.relu, default_dynamic_qconfig)
    ),
}


@pytest.mark.parametrize("mapping", list(_DYNAMIC_RELU_MAPPINGS))
@pytest.mark.parametrize("relu_module", [False, True], ids=["F.relu", "nn.ReLU"])
def test_dynamic_linear_relu_lowered(relu_module: bool, mapping: str) -> None:
    torch.manual_seed(0)
    model = _FeedForward(relu_module).eval()
    reference, lowered = _lower(
        model, _DYNAMIC_RELU_MAPPINGS[mapping](), _ffn_data(0)[0], _ffn_data(1)
    )
    assert type(reference.get_submodule("fc1")).__name__ == "LinearReLU"
    report = L.lowering_report(lowered)
    assert report.kept == []
    lowered_as = dict(report.lowered)
    assert lowered_as["fc1_dynamic"].startswith("kernels.linear_dynamic (")
    assert lowered_as["fc1_dynamic"].endswith(", relu fused")  # in the kernel's epilogue
    assert lowered_as["fc2_dynamic"] == f"kernels.linear_dynamic ({report.target})"
    dyn = [m for m in lowered.modules() if isinstance(m, L.LoweredModule)]
    assert [type(m).__name__ for m in dyn] == ["QuantizedDynamicLinear"] * 2
    assert "choose_qparams" not in lowered.code
    # the same fc1 without relu, lowered: the relu model's first layer is exactly its relu
    # (computed in the dynamic linear's float epilogue)
    _, plain = _lower(_FirstLayer(model.fc1), _dynamic_mapping(), _ffn_data(0)[0], _ffn_data(1))
    for (x,) in _ffn_data(2):
        with torch.no_grad():
            got, want, ideal = lowered(x), reference(x), model(x)
            hidden = lowered.get_submodule("fc1_dynamic")(x)
            assert torch.equal(hidden, torch.relu(plain(x)))
        # as the other dynamic-linear tests: no farther from float than the reference
        err_ref = float((want - ideal).abs().max())
        err_low = float((got - ideal).abs().max())
        assert err_ref > 0
        assert err_low <= 1.5 * err_ref + 1e-4, (err_low, err_ref)
        assert float((got - want).abs().max()) <= 2.5 * err_ref + 1e-4
        with torch.no_grad():
            fc2 = lowered.get_submodule("fc2_dynamic")
            assert torch.equal(got, fc2(hidden))


def test_invariant_catches_a_silently_skipped_op() -> None:
    """Without the LinearReLU pattern, the dynamic fused layer stays reference unreported."""
    without = tuple(
        rule
        if rule.name != "dynamic linear"
        else L.LoweringRule(
            rule.name,
            tuple(p for p in rule.ops if "LinearReLU" not in repr(p)),
            rule.build,
            kind=rule.kind,
            constraints=rule.constraints,
            match_filter=rule.match_filter,
        )
        for rule in L.default_lowering_rules()
    )
    assert len(without) == len(L.default_lowering_rules())
    _, lowered = _lower(
        _FeedForward(True), _dynamic_mapping(), _ffn_data(0)[0], _ffn_data(1), rules=without
    )
    problems = unreported(lowered)
    assert any(p.startswith("fc1: reference module LinearReLU") for p in problems), problems
    assert any("reference op" in p for p in problems), problems
