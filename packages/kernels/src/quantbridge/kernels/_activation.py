"""relu / relu6 / hardtanh / clamp directly on uint8 codes (output qparams = input qparams).

Each is a clamp of codes between two bounds: relu uses the zero point as lower bound; the
others first quantize the float bounds with torch's scalar rule
``rint(float32(float32(b * (1.0f / scale)) + zero_point))`` saturated to [0, 255], as torch's
quantized clamp/hardtanh do. Exact; one numba implementation serves every target.
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
import numpy.typing as npt

from quantbridge.kernels._checks import check_out, check_zero_point
from quantbridge.kernels._errors import KernelError
from quantbridge.kernels._layout import check_dense, empty_in_order, flat
from quantbridge.kernels._quantize import choose_kernel, f32_scale
from quantbridge.kernels._targets import check_target

U8 = npt.NDArray[np.uint8]
_CHUNK = 1 << 15


@numba.njit(cache=True)
def _clamp_span(q, out, lo, hi, start, stop):  # type: ignore[no-untyped-def]
    for i in range(start, stop):
        v = q[i]
        if v < lo:
            v = lo
        if v > hi:
            v = hi
        out[i] = v


@numba.njit(cache=True)
def _clamp(q, out, lo, hi):  # type: ignore[no-untyped-def]
    _clamp_span(q, out, np.uint8(lo), np.uint8(hi), 0, q.size)


@numba.njit(cache=True, parallel=True)
def _clamp_par(q, out, lo, hi):  # type: ignore[no-untyped-def]
    n = q.size
    lo8, hi8 = np.uint8(lo), np.uint8(hi)
    for c in numba.prange((n + _CHUNK - 1) // _CHUNK):
        lo, hi = c * _CHUNK, min(c * _CHUNK + _CHUNK, n)
        _clamp_span(q[lo:hi], out[lo:hi], lo8, hi8, 0, hi - lo)  # slices: see _elementwise


@functools.lru_cache(maxsize=1024)
def quantize_bound(value: float, scale: float, zero_point: int) -> int:
    """A float bound as a uint8 code: torch's scalar quantizer, saturated to [0, 255]."""
    # a bound far outside the range overflows float32 to +-inf, which saturates below as
    # torch's quantizer does: not worth a RuntimeWarning to the caller
    with np.errstate(over="ignore"):
        t = np.float32(value) * (np.float32(1.0) / np.float32(scale)) + np.float32(zero_point)
    if math.isnan(t):
        return 0
    return int(min(max(float(np.rint(t)), 0.0), 255.0))


def _bound(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise KernelError(f"{name}: expected a real number, got {value!r}")
    v = float(value)
    if math.isnan(v):
        raise KernelError(f"{name}: must not be NaN")
    return min(max(v, -3.0e38), 3.0e38)  # keep float32 conversion finite (saturates anyway)


def _run(q: object, lo: int, hi: int, out: U8 | None) -> U8:
    arr, order = check_dense("q", q, np.uint8)
    if out is None:
        out = empty_in_order(arr, np.uint8)
    else:
        check_out(out, arr.shape, np.uint8, arr, order=order)
    kernel = choose_kernel(arr.size, "clamp", _clamp, _clamp_par, stream=True)
    kernel(flat(arr, order), flat(out, order), lo, hi)
    return out


def relu(q: U8, zero_point: int, *, out: U8 | None = None, target: str | None = None) -> U8:
    """``max(q, zero_point)``: relu on codes (torch's quantized relu)."""
    check_target(target)
    zp = check_zero_point("zero_point", zero_point, 0, 255)
    return _run(q, zp, 255, out)


def clamp(
    q: U8,
    scale: float,
    zero_point: int,
    min_val: float | None = None,
    max_val: float | None = None,
    *,
    out: U8 | None = None,
    target: str | None = None,
) -> U8:
    """Clamp to ``[min_val, max_val]`` (either may be None) on codes (torch's quantized clamp)."""
    check_target(target)
    s = f32_scale("scale", scale, inverted=True)
    zp = check_zero_point("zero_point", zero_point, 0, 255)
    lo = 0 if min_val is None else quantize_bound(_bound("min_val", min_val), s, zp)
    hi = 255 if max_val is None else quantize_bound(_bound("max_val", max_val), s, zp)
    return _run(q, lo, hi, out)


def hardtanh(
    q: U8,
    scale: float,
    zero_point: int,
    min_val: float = -1.0,
    max_val: float = 1.0,
    *,
    out: U8 | None = None,
    target: str | None = None,
) -> U8:
    """torch's quantized hardtanh: a clamp of the codes to the quantized bounds."""
    return clamp(q, scale, zero_point, min_val, max_val, out=out, target=target)


def relu6(
    q: U8, scale: float, zero_point: int, *, out: U8 | None = None, target: str | None = None
) -> U8:
    """``clamp(q, 0.0, 6.0)`` on codes (torch's quantized relu6 / hardtanh(0, 6))."""
    return clamp(q, scale, zero_point, 0.0, 6.0, out=out, target=target)
