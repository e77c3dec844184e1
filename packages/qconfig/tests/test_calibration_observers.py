"""PercentileObserver and EntropyObserver against an independent numpy reference, properties,
bad input and JSON round trips."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quantbridge.qconfig as qbq
from quantbridge.qconfig import (
    EntropyObserver,
    MinMaxObserver,
    PercentileObserver,
    QConfig,
    QConfigError,
    QConfigMapping,
)

SYM = torch.per_tensor_symmetric
AFF = torch.per_tensor_affine


# -- the numpy reference: built from all the data at once -----------------------------------


def ref_histogram(data: np.ndarray, bins: int, signed: bool) -> tuple[np.ndarray, float]:
    """Counts at bin width 2**e, e the smallest with max|x| < bins * 2**e."""
    abs_max = float(np.max(np.abs(data)))
    _mantissa, top = np.frexp(abs_max)
    width = 2.0 ** (int(top) - int(math.log2(bins)))
    values = data.astype(np.float64) if signed else np.abs(data.astype(np.float64))
    index = np.floor(values / width).astype(np.int64) + (bins if signed else 0)
    return np.bincount(index, minlength=2 * bins if signed else bins), width


def ref_qparams(lo: float, hi: float, qmin: int, qmax: int, symmetric: bool) -> tuple[float, int]:
    """torch.ao's per-tensor formula, float32 as torch computes it."""
    lo32 = np.float32(min(lo, 0.0))
    hi32 = np.float32(max(hi, 0.0))
    eps = np.finfo(np.float32).eps
    if symmetric:
        amax = max(-lo32, hi32)
        scale = max(np.float32(amax / np.float32((qmax - qmin) / 2)), eps)
        zp = 0 if qmin < 0 else (qmin + qmax + 1) // 2
        return float(scale), zp
    scale = max(np.float32((hi32 - lo32) / np.float32(qmax - qmin)), eps)
    zp = int(np.clip(qmin - round(float(lo32 / np.float32(scale))), qmin, qmax))
    return float(scale), zp


def ref_percentile_range(data: np.ndarray, percentile: float, bins: int, signed: bool):
    hist, width = ref_histogram(data, bins, signed)
    cum = np.cumsum(hist).astype(np.float64)
    total = cum[-1]
    if not signed:
        k = int(np.argmax(cum >= percentile / 100.0 * total))
        t = (k + 1) * width
        return max(float(data.min()), -t), min(float(data.max()), t)
    cut = (100.0 - percentile) / 200.0
    k_lo = int(np.argmax(cum > cut * total))
    k_hi = int(np.argmax(cum >= (1.0 - cut) * total))
    return (
        max(float(data.min()), (k_lo - bins) * width),
        min(float(data.max()), (k_hi - bins + 1) * width),
    )


def ref_smooth(p: np.ndarray, eps: float = 1e-4):
    zeros = p == 0
    n_nonzero = p.size - zeros.sum()
    if n_nonzero == 0:
        return None
    eps1 = eps * zeros.sum() / n_nonzero
    out = p + eps * zeros - eps1 * (~zeros)
    return None if (out <= 0).any() else out


def ref_entropy_bins(hist: np.ndarray, levels: int) -> int:
    """TensorRT's search as MXNet wrote it out: loops, no vectorisation."""
    used = int(np.nonzero(hist)[0][-1]) + 1
    if used <= levels:
        return used
    best, best_kl = used, np.inf
    for i in range(levels, used + 1):
        sliced = hist[:i].astype(np.float64)
        p = sliced.copy()
        p[-1] += hist[i:].sum()
        nonzero = (p != 0).astype(np.int64)
        merged = i // levels
        quantized = np.zeros(levels)
        for j in range(levels):
            stop = i if j == levels - 1 else (j + 1) * merged
            quantized[j] = sliced[j * merged : stop].sum()
        q = np.zeros(i)
        for j in range(levels):
            start = j * merged
            stop = i if j == levels - 1 else start + merged
            norm = nonzero[start:stop].sum()
            if norm:
                q[start:stop] = quantized[j] / norm
        q[p == 0] = 0
        ps, qs = ref_smooth(p), ref_smooth(q)
        if ps is None or qs is None:
            continue
        ps, qs = ps / ps.sum(), qs / qs.sum()
        kl = float(np.sum(ps * np.log(ps / qs)))
        if kl < best_kl:
            best, best_kl = i, kl
    return best


