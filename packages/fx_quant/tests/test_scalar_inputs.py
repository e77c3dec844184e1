"""Python numbers as forward arguments (``forward(self, x, scale: float = 2.0)``).

torch.ao 2.13 observes every model input and its HistogramObserver then fails at
calibration on the number (``'float' object has no attribute 'numel'``). prepare here runs
the example inputs, sees which inputs hold Python numbers and does not observe them: the op
reading one takes it as a scalar operand, exactly as torch.ao treats a constant number
(``x * 2.0``), and ``explain`` lists the input as float with the reason. The reference model
is compared with torch.ao's on the model with the number written in as a constant.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.fx import GraphModule

import quantbridge.lowering as L
from quantbridge.fx_quant import (
    calibrate,
    convert_to_reference_fx,
    explain,
    get_native_backend_config,
    prepare_fx,
)
from quantbridge.qconfig import HistogramObserver, get_default_qconfig_mapping

_Q = torch.ops.quantbridge.quantize_per_tensor.tensor


class _Scaled(nn.Module):
    """linear -> times a forward argument (or a constant) -> plus another -> linear."""

    def __init__(self, constants: tuple[float, int] | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)
        self.constants = constants

    def forward(self, x: Tensor, scale: float = 2.0, offset: int = 1) -> Tensor:
        if self.constants is not None:  # traced as literals: torch.ao's oracle model
            scale, offset = self.constants
        h = self.fc1(x) * scale
        out: Tensor = self.fc2(h + offset)
        return out


def _data(seed: int, n: int = 3) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 8, generator=g) for _ in range(n)]


def _ours(example: tuple[Any, ...], calib: list[tuple[Any, ...]]) -> tuple[GraphModule, Any]:
    torch.manual_seed(0)
    prepared = prepare_fx(
        _Scaled().eval(),
        get_default_qconfig_mapping("x86"),
        example,
        backend_config=get_native_backend_config(),
    )
    calibrate(prepared, calib, progress=False)
    return prepared, explain(prepared)


def _torch_ao_constant_model(scale: float, offset: int, calib: list[Tensor]) -> Any:
    quantize_fx = pytest.importorskip("torch.ao.quantization.quantize_fx")
    ao = pytest.importorskip("torch.ao.quantization")
    torch.manual_seed(0)
    model = _Scaled((scale, offset)).eval()
    prepared = quantize_fx.prepare_fx(model, ao.get_default_qconfig_mapping("x86"), (calib[0],))
    with torch.no_grad():
        for x in calib:
            prepared(x)
    return quantize_fx.convert_to_reference_fx(prepared)


@pytest.mark.parametrize(
    "example",
    [
        pytest.param(lambda x: (x,), id="defaults"),
        pytest.param(lambda x: (x, 2.0), id="float-passed"),
        pytest.param(lambda x: (x, 2.0, 1), id="float-and-int-passed"),
    ],
)
def test_number_inputs_are_not_observed(example: Any) -> None:
    data = _data(1)
    prepared, report = _ours(example(data[0]), [example(x) for x in data])
    # no observer reads the number inputs; the tensor input and the ops' outputs are observed
    for name in ("scale", "offset"):
        node = next(n for n in prepared.graph.nodes if n.name == name)
        assert [u.name for u in node.users] == [{"scale": "mul", "offset": "add"}[name]]
        row = report[name]
        assert row.status == "float"
        assert row.op == "placeholder"
        assert "Python" in row.reason
        assert "not observed" in row.reason
        assert ("float" if name == "scale" else "int") in row.reason
    assert report["mul"].status == report["add"].status == "quantized"
    histograms = [m for m in prepared.modules() if isinstance(m, HistogramObserver)]
    assert histograms
    assert all(int(m.histogram.sum()) > 0 for m in histograms)


def test_reference_model_equals_torch_ao_with_the_numbers_as_constants() -> None:
    data = _data(1)
    prepared, _ = _ours((data[0], 2.0, 1), [(x, 2.0, 1) for x in data])
    reference = convert_to_reference_fx(copy.deepcopy(prepared))
    oracle = _torch_ao_constant_model(2.0, 1, data)
    # same quantization points: input, fc1, mul, add, fc2 (a number is a scalar operand)
    assert sum(n.target is _Q for n in reference.graph.nodes) == 5
    for x in _data(2):
        with torch.no_grad():
            want = oracle(x)
            assert torch.equal(reference(x, 2.0, 1), want)
            assert torch.equal(reference(x), want)  # the defaults are the same numbers
    # the number stays an input: another value is used as given (not the calibrated one)
    x = _data(3, 1)[0]
    with torch.no_grad():
        assert not torch.equal(reference(x, 0.5, 1), reference(x, 2.0, 1))


def test_lowered_model_keeps_the_runtime_scalar_ops_and_says_why() -> None:
    data = _data(1)
    backend = L.get_backend("numba")
    torch.manual_seed(0)
    prepared = prepare_fx(
        _Scaled().eval(),
        backend.qconfig_mapping(),
        (data[0], 2.0),
        backend_config=backend.backend_config,
    )
    calibrate(prepared, [(x, 2.0) for x in data], progress=False)
    reference = convert_to_reference_fx(
        copy.deepcopy(prepared), backend_config=backend.backend_config
    )
    lowered = backend.convert(prepared)
    report = L.lowering_report(lowered)
    kept = dict(report.kept)
    assert set(kept) == {"mul", "add"}, str(report)
    assert "'scale'" in kept["mul"]
    assert "known only at run time" in kept["mul"]
    assert "'offset'" in kept["add"]
    assert sum("kernels.linear (" in what for _, what in report.lowered) == 2
    out = next(n for n in reference.graph.nodes if n.op == "output").args[0]
    step = float(getattr(reference, str(out.args[1].target)))  # the output's scale
    for x in _data(2):
        for scale in (2.0, 1.5):
            with torch.no_grad():
                want, got = reference(x, scale), lowered(x, scale)
            assert float((got - want).abs().max()) <= step + 1e-6
