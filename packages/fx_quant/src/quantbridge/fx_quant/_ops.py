"""Quantize/dequantize operators in the ``torch.ops.quantbridge`` namespace, on plain tensors.

Quantized values are ordinary ``uint8``/``int8``/``uint16``/``int16``/``int32`` tensors; scale
and zero point travel next to them as arguments. Every operator has a fake (meta) kernel, so
graphs that call them work under ``torch.export`` and ``torch.compile``; the real kernels are
opaque to tracing, which is why their argument checks can look at data.

Numerics (the rule the reference model is held to, bit for bit against torch's quantized
tensors on x86 CPUs with AVX2/AVX-512, where torch's quantizer uses fused multiply-add):

* ``inv = float32(1 / float32(scale))``; all products are float32.
* per-tensor ``uint8``/``int8``: ``q = round_half_even(float32(x * inv + zero_point))`` where
  ``x * inv + zero_point`` is rounded once (as a fused multiply-add does);
* per-tensor ``int32`` and every per-channel case:
  ``q = round_half_even(float32(float32(x * inv) + zero_point))`` (two roundings);
* ``uint16``/``int16`` (no torch quantized dtype): ``round_half_even(float32(x * inv)) + zp``,
  the rule of torch's decomposed reference ops;
* then ``clamp(q, quant_min, quant_max)``; NaN becomes ``quant_max`` on the fused path and
  ``0`` (``quant_min`` for ``int32``) elsewhere, which is what torch's kernels produce.
* dequantize: ``float32(q - zero_point) * float32(scale)``; with float zero points
  (``per_channel_affine_float_qparams``, used by embeddings) the subtraction is in float32.

Inputs are float32; float16/bfloat16/float64 inputs are converted to float32 first.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable
from typing import TypeVar, cast

import torch

from quantbridge.fx_quant._errors import FxQuantError

__all__ = [
    "QUANT_DTYPE_RANGES",
    "choose_qparams_values",
    "dtype_range",
]

# The integer dtypes a quantized value may be stored in, with their full ranges.
QUANT_DTYPE_RANGES: dict[torch.dtype, tuple[int, int]] = {
    torch.uint8: (0, 255),
    torch.int8: (-128, 127),
    torch.uint16: (0, 65535),
    torch.int16: (-32768, 32767),
    torch.int32: (-(2**31), 2**31 - 1),
}
# Dtypes whose per-tensor quantizer in torch rounds x * inv + zero_point once (FMA).
_FUSED_DTYPES = (torch.uint8, torch.int8)
# Dtypes that follow torch's decomposed rule (round, then add the zero point).
_ROUND_THEN_ADD_DTYPES = (torch.uint16, torch.int16)

_F = TypeVar("_F", bound=Callable[..., object])

_lib = torch.library.Library("quantbridge", "FRAGMENT")  # type: ignore[no-untyped-call]


def _define(schema: str) -> None:
    _lib.define(schema)  # type: ignore[no-untyped-call]


def dtype_range(dtype: torch.dtype, where: str = "dtype") -> tuple[int, int]:
    """The full (min, max) of a quantized storage dtype; FxQuantError for any other dtype."""
    try:
        return QUANT_DTYPE_RANGES[dtype]
    except (KeyError, TypeError):
        allowed = ", ".join(str(d) for d in QUANT_DTYPE_RANGES)
        raise FxQuantError(
            f"{where}: {dtype!r} is not a quantized storage dtype; use one of {allowed} "
            "(map torch.quint8/qint8/qint32 with quantbridge.qconfig's canonical_dtype)"
        ) from None


def _check_range(op: str, quant_min: int, quant_max: int, dtype: torch.dtype) -> None:
    lo, hi = dtype_range(dtype, f"{op}: dtype")
    if not lo <= quant_min <= quant_max <= hi:
        raise FxQuantError(
            f"{op}: quant_min={quant_min}, quant_max={quant_max} do not fit dtype {dtype} "
            f"(need {lo} <= quant_min <= quant_max <= {hi})"
        )


def _float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (OverflowError when out of range)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def _check_scale(op: str, scale: float) -> float:
    """The float32 reciprocal of a per-tensor scale, after checking the scale is usable."""
    try:
        scale32 = _float32(scale)
        inv = _float32(1.0 / scale32) if scale32 > 0 else 0.0
    except (OverflowError, ZeroDivisionError):
        scale32, inv = 0.0, 0.0
    if not (scale32 > 0 and inv != float("inf") and inv > 0):
        raise FxQuantError(
            f"{op}: scale={scale!r} must be a positive, finite float32 whose reciprocal is "
            "finite; recompute the qparams (observers never produce such a scale)"
        )
    return inv


def _check_input_float(op: str, x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:
        return x
    if x.is_floating_point():
        return x.to(torch.float32)
    raise FxQuantError(f"{op}: input must be a floating point tensor, got {x.dtype}")


def _check_input_int(op: str, q: torch.Tensor, dtype: torch.dtype) -> None:
    if q.dtype != dtype:
        raise FxQuantError(
            f"{op}: input has dtype {q.dtype} but dtype={dtype} was given; pass the dtype the "
            "tensor was quantized to"
        )


def _check_axis(op: str, axis: int, ndim: int, channels: int, n_scales: int, n_zps: int) -> int:
    if not -ndim <= axis < ndim:
        raise FxQuantError(f"{op}: axis={axis} is out of range for a {ndim}-d input")
    if not n_scales == n_zps == channels:
        raise FxQuantError(
            f"{op}: scales has {n_scales} and zero_points has {n_zps} elements but the input "
            f"has {channels} channels along axis {axis}; they must all match"
        )
    return axis % ndim


def _saturate(r: torch.Tensor, quant_min: int, quant_max: int, nan_to: int) -> torch.Tensor:
    """Clamp fresh tensor ``r`` in place to [quant_min, quant_max], NaN becoming ``nan_to``."""
    if quant_max >= 2**24 or quant_min <= -(2**24):
        # float32 cannot hold int32 bounds exactly; clamp in float64.
        r = r.to(torch.float64)
    return r.nan_to_num_(nan=float(nan_to)).clamp_(quant_min, quant_max)


def _nan_value(fused: bool, quant_min: int, quant_max: int, dtype: torch.dtype) -> int:
    if fused:
        return quant_max
    if dtype == torch.int32:
        return quant_min
    return min(max(0, quant_min), quant_max)


# In a float64 holding a float32 midpoint, the 29 bits below float32 precision are 100...0.
_MIDPOINT_MASK = (1 << 29) - 1
_MIDPOINT_BITS = 1 << 28


def _fma_to_float32(x: torch.Tensor, inv: float, zero_point: int) -> torch.Tensor:
    """``float32(x * inv + zero_point)`` rounded once, as a float32 fused multiply-add.

    ``x * inv`` (two float32s) is exact in float64, the sum is rounded to float64 and then to
    float32. That double rounding is wrong only when the float64 sum lands exactly on a
    float32 midpoint while the exact sum does not; those elements (rare, but reachable) are
    found by their bit pattern and nudged one float64 step towards the exact sum, whose
    remainder an error-free two-sum gives.
    """
    # Contiguous, so that its flat view lines up with x.reshape(-1) below.
    total = x.to(torch.float64, memory_format=torch.contiguous_format).mul_(inv).add_(zero_point)
    flat = total.view(-1)
    bits = flat.view(torch.int64)
    where = torch.nonzero(torch.bitwise_and(bits, _MIDPOINT_MASK) == _MIDPOINT_BITS).view(-1)
    if where.numel():
        p = x.reshape(-1).index_select(0, where).to(torch.float64) * inv
        t = flat.index_select(0, where)
        b = t - p
        remainder = (p - (t - b)) + (zero_point - b)  # exact: p + zero_point == t + remainder
        towards = torch.where(remainder > 0, torch.inf, -torch.inf).to(torch.float64)
        flat.index_copy_(0, where, torch.where(remainder != 0, torch.nextafter(t, towards), t))
    return total.to(torch.float32)


def _quantize(
    x: torch.Tensor,
    inv: torch.Tensor | float,
    zero_point: torch.Tensor | int,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
    fused: bool,
) -> torch.Tensor:
    # Every intermediate is a fresh tensor, so the steps work in place.
    if dtype in _ROUND_THEN_ADD_DTYPES:
        r = (x * inv).round_().add_(zero_point)
        fused = False
    elif not fused:
        r = (x * inv).add_(zero_point).round_()
    elif isinstance(zero_point, int) and zero_point == 0:
        r = (x * inv).round_()  # a fused multiply-add with 0 is a plain rounded product
    else:
        # The fused rule is per-tensor only: scalar reciprocal and zero point.
        assert isinstance(inv, float)
        assert isinstance(zero_point, int)
        r = _fma_to_float32(x, inv, zero_point).round_()
    nan_to = _nan_value(fused, quant_min, quant_max, dtype)
    return _saturate(r, quant_min, quant_max, nan_to).to(dtype)


# --- quantize_per_tensor -------------------------------------------------------------------

_define(
    "quantize_per_tensor(Tensor input, float scale, int zero_point, int quant_min, "
    "int quant_max, ScalarType dtype) -> Tensor"
)
_define(
    "quantize_per_tensor.tensor(Tensor input, Tensor scale, Tensor zero_point, int quant_min, "
    "int quant_max, ScalarType dtype) -> Tensor"
)
_define(
    "dequantize_per_tensor(Tensor input, float scale, int zero_point, int quant_min, "
    "int quant_max, ScalarType dtype) -> Tensor"
)
_define(
    "dequantize_per_tensor.tensor(Tensor input, Tensor scale, Tensor zero_point, "
    "int quant_min, int quant_max, ScalarType dtype) -> Tensor"
)
_define(
    "quantize_per_channel(Tensor input, Tensor scales, Tensor zero_points, int axis, "
    "int quant_min, int quant_max, ScalarType dtype) -> Tensor"
)
_define(
    "dequantize_per_channel(Tensor input, Tensor scales, Tensor zero_points, int axis, "
    "int quant_min, int quant_max, ScalarType dtype) -> Tensor"
)
_define(
    "choose_qparams_per_tensor(Tensor input, int quant_min, int quant_max, "
    "bool reduce_range=False) -> (Tensor, Tensor)"
)


def _impl(name: str) -> Callable[[_F], _F]:
    """Register ``fn`` as the real kernel of ``name``, run with gradient tracking off.

    The outputs are integers (or floats computed from integers), so no gradient flows through
    these ops; tracking would only make the in-place steps fail on inputs that require grad
    (reference models run without ``torch.no_grad()``, e.g. right after QAT).
    """

    def register(fn: _F) -> _F:
        @functools.wraps(fn)
        def untracked(*args: object, **kwargs: object) -> object:
            with torch.no_grad():
                return fn(*args, **kwargs)

        kernel = cast(_F, untracked)
        _lib.impl(name, kernel, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
        return kernel

    return register


def _fake(name: str) -> Callable[[_F], _F]:
    def register(fn: _F) -> _F:
        torch.library.register_fake(f"quantbridge::{name}", fn, lib=_lib)
        return fn

    return register


def _fake_like_input(name: str, out_dtype: torch.dtype | None, per_channel: bool = False) -> None:
    """Register the fake kernel of quantize/dequantize op ``name``: an empty tensor shaped like
    the input, of ``out_dtype`` (``None``: the op's ``dtype`` argument), after the checks that
    need no data (the range fits the dtype; for per-channel ops, the axis is in range)."""
    op = f"quantbridge::{name}"

    def per_tensor(
        input: torch.Tensor,
        scale: object,
        zero_point: object,
        quant_min: int,
        quant_max: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        _check_range(op, quant_min, quant_max, dtype)
        return torch.empty_like(input, dtype=dtype if out_dtype is None else out_dtype)

    def per_channel_fake(
        input: torch.Tensor,
        scales: torch.Tensor,
        zero_points: torch.Tensor,
        axis: int,
        quant_min: int,
        quant_max: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        _check_range(op, quant_min, quant_max, dtype)
        if not -input.dim() <= axis < input.dim():
            raise FxQuantError(f"{op}: axis={axis} is out of range for a {input.dim()}-d input")
        return torch.empty_like(input, dtype=dtype if out_dtype is None else out_dtype)

    fake: Callable[..., torch.Tensor] = per_channel_fake if per_channel else per_tensor
    torch.library.register_fake(op, fake, lib=_lib)


def _scalar_qparams(op: str, scale: torch.Tensor, zero_point: torch.Tensor) -> tuple[float, int]:
    if scale.numel() != 1 or zero_point.numel() != 1:
        raise FxQuantError(
            f"{op}: scale and zero_point must hold one element each (got {scale.numel()} and "
            f"{zero_point.numel()}); use the per-channel op for per-channel qparams"
        )
    if zero_point.is_floating_point():
        zp_value = zero_point.item()
        if zp_value != int(zp_value):
            raise FxQuantError(f"{op}: zero_point={zp_value} must be an integer")
    return float(scale.item()), int(zero_point.item())


def _impl_tensor_overload(name: str, scalar_kernel: Callable[..., torch.Tensor]) -> None:
    """Register ``name.tensor``: ``scalar_kernel`` with scale and zero point passed as
    one-element tensors (as convert's graphs hold them) instead of Python numbers."""
    op = f"quantbridge::{name}.tensor"

    def kernel(
        input: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor,
        quant_min: int,
        quant_max: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        s, zp = _scalar_qparams(op, scale, zero_point)
        return scalar_kernel(input, s, zp, quant_min, quant_max, dtype)

    _impl(f"{name}.tensor")(kernel)


def _check_zero_point(op: str, zero_point: int, quant_min: int, quant_max: int) -> None:
    if not quant_min <= zero_point <= quant_max:
        raise FxQuantError(
            f"{op}: zero_point={zero_point} lies outside [quant_min, quant_max] = "
            f"[{quant_min}, {quant_max}]"
        )


@_impl("quantize_per_tensor")
def _quantize_per_tensor(
    input: torch.Tensor,
    scale: float,
    zero_point: int,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    op = "quantbridge::quantize_per_tensor"
    _check_range(op, quant_min, quant_max, dtype)
    _check_zero_point(op, zero_point, quant_min, quant_max)
    inv = _check_scale(op, scale)
    x = _check_input_float(op, input)
    return _quantize(x, inv, zero_point, quant_min, quant_max, dtype, dtype in _FUSED_DTYPES)


_impl_tensor_overload("quantize_per_tensor", _quantize_per_tensor)
_fake_like_input("quantize_per_tensor", None)
_fake_like_input("quantize_per_tensor.tensor", None)


# --- dequantize_per_tensor -----------------------------------------------------------------


def _dequantize(
    q: torch.Tensor, scale: torch.Tensor | float, zero_point: torch.Tensor | int
) -> torch.Tensor:
    # Integer subtraction in int32 first (exact below 32 bits; int32 wraps around exactly as
    # torch's kernel does), then one conversion and one float32 product.
    return (q.to(torch.int32) - zero_point).to(torch.float32) * scale


@_impl("dequantize_per_tensor")
def _dequantize_per_tensor(
    input: torch.Tensor,
    scale: float,
    zero_point: int,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    op = "quantbridge::dequantize_per_tensor"
    _check_range(op, quant_min, quant_max, dtype)
    _check_input_int(op, input, dtype)
    _check_scale(op, scale)
    return _dequantize(input, _float32(scale), zero_point)


_impl_tensor_overload("dequantize_per_tensor", _dequantize_per_tensor)
_fake_like_input("dequantize_per_tensor", torch.float32)
_fake_like_input("dequantize_per_tensor.tensor", torch.float32)


# --- per channel ---------------------------------------------------------------------------


def _channel_shape(ndim: int, axis: int) -> list[int]:
    shape = [1] * ndim
    shape[axis] = -1
    return shape


def _check_per_channel(
    op: str,
    input: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor,
    axis: int,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
) -> tuple[int, torch.Tensor]:
    """Validated (axis, float32 scales shaped to broadcast along axis)."""
    _check_range(op, quant_min, quant_max, dtype)
    if input.dim() == 0:
        raise FxQuantError(f"{op}: input is 0-d; per-channel quantization needs an axis")
    channels = input.shape[axis] if -input.dim() <= axis < input.dim() else -1
    axis = _check_axis(op, axis, input.dim(), channels, scales.numel(), zero_points.numel())
    scales32 = scales.reshape(_channel_shape(input.dim(), axis)).to(torch.float32)
    bad_scale = not bool(torch.all(scales32 > 0)) or not bool(
        torch.all(torch.isfinite(1.0 / scales32))
    )
    # Float zero points (embedding tables) allow a zero scale, which torch reads as 1.
    if bad_scale and (not zero_points.is_floating_point() or bool(torch.any(scales32 < 0))):
        raise FxQuantError(
            f"{op}: scales must be positive, finite float32 values with finite "
            f"reciprocals; got {scales.tolist()}"
        )
    if not zero_points.is_floating_point() and (
        bool(torch.any(zero_points < quant_min)) or bool(torch.any(zero_points > quant_max))
    ):
        raise FxQuantError(
            f"{op}: zero_points {zero_points.tolist()} must lie in [quant_min, quant_max] = "
            f"[{quant_min}, {quant_max}]"
        )
    return axis, scales32


@_impl("quantize_per_channel")
def _quantize_per_channel(
    input: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor,
    axis: int,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    op = "quantbridge::quantize_per_channel"
    axis, scales32 = _check_per_channel(
        op, input, scales, zero_points, axis, quant_min, quant_max, dtype
    )
    x = _check_input_float(op, input)
    zp_shaped = zero_points.reshape(scales32.shape)
    if zero_points.is_floating_point():
        # Float zero points (embedding tables): a zero scale means "scale 1", as in torch.
        inv = torch.where(scales32 == 0, 1.0, 1.0 / scales32)
        return _quantize(x, inv, zp_shaped.to(torch.float32), quant_min, quant_max, dtype, False)
    zp: torch.Tensor = zp_shaped.to(
        torch.int64 if dtype in _ROUND_THEN_ADD_DTYPES else torch.float32
    )
    return _quantize(x, 1.0 / scales32, zp, quant_min, quant_max, dtype, False)


_fake_like_input("quantize_per_channel", None, per_channel=True)


@_impl("dequantize_per_channel")
def _dequantize_per_channel(
    input: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor,
    axis: int,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    op = "quantbridge::dequantize_per_channel"
    _check_input_int(op, input, dtype)
    axis, scales32 = _check_per_channel(
        op, input, scales, zero_points, axis, quant_min, quant_max, dtype
    )
    zp = zero_points.reshape(scales32.shape)
    # torch multiplies by the scales in their own precision (float64 scales give one float64
    # product, rounded once to float32); float32 scales give a float32 product.
    if scales.dtype == torch.float64:
        scales_f = scales.reshape(scales32.shape)
        if zero_points.is_floating_point():
            diff = input.to(torch.float32) - zp.to(torch.float32)
        else:
            diff = (input.to(torch.int32) - zp.to(torch.int32)).to(torch.float32)
        return (diff.to(torch.float64) * scales_f).to(torch.float32)
    if zero_points.is_floating_point():
        return (input.to(torch.float32) - zp.to(torch.float32)) * scales32
    return _dequantize(input, scales32, zp.to(torch.int32))


_fake_like_input("dequantize_per_channel", torch.float32, per_channel=True)


# --- dynamic qparams -----------------------------------------------------------------------

# Scales below this are raised to it (and the range widened to match), as torch does.
_SMALL_SCALE = _float32(6.1e-5)


def choose_qparams_values(
    min_val: float, max_val: float, quant_min: int, quant_max: int, reduce_range: bool = False
) -> tuple[float, int]:
    """torch's dynamic-quantization rule: (scale, zero point) for a [min, max] range.

    The range is widened to contain 0; ``reduce_range`` halves the integer range (for x86
    kernels that would otherwise saturate 16-bit accumulators). Intermediate values are in
    float64, as in torch's ChooseQuantizationParams; the scale stays float64 (the quantize
    ops round it to float32).
    """
    if reduce_range:
        quant_min, quant_max = int(quant_min / 2), int(quant_max / 2)
    lo = min(_float32(min_val), 0.0)
    hi = max(_float32(max_val), 0.0)
    scale = (hi - lo) / (quant_max - quant_min)
    scale32 = _float32(scale)
    if scale32 == 0.0 or _float32(1.0 / scale32) == float("inf"):
        scale = 0.1
    if scale < _SMALL_SCALE:
        original = _float32(scale)
        scale = _SMALL_SCALE
        if lo == 0.0:
            hi = _float32(_SMALL_SCALE * (quant_max - quant_min))
        elif hi == 0.0:
            lo = _float32(-_SMALL_SCALE * (quant_max - quant_min))
        else:
            amplifier = _float32(_SMALL_SCALE / original)
            lo, hi = _float32(lo * amplifier), _float32(hi * amplifier)
    # Derive the zero point from whichever end adds the smaller magnitudes.
    from_min = quant_min - lo / scale
    from_max = quant_max - hi / scale
    error_min = abs(quant_min) + abs(lo / scale)
    error_max = abs(quant_max) + abs(hi / scale)
    initial = from_min if error_min < error_max else from_max
    zero_point = quant_min if initial < quant_min else quant_max if initial > quant_max else None
    if zero_point is None:
        zero_point = round(initial)  # half to even, like nearbyint
    return scale, int(zero_point)


@_impl("choose_qparams_per_tensor")
def _choose_qparams_per_tensor(
    input: torch.Tensor, quant_min: int, quant_max: int, reduce_range: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    op = "quantbridge::choose_qparams_per_tensor"
    if quant_min >= quant_max:
        raise FxQuantError(f"{op}: quant_min={quant_min} must be below quant_max={quant_max}")
    if input.numel() == 0:
        raise FxQuantError(f"{op}: input is empty; there is no range to choose qparams from")
    x = _check_input_float(op, input)
    lo, hi = torch.aminmax(x)
    if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
        raise FxQuantError(
            f"{op}: input contains NaN or infinity (min={float(lo)}, max={float(hi)}); dynamic "
            "quantization needs a finite range (check the activations feeding this op)"
        )
    scale, zero_point = choose_qparams_values(
        float(lo), float(hi), quant_min, quant_max, reduce_range
    )
    return (
        torch.tensor(scale, dtype=torch.float64, device=input.device),
        torch.tensor(zero_point, dtype=torch.int64, device=input.device),
    )


@_fake("choose_qparams_per_tensor")
def _choose_qparams_per_tensor_fake(
    input: torch.Tensor, quant_min: int, quant_max: int, reduce_range: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        input.new_empty((), dtype=torch.float64),
        input.new_empty((), dtype=torch.int64),
    )
