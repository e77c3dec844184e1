"""PercentileObserver and EntropyObserver: clipping ranges chosen from a histogram.

Both accumulate the same statistic: an exact integer histogram whose bins have a width that
is a power of two and whose edges are anchored at 0. When a batch exceeds the covered range
the width doubles (as often as needed) and neighbouring bins are summed, which loses nothing
because the coarser edges are a subset of the finer ones. So the histogram after any number
of batches, in any order, on any number of ranks, is exactly the histogram of all the data at
the width that its overall largest magnitude requires. That makes merging across ranks exact
(``quantbridge.fx_quant.sync_observers``).

The documentation's "Observers and calibration" page states the formulas.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from quantbridge.qconfig._dtypes import QScheme, canonical_qscheme
from quantbridge.qconfig._errors import QConfigError
from quantbridge.qconfig._observer_base import (
    _FLOAT32_EPS,
    UniformQuantizationObserverBase,
    buffer_kwargs,
)

MAX_BINS = 2**20
# The exponent before any non-zero value was seen: finer than any float32 needs
# (2**-149 is the smallest subnormal, and bins <= 2**20), so the first real exponent only
# coarsens and all-zero data sits in the zero bin whatever comes later.
INITIAL_EXPONENT = -170
_SMOOTHING_EPS = 1e-4


def exponent_for(abs_max: float, bins: int) -> int:
    """The smallest ``e`` with ``abs_max < bins * 2**e`` (``bins`` a power of two)."""
    if abs_max <= 0.0:
        return INITIAL_EXPONENT
    _, top = math.frexp(abs_max)  # abs_max < 2**top
    return max(top - (bins.bit_length() - 1), INITIAL_EXPONENT)


class _PowerOfTwoHistogramObserver(UniformQuantizationObserverBase):
    """Shared state: ``min_val``/``max_val`` (0-dim float32, exact running extremes),
    ``histogram`` (int64 counts; bin ``k`` holds ``k*2**exponent <= v < (k+1)*2**exponent``)
    and ``exponent`` (0-dim int64). ``signed`` histograms cover ``x`` with ``2*bins`` bins
    (bin ``k`` is ``[(k-bins)*w, (k-bins+1)*w)``), unsigned ones cover ``|x|`` with ``bins``."""

    min_val: torch.Tensor
    max_val: torch.Tensor
    histogram: torch.Tensor
    exponent: torch.Tensor
    signed: bool

    def __init__(
        self,
        bins: int,
        signed: bool,
        dtype: object,
        qscheme: object,
        reduce_range: bool,
        quant_min: int | None,
        quant_max: int | None,
        factory_kwargs: dict[str, Any] | None,
        eps: float,
        is_dynamic: bool,
        **kwargs: Any,
    ) -> None:
        where = type(self).__name__
        if is_dynamic:
            raise QConfigError(f"{where} does not support dynamic quantization")
        if (
            isinstance(bins, bool)
            or not isinstance(bins, int)
            or not 1 <= bins <= MAX_BINS
            or bins & (bins - 1)
        ):
            raise QConfigError(
                f"{where}: bins must be a power of two in [1, {MAX_BINS}] (the bin width is a "
                f"power of two so that histograms merge exactly), got {bins!r}"
            )
        super().__init__(
            dtype=dtype,
            qscheme=qscheme,
            reduce_range=reduce_range,
            quant_min=quant_min,
            quant_max=quant_max,
            factory_kwargs=factory_kwargs,
            eps=eps,
            is_dynamic=is_dynamic,
            **kwargs,
        )
        self._init_per_tensor_range(factory_kwargs)
        device = buffer_kwargs(factory_kwargs).get("device")
        self.bins = bins
        self.signed = signed
        length = 2 * bins if signed else bins
        self.register_buffer("histogram", torch.zeros(length, dtype=torch.int64, device=device))
        self.register_buffer(
            "exponent", torch.tensor(INITIAL_EXPONENT, dtype=torch.int64, device=device)
        )

    # -- observing -------------------------------------------------------------------------

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        where = type(self).__name__
        x = x_orig.detach()
        if not x.is_floating_point():
            raise QConfigError(
                f"{where}: input dtype {x.dtype} is not a floating-point dtype; observe the "
                "float tensor"
            )
        x = x.to(torch.float32).reshape(-1)
        if bool(torch.isnan(x).any()):
            raise QConfigError(
                f"{where}: the input contains NaN; a histogram of NaN is undefined. Find where "
                "the NaN comes from (torch.isnan) before calibrating."
            )
        finite = torch.isfinite(x)
        if not bool(finite.all()):
            warnings.warn(
                f"{where}: ignoring inf values in the input (they would make the range "
                "infinite; quantization clamps them anyway)",
                stacklevel=2,
            )
            x = x[finite]
            if x.numel() == 0:
                return x_orig
        x_min, x_max = torch.aminmax(x)
        with torch.no_grad():
            self.min_val.copy_(torch.min(self.min_val, x_min.to(self.min_val.device)))
            self.max_val.copy_(torch.max(self.max_val, x_max.to(self.max_val.device)))
            abs_max = max(-float(self.min_val), float(self.max_val))
            wanted = exponent_for(abs_max, self.bins)
            current = int(self.exponent)
            if wanted > current:
                self.histogram.copy_(self.coarsened(self.histogram, current, wanted))
                self.exponent.fill_(wanted)
            self.histogram.add_(self._counts(x, wanted if wanted > current else current))
        return x_orig

    def _counts(self, x: torch.Tensor, exponent: int) -> torch.Tensor:
        """The histogram of ``x`` (finite float32) at bin width ``2**exponent``."""
        values = x.double() if self.signed else x.double().abs()
        # Multiplying by a power of two is exact in float64 for every float32 value.
        index = torch.floor(values * math.ldexp(1.0, -exponent)).to(torch.int64)
        if self.signed:
            index = index + self.bins
        counts = torch.bincount(index.to(self.histogram.device), minlength=len(self.histogram))
        return counts

    def coarsened(self, histogram: torch.Tensor, exponent: int, new_exponent: int) -> torch.Tensor:
        """``histogram`` (this observer's layout, bin width ``2**exponent``) at the bin width
        ``2**new_exponent >= 2**exponent``: each coarse bin sums the fine bins inside it."""
        if new_exponent < exponent:
            raise QConfigError(
                f"{type(self).__name__}: cannot refine a histogram from bin width 2**{exponent} "
                f"to 2**{new_exponent}"
            )
        if new_exponent == exponent:
            return histogram.clone()
        shift = min(new_exponent - exponent, 62)  # beyond 62 every index maps alike
        index = torch.arange(len(histogram), device=histogram.device)
        if self.signed:
            index = torch.div(index - self.bins, 2**shift, rounding_mode="floor") + self.bins
        else:
            index = torch.div(index, 2**shift, rounding_mode="floor")
        return torch.zeros_like(histogram).index_add_(0, index, histogram)

    def _observed(self) -> bool:
        return not (bool(self.min_val == float("inf")) and bool(self.max_val == float("-inf")))

    def _clipped_qparams(self, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Qparams of the observed range clipped to ``[low, high]`` (float64 bounds)."""
        lo = torch.max(self.min_val.double(), torch.tensor(low, dtype=torch.float64))
        hi = torch.min(self.max_val.double(), torch.tensor(high, dtype=torch.float64))
        lo32 = lo.to(self.min_val.dtype).to(self.min_val.device)
        hi32 = hi.to(self.max_val.dtype).to(self.max_val.device)
        return self._calculate_qparams(lo32, hi32)

    def reset_min_max_vals(self) -> None:
        """Forget everything observed so far."""
        self.min_val.fill_(float("inf"))
        self.max_val.fill_(float("-inf"))
        self.histogram.zero_()
        self.exponent.fill_(INITIAL_EXPONENT)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}, bins={self.bins}"


