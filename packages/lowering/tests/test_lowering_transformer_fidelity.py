"""Static int8 on a Hugging Face style BERT encoder: the numba backend's transformer mapping.

``qconfig_mapping(transformer=True)`` keeps the residual adds, LayerNorm and the attention
mask arithmetic float; the extended mask ``(1 - mask) * finfo.min`` is then never observed.
With the plain mapping the mask shares an observer with its finfo.min companion and the
flow warns, naming the nodes. ``smooth_quant`` on an encoder with outlier channels raises
the static int8 SQNR.
"""

from __future__ import annotations

import copy
import io
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

if str(Path(__file__).parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))

from bert_zoo import BertEncoder, add_outliers, token_batches

import quantbridge.lowering as L
from quantbridge.fx_quant import (
    calibrate,
    convert_to_reference_fx,
    explain,
    find_dominated_ranges,
    keep_outlier_channels_float,
    prepare_fx,
    smooth_quant,
)

CALIB, TEST = token_batches(8), token_batches(8, seed=1)


def _prepared(model: nn.Module, transformer: bool) -> torch.fx.GraphModule:
    backend = L.get_backend("numba")
    mapping = backend.qconfig_mapping(transformer=transformer)
    return prepare_fx(model, mapping, CALIB[0], backend_config=backend.backend_config)


def _cosine(lowered: nn.Module, model: nn.Module) -> float:
    cos = []
    with torch.no_grad():
        for ids, mask in TEST:
            cos.append(F.cosine_similarity(lowered(ids, mask), model(ids, mask), dim=1))
    return float(torch.cat(cos).mean())


def _sqnr(lowered: nn.Module, model: nn.Module) -> float:
    signal = noise = 0.0
    with torch.no_grad():
        for ids, mask in TEST:
            want = model(ids, mask)
            signal += float((want**2).sum())
            noise += float(((lowered(ids, mask) - want) ** 2).sum())
    return 10 * math.log10(signal / noise)


def test_transformer_mapping_reaches_cosine_099() -> None:
    torch.manual_seed(0)
    model = BertEncoder().eval()
    prepared = _prepared(model, transformer=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no sentinel-dominated observer
        calibrate(prepared, CALIB, progress=False)
    assert find_dominated_ranges(prepared) == []
    report = explain(prepared)
    for row in report:  # residual adds, the mask arithmetic and the norms stay float
        if row.target in ("add", "sub", "mul", "truediv") or "norm" in row.node:
            assert row.status != "quantized", (row.node, row.status)
    lowered = L.get_backend("numba").convert(prepared)
    done = " ".join(what for _, what in L.lowering_report(lowered).lowered)
    # q, k, v and intermediate return codes; out and output return float into the float
    # residual adds
    assert done.count("kernels.linear (") == 2 * 4
    assert done.count("kernels.linear_float (") == 2 * 2
    assert done.count("kernels.matmul") == 2 * 2  # q.k^T and p.v per layer
    cosine = _cosine(lowered, model)
    print(f"BERT-style encoder, static int8, transformer mapping: mean cosine {cosine:.5f}")
    assert cosine >= 0.99


def test_plain_mapping_warns_about_the_mask() -> None:
    torch.manual_seed(0)
    model = BertEncoder().eval()
    prepared = _prepared(model, transformer=False)
    with pytest.warns(UserWarning, match="dominates its range") as record:
        calibrate(prepared, CALIB, progress=False)
    text = "\n".join(str(w.message) for w in record)
    assert "'mul' (operator.mul(" in text  # (1 - mask) * finfo.min
    assert "min -3.40282e+38" in text
    nodes = {n for f in find_dominated_ranges(prepared) for n in f.nodes}
    assert {"sub", "mul"} <= nodes
    assert any(n.startswith("add") for n in nodes)  # scores + mask
    with warnings.catch_warnings():  # calibrate already said it: once per observer
        warnings.simplefilter("error", UserWarning)
        lowered = L.get_backend("numba").convert(copy.deepcopy(prepared))
    cosine = _cosine(lowered, model)
    print(f"BERT-style encoder, static int8, plain mapping: mean cosine {cosine:.5f}")
    assert cosine < 0.99  # what the transformer mapping fixes


def test_smooth_quant_improves_static_sqnr_on_outliers() -> None:
    torch.manual_seed(0)
    model = BertEncoder().eval()
    add_outliers(model, factor=30.0)
    backend = L.get_backend("numba")

    def lowered(m: nn.Module) -> nn.Module:
        prepared = _prepared(m, transformer=True)
        calibrate(prepared, CALIB, progress=False)
        return backend.convert(prepared)

    smoothed = smooth_quant(model, CALIB)
    with torch.no_grad():  # the migration alone keeps the float function
        for ids, mask in TEST[:2]:
            want = model(ids, mask)
            assert float((smoothed(ids, mask) - want).abs().max()) <= 1e-5 * float(want.abs().max())
    plain, smooth = _sqnr(lowered(model), model), _sqnr(lowered(smoothed), model)
    print(f"outlier encoder, static int8 SQNR: plain {plain:.1f} dB, smooth_quant {smooth:.1f} dB")
    assert smooth > plain + 10.0


def test_outlier_split_lowers_to_one_kernel_call_per_linear_under_fx_capture() -> None:
    torch.manual_seed(0)
    model = BertEncoder().eval()
    add_outliers(model, factor=30.0)
    split = keep_outlier_channels_float(model, CALIB)
    prepared = _prepared(split, transformer=True)
    calibrate(prepared, CALIB, progress=False)
    backend = L.get_backend("numba")
    reference = convert_to_reference_fx(
        copy.deepcopy(prepared), backend_config=backend.backend_config
    )
    lowered = backend.lower(copy.deepcopy(reference))
    report = L.lowering_report(lowered)
    removed = " ".join(what for _, what in report.removed)
    # q, k, v and the intermediate Linear read the outlier LayerNorm outputs: split, each one
    # float-output kernel call with its float columns, the zeroing gone
    assert removed.count("zeroed outlier channels") == 4 * 2
    with_columns = [m for m in lowered.modules() if getattr(m, "side_channels", None) is not None]
    assert len(with_columns) == 4 * 2
    # the intermediate's GELU runs in its epilogue, after the float columns
    assert sorted(m.epilogue for m in with_columns).count("gelu") == 2
    # each one's int8 consumer (attention matmuls, the output Linear) reads codes the same
    # pass quantized (no separate quantize pass over a float-output Linear's result)
    split_entries = [what for _, what in report.lowered if "float columns" in what]
    assert len(split_entries) == 4 * 2
    assert all("also returns codes" in what for what in split_entries)
    assert not any(
        type(m).__name__ in ("ZeroedChannels", "FloatColumns") for m in lowered.modules()
    )
    with torch.no_grad():
        for ids, mask in TEST[:2]:
            want, got = reference(ids, mask), lowered(ids, mask)
            assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())
    assert _cosine(lowered, model) >= 0.999


def test_lowered_split_model_saves_and_loads() -> None:
    # bert_zoo's forward annotations are strings (``from __future__ import annotations``),
    # which fx used to record as a global that torch.save could not pickle
    torch.manual_seed(0)
    model = BertEncoder().eval()
    add_outliers(model, factor=30.0)
    prepared = _prepared(keep_outlier_channels_float(model, CALIB), transformer=True)
    calibrate(prepared, CALIB, progress=False)
    lowered = L.get_backend("numba").convert(prepared)
    buffer = io.BytesIO()
    torch.save(lowered, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        for ids, mask in TEST[:2]:
            assert torch.equal(loaded(ids, mask), lowered(ids, mask))
