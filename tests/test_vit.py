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

from vit_model import VisionTransformer, add_trained_statistics

import quantbridge.lowering as L
from quantbridge.fx_quant import (
    SmoothQuantConfig,
    calibrate,
    explain,
    keep_outlier_channels_float,
    prepare_fx,
    smooth_quant,
)
from quantbridge.fx_quant.nn.quantizable import OutlierSplitLinear
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


def _calibration() -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 3, 64, 64, generator=g),) for _ in range(4)]


def test_trained_statistics_need_the_outlier_split() -> None:
    # LayerNorm outlier dimensions reach q, k, v (inside nn.MultiheadAttention) and the MLP;
    # the class token's massive activation joins the patches at the concatenation
    torch.manual_seed(0)
    model = VisionTransformer(**SMALL).eval()
    add_trained_statistics(model)
    backend = L.get_backend("numba")
    mapping = backend.qconfig_mapping(transformer=True)
    plain = _sqnr(_lowered(model, mapping), model)
    split = keep_outlier_channels_float(model, _calibration())
    attention = split.get_submodule("encoder.layers.encoder_layer_0.self_attention")
    for name in ("q_proj", "k_proj", "v_proj"):
        assert isinstance(getattr(attention, name), OutlierSplitLinear), name
    fc1 = split.get_submodule("encoder.layers.encoder_layer_0.mlp.0")
    assert isinstance(fc1, OutlierSplitLinear)
    backend_config = backend.backend_config
    prepared = prepare_fx(split, mapping, _calibration()[0], backend_config=backend_config)
    # explain names the rule: q, k and v's results observed, in every layer
    splits = [row for row in explain(prepared) if "outlier split" in row.reason]
    assert len(splits) == 3 * SMALL["layers"]
    assert {row.status for row in splits} == {"quantized"}
    lowered = _lowered(split, mapping)
    recipe = _sqnr(lowered, model)
    done = " ".join(what for _, what in L.lowering_report(lowered).lowered)
    # the splits' results are observed for the attention, which runs on their codes
    assert done.count("nn.MultiheadAttention's attention on codes") == SMALL["layers"]
    shared = backend.qconfig_mapping(transformer=True)
    # the class token observed together with the patches
    shared.set_object_type(torch.cat, shared.global_qconfig)
    cat_observed = _sqnr(_lowered(model, shared), model)
    print(f"trained-like ViT (small): mapping {plain:.1f} dB, with torch.cat observed "
          f"{cat_observed:.1f} dB, outlier split {recipe:.1f} dB")  # fmt: skip
    assert plain < 20.0
    assert cat_observed < plain - 1.0
    assert recipe > 23.0


def test_smooth_quant_reaches_the_attention_projections() -> None:
    torch.manual_seed(0)
    model = VisionTransformer(**SMALL).eval()
    add_trained_statistics(model)
    smoothed = smooth_quant(model, _calibration(), SmoothQuantConfig(alpha=0.5))
    report = smoothed.smooth_quant_report  # type: ignore[attr-defined]
    qkv = tuple(f"encoder.layers.encoder_layer_0.self_attention.{p}_proj" for p in "qkv")
    assert (qkv, "LayerNorm encoder.layers.encoder_layer_0.ln_1") in [
        (linears, into) for linears, into, _, _ in report.groups
    ]
    x = _calibration()[0][0]
    with torch.no_grad():
        torch.testing.assert_close(smoothed(x), model(x), rtol=1e-3, atol=1e-3)


def test_outlier_split_kept_float_by_the_mapping_stays_float() -> None:
    # a split whose Linear the mapping keeps float returns float; its attention stays float
    torch.manual_seed(0)
    model = VisionTransformer(**SMALL).eval()
    add_trained_statistics(model)
    split = keep_outlier_channels_float(model, _calibration())
    mapping = L.get_backend("numba").qconfig_mapping(transformer=True)
    q_proj = r"encoder\.layers\.encoder_layer_0\.self_attention\.q_proj.*"
    mapping.set_module_name_regex(q_proj, None)
    lowered = _lowered(split, mapping)
    done = " ".join(what for _, what in L.lowering_report(lowered).lowered)
    assert done.count("nn.MultiheadAttention's attention on codes") == SMALL["layers"] - 1
    q_proj = lowered.get_submodule("encoder.layers.encoder_layer_0.self_attention.q_proj")
    assert isinstance(q_proj.get_submodule("linear"), nn.Linear)
    assert _sqnr(lowered, model) > 23.0
