"""End to end on the zoo: every numba backend lowers, stays uint8 between quantized ops, and
its outputs are within one quantization step of the reference model, element by element."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Interpreter, Node

if str(Path(__file__).parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))
import lowering_zoo as zoo

import quantbridge.lowering as L
from quantbridge import kernels as K
from quantbridge.lowering._modules import Dequantize, Quantize, QuantizedConvAdd

_Q = torch.ops.quantbridge.quantize_per_tensor.tensor
_DQ = torch.ops.quantbridge.dequantize_per_tensor.tensor

NUMBA = [f"numba_{t}" for t in K.available_targets()]


def _count(gm: GraphModule, target: object) -> int:
    """quantize (``_Q``) or dequantize (``_DQ``) nodes: reference ops or the lowered modules
    that replace them at chain boundaries."""
    kind = {_Q: Quantize, _DQ: Dequantize}[target]
    return sum(
        1
        for n in gm.graph.nodes
        if (n.op == "call_function" and n.target is target)
        or (n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), kind))
    )


def _outputs(result: object) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    assert isinstance(result, tuple)
    return list(result)


def _output_steps(reference: GraphModule) -> list[float | None]:
    """The scale of the dequantize producing each model output (None for float outputs)."""
    out_node = next(n for n in reference.graph.nodes if n.op == "output")
    outs = out_node.args[0]
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    steps: list[float | None] = []
    for o in outs:
        if isinstance(o, Node) and o.op == "call_function" and o.target is _DQ:
            scale = getattr(reference, str(o.args[1].target))  # type: ignore[union-attr]
            steps.append(float(scale))
        else:
            steps.append(None)
    return steps


class _Recorder(Interpreter):
    """Runs a graph and keeps every node's value by node name."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: Node) -> Any:
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def _allowed_codes(gm: GraphModule, n: Node) -> int:
    """How many codes a lowered op may be from the reference quantize it replaced: one, plus,
    for a fused conv + add, the conv's own rounding point carried through the add (the
    reference conv sums in float, the kernel in integers: one conv code apart near a tie)."""
    module = gm.get_submodule(str(n.target)) if n.op == "call_module" else None
    if isinstance(module, QuantizedConvAdd):
        return 1 + math.ceil(float(module.scale) / float(module.add_scale))
    return 1


class _TeacherForced(Interpreter):
    """Runs the lowered graph; each lowered op's output is compared with the reference
    quantize it replaced (at most one code apart), then replaced by the reference value so
    one op's rounding difference does not travel to the next op."""

    def __init__(self, gm: GraphModule, ref: dict[str, Any], origins: dict[str, str]) -> None:
        super().__init__(gm)
        self.ref, self.origins = ref, origins
        self.checked = 0
        self.worst = 0

    def run_node(self, n: Node) -> Any:
        out = super().run_node(n)
        origin = self.origins.get(n.name)
        if origin is None:
            return out
        want = self.ref[origin]
        assert isinstance(out, torch.Tensor)
        assert out.shape == want.shape, n.name
        if want.dtype == torch.uint8:
            assert out.dtype == torch.uint8, n.name
            codes = (out.to(torch.int16) - want.to(torch.int16)).abs()
            worst = int(codes.max()) if codes.numel() else 0
            assert worst <= _allowed_codes(self.module, n), (n.name, origin, worst)
            self.worst = max(self.worst, worst)
            self.checked += 1
        elif n.op == "call_module" and isinstance(self.module.get_submodule(str(n.target)),
                                                  Dequantize):  # fmt: skip
            assert torch.equal(out, want), n.name  # same formula as the reference op
            self.checked += 1
        return want


def _coarsest_step(reference: GraphModule) -> float:
    steps = []
    for n in reference.graph.nodes:
        scale = n.args[1] if n.op == "call_function" and n.target is _Q else None
        if isinstance(scale, Node) and scale.op == "get_attr":
            steps.append(float(getattr(reference, str(scale.target))))
    return max(steps)