class PercentileObserver(_PowerOfTwoHistogramObserver):
    """Clips the observed range at a percentile of the data.

    Symmetric qschemes: ``T`` is the upper edge of the first bin of the ``|x|`` histogram
    whose cumulative count reaches ``percentile / 100 * total``; the range is
    ``[max(min_val, -T), min(max_val, T)]``. Affine qschemes cut ``(100 - percentile) / 2``
    percent from each side of the signed histogram. ``percentile=100`` gives exactly
    :class:`MinMaxObserver`'s qparams. Other arguments as :class:`HistogramObserver`'s;
    ``bins`` must be a power of two.
    """

    def __init__(
        self,
        percentile: float = 99.99,
        bins: int = 2048,
        dtype: object = torch.uint8,
        qscheme: object = QScheme.PER_TENSOR_AFFINE,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        factory_kwargs: dict[str, Any] | None = None,
        eps: float = _FLOAT32_EPS,
        is_dynamic: bool = False,
        **kwargs: Any,
    ) -> None:
        if (
            isinstance(percentile, bool)
            or not isinstance(percentile, (int, float))
            or not (math.isfinite(percentile) and 0 < percentile <= 100)
        ):
            raise QConfigError(
                f"PercentileObserver: percentile must be a number in (0, 100] (the share of "
                f"values kept inside the range, in percent), got {percentile!r}"
            )
        signed = not canonical_qscheme(qscheme, where="PercentileObserver: qscheme").is_symmetric
        super().__init__(
            bins,
            signed,
            dtype,
            qscheme,
            reduce_range,
            quant_min,
            quant_max,
            factory_kwargs,
            eps,
            is_dynamic,
            **kwargs,
        )
        self.percentile = float(percentile)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._observed():
            return self._calculate_qparams(self.min_val, self.max_val)  # warns, default
        width = math.ldexp(1.0, int(self.exponent))
        cumulative = torch.cumsum(self.histogram, 0).double().cpu()
        total = float(cumulative[-1])
        if not self.signed:
            target = torch.tensor([self.percentile / 100.0 * total], dtype=torch.float64)
            k = int(torch.searchsorted(cumulative, target))
            threshold = (k + 1) * width
            return self._clipped_qparams(-threshold, threshold)
        cut = (100.0 - self.percentile) / 200.0
        low_target = torch.tensor([cut * total], dtype=torch.float64)
        high_target = torch.tensor([(1.0 - cut) * total], dtype=torch.float64)
        k_low = int(torch.searchsorted(cumulative, low_target, right=True))
        k_high = int(torch.searchsorted(cumulative, high_target))
        return self._clipped_qparams((k_low - self.bins) * width, (k_high - self.bins + 1) * width)


