"""Quantization ranges and the scale / zero-point computation shared by all min/max observers.

The arithmetic is torch.ao 2.13's, step for step in float32, so results are bit-identical:

* affine: ``scale = max((max(max_val, 0) - min(min_val, 0)) / (qmax - qmin), eps)``,
  ``zero_point = clamp(qmin - round(min(min_val, 0) / scale), qmin, qmax)`` (int32);
* symmetric: ``scale = max(max(-min(min_val, 0), max(max_val, 0)) / ((qmax - qmin) / 2), eps)``,
  zero point fixed by the dtype (int64, as torch.ao returns it);
* float qparams: ``scale = (max_val - min_val) / (qmax - qmin)`` (1.0 where not above eps),
  ``zero_point = -min_val / scale`` (float32).
"""

from __future__ import annotations

import warnings

import torch

from quantbridge.qconfig._dtypes import (
    QScheme,
    canonical_dtype,
    dtype_alias_name,
    natural_quant_range,
)
from quantbridge.qconfig._errors import QConfigError


class QuantRange:
    """The integer range an observer quantizes to, resolved once at construction."""

    __slots__ = ("dtype", "has_customized_qrange", "quant_max", "quant_min", "symmetric_zero")

    def __init__(
        self,
        dtype: torch.dtype,
        quant_min: int,
        quant_max: int,
        has_customized_qrange: bool,
        symmetric_zero: int,
    ) -> None:
        self.dtype = dtype
        self.quant_min = quant_min
        self.quant_max = quant_max
        self.has_customized_qrange = has_customized_qrange
        # The zero point symmetric schemes use: mid-range for unsigned 8/16-bit types.
        self.symmetric_zero = symmetric_zero