@pytest.mark.parametrize("backend_name", NUMBA)
@pytest.mark.parametrize("case", zoo.STATIC_CASES, ids=lambda c: c.name)
def test_static_each_op_within_one_code_of_reference(case: zoo.Case, backend_name: str) -> None:
    backend = L.get_backend(backend_name)
    reference = zoo.reference_model(case, backend)
    lowered = backend.lower(reference)
    origins = L.lowering_report(lowered).origins
    assert origins
    steps = _output_steps(reference)
    coarsest = _coarsest_step(reference)
    for seed in range(3):
        inputs = case.inputs(seed)
        with torch.no_grad():
            rec = _Recorder(reference)
            want = _outputs(rec.run(*inputs))
            forced = _TeacherForced(lowered, rec.values, origins)
            forced_out = _outputs(forced.run(*inputs))
            got = _outputs(lowered(*inputs))
        assert forced.checked == sum(1 for o in origins.values() if o in rec.values)
        assert len(want) == len(got) == len(steps)
        for i, (w, g, f, step) in enumerate(zip(want, got, forced_out, steps, strict=True)):
            assert g.shape == w.shape, (case.name, i)
            assert g.dtype == torch.float32
            assert step is not None, "every static zoo output ends in a dequantize"
            # the last op alone: at most one output code apart, element by element
            assert not bool(((w - f).abs() > step * (1 + 1e-5)).any()), (case.name, i)
            # end to end: a one-code difference upstream is one step of *its* (coarser)
            # qparams downstream, so bound by the coarsest step in the model
            diff = (w - g).abs()
            assert not bool((diff > coarsest * (1 + 1e-5)).any()), (case.name, i, float(diff.max()))


@pytest.mark.parametrize("case", zoo.STATIC_CASES, ids=lambda c: c.name)
def test_quantized_chains_stay_uint8(case: zoo.Case) -> None:
    backend = L.get_backend("numba")
    reference = zoo.reference_model(case, backend)
    lowered = backend.lower(reference)
    report = L.lowering_report(lowered)
    n_in = sum(1 for n in reference.graph.nodes if n.op == "placeholder")
    n_out = len(_output_steps(reference))
    assert _count(reference, _Q) > n_in  # the reference has q/dq around every op
    if case.fully_lowered:
        assert report.kept == [], report
        assert _count(lowered, _Q) == n_in
        assert _count(lowered, _DQ) == n_out
    else:
        assert report.kept, "the unsupported op must be reported"
        assert _count(lowered, _Q) > n_in
    assert report.lowered


