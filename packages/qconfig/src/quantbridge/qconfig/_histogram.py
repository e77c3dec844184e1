"""HistogramObserver: a running histogram and an L2-optimal clipping range.

The search and the histogram merging follow torch.ao 2.13 operation for operation (float32
tensors where torch.ao uses tensors, Python floats where it uses Python floats), so the
chosen range and the qparams are bit-identical. The quantile scan is done with bisection on
the (non-decreasing) cumulative histogram instead of a bin-by-bin walk: it visits the same
bins, just faster.
"""

from __future__ import annotations

import bisect
import struct
import warnings
from typing import Any

import torch

from quantbridge.qconfig._dtypes import QScheme
from quantbridge.qconfig._errors import QConfigError
from quantbridge.qconfig._observer_base import (
    _FLOAT32_EPS,
    UniformQuantizationObserverBase,
    buffer_kwargs,
)
from quantbridge.qconfig._qparams import default_qparams

_STEP = 1e-5  # quantile granularity of the clipping search
# Most bins accepted (torch.ao has no limit): 2**20 float32 bins are 4 MiB per observer and
# the clipping search already takes seconds; beyond that a typo exhausts memory.
MAX_BINS = 2**20


def _to_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (torch compares float32 elements that way)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def _l2_error(begin: torch.Tensor, end: torch.Tensor, density: torch.Tensor) -> torch.Tensor:
    """Squared error of values spread uniformly (``density``) over ``[begin, end]`` around a
    quantization level at 0: ``density * (end**3 - begin**3) / 3``."""
    cubes = (end * end * end - begin * begin * begin) / 3
    return density * cubes


