"""bias_correction: after it, each corrected layer's mean output on the calibration data equals
the float layer's on the same inputs; bad input is refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantbridge.fx_quant import (
    FxQuantError,
    bias_correction,
    calibrate,
    convert_to_reference_fx,
    prepare_fx,
)
from quantbridge.fx_quant.nn import reference as nnqr
from quantbridge.qconfig import get_default_qconfig_mapping


class Net(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.conv = nn.Conv2d(2, 4, 3, padding=1, bias=bias)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(4 * 5 * 5, 6, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.relu(self.conv(x)), 1))


def data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return [torch.rand(8, 2, 5, 5, generator=g) * 3 + 0.5 for _ in range(4)]


def reference(backend: str, bias: bool = True) -> nn.Module:
    prepared = prepare_fx(Net(bias).eval(), get_default_qconfig_mapping(backend), (data()[0],))
    calibrate(prepared, data(), progress=False)
    return convert_to_reference_fx(prepared)


def layer_inputs(model: nn.Module, names: list[str]) -> dict[str, list[torch.Tensor]]:
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = [
        model.get_submodule(n).register_forward_pre_hook(
            lambda m, a, n=n: seen[n].append(a[0].detach())
        )
        for n in names
    ]
    with torch.no_grad():
        for x in data():
            model(x)
    for h in handles:
        h.remove()
    return seen


def mean_output(module: nn.Module, inputs: list[torch.Tensor], weight, bias) -> torch.Tensor:
    outs = []
    for x in inputs:
        if isinstance(module, nn.Linear):
            outs.append(F.linear(x, weight, bias))
        else:
            outs.append(module._conv_forward(x, weight, bias).transpose(0, 1).flatten(1).T)
    return torch.cat(outs).double().mean(0)


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])  # per-channel, per-tensor weights
@pytest.mark.parametrize("bias", [True, False])
def test_mean_output_matches_the_float_layer(backend: str, bias: bool) -> None:
    ref = reference(backend, bias)
    names = ["conv.0", "fc"]  # conv is fused with the ReLU: its reference conv is conv[0]
    for n in names:
        assert isinstance(ref.get_submodule(n), (nnqr.Conv2d, nnqr.Linear))
    inputs = layer_inputs(ref, names)  # what each layer sees in the uncorrected model
    float_bias = {n: copy.deepcopy(ref.get_submodule(n).bias) for n in names}
    corrections = bias_correction(ref, data())
    assert sorted(corrections) == names
    for n in names:
        module = ref.get_submodule(n)
        float_mean = mean_output(module, inputs[n], module.weight, float_bias[n])
        quant_before = mean_output(module, inputs[n], module.get_weight(), float_bias[n])
        quant_after = mean_output(module, inputs[n], module.get_weight(), module.bias)
        assert not torch.allclose(quant_before, float_mean, atol=1e-6, rtol=0)
        torch.testing.assert_close(quant_after, float_mean, atol=2e-6, rtol=1e-5)


def test_module_names_limit_the_correction() -> None:
    ref = reference("fbgemm")
    conv_bias = ref.conv[0].bias.detach().clone()
    fc_bias = ref.fc.bias.detach().clone()
    assert sorted(bias_correction(ref, data(), module_names=["fc"])) == ["fc"]
    assert torch.equal(ref.conv[0].bias, conv_bias)
    assert not torch.equal(ref.fc.bias, fc_bias)


def test_bad_input() -> None:
    ref = reference("fbgemm")
    with pytest.raises(FxQuantError, match="not quantized Linear/Conv"):
        bias_correction(ref, data(), module_names=["relu"])
    with pytest.raises(FxQuantError, match="data item"):
        bias_correction(ref, ["not a tensor"])
    with pytest.raises(FxQuantError, match="saw no data"):
        bias_correction(ref, [])
    with pytest.raises(FxQuantError, match=r"(?s)no quantized Linear/Conv.*functional linear"):
        bias_correction(Net().eval(), data())