def resolve_quant_range(
    dtype: object,
    quant_min: int | None,
    quant_max: int | None,
    reduce_range: bool,
    where: str,
) -> QuantRange:
    """Validate ``dtype``/``quant_min``/``quant_max``/``reduce_range`` and resolve the range.

    Without a custom range the dtype's 8-bit default is used (``reduce_range`` drops one bit
    for int8/uint8 only, like torch.ao). A custom range must contain 0, have
    ``quant_min < quant_max`` and fit the dtype; ``reduce_range`` halves it (floor division).
    """
    canonical = canonical_dtype(dtype, where=f"{where}: dtype")
    if canonical.is_floating_point:
        raise QConfigError(
            f"{where}: dtype {canonical} is a float dtype; this observer computes integer "
            "qparams. Use uint8/int8/uint16/int16/int32 (or torch.quint8/qint8/qint32), or "
            "PlaceholderObserver for float16 configs."
        )
    alias = dtype_alias_name(dtype)
    natural_min, natural_max = natural_quant_range(dtype)
    if (quant_min is None) != (quant_max is None):
        raise QConfigError(
            f"{where}: quant_min={quant_min!r}, quant_max={quant_max!r}; give both or neither "
            "(torch.ao silently ignores a lone bound)"
        )
    customized = quant_min is not None and quant_max is not None
    if quant_min is not None and quant_max is not None:
        for name, value in (("quant_min", quant_min), ("quant_max", quant_max)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise QConfigError(f"{where}: {name} must be an int, got {value!r}")
        if not quant_min <= 0 <= quant_max:
            raise QConfigError(
                f"{where}: the quantization range [{quant_min}, {quant_max}] must include 0"
            )
        if quant_min >= quant_max:
            raise QConfigError(
                f"{where}: quant_min ({quant_min}) must be strictly less than quant_max "
                f"({quant_max})"
            )
        if quant_min < natural_min or quant_max > natural_max:
            raise QConfigError(
                f"{where}: [{quant_min}, {quant_max}] does not fit dtype "
                f"{alias or canonical} whose range is [{natural_min}, {natural_max}]"
            )
        qmin, qmax = (quant_min // 2, quant_max // 2) if reduce_range else (quant_min, quant_max)
    elif alias in ("quint4x2", "quint2x4"):
        qmin, qmax = natural_min, natural_max
    elif canonical == torch.int8:
        qmin, qmax = (-64, 63) if reduce_range else (-128, 127)
    elif canonical == torch.uint8:
        qmin, qmax = (0, 127) if reduce_range else (0, 255)
    else:  # int16, uint16, int32: reduce_range does not apply (torch.ao ignores it too)
        qmin, qmax = natural_min, natural_max

    if alias in ("quint4x2", "quint2x4"):
        symmetric_zero = 0  # torch.ao only centres 8/16-bit unsigned types
    elif canonical == torch.uint8:
        symmetric_zero = (qmin + qmax) // 2 if customized else 128
    elif canonical == torch.uint16:
        symmetric_zero = 2**15
    else:
        symmetric_zero = 0
    return QuantRange(canonical, qmin, qmax, customized, symmetric_zero)


def default_qparams(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """What an observer that saw nothing returns: scale 1.0, zero point 0 (int64)."""
    return (
        torch.tensor([1.0], device=device.type),
        torch.tensor([0], device=device.type),
    )


def _has_stats(min_val: torch.Tensor, max_val: torch.Tensor, where: str) -> bool:
    """False (with a warning) before any data was seen; raises on inconsistent statistics."""
    unobserved = min_val.numel() == 0 or max_val.numel() == 0
    if not unobserved and (min_val.dim() == 0 or max_val.dim() == 0):
        # Per-tensor buffers start at (inf, -inf).
        unobserved = bool(min_val == float("inf")) and bool(max_val == float("-inf"))
    if unobserved:
        warnings.warn(
            f"{where}: calculate_qparams called before the observer saw any data; "
            "returning scale=1.0, zero_point=0",
            stacklevel=3,
        )
        return False
    finite = torch.isfinite(min_val) & torch.isfinite(max_val)
    if not bool(finite.all()):
        bad = (~finite).reshape(-1).nonzero().reshape(-1).tolist()
        place = "" if min_val.dim() == 0 else f" in channel(s) {bad[:8]}"
        raise QConfigError(
            f"{where}: the observed range is not finite{place} (min_val={min_val.tolist()}, "
            f"max_val={max_val.tolist()}); the observer saw NaN or inf. Clean the input, or "
            "use HistogramObserver, which skips inf values."
        )
    if bool((min_val > max_val).any()):
        raise QConfigError(
            f"{where}: min_val {min_val.tolist()} exceeds max_val {max_val.tolist()}; the "
            "observer state is inconsistent (was it loaded from a corrupted state_dict?)"
        )
    return True


def compute_qparams(
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    qrange: QuantRange,
    qscheme: QScheme,
    eps: torch.Tensor,
    where: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point for per-tensor (0-dim) or per-channel (1-dim) min/max values.

    Shapes and dtypes follow torch.ao: both results have shape ``[1]`` per tensor and
    ``[C]`` per channel; scale is float32; zero point is int32 (affine), int64 (symmetric,
    and the not-yet-observed default) or float32 (per_channel_affine_float_qparams).
    """
    if not _has_stats(min_val, max_val, where):
        return default_qparams(min_val.device)

    qmin, qmax = qrange.quant_min, qrange.quant_max
    min_neg = torch.min(min_val, torch.zeros_like(min_val))
    max_pos = torch.max(max_val, torch.zeros_like(max_val))
    zero_point: torch.Tensor
    if qscheme.is_symmetric:
        bound = torch.max(-min_neg, max_pos)
        scale = torch.max(bound / (float(qmax - qmin) / 2), eps)
        zero_point = torch.full(
            min_neg.size(), qrange.symmetric_zero, dtype=torch.int64, device=min_neg.device
        )
    elif qscheme is QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS:
        scale = (max_val - min_val) / float(qmax - qmin)
        scale = torch.where(scale > eps, scale, torch.ones_like(scale))
        # Float zero point: quantize as round((x - min_val) / scale).
        zero_point = -1 * min_val / scale
    else:
        scale = torch.max((max_pos - min_neg) / float(qmax - qmin), eps)
        zero_point = qmin - torch.round(min_neg / scale).to(torch.int)
        zero_point = torch.clamp(zero_point, qmin, qmax)

    # Per-tensor results are 1-element vectors, as FakeQuantize's buffers expect.
    if scale.dim() == 0:
        scale = scale.reshape(1)
    if zero_point.dim() == 0:
        zero_point = zero_point.reshape(1)
    return scale, zero_point