class HistogramObserver(UniformQuantizationObserverBase):
    """Keeps a ``bins``-bin histogram over the running [min, max] and, in
    ``calculate_qparams``, picks the sub-range whose quantization minimizes the L2 error.

    Buffers: ``eps`` ``[1]``, ``histogram`` ``[bins]``, ``min_val``/``max_val`` (0-dim).
    Inputs containing ``inf`` are observed without the infinite values (with a warning, as
    torch.ao); inputs containing NaN raise :class:`QConfigError`.
    """

    histogram: torch.Tensor
    min_val: torch.Tensor
    max_val: torch.Tensor

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
        if is_dynamic:
            raise QConfigError("HistogramObserver does not support dynamic quantization")
        if isinstance(bins, bool) or not isinstance(bins, int) or not 1 <= bins <= MAX_BINS:
            raise QConfigError(
                f"HistogramObserver: bins must be an int in [1, {MAX_BINS}], got {bins!r}"
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
        self._check_qscheme(per_channel=False)
        self._check_symmetric_reduce_range()
        fk = buffer_kwargs(factory_kwargs)
        self.bins = bins
        self.register_buffer("histogram", torch.zeros(bins, **fk))
        self.register_buffer("min_val", torch.tensor(float("inf"), **fk))
        self.register_buffer("max_val", torch.tensor(float("-inf"), **fk))
        # Number of levels of the target integer type (torch.ao uses the dtype's bit width).
        self.dst_nbins = 2 ** torch.iinfo(self.dtype).bits
        # Each source bin is split this many times when re-binning onto a wider range.
        self.upsample_rate = 16

    # -- observing -------------------------------------------------------------------------

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        x = x_orig.detach()
        if not x.is_floating_point():
            raise QConfigError(
                f"HistogramObserver: input dtype {x.dtype} is not a floating-point dtype; "
                "observe the float tensor (torch.histc has no integer kernel)"
            )
        x_min, x_max = torch.aminmax(x)
        if bool(torch.isnan(x_min)) or bool(torch.isnan(x_max)):
            raise QConfigError(
                "HistogramObserver: the input contains NaN; a histogram of NaN is undefined. "
                "Find where the NaN comes from (torch.isnan) before calibrating."
            )
        if bool(x_min == float("-inf")) or bool(x_max == float("inf")):
            warnings.warn(
                "HistogramObserver: ignoring inf values in the input (they would make the "
                "range infinite; quantization clamps them anyway)",
                stacklevel=2,
            )
            x = x[x.abs() != float("inf")]
            if x.numel() == 0:
                return x_orig
            x_min, x_max = torch.aminmax(x)

        if bool(self.min_val == float("inf")) or bool(self.max_val == float("-inf")):
            self._start(x, x_min, x_max)
            return x_orig

        cur_min, cur_max = self.min_val, self.max_val
        new_min = torch.min(cur_min, x_min).detach()
        new_max = torch.max(cur_max, x_max).detach()
        update = torch.histc(x, self.bins, min=new_min, max=new_max).to(  # type: ignore[arg-type]
            self.histogram.device
        )
        if bool(new_min == cur_min) and bool(new_max == cur_max):
            self._set_histogram(self.histogram + update)
        else:
            self._set_histogram(
                self._merge(self.histogram, cur_min, cur_max, update, new_min, new_max)
            )
            self.min_val.detach_().resize_(new_min.shape)
            self.min_val.copy_(new_min)
            self.max_val.detach_().resize_(new_max.shape)
            self.max_val.copy_(new_max)
        return x_orig

    def _set_histogram(self, hist: torch.Tensor) -> None:
        self.histogram.detach_().resize_(hist.shape)
        self.histogram.copy_(hist)

    def rebin(
        self,
        hist: torch.Tensor,
        low: torch.Tensor,
        high: torch.Tensor,
        new_low: torch.Tensor,
        new_high: torch.Tensor,
    ) -> torch.Tensor:
        """``hist`` (this observer's bins over [low, high]) moved onto [new_low, new_high] by
        the rule ``forward`` uses when its range grows."""
        return self._merge(hist, low, high, torch.zeros_like(hist), new_low, new_high)

    def set_histogram(self, hist: torch.Tensor) -> None:
        """Replace the bin counts over the current range (``min_val``..``max_val``): a
        histogram merged from other processes' observers of the same range."""
        self._set_histogram(hist)

    def _start(self, x: torch.Tensor, x_min: torch.Tensor, x_max: torch.Tensor) -> None:
        """First input: the range is its own, the histogram its own."""
        self.min_val.resize_(x_min.shape)
        self.min_val.copy_(x_min)
        self.max_val.resize_(x_max.shape)
        self.max_val.copy_(x_max)
        self._set_histogram(torch.histc(x, self.bins, min=x_min, max=x_max))  # type: ignore[arg-type]

    def reset_histogram(
        self, x: torch.Tensor, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> None:
        """Restart the histogram from ``x`` over ``[min_val, max_val]`` (scalars)."""
        if min_val.numel() != 1 or max_val.numel() != 1:
            raise QConfigError("HistogramObserver.reset_histogram: min/max must be scalars")
        self._start(x, min_val, max_val)

    def _rebin(
        self,
        hist: torch.Tensor,
        old_min: torch.Tensor,
        old_max: torch.Tensor,
        new_min: torch.Tensor,
        new_max: torch.Tensor,
    ) -> torch.Tensor:
        """``hist`` over [old_min, old_max] moved onto ``bins`` bins over [new_min, new_max]:
        each bin is split into ``upsample_rate`` equal parts placed by their mid-points."""
        fine_count = self.bins * self.upsample_rate
        fine = hist.repeat_interleave(self.upsample_rate) / self.upsample_rate
        fine_width = (old_max - old_min) / fine_count
        mids = (
            torch.linspace(old_min, old_max, fine_count + 1, device=old_min.device)[:-1].to(
                hist.device
            )
            + 0.5 * fine_width
        )
        edges = torch.linspace(new_min, new_max, self.bins + 1, device=new_min.device).to(
            hist.device
        )
        target = torch.bucketize(mids, edges, right=True) - 1
        # Rounding can put a mid-point just outside the new edges: keep it in the end bins.
        target = target.clamp(0, self.bins - 1)
        return torch.bincount(target, weights=fine, minlength=self.bins)

    def _merge(
        self,
        old_hist: torch.Tensor,
        old_min: torch.Tensor,
        old_max: torch.Tensor,
        new_hist: torch.Tensor,
        new_min: torch.Tensor,
        new_max: torch.Tensor,
    ) -> torch.Tensor:
        """The old histogram re-binned onto the new range, plus the new histogram."""
        if bool(new_min == old_min) and bool(new_max == old_max):
            return old_hist + new_hist
        if bool(old_min == old_max):
            # A single-valued history is one spike: drop its whole mass into its new bin.
            mass = torch.sum(old_hist)
            spike = torch.histc(old_min, bins=self.bins, min=new_min, max=new_max)  # type: ignore[arg-type]
            return spike * mass + new_hist
        if bool(new_min > old_min) or bool(new_max < old_max):
            raise QConfigError("HistogramObserver: the merged range must contain the old one")
        return new_hist + self._rebin(old_hist, old_min, old_max, new_min, new_max)

    # -- choosing the range ----------------------------------------------------------------

    def _quantization_error(self, first_bin: int, last_bin: int) -> float:
        """L2 error of quantizing the histogram to ``dst_nbins`` levels spread over the
        source bins ``first_bin..last_bin`` (values outside are clamped to the ends)."""
        bins = self.bins
        device = self.histogram.device
        src_width = (self.max_val.item() - self.min_val.item()) / bins
        dst_width = src_width * (last_bin - first_bin + 1) / self.dst_nbins
        if dst_width == 0.0:
            return 0.0

        src_begin = (torch.arange(bins, device=device) - first_bin) * src_width
        src_end = src_begin + src_width
        top = self.dst_nbins - 1
        dst_of_begin = torch.clamp(torch.div(src_begin, dst_width, rounding_mode="floor"), 0, top)
        dst_of_end = torch.clamp(torch.div(src_end, dst_width, rounding_mode="floor"), 0, top)
        begin_center = (dst_of_begin + 0.5) * dst_width
        density = self.histogram / src_width
        half = dst_width / 2

        error = torch.zeros(bins, device=device)
        # The part of each source bin inside its first destination bin,
        error += _l2_error(
            src_begin - begin_center, torch.ones(bins, device=device) * half, density
        )
        # the destination bins it covers completely,
        error += (dst_of_end - dst_of_begin - 1) * _l2_error(
            torch.tensor(-half), torch.tensor(half), density
        )
        # and the part inside its last destination bin.
        end_center = dst_of_end * dst_width + half
        error += _l2_error(torch.tensor(-half), src_end - end_center, density)
        return float(error.sum().item())

    def _non_linear_param_search(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Shrink [min, max] from whichever side drops fewer histogram counts per quantile
        step, while the quantization error keeps decreasing; return the clipped range."""
        if self.histogram.size(0) != self.bins:
            raise QConfigError(
                f"HistogramObserver: histogram has {self.histogram.size(0)} bins, expected "
                f"{self.bins}"
            )
        bin_width = (self.max_val - self.min_val) / self.bins
        total = torch.sum(self.histogram).item()
        cumulative_t = torch.cumsum(self.histogram, dim=0)
        # torch compares a float32 element with a Python float in float32: round the bounds.
        cumulative: list[float] = cumulative_t.tolist()
        monotone = bool((cumulative_t[1:] >= cumulative_t[:-1]).all())

        alpha, beta = 0.0, 1.0
        first, last = 0, self.bins - 1
        best = float("inf")
        while alpha < beta:
            next_alpha = alpha + _STEP
            next_beta = beta - _STEP
            lower = _to_float32(next_alpha * total)
            upper = _to_float32(next_beta * total)
            left, right = self._quantile_bins(cumulative, monotone, first, last, lower, upper)

            cand_first, cand_last = first, last
            if left - first > last - right:
                cand_first = left
                alpha = next_alpha
            else:
                cand_last = right
                beta = next_beta
            if cand_first == first and cand_last == last:
                continue
            error = self._quantization_error(cand_first, cand_last)
            if error > best:
                break
            best = error
            first, last = cand_first, cand_last

        new_min = self.min_val + bin_width * first
        new_max = self.min_val + bin_width * (last + 1)
        return new_min, new_max

    @staticmethod
    def _quantile_bins(
        cumulative: list[float], monotone: bool, first: int, last: int, lower: float, upper: float
    ) -> tuple[int, int]:
        """First bin in [first, last] whose cumulative count reaches ``lower`` (else
        ``last``) and last bin in [first, last] whose count is within ``upper`` (else
        ``first``)."""
        if monotone:
            left = bisect.bisect_left(cumulative, lower, first, last)
            right = bisect.bisect_right(cumulative, upper, first + 1, last + 1) - 1
            return left, right
        left = first
        while left < last and cumulative[left] < lower:
            left += 1
        right = last
        while right > first and cumulative[right] > upper:
            right -= 1
        return left, right

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        if bool(self.min_val == float("inf")) and bool(self.max_val == float("-inf")):
            warnings.warn(
                "HistogramObserver: calculate_qparams called before the observer saw any "
                "data; returning scale=1.0, zero_point=0",
                stacklevel=2,
            )
            return default_qparams(self.min_val.device)
        if self.bins != len(self.histogram):
            raise QConfigError(
                f"HistogramObserver: histogram has {len(self.histogram)} bins but the observer "
                f"was built with bins={self.bins}; build it with the matching bins"
            )
        new_min, new_max = self._non_linear_param_search()
        return self._calculate_qparams(new_min, new_max)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}"

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # args: local_metadata, strict, missing_keys, unexpected_keys, error_msgs (nn.Module's)
        local_metadata: dict[str, Any] = args[0]
        version = local_metadata.get("version")
        if version is None or version < 3:
            # Before version 3 an unobserved min/max was stored as an empty [0] tensor.
            for name, empty in (("min_val", float("inf")), ("max_val", float("-inf"))):
                value = state_dict.get(prefix + name)
                if isinstance(value, torch.Tensor) and value.shape == torch.Size([0]):
                    state_dict[prefix + name] = torch.tensor(empty)
        for name in ("min_val", "max_val"):
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor):
                getattr(self, name).resize_(value.shape)
        super()._load_from_state_dict(state_dict, prefix, *args)