def test_conv_relu_maxpool_conv_has_one_quantize_and_one_dequantize() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1 = torch.nn.Conv2d(3, 4, 3)
            self.c2 = torch.nn.Conv2d(4, 4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c2(torch.nn.functional.max_pool2d(torch.relu(self.c1(x)), 2))

    case = zoo.Case("chain", Net, zoo._randn(1, 3, 12, 12))
    backend = L.get_backend("numba")
    reference = zoo.reference_model(case, backend)
    lowered = backend.lower(reference)
    assert _count(reference, _Q) >= 4
    assert _count(lowered, _Q) == 1
    assert _count(lowered, _DQ) == 1
    (dq,) = [
        n
        for n in lowered.graph.nodes
        if n.op == "call_module" and isinstance(lowered.get_submodule(str(n.target)), Dequantize)
    ]
    producer = dq.args[0]
    assert isinstance(producer, Node)
    assert producer.op == "call_module"
    assert isinstance(lowered.get_submodule(str(producer.target)), L.LoweredModule)


def test_unsupported_op_keeps_reference_form_and_is_reported() -> None:
    case = next(c for c in zoo.STATIC_CASES if c.name == "unsupported_layer_norm")
    lowered = L.get_backend("numba").lower(zoo.reference_model(case, L.get_backend("numba")))
    report = L.lowering_report(lowered)
    kept = dict(report.kept)
    assert "layer_norm" in kept
    assert "layer_norm" in lowered.code
    text = str(report)
    assert "kept as reference" in text
    assert "layer_norm" in text


@pytest.mark.parametrize("case", zoo.DYNAMIC_CASES, ids=lambda c: c.name)
def test_dynamic_linear_lowered(case: zoo.Case) -> None:
    backend = L.get_backend("numba")
    reference = zoo.reference_model(case, backend)
    lowered = backend.lower(reference)
    dyn = [m for m in lowered.modules() if type(m).__name__ == "QuantizedDynamicLinear"]
    n_linear = sum(1 for m in case.model().modules() if type(m) is torch.nn.Linear)
    assert len(dyn) == n_linear
    assert "choose_qparams" not in lowered.code
    torch.manual_seed(0)
    float_model = case.model().eval()
    for seed in range(2):
        inputs = case.inputs(seed)
        with torch.no_grad():
            want = reference(*inputs)
            got = lowered(*inputs)
            ideal = float_model(*inputs)
        # the kernels quantize x over the full 8 bits (reference: torch's reduce_range rule), so
        # the lowered model is no farther from float than the reference, up to rounding noise
        err_ref = float((want - ideal).abs().max())
        err_low = float((got - ideal).abs().max())
        assert err_low <= 1.5 * err_ref + 1e-4, (err_low, err_ref)
        assert float((got - want).abs().max()) <= 2.5 * err_ref + 1e-4


def test_embedding_weight_only_lowered() -> None:
    case = zoo.WEIGHT_ONLY_CASES[0]
    backend = L.get_backend("numba")
    reference = zoo.reference_model(case, backend)
    lowered = backend.lower(reference)
    kinds = sorted(type(m).__name__ for m in lowered.modules() if isinstance(m, L.LoweredModule))
    assert kinds == ["QuantizedEmbedding", "QuantizedEmbeddingBag", "QuantizedEmbeddingBag"]
    for seed in range(3):
        inputs = case.inputs(seed)
        with torch.no_grad():
            for w, g in zip(reference(*inputs), lowered(*inputs), strict=True):
                assert g.shape == w.shape
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_embedding_bag_4bit_weight_only_lowered() -> None:
    from quantbridge.fx_quant import convert_to_reference_fx, prepare_fx
    from quantbridge.qconfig import QConfigMapping, float_qparams_weight_only_qconfig_4bit

    class Bag(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = torch.nn.EmbeddingBag(30, 8, mode="sum")

        def forward(self, idx: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            return self.bag(idx, offsets)

    backend = L.get_backend("numba")
    model = Bag().eval()
    idx, offsets = torch.randint(0, 30, (12,)), torch.tensor([0, 4, 9])
    mapping = QConfigMapping().set_object_type(
        torch.nn.EmbeddingBag, float_qparams_weight_only_qconfig_4bit
    )
    prepared = prepare_fx(model, mapping, (idx, offsets), backend_config=backend.backend_config)
    reference = convert_to_reference_fx(prepared, backend_config=backend.backend_config)
    lowered = backend.lower(reference)
    assert any(type(m).__name__ == "QuantizedEmbeddingBag" for m in lowered.modules())
    codes = next(m for m in lowered.modules() if type(m).__name__ == "QuantizedEmbeddingBag")
    assert int(codes.weight.max()) <= 15  # type: ignore[operator]
    with torch.no_grad():
        torch.testing.assert_close(lowered(idx, offsets), reference(idx, offsets))


def test_reference_backend_returns_reference_model() -> None:
    backend = L.get_backend("reference")
    case = zoo.STATIC_CASES[0]
    reference = zoo.reference_model(case, backend)
    assert backend.lower(reference) is reference


def test_lower_leaves_reference_model_unchanged() -> None:
    backend = L.get_backend("numba")
    reference = zoo.reference_model(zoo.STATIC_CASES[1], backend)
    before = reference.code
    backend.lower(reference)
    assert reference.code == before


@pytest.mark.parametrize("model", [zoo.ConvBnCNN, zoo.ClampedLayers])
def test_qat_prepared_model_converts_and_lowers(model: type[torch.nn.Module]) -> None:
    from quantbridge.fx_quant import convert_to_reference_fx, prepare_qat_fx

    backend = L.get_backend("numba")
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    prepared = prepare_qat_fx(
        model().train(), backend.qconfig_mapping(qat=True), (x,),
        backend_config=backend.backend_config,
    )  # fmt: skip
    # a clamp after a conv / linear (QAT, with BatchNorm or not) is fake-quantized once, after it
    clamps = [
        n
        for n in prepared.graph.nodes
        if n.target in ("relu6", "clamp") or n.target in (F.relu6, F.hardtanh)
    ]
    assert len(clamps) == (4 if model is zoo.ClampedLayers else 0)
    for clamp in clamps:
        producer = clamp.args[0]
        assert "activation_post_process" not in str(producer.target)
    opt = torch.optim.SGD(prepared.parameters(), lr=0.01)
    for _ in range(3):
        loss = prepared(torch.randn(4, 3, 16, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    prepared.eval()
    reference = convert_to_reference_fx(
        copy.deepcopy(prepared), backend_config=backend.backend_config
    )
    lowered = backend.convert(prepared)
    assert L.lowering_report(lowered).kept == []
    step = _coarsest_step(reference)
    with torch.no_grad():
        diff = (reference(x) - lowered(x)).abs()
    assert float(diff.max()) <= step * (1 + 1e-5)


def test_pass_errors_are_clear() -> None:
    with pytest.raises(L.LoweringError, match="convert_to_reference_fx"):
        L.lower_to_kernels(torch.nn.Linear(2, 2), "generic")  # type: ignore[arg-type]
    with pytest.raises(L.LoweringError, match="was not produced by"):
        L.lowering_report(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)))
