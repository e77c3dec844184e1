"""A torchvision-style ViT (``vit_model.py``), static int8 on the numba backend.

Random init, reduced size (64x64 images, 4 layers, hidden 192) so the test runs in seconds.
``qconfig_mapping(transformer=True)`` keeps the residual stream and LayerNorms float and the
projections before the residual adds return float; the plain mapping quantizes the residual
stream and collapses.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from vit_model import VisionTransformer

import quantbridge.lowering as L
from quantbridge.fx_quant import calibrate, prepare_fx
from quantbridge.qconfig import QConfigMapping

SMALL = {"image_size": 64, "layers": 4, "heads": 4, "dim": 192, "mlp_dim": 768}


def _lowered(model: nn.Module, mapping: QConfigMapping) -> nn.Module:
    backend = L.get_backend("numba")
    g = torch.Generator().manual_seed(1)
    calib = [(torch.randn(2, 3, 64, 64, generator=g),) for _ in range(4)]
    prepared = prepare_fx(
        copy.deepcopy(model), mapping, calib[0], backend_config=backend.backend_config
    )
    calibrate(prepared, calib, progress=False)
    return backend.convert(prepared)


def _sqnr(lowered: nn.Module, model: nn.Module) -> float:
    g = torch.Generator().manual_seed(2)
    signal = noise = 0.0
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 3, 64, 64, generator=g)
            want = model(x)
            signal += float((want**2).sum())
            noise += float(((lowered(x) - want) ** 2).sum())
    return 10 * math.log10(signal / noise)


def test_vit_static_int8_with_the_transformer_mapping() -> None:
    torch.manual_seed(0)
    model = VisionTransformer(**SMALL).eval()
    backend = L.get_backend("numba")
    plain = _sqnr(_lowered(model, backend.qconfig_mapping()), model)
    lowered = _lowered(model, backend.qconfig_mapping(transformer=True))
    transformer = _sqnr(lowered, model)
    print(f"ViT (small), static int8 SQNR: plain {plain:.1f} dB, transformer {transformer:.1f} dB")
    assert plain < 15.0
    assert transformer > 25.0
    done = " ".join(what for _, what in L.lowering_report(lowered).lowered)
    # attention output and MLP output projections return float into the residual adds
    assert done.count("kernels.linear_float") == 2 * SMALL["layers"]
    # nn.MultiheadAttention's attention runs on the projections' codes, quantized inside
    assert done.count("nn.MultiheadAttention's attention on codes") == SMALL["layers"]


def test_vit_with_float_attention_runs_lowered() -> None:
    # the attention heads merged in float reach LayerNorm as a transposed view
    torch.manual_seed(0)
    model = VisionTransformer(**SMALL).eval()
    mapping = L.get_backend("numba").qconfig_mapping(transformer=True)
    mapping.set_module_name_regex(r"encoder\.layers\..*\.self_attention.*", None)
    assert _sqnr(_lowered(model, mapping), model) > 25.0