def _smoothed(counts: torch.Tensor) -> torch.Tensor | None:
    """Zero entries raised to eps, the others lowered by the same total; None when that
    would leave an entry <= 0 or nothing is non-zero."""
    zeros = counts == 0
    n_zeros = int(zeros.sum())
    n_nonzeros = counts.numel() - n_zeros
    if n_nonzeros == 0:
        return None
    eps1 = _SMOOTHING_EPS * n_zeros / n_nonzeros
    smoothed = torch.where(zeros, counts + _SMOOTHING_EPS, counts - eps1)
    if bool((smoothed <= 0).any()):
        return None
    return smoothed


def kl_divergence_threshold_bins(histogram: torch.Tensor, levels: int) -> int:
    """The number of histogram bins ``i`` (``levels <= i <= used bins``) whose clipping has
    the smallest KL divergence between the clipped reference and its ``levels``-level
    quantization; the first one on ties. Fewer used bins than levels: all of them."""
    hist = histogram.double().cpu()
    nonzero_bins = torch.nonzero(hist).reshape(-1)
    used = int(nonzero_bins[-1]) + 1 if nonzero_bins.numel() else 0
    if used <= levels:
        return max(used, 1)
    best_i, best_kl = used, math.inf
    for i in range(levels, used + 1):
        sliced = hist[:i]
        p = sliced.clone()
        p[i - 1] += hist[i:].sum()
        present = (p != 0).double()
        merged = i // levels
        group = torch.clamp(torch.arange(i) // merged, max=levels - 1)
        quantized = torch.zeros(levels, dtype=torch.float64).index_add_(0, group, sliced)
        norm = torch.zeros(levels, dtype=torch.float64).index_add_(0, group, present)
        per_bin = torch.where(norm > 0, quantized / torch.clamp(norm, min=1.0), 0.0)
        q = per_bin[group] * present
        p_s, q_s = _smoothed(p), _smoothed(q)
        if p_s is None or q_s is None:
            continue
        p_n = p_s / p_s.sum()
        q_n = q_s / q_s.sum()
        kl = float(torch.sum(p_n * torch.log(p_n / q_n)))
        if kl < best_kl:
            best_i, best_kl = i, kl
    return best_i


class EntropyObserver(_PowerOfTwoHistogramObserver):
    """Clips at the threshold whose int8 quantization loses the least information (KL
    divergence), as TensorRT's entropy calibrator.

    Keeps a histogram of ``|x|`` (for every qscheme). ``calculate_qparams`` tries every
    candidate of ``i`` bins, ``levels <= i <= used bins`` where ``levels = (quant_max -
    quant_min + 1) // 2`` (128 for 8 bits), and picks the smallest KL divergence (docs:
    "Observers and calibration"); ``T = min(i * bin_width, max|x|)``. The range is
    ``[max(min_val, -T), min(max_val, T)]``. ``bins`` must be a power of two.
    """

    def __init__(
        self,
        bins: int = 2048,
        dtype: object = torch.uint8,
        qscheme: object = QScheme.PER_TENSOR_AFFINE,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        factory_kwargs: dict[str, Any] | None = None,
        eps: float = _FLOAT32_EPS,
        is_dynamic: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            bins,
            False,
            dtype,
            qscheme,
            reduce_range,
            quant_min,
            quant_max,
            factory_kwargs,
            eps,
            is_dynamic,
            **kwargs,
        )
        self.levels = (self.quant_max - self.quant_min + 1) // 2

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._observed():
            return self._calculate_qparams(self.min_val, self.max_val)  # warns, default
        i = kl_divergence_threshold_bins(self.histogram, self.levels)
        threshold = i * math.ldexp(1.0, int(self.exponent))
        return self._clipped_qparams(-threshold, threshold)
