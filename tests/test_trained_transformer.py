"""Static int8 on an encoder with the activation statistics of a trained BERT.

The encoder is written the Hugging Face way (``hf_models.BertModel``: dropout, dict output, a
forward that only ``torch.export`` captures) and given outlier dimensions, an attention sink
with massive activations and peaked attention by ``bert_zoo.add_trained_outliers``. On it:

* the static flow of before (every quantized op's output quantized) falls far from fp32, as
  static int8 does on trained BERTs;
* the recipe (``keep_outlier_channels_float``, the transformer mapping, ``capture="export"``,
  whose projections feeding the float residual stream return float) holds: cosine >= 0.995
  and the same nearest neighbours.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "packages" / "lowering" / "tests"))

import hf_models
from bert_zoo import add_trained_outliers, hf_bert_parts

import quantbridge.lowering as L
from quantbridge.fx_quant import (
    OutlierChannelsConfig,
    SmoothQuantConfig,
    bias_correction,
    calibrate,
    convert_to_reference_fx,
    keep_outlier_channels_float,
    prepare_fx,
    smooth_quant,
)
from quantbridge.fx_quant.nn.quantizable import OutlierSplitLinear
from quantbridge.qconfig import BackendConfig

CONFIG = hf_models.BertConfig(
    hidden_size=384, num_hidden_layers=2, num_attention_heads=12, intermediate_size=1536
)
CALIB = [hf_models.token_batch(CONFIG, 4, 64, seed=s) for s in range(6)]
TEST = [hf_models.token_batch(CONFIG, 4, 64, seed=100 + s) for s in range(6)]


@pytest.fixture(scope="module")
def trained() -> tuple[nn.Module, list[int]]:
    torch.manual_seed(0)
    model = hf_models.BertModel(CONFIG).eval()
    dims = add_trained_outliers(model, hf_bert_parts(model), CALIB)
    return model, dims


def _pooled(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_models.pooled(model(ids, mask), mask)


def _fidelity(lowered: nn.Module, model: nn.Module) -> tuple[float, float]:
    """(mean cosine, top-10 neighbour overlap) of the pooled sentence embeddings."""
    got = torch.cat([_pooled(lowered, *b) for b in TEST])
    want = torch.cat([_pooled(model, *b) for b in TEST])
    cosine = float(F.cosine_similarity(got, want, dim=1).mean())

    def neighbours(e: torch.Tensor) -> torch.Tensor:
        e = F.normalize(e, dim=1)
        sim = e @ e.T
        sim.fill_diagonal_(-2.0)
        return sim.topk(10, dim=1).indices

    a, b = neighbours(got), neighbours(want)
    overlap = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b, strict=True))
    return cosine, overlap / (10 * len(a))


def _static(model: nn.Module, backend_config: BackendConfig | None = None) -> nn.Module:
    backend = L.get_backend("numba")
    prepared = prepare_fx(
        copy.deepcopy(model),
        backend.qconfig_mapping(transformer=True),
        CALIB[0],
        backend_config=backend.backend_config if backend_config is None else backend_config,
        capture="export",
    )
    calibrate(prepared, CALIB, progress=False)
    return backend.convert(prepared)


def _without_float_outputs(config: BackendConfig) -> BackendConfig:
    """The same BackendConfig with every output quantized (the static flow of before)."""
    out = BackendConfig(config.name)
    for entry in config.configs:
        kept = [dc for dc in entry.dtype_configs if dc.output_dtype != torch.float32]
        if kept:
            out.set_backend_pattern_config(entry.set_dtype_configs(kept))
    return out


def _channel_max(model: nn.Module, module: nn.Module, inputs: bool) -> torch.Tensor:
    seen: list[torch.Tensor] = []

    def record(t: torch.Tensor) -> None:
        seen.append(t.detach().abs().reshape(-1, t.shape[-1]).amax(0))

    if inputs:
        handle = module.register_forward_pre_hook(lambda m, a: record(a[0]))
    else:
        handle = module.register_forward_hook(lambda m, a, out: record(out))
    with torch.no_grad():
        for batch in CALIB:
            model(*batch)
    handle.remove()
    return torch.stack(seen).amax(0)


def test_the_encoder_has_trained_statistics(trained: Any) -> None:
    model, dims = trained
    layer = model.encoder.layer[1]
    query_in = _channel_max(model, layer.attention.self.query, inputs=True)
    ordinary = float(query_in.median())
    # outlier dimensions: LayerNorm output channels many times the median one
    assert float(query_in[dims].min()) > 6 * ordinary
    # massive activations: the FFN's inner activation and output on the sink token
    inner = _channel_max(model, layer.output.dense, inputs=True)
    assert float(inner.max()) > 50 * float(inner.median())
    ffn_out = _channel_max(model, layer.output.dense, inputs=False)
    assert float(ffn_out.max()) > 100 * float(ffn_out.median())


def test_static_int8_of_before_fails_on_it(trained: Any) -> None:
    model, _ = trained
    config = _without_float_outputs(L.get_backend("numba").backend_config)
    cosine, _ = _fidelity(_static(model, config), model)
    print(f"trained-like encoder, static int8, outputs quantized: cosine {cosine:.4f}")
    assert cosine < 0.97


def test_the_recipe_holds_on_it(trained: Any) -> None:
    model, dims = trained
    split = keep_outlier_channels_float(model, CALIB)
    splits = {n: m for n, m in split.named_modules() if isinstance(m, OutlierSplitLinear)}
    query = splits["encoder.layer.0.attention.self.query"]
    assert set(dims) <= set(query.channels)
    assert len(query.channels) <= 384 // 32
    # the split changes no number in float
    for ids, mask in TEST[:2]:
        want = _pooled(model, ids, mask)
        torch.testing.assert_close(_pooled(split, ids, mask), want, rtol=1e-4, atol=1e-4)
    lowered = _static(split)
    done = " ".join(what for _, what in L.lowering_report(lowered).lowered)
    # every int8 part of a projection returns float into the residual stream
    assert done.count("kernels.linear_float") >= 2 * 6
    cosine, overlap = _fidelity(lowered, model)
    print(f"trained-like encoder, static int8 recipe: cosine {cosine:.5f}, top-10 {overlap:.3f}")
    assert cosine >= 0.995
    assert overlap >= 0.95


def test_smooth_quant_and_bias_correction_take_an_exported_model(trained: Any) -> None:
    model, _ = trained
    smoothed = smooth_quant(model, CALIB, SmoothQuantConfig(alpha=0.5), capture="export")
    assert type(smoothed) is type(model)
    report = smoothed.smooth_quant_report
    # q, k and v read one LayerNorm output that is also the residual: a ChannelScale each
    assert any(len(linears) == 3 and "ChannelScale" in into for linears, into, *_ in report.groups)
    for ids, mask in TEST[:2]:  # the migration keeps the float function
        want = _pooled(model, ids, mask)
        torch.testing.assert_close(_pooled(smoothed, ids, mask), want, rtol=1e-4, atol=1e-4)
    backend = L.get_backend("numba")
    prepared = prepare_fx(
        copy.deepcopy(smoothed),
        backend.qconfig_mapping(transformer=True),
        CALIB[0],
        backend_config=backend.backend_config,
        capture="export",
    )
    calibrate(prepared, CALIB, progress=False)
    reference = convert_to_reference_fx(prepared, backend_config=backend.backend_config)
    corrections = bias_correction(reference, CALIB[:2])
    assert len(corrections) >= 2 * 6
    lowered = backend.lower(reference)
    cosine, _ = _fidelity(lowered, model)
    plain, _ = _fidelity(_static(model), model)
    print(f"trained-like encoder: smooth_quant + bias_correction {cosine:.5f}, plain {plain:.5f}")
    assert cosine > 0.99


def test_outlier_config_is_checked() -> None:
    with pytest.raises(ValueError, match="threshold must be above 1"):
        OutlierChannelsConfig(threshold=0.5)
    with pytest.raises(ValueError, match="max_fraction must be in"):
        OutlierChannelsConfig(max_fraction=0.0)
    with pytest.raises(ValueError, match="config must be an OutlierChannelsConfig"):
        keep_outlier_channels_float(nn.Linear(2, 2), [torch.zeros(1, 2)], config=6.0)  # type: ignore[arg-type]
