"""Affine quantize / dequantize / requantize on numpy arrays, per tensor and per channel.

Numerics follow PyTorch's CPU kernels (``torch.quantize_per_tensor`` / ``_per_channel`` and
``Tensor.dequantize``) bit for bit:

* quantize per tensor: ``q = clamp(rint(fma(x, 1.0f / float32(scale), zero_point)), quant_min,
  quant_max)`` -- one float32 rounding of ``x * inv_scale + zero_point``, then round half to
  even (fbgemm's vectorised quantizer that torch.quantize_per_tensor runs); NaN -> quant_max;
* quantize per channel: ``q = clamp(rint(float32(float32(x * inv_scale[c]) + zero_point[c])),
  ...)`` -- the same order but two float32 roundings and no FMA (torch's scalar quantizer, used
  for per-channel tensors); NaN -> 0;
* dequantize per tensor: ``float32(scale) * float32(q - zero_point)`` (one float32 rounding);
* dequantize per channel: ``float32(float64(q - zero_point) * float64(scale[c]))`` (torch keeps
  per-channel scales as float64 and rounds the product once to float32).

One numba implementation serves every target: these loops are memory-bound and numba compiles
them for the host CPU. Large inputs run as a parallel loop over chunks (numba's thread count).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import numba
import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from quantbridge.kernels._checks import (
    INT_RANGES,
    check_array,
    check_int,
    check_out,
    check_quant_range,
    check_scale,
    check_scales,
    check_zero_point,
)
from quantbridge.kernels._errors import KernelError
from quantbridge.kernels._float_math import RowSteps, codes_lanes, flat_f32, flat_u8
from quantbridge.kernels._fma import fma32
from quantbridge.kernels._ir import arrays_data, vec_broadcast
from quantbridge.kernels._layout import (
    InputLayout,
    InputPlan,
    check_dense,
    empty_in_order,
    flat,
)
from quantbridge.kernels._qparams import QParams, as_qparams
from quantbridge.kernels._targets import check_target
from quantbridge.kernels._threads import apply_num_threads, get_num_threads, with_threads

# Work (elements touched) from which a call splits across threads. These kernels stream memory
# at near bandwidth on one core, while a parallel region costs microseconds to tens of them,
# so only large inputs are worth splitting: pools, embedding_bag, per-channel (de)quantize and
# per-channel multiplies from PARALLEL_MIN_WORK, the per-element streams (per-tensor
# quantize / dequantize, add / mul, clamps, table lookups) from STREAM_MIN_WORK. For those,
# ``packages/kernels/bench/bench_kernels.py --crossover`` (family ``add``, the public call, on the
# 2-core AVX-512 Xeon) has 2 threads break even at ~75K elements and gain 1.2x at 113K, 1.4x
# at 452K and 1.5x at 1.2M. Until their chunks were passed as slices, their parallel versions
# ran 4-40x slower than the serial ones; STREAM_MIN_WORK was PARALLEL_MIN_WORK then.
PARALLEL_MIN_WORK = 1 << 22
STREAM_MIN_WORK = 1 << 18
_CHUNK = 1 << 14
_K = TypeVar("_K", bound=Callable[..., Any])


def choose_kernel(work: int, where: str, serial: _K, parallel: _K, *, stream: bool = False) -> _K:
    """``parallel`` on the call's thread count if ``work`` is big enough to split and more
    than one thread is configured (the package thread setting, like the GEMM kernels), else
    ``serial``. ``stream``: a per-element stream (``STREAM_MIN_WORK``)."""
    if work >= (STREAM_MIN_WORK if stream else PARALLEL_MIN_WORK):
        threads = apply_num_threads(None, where)
        if threads > 1:
            return with_threads(parallel, threads)
    return serial


_QDTYPES = (np.dtype(np.uint8), np.dtype(np.int8))

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]


# --------------------------------------------------------------------------- argument helpers


# the wrappers' name for the shared scale check (float32 range, optionally its reciprocal)
f32_scale = check_scale


def quant_dtype(dtype: object) -> np.dtype[np.generic]:
    """Resolve a quantized dtype argument (uint8 or int8)."""
    try:
        resolved: np.dtype[np.generic] = np.dtype(dtype)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise KernelError(f"dtype: expected numpy uint8 or int8, got {dtype!r}") from None
    if resolved not in _QDTYPES:
        raise KernelError(f"dtype: expected numpy uint8 or int8, got {resolved}")
    return resolved


def check_axis(axis: object, ndim: int) -> int:
    """A channel axis, negative values counted from the end."""
    value = check_int("axis", axis)
    if not -ndim <= value < ndim:
        raise KernelError(f"axis: {value} is out of range for a {ndim}-D array")
    return value % ndim


def channel_params(
    scales: object,
    zero_points: object,
    channels: int,
    quant_min: int,
    quant_max: int,
    *,
    inverted: bool = False,
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int32]]:
    """Validate per-channel scales (float32/float64) and zero points (any integer dtype)."""
    s = check_array("scales", scales, (np.float32, np.float64), 1, contiguous=False)
    z = check_array(
        "zero_points", zero_points, (np.int32, np.int64, np.uint8, np.int8), 1, contiguous=False
    )
    if s.shape[0] != channels or z.shape[0] != channels:
        raise KernelError(
            f"scales/zero_points: expected {channels} entries (the size of the channel axis), "
            f"got {s.shape[0]} and {z.shape[0]}"
        )
    s64 = s.astype(np.float64)
    check_scales("scales", s64, inverted=inverted)
    zi = z.astype(np.int64)
    if np.any(zi < quant_min) or np.any(zi > quant_max):
        raise KernelError(f"zero_points: every zero point must lie in [{quant_min}, {quant_max}]")
    return s64, zi.astype(np.int32)


def as_3d(shape: tuple[int, ...], axis: int) -> tuple[int, int, int]:
    """(outer, channels, inner) sizes of a C-contiguous array around ``axis``."""
    outer = math.prod(shape[:axis])
    inner = math.prod(shape[axis + 1 :])
    return outer, shape[axis], inner


# --------------------------------------------------------------------------- compiled kernels


@numba.njit(cache=True)
def _quantize_one(v, inv, zp, lo, hi):  # type: ignore[no-untyped-def]
    # Per-tensor rule (fbgemm's vector quantizer): round(fma(x, 1/scale, zero_point)).
    t = fma32(v, inv, zp)
    if t != t:  # NaN saturates to quant_max, as torch's vector conversion does
        return hi
    r = np.rint(t)
    if r < lo:
        return lo
    if r > hi:
        return hi
    return r


@numba.njit(cache=True)
def _quantize_one_pc(v, inv, zp, lo, hi):  # type: ignore[no-untyped-def]
    # Per-channel rule (torch's scalar quantizer): round(float32(float32(x * (1/scale)) + zp)),
    # two float32 roundings, no FMA.
    t = v * inv + zp
    if t != t:  # NaN becomes 0 in torch's per-channel kernel
        return min(max(np.float32(0.0), lo), hi)
    r = np.rint(t)
    if r < lo:
        return lo
    if r > hi:
        return hi
    return r


@numba.njit(cache=True)
def _quantize_span(x, out, inv, zp, lo, hi, start, stop):  # type: ignore[no-untyped-def]
    for i in range(start, stop):
        out[i] = _quantize_one(x[i], inv, zp, lo, hi)


@numba.njit(cache=True)
def f32_params(scale, zp, lo, hi):  # type: ignore[no-untyped-def]
    # Scalars arrive as Python numbers (cheaper to pass); torch computes 1.0f / float(scale).
    one = np.float32(1.0)
    return one / np.float32(scale), np.float32(zp), np.float32(lo), np.float32(hi)


@numba.njit(cache=True)
def _quantize_flat(x, out, scale, zp, lo, hi):  # type: ignore[no-untyped-def]
    inv, zpf, lof, hif = f32_params(scale, zp, lo, hi)
    _quantize_span(x, out, inv, zpf, lof, hif, 0, x.size)


@numba.njit(cache=True, parallel=True)
def _quantize_flat_par(x, out, scale, zp, lo, hi):  # type: ignore[no-untyped-def]
    inv, zpf, lof, hif = f32_params(scale, zp, lo, hi)
    n = x.size
    for c in numba.prange((n + _CHUNK - 1) // _CHUNK):
        lo, hi = c * _CHUNK, min(c * _CHUNK + _CHUNK, n)
        # the chunk as slices: with the whole arrays and offsets the span ran 4-8x slower
        _quantize_span(x[lo:hi], out[lo:hi], inv, zpf, lof, hif, 0, hi - lo)


@intrinsic
def _quantize_u8_vectors(typingctx, x, out, inv, zp):  # type: ignore[no-untyped-def]
    """``out[j] = clamp(rint(fma(x[j], inv, zp)), 0, 255)`` (NaN -> 255), every ``j``, in
    16-float vectors: ``_quantize_one`` for uint8's full range, the same bytes."""
    if not (flat_f32(x) and flat_u8(out) and inv == types.float32 and zp == types.float32):
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        x_p, out_p = arrays_data(context, builder, sig, args, (0, 1))
        n = context.make_array(sig.args[0])(context, builder, args[0]).nitems
        steps = RowSteps(builder, n)
        inv_v, zp_v = (vec_broadcast(builder, v, 16) for v in args[2:])
        start = ir.Constant(ir.IntType(64), 0)

        def body(at: ir.Value, valid: ir.Value | None) -> None:
            codes = codes_lanes(builder, steps.load(x_p, start, at, valid), inv_v, zp_v)
            steps.store_bytes(codes, out_p, start, at, valid)

        steps.each(body)
        return context.get_dummy_value()

    return types.void(x, out, inv, zp), codegen


