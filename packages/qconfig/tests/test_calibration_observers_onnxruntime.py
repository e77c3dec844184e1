"""PercentileObserver / EntropyObserver next to ONNX Runtime's histogram calibrators (only
where onnxruntime is installed; quantbridge does not depend on it).

The histograms differ by design, so the thresholds are compared within stated bounds:
ONNX Runtime bins |x| over [min|x|, max|x|] of the first batch and appends bins of that width,
and reports a bin's lower edge; quantbridge bins over [0, 2**e) with a power-of-two width and
reports the upper edge. Percentile thresholds therefore agree within one bin of each. ONNX
Runtime's entropy search runs on a signed histogram with its 128 levels spread over [-T, T],
64 a side (quantbridge: 128 levels over [0, T] of |x|, TensorRT's layout), and the KL
minimum is flat, so the two thresholds differ by up to about a quarter. What must hold is that
either threshold quantizes the data about as well: int8 mean squared errors within 25 %.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from quantbridge.qconfig import EntropyObserver, PercentileObserver

calibrate = pytest.importorskip("onnxruntime.quantization.calibrate")


def _batches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # 50001 values a batch: the percentile's count target is not an integer, so float
    # rounding of ONNX Runtime's normalised CDF cannot move it by one sample.
    return [torch.randn(50001, generator=g) * (1 + 0.2 * k) for k in range(3)]


def _ort_threshold(method: str, batches: list[torch.Tensor], percentile: float) -> float:
    collector = calibrate.HistogramCollector(
        method=method,
        symmetric=True,
        num_bins=2048,
        num_quantized_bins=128,
        percentile=percentile,
        scenario="same",
    )
    with contextlib.redirect_stdout(io.StringIO()):
        for b in batches:
            collector.collect({"t": [b.numpy()]})
        result = collector.compute_collection_result()["t"]
    return float(result[1])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("percentile", [99.9, 99.99])
def test_percentile_within_one_bin_of_onnxruntime(seed: int, percentile: float) -> None:
    batches = _batches(seed)
    obs = PercentileObserver(
        percentile=percentile, qscheme=torch.per_tensor_symmetric, dtype=torch.qint8
    )
    for b in batches:
        obs(b)
    ours = obs.calculate_qparams()[0].item() * 127.5
    theirs = _ort_threshold("percentile", batches, percentile)
    our_width = 2.0 ** int(obs.exponent)
    abs_first = batches[0].abs()
    their_width = float(abs_first.max() - abs_first.min()) / 2048
    assert abs(ours - theirs) <= our_width + their_width + 1e-6


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_entropy_close_to_onnxruntime(seed: int) -> None:
    batches = _batches(seed)
    obs = EntropyObserver(qscheme=torch.per_tensor_symmetric, dtype=torch.qint8)
    for b in batches:
        obs(b)
    ours = obs.calculate_qparams()[0].item() * 127.5
    theirs = _ort_threshold("entropy", batches, 99.99)
    data = torch.cat(batches)
    assert abs(ours - theirs) <= 0.3 * theirs
    assert _int8_mse(data, ours) <= 1.25 * _int8_mse(data, theirs)


def _int8_mse(x: torch.Tensor, threshold: float) -> float:
    scale = threshold / 127.5
    q = torch.clamp(torch.round(x / scale), -128, 127) * scale
    return float((q - x).pow(2).mean())