def observe(obs: torch.nn.Module, batches: list[torch.Tensor]) -> torch.nn.Module:
    for b in batches:
        obs(b)
    return obs


def gaussian_batches(seed: int, n: int = 3, size: int = 4000) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) * (1.0 + i) + 0.3 for i in range(n)]


# -- reference tests ------------------------------------------------------------------------


@pytest.mark.parametrize(("qscheme", "dtype"), [(SYM, torch.qint8), (AFF, torch.quint8)])
@pytest.mark.parametrize("percentile", [99.99, 99.0, 90.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_percentile_matches_reference(qscheme, dtype, percentile, seed):
    batches = gaussian_batches(seed)
    obs = observe(PercentileObserver(percentile=percentile, qscheme=qscheme, dtype=dtype), batches)
    data = torch.cat(batches).numpy()
    lo, hi = ref_percentile_range(data, percentile, 2048, signed=qscheme == AFF)
    scale, zp = obs.calculate_qparams()
    exp_scale, exp_zp = ref_qparams(lo, hi, obs.quant_min, obs.quant_max, qscheme == SYM)
    assert scale.item() == exp_scale
    assert zp.item() == exp_zp


@pytest.mark.parametrize(("qscheme", "dtype"), [(SYM, torch.qint8), (AFF, torch.quint8)])
@pytest.mark.parametrize("seed", [0, 1])
def test_entropy_matches_reference(qscheme, dtype, seed):
    batches = gaussian_batches(seed)
    obs = observe(EntropyObserver(qscheme=qscheme, dtype=dtype, bins=512), batches)
    data = torch.cat(batches).numpy()
    hist, width = ref_histogram(data, 512, signed=False)
    i = ref_entropy_bins(hist, 128)
    t = i * width
    lo, hi = max(float(data.min()), -t), min(float(data.max()), t)
    scale, zp = obs.calculate_qparams()
    exp_scale, exp_zp = ref_qparams(lo, hi, obs.quant_min, obs.quant_max, qscheme == SYM)
    assert scale.item() == exp_scale
    assert zp.item() == exp_zp
    assert np.array_equal(obs.histogram.numpy(), hist)


def test_histogram_is_order_independent():
    batches = gaussian_batches(3, n=4)
    a = observe(PercentileObserver(qscheme=AFF), batches)
    b = observe(PercentileObserver(qscheme=AFF), batches[::-1])
    c = observe(PercentileObserver(qscheme=AFF), [torch.cat(batches)])
    for other in (b, c):
        assert torch.equal(a.histogram, other.histogram)
        assert torch.equal(a.exponent, other.exponent)


# -- properties ------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    values=st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=1, max_size=200),
    symmetric=st.booleans(),
)
def test_percentile_100_equals_minmax(values, symmetric):
    x = torch.tensor(values, dtype=torch.float32)
    kw = {"qscheme": SYM, "dtype": torch.qint8} if symmetric else {"qscheme": AFF}
    obs = observe(PercentileObserver(percentile=100, **kw), [x, x[: len(x) // 2]])
    ref = observe(MinMaxObserver(**kw), [x])
    for got, exp in zip(obs.calculate_qparams(), ref.calculate_qparams(), strict=True):
        assert torch.equal(got, exp)


@pytest.mark.parametrize(
    ("cls", "spike"),
    # The entropy search starts at `levels` bins: with 2048 bins and 128 levels its smallest
    # threshold is 1/16 of the histogram's reach, so its spike is nearer.
    [(PercentileObserver, 1000.0), (EntropyObserver, 20.0), (EntropyObserver, 30.0)],
)
def test_outlier_is_clipped(cls, spike):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(200_000, generator=g)
    x[17] = spike  # one spike far out
    obs = cls(qscheme=SYM, dtype=torch.qint8)
    obs(x)
    scale, _ = obs.calculate_qparams()
    threshold = scale.item() * 127.5
    assert threshold < 10.0  # well below the spike ...
    assert threshold >= 2.0  # ... and keeps the bulk of the Gaussian
    minmax = MinMaxObserver(qscheme=SYM, dtype=torch.qint8)
    minmax(x)
    assert minmax.calculate_qparams()[0].item() * 127.5 >= spike


def test_entropy_keeps_a_range_without_outliers():
    x = torch.linspace(-1, 1, 10001)  # uniform: nothing to clip
    obs = EntropyObserver(qscheme=SYM, dtype=torch.qint8)
    obs(x)
    scale, _ = obs.calculate_qparams()
    assert scale.item() * 127.5 > 0.95


def test_all_zero_then_data():
    obs = PercentileObserver(percentile=100, qscheme=SYM, dtype=torch.qint8)
    obs(torch.zeros(10))
    obs(torch.tensor([0.5, -0.25]))
    assert obs.histogram[0].item() == 10  # the zeros; 0.25 and 0.5 lie in higher bins
    assert obs.histogram.sum().item() == 12
    assert obs.calculate_qparams()[0].item() == pytest.approx(0.5 / 127.5)


def test_unobserved_warns_default():
    with pytest.warns(UserWarning, match="before the observer saw any data"):
        scale, zp = EntropyObserver().calculate_qparams()
    assert scale.item() == 1.0
    assert zp.item() == 0


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, 100.5, float("nan"), True, "99"])
def test_bad_percentile(bad):
    with pytest.raises(QConfigError, match="percentile"):
        PercentileObserver(percentile=bad)


@pytest.mark.parametrize("cls", [PercentileObserver, EntropyObserver])
def test_bad_arguments(cls):
    with pytest.raises(QConfigError, match="power of two"):
        cls(bins=1000)
    with pytest.raises(QConfigError, match="qscheme"):
        cls(qscheme=torch.per_channel_affine)
    with pytest.raises(QConfigError, match="dynamic"):
        cls(is_dynamic=True)
    with pytest.raises(QConfigError, match="unexpected"):
        cls(bogus=1)
    with pytest.raises(QConfigError, match="NaN"):
        cls()(torch.tensor([1.0, float("nan")]))
    with pytest.raises(QConfigError, match="floating"):
        cls()(torch.tensor([1, 2]))


def test_inf_is_ignored_with_warning():
    obs = PercentileObserver(percentile=100)
    with pytest.warns(UserWarning, match="inf"):
        obs(torch.tensor([1.0, float("inf"), -2.0]))
    assert obs.max_val.item() == 1.0
    assert obs.min_val.item() == -2.0


def test_state_dict_round_trip():
    obs = observe(EntropyObserver(), gaussian_batches(2))
    other = EntropyObserver()
    other.load_state_dict(obs.state_dict())
    for a, b in zip(obs.calculate_qparams(), other.calculate_qparams(), strict=True):
        assert torch.equal(a, b)


# -- JSON ------------------------------------------------------------------------------------


def test_json_round_trip():
    qconfig = QConfig(
        activation=PercentileObserver.with_args(percentile=99.9, qscheme=SYM, dtype=torch.qint8),
        weight=EntropyObserver.with_args(bins=1024),
    )
    mapping = QConfigMapping().set_global(qconfig)
    back = QConfigMapping.from_json(mapping.to_json())
    restored = back.global_qconfig
    act = restored.activation()
    assert isinstance(act, PercentileObserver)
    assert act.percentile == 99.9
    assert act.qscheme.value == "per_tensor_symmetric"
    weight = restored.weight()
    assert isinstance(weight, EntropyObserver)
    assert weight.bins == 1024
    assert back.to_json() == mapping.to_json()


def test_json_refuses_bad_percentile():
    mapping = QConfigMapping().set_global(
        QConfig(
            activation=PercentileObserver.with_args(percentile=99.9),
            weight=qbq.default_weight_observer,
        )
    )
    text = mapping.to_json().replace("99.9", "150.0")
    with pytest.raises(QConfigError, match="percentile"):
        QConfigMapping.from_json(text)
