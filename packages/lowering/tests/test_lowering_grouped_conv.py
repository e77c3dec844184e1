"""Grouped and depthwise convs whose stride/dilation/padding differ per axis, lowered to the
numba kernels: every element within one output code of the reference model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import quantbridge.lowering as L
from quantbridge import kernels as K
from quantbridge.fx_quant import convert_to_reference_fx, prepare_fx

NUMBA = ["numba", *(f"numba_{t}" for t in K.available_targets())]

# (in, out, kernel, stride, padding, dilation, groups, input H x W): the first two are the
# convs on which torch's x86 engine returns wrong codes (one-pixel-wide output)
CONVS = [
    (3, 6, (1, 3), (1, 2), (0, 0), (1, 2), 3, (5, 5)),
    (2, 4, (3, 3), (1, 2), (2, 0), (1, 2), 2, (7, 6)),
    (4, 4, (3, 2), (2, 1), (0, 1), (2, 1), 4, (9, 7)),
    (4, 6, (3, 3), (2, 1), (1, 0), (1, 2), 2, (8, 9)),
]


class _Convs(nn.Module):
    def __init__(self, spec: tuple, conv1d: bool) -> None:
        super().__init__()
        cin, cout, k, s, p, d, g, _ = spec
        if conv1d:  # the W axis of the same conv
            self.conv: nn.Module = nn.Conv1d(cin, cout, k[1], s[1], p[1], d[1], g)
        else:
            self.conv = nn.Conv2d(cin, cout, k, s, p, d, g)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv(x))


@pytest.mark.parametrize("backend_name", NUMBA)
@pytest.mark.parametrize("conv1d", [False, True], ids=["conv2d", "conv1d"])
@pytest.mark.parametrize("spec", CONVS, ids=lambda s: f"g{s[6]}-s{s[3]}-p{s[4]}-d{s[5]}")
def test_asymmetric_grouped_conv_lowered_matches_reference(
    spec: tuple, conv1d: bool, backend_name: str
) -> None:
    torch.manual_seed(0)
    cin, h, w = spec[0], *spec[7]
    shape = (2, cin, w) if conv1d else (2, cin, h, w)
    model = _Convs(spec, conv1d).eval()
    backend = L.get_backend(backend_name)
    prepared = prepare_fx(
        model, backend.qconfig_mapping(), (torch.randn(shape),),
        backend_config=backend.backend_config,
    )  # fmt: skip
    with torch.no_grad():
        for _ in range(4):
            prepared(torch.randn(shape))
    reference = convert_to_reference_fx(
        copy.deepcopy(prepared), backend_config=backend.backend_config
    )
    lowered = backend.convert(prepared)
    report = L.lowering_report(lowered)
    assert report.kept == [], report
    assert any("conv" in what for _, what in report.lowered), report
    # the output step: the scale of the reference's last quantize
    scales = [
        float(getattr(reference, str(n.args[1].target)))
        for n in reference.graph.nodes
        if n.op == "call_function" and "quantize_per_tensor" in str(n.target)
        and "dequantize" not in str(n.target)
    ]  # fmt: skip
    out_step = scales[-1]
    for seed in range(3):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            want, got = reference(x), lowered(x)
        assert got.shape == want.shape
        diff = (got - want).abs()
        assert float(diff.max()) <= out_step * (1 + 1e-5), (report, float(diff.max()), out_step)
