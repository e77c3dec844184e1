"""smooth_quant: activation -> weight scale migration before static quantization."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from quantbridge.fx_quant import (
    FxQuantError,
    SmoothQuantConfig,
    calibrate,
    convert_to_reference_fx,
    prepare_fx,
    smooth_quant,
)
from quantbridge.qconfig import get_default_qconfig_mapping


class _PreNormBlock(nn.Module):
    """Pre-LN feed-forward (LayerNorm feeds only fc1: foldable) and a bare Linear (a mul)."""

    def __init__(self, outliers: float = 1.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)
        self.head = nn.Linear(32, 8)
        with torch.no_grad():  # a few huge channels, as pretrained transformers have
            self.norm.weight[:3] *= outliers
            self.norm.bias[:3] *= outliers
            self.fc1.weight[:, :3] /= outliers

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.fc2(torch.relu(self.fc1(self.norm(x))))
        return self.head(x)


def _data(seed: int, n: int = 6) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 10, 32, generator=g) for _ in range(n)]


def _sqnr(model: nn.Module, reference: nn.Module, data: list[Tensor]) -> float:
    signal = noise = 0.0
    with torch.no_grad():
        for x in data:
            want = reference(x)
            signal += float((want**2).sum())
            noise += float(((model(x) - want) ** 2).sum())
    return 10 * math.log10(signal / noise)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.8, 1.0])
def test_float_function_unchanged(alpha: float) -> None:
    torch.manual_seed(0)
    model = _PreNormBlock(outliers=20.0).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    smoothed = smooth_quant(model, _data(0), SmoothQuantConfig(alpha=alpha))
    for x in _data(1, 3):
        with torch.no_grad():
            want, got = model(x), smoothed(x)
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    for k, v in model.state_dict().items():  # the user's model is left alone
        assert torch.equal(v, before[k]), k
    report = smoothed.meta["smooth_quant"]
    into = {linears: where for linears, where, _, _ in report.groups}
    assert into[("fc1",)] == "LayerNorm norm"  # its only user: folded
    assert into[("head",)].startswith("mul ")  # read by the residual add too: explicit mul
    assert into[("fc2",)].startswith("mul ")


def test_migration_math_on_fold() -> None:
    torch.manual_seed(1)
    model = _PreNormBlock(outliers=10.0).eval()
    data = _data(2)
    smoothed = smooth_quant(model, data, SmoothQuantConfig(alpha=0.5))
    with torch.no_grad():
        amax = torch.stack([model.norm(x).abs().reshape(-1, 32).amax(0) for x in data]).amax(0)
        w_amax = model.fc1.weight.abs().amax(0)
        s = amax.sqrt() / w_amax.sqrt()
        torch.testing.assert_close(smoothed.get_submodule("fc1").weight, model.fc1.weight * s)
        torch.testing.assert_close(smoothed.get_submodule("norm").weight, model.norm.weight / s)


def test_static_int8_sqnr_improves_with_outliers() -> None:
    torch.manual_seed(2)
    model = _PreNormBlock(outliers=40.0).eval()
    calib, test = _data(3), _data(4)
    mapping = get_default_qconfig_mapping("x86")

    def quantize(m: nn.Module) -> nn.Module:
        prepared = prepare_fx(m, mapping, (calib[0],))
        calibrate(prepared, calib, progress=False)
        return convert_to_reference_fx(prepared)

    plain = _sqnr(quantize(model), model, test)
    smoothed = _sqnr(quantize(smooth_quant(model, calib)), model, test)
    assert smoothed > plain + 6.0, (plain, smoothed)  # at least 4x less error power


def test_bad_arguments() -> None:
    with pytest.raises(FxQuantError, match=r"alpha must be in \[0, 1\]"):
        SmoothQuantConfig(alpha=1.5)
    with pytest.raises(FxQuantError, match="config must be a SmoothQuantConfig"):
        smooth_quant(_PreNormBlock(), _data(0), 0.5)  # type: ignore[arg-type]
    with pytest.raises(FxQuantError, match="data must be an iterable"):
        smooth_quant(_PreNormBlock(), torch.randn(2, 32))