@numba.njit(cache=True)
def _quantize_u8_flat(x, out, scale, zp, lo, hi):  # type: ignore[no-untyped-def]
    inv, zpf, _, _ = f32_params(scale, zp, lo, hi)
    _quantize_u8_vectors(x, out, inv, zpf)  # type: ignore[call-arg]  # an intrinsic


@numba.njit(cache=True, parallel=True)
def _quantize_u8_flat_par(x, out, scale, zp, lo, hi):  # type: ignore[no-untyped-def]
    inv, zpf, _, _ = f32_params(scale, zp, lo, hi)
    n = x.size
    for c in numba.prange((n + _CHUNK - 1) // _CHUNK):
        lo, hi = c * _CHUNK, min(c * _CHUNK + _CHUNK, n)
        _quantize_u8_vectors(x[lo:hi], out[lo:hi], inv, zpf)  # type: ignore[call-arg]


@numba.njit(cache=True)
def _quantize_rows(x, out, inv, zp, lo, hi, channels, start, stop):  # type: ignore[no-untyped-def]
    for r in range(start, stop):
        c = r % channels
        for j in range(x.shape[1]):
            out[r, j] = _quantize_one_pc(x[r, j], inv[c], zp[c], lo, hi)


@numba.njit(cache=True)
def _quantize_pc(x, out, inv, zp, lo, hi, channels):  # type: ignore[no-untyped-def]
    lof, hif = np.float32(lo), np.float32(hi)
    _quantize_rows(x, out, inv, zp, lof, hif, channels, 0, x.shape[0])


@numba.njit(cache=True, parallel=True)
def _quantize_pc_par(x, out, inv, zp, lo, hi, channels):  # type: ignore[no-untyped-def]
    lof, hif = np.float32(lo), np.float32(hi)
    rows = x.shape[0]
    step = max(1, _CHUNK // max(1, x.shape[1]))
    for c in numba.prange((rows + step - 1) // step):
        _quantize_rows(x, out, inv, zp, lof, hif, channels, c * step, min(c * step + step, rows))


@numba.njit(cache=True)
def _dequantize_span(q, out, scale, zp, start, stop):  # type: ignore[no-untyped-def]
    # q - zp in float32 (exact: |q - zp| <= 255): numba would widen an int32 difference to
    # int64, whose conversion to float32 has no AVX2 vector instruction (the loop ran scalar)
    for i in range(start, stop):
        out[i] = scale * (np.float32(q[i]) - zp)


@numba.njit(cache=True)
def _dequantize_flat(q, out, scale, zp):  # type: ignore[no-untyped-def]
    _dequantize_span(q, out, np.float32(scale), np.float32(zp), 0, q.size)


@numba.njit(cache=True, parallel=True)
def _dequantize_flat_par(q, out, scale, zp):  # type: ignore[no-untyped-def]
    s, z = np.float32(scale), np.float32(zp)
    n = q.size
    for c in numba.prange((n + _CHUNK - 1) // _CHUNK):
        lo, hi = c * _CHUNK, min(c * _CHUNK + _CHUNK, n)
        _dequantize_span(q[lo:hi], out[lo:hi], s, z, 0, hi - lo)


@numba.njit(cache=True)
def _dequantize_rows(q, out, scale, zp, channels, start, stop):  # type: ignore[no-untyped-def]
    for r in range(start, stop):
        c = r % channels
        s = scale[c]
        z = zp[c]
        for j in range(q.shape[1]):
            out[r, j] = np.float32(np.float64(np.int32(q[r, j]) - z) * s)


@numba.njit(cache=True)
def _dequantize_pc(q, out, scale, zp, channels):  # type: ignore[no-untyped-def]
    _dequantize_rows(q, out, scale, zp, channels, 0, q.shape[0])


@numba.njit(cache=True, parallel=True)
def _dequantize_pc_par(q, out, scale, zp, channels):  # type: ignore[no-untyped-def]
    rows = q.shape[0]
    step = max(1, _CHUNK // max(1, q.shape[1]))
    for c in numba.prange((rows + step - 1) // step):
        _dequantize_rows(q, out, scale, zp, channels, c * step, min(c * step + step, rows))


# --------------------------------------------------------------------------- public wrappers


def quantize_per_tensor(
    x: npt.NDArray[np.float32],
    scale: float,
    zero_point: int,
    dtype: npt.DTypeLike = np.uint8,
    quant_min: int | None = None,
    quant_max: int | None = None,
    *,
    out: npt.NDArray[np.generic] | None = None,
    target: str | None = None,
) -> npt.NDArray[np.generic]:
    """Quantize float32 ``x`` to ``dtype`` (uint8 or int8) with one scale and zero point.

    ``quant_min``/``quant_max`` default to the dtype's full range (torch.quantize_per_tensor).
    """
    check_target(target)
    qdtype = quant_dtype(dtype)
    x, order = check_dense("x", x, np.float32)
    lo, hi = check_quant_range(qdtype, quant_min, quant_max)
    s32 = check_scale("scale", scale, inverted=True)
    zp = check_zero_point("zero_point", zero_point, lo, hi)
    if out is None:
        out = empty_in_order(x, qdtype)
    else:
        check_out(out, x.shape, qdtype, x, order=order)
    _quantize_kernel(x.size, qdtype, lo, hi)(flat(x, order), flat(out, order), s32, zp, lo, hi)
    return out


def _quantize_kernel(size: int, qdtype: np.dtype[np.generic], lo: int, hi: int) -> Any:
    """The per-tensor quantizer for ``size`` elements at this thread count."""
    if qdtype == np.uint8 and lo == 0 and hi == 255:  # 16-float vectors, ~2x faster
        serial, parallel = _quantize_u8_flat, _quantize_u8_flat_par
    else:
        serial, parallel = _quantize_flat, _quantize_flat_par
    return choose_kernel(size, "quantize_per_tensor", serial, parallel, stream=True)


def quantize_per_channel(
    x: npt.NDArray[np.float32],
    scales: npt.NDArray[np.floating],
    zero_points: npt.NDArray[np.integer],
    axis: int,
    dtype: npt.DTypeLike = np.uint8,
    quant_min: int | None = None,
    quant_max: int | None = None,
    *,
    out: npt.NDArray[np.generic] | None = None,
    target: str | None = None,
) -> npt.NDArray[np.generic]:
    """Quantize float32 ``x`` with one scale/zero point per index along ``axis``.

    ``scales`` (float32 or float64) are rounded to float32 and inverted in float32, like
    torch.quantize_per_channel.
    """
    check_target(target)
    qdtype = quant_dtype(dtype)
    x = check_array("x", x, np.float32)
    lo, hi = check_quant_range(qdtype, quant_min, quant_max)
    ax = check_axis(axis, x.ndim)
    outer, channels, inner = as_3d(x.shape, ax)
    s64, z = channel_params(scales, zero_points, channels, lo, hi, inverted=True)
    if out is None:
        out = np.empty(x.shape, qdtype)
    else:
        check_out(out, x.shape, qdtype, x)
    inv = np.float32(1.0) / s64.astype(np.float32)
    kernel = choose_kernel(x.size, "quantize_per_channel", _quantize_pc, _quantize_pc_par)
    kernel(
        x.reshape(outer * channels, inner),
        out.reshape(outer * channels, inner),
        inv,
        z.astype(np.float32),
        lo,
        hi,
        channels,
    )
    return out


def dequantize_per_tensor(
    q: npt.NDArray[np.generic],
    scale: float,
    zero_point: int,
    *,
    out: F32 | None = None,
    target: str | None = None,
) -> F32:
    """``float32(scale) * float32(q - zero_point)`` for uint8 or int8 ``q``."""
    check_target(target)
    q, order = check_dense("q", q, _QDTYPES)
    qmin, qmax = INT_RANGES[q.dtype]
    s32 = check_scale("scale", scale)
    zp = check_zero_point("zero_point", zero_point, qmin, qmax)
    if out is None:
        out = empty_in_order(q, np.float32)
    else:
        check_out(out, q.shape, np.float32, q, order=order)
    _dequantize_kernel(q.size)(flat(q, order), flat(out, order), s32, zp)
    return out


def _dequantize_kernel(size: int) -> Any:
    """The per-tensor dequantizer for ``size`` elements at this thread count."""
    return choose_kernel(
        size, "dequantize_per_tensor", _dequantize_flat, _dequantize_flat_par, stream=True
    )


def dequantize_per_channel(
    q: npt.NDArray[np.generic],
    scales: npt.NDArray[np.floating],
    zero_points: npt.NDArray[np.integer],
    axis: int,
    *,
    out: F32 | None = None,
    target: str | None = None,
) -> F32:
    """Per-channel dequantize: ``float32(float64(q - zero_point[c]) * float64(scale[c]))``."""
    check_target(target)
    q = check_array("q", q, _QDTYPES)
    qmin, qmax = INT_RANGES[q.dtype]
    ax = check_axis(axis, q.ndim)
    outer, channels, inner = as_3d(q.shape, ax)
    s64, z = channel_params(scales, zero_points, channels, qmin, qmax)
    if out is None:
        out = np.empty(q.shape, np.float32)
    else:
        check_out(out, q.shape, np.float32, q)
    kernel = choose_kernel(q.size, "dequantize_per_channel", _dequantize_pc, _dequantize_pc_par)
    kernel(
        q.reshape(outer * channels, inner),
        out.reshape(outer * channels, inner),
        s64,
        z,
        channels,
    )
    return out


@functools.lru_cache(maxsize=512)
def requantize_table(
    in_scale: float, in_zero_point: int, out_scale: float, out_zero_point: int, lo: int, hi: int
) -> U8:
    """The 256-entry uint8 table ``quantize(dequantize(q))`` between two sets of qparams."""
    codes = np.arange(256, dtype=np.uint8)
    real = np.empty(256, np.float32)
    _dequantize_flat(codes, real, in_scale, in_zero_point)
    table = np.empty(256, np.uint8)
    _quantize_flat(real, table, out_scale, out_zero_point, lo, hi)
    table.flags.writeable = False
    return table


def requantize(
    q: U8,
    in_scale: float,
    in_zero_point: int,
    out_scale: float,
    out_zero_point: int,
    quant_min: int = 0,
    quant_max: int = 255,
    *,
    out: U8 | None = None,
    target: str | None = None,
) -> U8:
    """uint8 → uint8 between qparams: exactly ``quantize(dequantize(q))`` (via a 256-entry table).

    Equals ``torch.quantize_per_tensor(qx.dequantize(), out_scale, out_zero_point, quint8)``.
    """
    from quantbridge.kernels._lut import apply_table  # deferred: _lut builds on this module

    check_target(target)
    q, order = check_dense("q", q, np.uint8)
    lo, hi = check_quant_range(np.uint8, quant_min, quant_max)
    s_in = check_scale("in_scale", in_scale)
    s_out = check_scale("out_scale", out_scale, inverted=True)
    zp_in = check_zero_point("in_zero_point", in_zero_point, 0, 255)
    zp_out = check_zero_point("out_zero_point", out_zero_point, lo, hi)
    if out is None:
        out = empty_in_order(q, np.uint8)
    else:
        check_out(out, q.shape, np.uint8, q, order=order)
    table = requantize_table(s_in, zp_in, s_out, zp_out, lo, hi)
    apply_table(flat(q, order), table, flat(out, order))
    return out


# --------------------------------------------------------------------------- prepared calls


def _flat_in(order: tuple[int, ...]) -> Callable[[npt.NDArray[Any]], npt.NDArray[Any]]:
    """``flat(a, order)`` for arrays laid out in ``order`` (one reshape when C-contiguous)."""
    if order == tuple(range(len(order))):
        return _c_flat
    return lambda a: flat(a, order)


def _c_flat(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    return a.reshape(-1)


class _PreparedPerTensor:
    """The fast path the prepared per-tensor conversions share: the first call on an input
    layout checks the input and plans the call (``_plan``); a later input of the same shape,
    strides and dtype, at the same thread count, runs that plan without the checks."""

    __slots__ = ("_fast", "target")

    def __init__(self, target: str | None) -> None:
        check_target(target)
        self.target = target
        self._fast: InputPlan | None = None  # the last plan, for inputs of its layout

    def __call__(self, x: npt.NDArray[Any]) -> npt.NDArray[Any]:
        fast = self._fast
        if fast is not None and fast.x.fits(x) and get_num_threads() == fast.threads:
            out: npt.NDArray[Any] = fast.run(x)
            return out
        self._fast = None
        check_target(self.target)
        arr, run = self._plan(x)
        if arr is x:
            self._fast = InputPlan(InputLayout.of(arr), get_num_threads(), run)
        result: npt.NDArray[Any] = run(arr)
        return result

    def _plan(self, x: object) -> tuple[npt.NDArray[Any], Callable[[Any], Any]]:
        raise NotImplementedError


class PreparedQuantize(_PreparedPerTensor):
    """``quantize_per_tensor`` with its qparams, dtype and range fixed, for a value quantized
    again and again in one shape and layout (a model's input).

    ``prepared(x)`` returns exactly ``quantize_per_tensor(x, scale, zero_point, dtype,
    quant_min, quant_max, target=target)``; bad arguments are refused here, by name.
    """

    __slots__ = ("_params",)

    def __init__(
        self,
        scale: float,
        zero_point: int,
        dtype: npt.DTypeLike = np.uint8,
        quant_min: int | None = None,
        quant_max: int | None = None,
        *,
        target: str | None = None,
    ) -> None:
        super().__init__(target)
        qdtype = quant_dtype(dtype)
        lo, hi = check_quant_range(qdtype, quant_min, quant_max)
        s32 = check_scale("scale", scale, inverted=True)
        zp = check_zero_point("zero_point", zero_point, lo, hi)
        self._params = (qdtype, s32, zp, lo, hi)

    def _plan(self, x: object) -> tuple[npt.NDArray[Any], Callable[[Any], Any]]:
        xa, order = check_dense("x", x, np.float32)
        qdtype, s32, zp, lo, hi = self._params
        kernel = _quantize_kernel(xa.size, qdtype, lo, hi)
        flat_of = _flat_in(order)

        def run(a: F32) -> npt.NDArray[Any]:
            out = empty_in_order(a, qdtype)
            kernel(flat_of(a), flat_of(out), s32, zp, lo, hi)
            return out

        return xa, run


class PreparedDequantize(_PreparedPerTensor):
    """``dequantize_per_tensor`` with its qparams fixed (a model's output, say).

    ``prepared(q)`` returns exactly ``dequantize_per_tensor(q, scale, zero_point,
    target=target)`` for uint8 or int8 ``q``: the zero point is checked against the range of
    each input's dtype.
    """

    __slots__ = ("_scale", "_zero_point")

    def __init__(self, scale: float, zero_point: int, *, target: str | None = None) -> None:
        super().__init__(target)
        self._scale = check_scale("scale", scale)
        # in the range of uint8 or int8 codes here; of the input's dtype at the first call
        self._zero_point = check_zero_point("zero_point", zero_point, -128, 255)

    def _plan(self, x: object) -> tuple[npt.NDArray[Any], Callable[[Any], Any]]:
        q, order = check_dense("q", x, _QDTYPES)
        zp = check_zero_point("zero_point", self._zero_point, *INT_RANGES[q.dtype])
        s32 = self._scale
        kernel = _dequantize_kernel(q.size)
        flat_of = _flat_in(order)

        def run(a: npt.NDArray[Any]) -> F32:
            out = empty_in_order(a, np.float32)
            kernel(flat_of(a), flat_of(out), s32, zp)
            return out

        return q, run


class PreparedRequantize(_PreparedPerTensor):
    """``requantize`` between fixed qparams (its table made once), for codes that cross
    between two quantized ops that disagree, call after call.

    ``prepared(q)`` returns exactly ``requantize(q, *in_qparams, *out_qparams, quant_min,
    quant_max, target=target)``; bad arguments are refused here, by name.
    """

    __slots__ = ("_table",)

    def __init__(
        self,
        in_qparams: QParams | tuple[float, int],
        out_qparams: QParams | tuple[float, int],
        quant_min: int = 0,
        quant_max: int = 255,
        *,
        target: str | None = None,
    ) -> None:
        super().__init__(target)
        in_scale, in_zero_point = as_qparams("in_qparams", in_qparams)
        out_scale, out_zero_point = as_qparams("out_qparams", out_qparams)
        lo, hi = check_quant_range(np.uint8, quant_min, quant_max)
        s_in = check_scale("in_qparams.scale", in_scale)
        s_out = check_scale("out_qparams.scale", out_scale, inverted=True)
        zp_in = check_zero_point("in_qparams.zero_point", in_zero_point, 0, 255)
        zp_out = check_zero_point("out_qparams.zero_point", out_zero_point, lo, hi)
        self._table = requantize_table(s_in, zp_in, s_out, zp_out, lo, hi)

    def _plan(self, x: object) -> tuple[npt.NDArray[Any], Callable[[Any], Any]]:
        from quantbridge.kernels._lut import table_kernel  # deferred: _lut builds on this module

        q, order = check_dense("q", x, np.uint8)
        table = self._table
        kernel = table_kernel(q.size)
        flat_of = _flat_in(order)

        def run(a: U8) -> U8:
            out = empty_in_order(a, np.uint8)
            kernel(flat_of(a), table, flat_of(out))
            return out

        return q, run
