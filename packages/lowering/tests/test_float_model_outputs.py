"""PrepareCustomConfig.set_output_float_indexes: a model output computed straight to float.

torch.ao quantizes the op producing a model output and dequantizes it again, so a
classifier's logits get 256 levels. With the output's position named, and a backend that
computes the op from quantized inputs to float32 (the numba backends' Linear), the reference
model has no quantize there and the lowered model runs the float-output kernel.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import quantbridge.fx_quant as fq
import quantbridge.lowering as L

BACKEND = L.get_backend("numba")


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.relu(self.conv(x))
        return self.fc(torch.flatten(self.pool(features), 1)), features


def _prepared(indexes: list[int]) -> tuple[nn.Module, torch.fx.GraphModule]:
    torch.manual_seed(0)
    model = Classifier().eval()
    config = fq.PrepareCustomConfig().set_output_float_indexes(indexes)
    g = torch.Generator().manual_seed(1)
    calibration = [(torch.randn(4, 3, 12, 12, generator=g),) for _ in range(4)]
    prepared = fq.prepare_fx(
        copy.deepcopy(model),
        BACKEND.qconfig_mapping(),
        calibration[0],
        prepare_custom_config=config,
        backend_config=BACKEND.backend_config,
    )
    fq.calibrate(prepared, calibration, progress=False)
    return model, prepared


def _returned(reference: torch.fx.GraphModule) -> tuple[torch.fx.Node, torch.fx.Node]:
    output = next(n for n in reference.graph.nodes if n.op == "output")
    logits, features = output.args[0]
    return logits, features


def test_named_output_comes_from_the_float_output_kernel() -> None:
    _, prepared = _prepared([0])
    reference = fq.convert_to_reference_fx(copy.deepcopy(prepared))
    logits, features = _returned(reference)
    assert logits.op == "call_module"  # the reference Linear itself, no dequantize after it
    assert features.target is torch.ops.quantbridge.dequantize_per_tensor.tensor
    lowered = BACKEND.lower(copy.deepcopy(reference))
    assert any(type(m).__name__ == "QuantizedLinearFloat" for m in lowered.modules())
    x = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        (got, _), (want, _) = lowered(x), reference(x)
    assert torch.allclose(got, want, rtol=0, atol=1e-5)
    # the only difference from torch.ao's form: the logits are not rounded to 8 bits
    _, default = _prepared([])
    quantized_logits = fq.convert_to_reference_fx(copy.deepcopy(default))
    dequantize, _ = _returned(quantized_logits)
    quantize = dequantize.args[0]
    _, scale, zero_point, qmin, qmax, dtype = quantize.args
    args = (getattr(quantized_logits, scale.target), getattr(quantized_logits, zero_point.target))
    with torch.no_grad():
        rounded, _ = quantized_logits(x)
    codes = torch.ops.quantbridge.quantize_per_tensor.tensor(want, *args, qmin, qmax, dtype)
    assert torch.equal(
        rounded, torch.ops.quantbridge.dequantize_per_tensor.tensor(codes, *args, qmin, qmax, dtype)
    )
    assert not torch.equal(rounded, want)


def test_output_the_backend_cannot_compute_to_float_stays_quantized() -> None:
    # position 1: the ReLU'd conv features; no float32-output DTypeConfig for conv + relu
    _, prepared = _prepared([1])
    reference = fq.convert_to_reference_fx(copy.deepcopy(prepared))
    logits, features = _returned(reference)
    assert logits.target is torch.ops.quantbridge.dequantize_per_tensor.tensor
    assert features.target is torch.ops.quantbridge.dequantize_per_tensor.tensor


def test_dict_round_trip() -> None:
    config = fq.PrepareCustomConfig().set_output_float_indexes([0, 2])
    as_dict = config.to_dict()
    assert as_dict == {"output_float_idxs": [0, 2]}
    assert fq.PrepareCustomConfig.from_dict(as_dict).output_float_indexes == [0, 2]
    assert "output_float_idxs" not in fq.PrepareCustomConfig().to_dict()  # torch.ao's dict
