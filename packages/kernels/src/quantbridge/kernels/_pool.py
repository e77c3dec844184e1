"""2-D pooling on NCHW (or CHW) uint8 activations, C-contiguous or channels-last.

Channels-last input (NHWC data viewed as NCHW, what conv returns with ``channels_last=True``)
runs NHWC loops with the channel loop innermost and returns channels-last output: the same
numbers, without transposing the activations.

* max_pool2d: exact (a max of codes); padding never wins.
* avg_pool2d: torch's quantized NCHW kernel bit for bit: ``s = sum(q) - n * zp_in`` in int32,
  ``m = float32(float64(in_scale / out_scale) / divisor)``, output
  ``clamp(rint(float32(s) * m + out_zp), 0, 255)`` with float32 arithmetic; ``divisor`` is
  ``divisor_override``, else the window size including padding (``count_include_pad``) or the
  number of in-bounds elements.
* adaptive_avg_pool2d: torch's quantized NCHW kernel: window ``[floor(o*I/O), ceil((o+1)*I/O))``
  with the divisions in float32, output ``rint(float32(sum(q)) * ((1 / kh) / kw))`` in float32,
  qparams unchanged (the zero point cancels out of a mean). With output qparams of its own
  (a mean has a narrower range than its input, so it earns a finer scale), the window's mean
  is requantized in the same pass by avg_pool2d's rule, ``n`` the window's size.

One numba implementation serves every target; planes (N*C) run in parallel for large
C-contiguous inputs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numba
import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from quantbridge.kernels._checks import (
    check_array,
    check_derived,
    check_int,
    check_out,
    check_zero_point,
)
from quantbridge.kernels._errors import KernelError
from quantbridge.kernels._ir import I8, I64, load_vec, store_vec
from quantbridge.kernels._layout import InputLayout, InputPlan, channels_last_data
from quantbridge.kernels._quantize import choose_kernel, f32_scale
from quantbridge.kernels._targets import check_target
from quantbridge.kernels._threads import get_num_threads

U8 = npt.NDArray[np.uint8]


def _pair(name: str, value: object, *, minimum: int) -> tuple[int, int]:
    if isinstance(value, (tuple, list)):
        if len(value) == 1:
            value = (value[0], value[0])
        if len(value) != 2:
            raise KernelError(f"{name}: expected an int or a pair of ints, got {value!r}")
        pair = (check_int(name, value[0]), check_int(name, value[1]))
    else:
        v = check_int(name, value)
        pair = (v, v)
    if min(pair) < minimum:
        raise KernelError(f"{name}: values must be >= {minimum}, got {pair}")
    if max(pair) > 1 << 20:
        raise KernelError(f"{name}: values must be <= {1 << 20}, got {pair}")
    return pair


def _out_size(size: int, k: int, pad: int, stride: int, dilation: int, ceil_mode: bool) -> int:
    # torch's pooling_output_shape: floor or ceil division, and in ceil mode the last window
    # must start inside the input or the left padding.
    span = size + 2 * pad - dilation * (k - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = span // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _planes(name: str, x: object) -> tuple[U8, int, int, int, U8 | None]:
    """(array, planes, H, W, NHWC data if ``x`` is a channels-last 4-D array else None)."""
    arr = check_array(name, x, np.uint8, (3, 4), contiguous=False)
    nhwc = None
    if not arr.flags.c_contiguous:
        nhwc = channels_last_data(arr) if arr.ndim == 4 else None
        if nhwc is None:
            raise KernelError(
                f"{name}: expected a C-contiguous CHW/NCHW array or channels-last NCHW data, "
                f"got strides {arr.strides}; pass np.ascontiguousarray({name})"
            )
    h, w = arr.shape[-2], arr.shape[-1]
    return arr, math.prod(arr.shape[:-2]), h, w, nhwc


def _pool_geometry(
    h: int,
    w: int,
    kernel_size: object,
    stride: object,
    padding: object,
    dilation: object,
    ceil_mode: object,
    pad_limit_uses_dilation: bool,
) -> tuple[int, int, int, int, int, int, int, int, int, int]:
    kh, kw = _pair("kernel_size", kernel_size, minimum=1)
    if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0):
        sh, sw = kh, kw
    else:
        sh, sw = _pair("stride", stride, minimum=1)
    ph, pw = _pair("padding", padding, minimum=0)
    dh, dw = _pair("dilation", dilation, minimum=1)
    if not isinstance(ceil_mode, (bool, np.bool_)):
        raise KernelError(f"ceil_mode: expected a bool, got {ceil_mode!r}")
    eff_h = (kh - 1) * dh + 1 if pad_limit_uses_dilation else kh
    eff_w = (kw - 1) * dw + 1 if pad_limit_uses_dilation else kw
    if 2 * ph > eff_h or 2 * pw > eff_w:
        raise KernelError(
            f"padding: {(ph, pw)} must be at most half the (effective) kernel size "
            f"{(eff_h, eff_w)}, as torch requires"
        )
    oh = _out_size(h, kh, ph, sh, dh, bool(ceil_mode))
    ow = _out_size(w, kw, pw, sw, dw, bool(ceil_mode))
    if oh < 1 or ow < 1:
        raise KernelError(
            f"kernel_size: a {(kh, kw)} window (dilation {(dh, dw)}, padding {(ph, pw)}) does not "
            f"fit the {h}x{w} input; output would be {oh}x{ow}"
        )
    return kh, kw, sh, sw, ph, pw, dh, dw, oh, ow


def _output(x: U8, oh: int, ow: int, out: U8 | None, nhwc: U8 | None) -> tuple[U8, U8 | None]:
    """(result, its NHWC data when the input is channels-last, else None)."""
    shape = (*x.shape[:-2], oh, ow)
    if out is None:
        if nhwc is None:
            return np.empty(shape, np.uint8), None
        data = np.empty((shape[0], oh, ow, shape[1]), np.uint8)
        return data.transpose(0, 3, 1, 2), data
    if nhwc is None:
        check_out(out, shape, np.uint8)
    else:
        check_out(out, shape, np.uint8, order=(0, 2, 3, 1))
    if np.may_share_memory(out, x):
        raise KernelError("out: must not overlap the input x")
    return out, (None if nhwc is None else out.transpose(0, 2, 3, 1))


# --------------------------------------------------------------------------- max pool


@numba.njit(cache=True)
def _taps(start, k, d, size):  # type: ignore[no-untyped-def]
    # first and last+1 tap index i with 0 <= start + i * d < size
    if d == 1:  # no divisions in the common case
        return max(0, -start), max(max(0, -start), min(k, size - start))
    lo = 0 if start >= 0 else (-start + d - 1) // d
    hi = 0 if start >= size else min(k, (size - start + d - 1) // d)
    return lo, max(lo, hi)


@numba.njit(cache=True)
def _max_plane(x, out, p, kh, kw, sh, sw, ph, pw, dh, dw):  # type: ignore[no-untyped-def]
    h, w = x.shape[1], x.shape[2]
    for oy in range(out.shape[1]):
        y0 = oy * sh - ph
        i0, i1 = _taps(y0, kh, dh, h)
        for ox in range(out.shape[2]):
            x0 = ox * sw - pw
            j0, j1 = _taps(x0, kw, dw, w)
            best = np.uint8(0)  # a window entirely in the padding gives 0, as in torch
            for i in range(i0, i1):
                row = y0 + i * dh
                for j in range(j0, j1):
                    v = x[p, row, x0 + j * dw]
                    if v > best:
                        best = v
            out[p, oy, ox] = best


@numba.njit(cache=True)
def _max_pool(x, out, kh, kw, sh, sw, ph, pw, dh, dw):  # type: ignore[no-untyped-def]
    for p in range(x.shape[0]):
        _max_plane(x, out, p, kh, kw, sh, sw, ph, pw, dh, dw)


@numba.njit(cache=True)
def _max_pool_dense(x, out, kh, kw, sh, sw):  # type: ignore[no-untyped-def]
    # every window inside the input (no padding, dilation 1): fixed trip counts and no
    # per-output tap bounds, which the general loop spends most of its time on for small planes
    for p in range(x.shape[0]):
        for oy in range(out.shape[1]):
            y0 = oy * sh
            for ox in range(out.shape[2]):
                x0 = ox * sw
                best = x[p, y0, x0]
                for i in range(kh):
                    for j in range(kw):
                        v = x[p, y0 + i, x0 + j]
                        if v > best:
                            best = v
                out[p, oy, ox] = best


_RUN = 32  # bytes per vector of ``_max_into`` (a ymm register)


def _max_into_codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
    dst, doff, src, soff, n, first = args
    d_p = context.make_array(sig.args[0])(context, builder, dst).data
    s_p = context.make_array(sig.args[2])(context, builder, src).data
    vt = ir.VectorType(I8, _RUN)

    def step(at: ir.Value, ty: ir.Type) -> None:
        dp = builder.gep(d_p, [builder.add(doff, at)])
        sv = load_vec(builder, builder.gep(s_p, [builder.add(soff, at)]), ty)
        dv = load_vec(builder, dp, ty)
        top = builder.select(builder.icmp_unsigned(">", sv, dv), sv, dv)
        store_vec(builder, builder.select(first, sv, top), dp)

    nvec = builder.udiv(n, ir.Constant(I64, _RUN))
    with cgutils.for_range(builder, nvec) as loop:
        step(builder.mul(loop.index, ir.Constant(I64, _RUN)), vt)
    done = builder.mul(nvec, ir.Constant(I64, _RUN))
    with cgutils.for_range(builder, builder.sub(n, done)) as loop:
        step(builder.add(done, loop.index), I8)
    return context.get_dummy_value()


def _max_into_typing(
    typingctx: Any, dst: Any, doff: Any, src: Any, soff: Any, n: Any, first: Any
) -> Any:
    """``dst[doff:doff+n] = src[soff:soff+n]`` if ``first`` else their unsigned byte max,
    32 bytes a vector (ints are int64, ``first`` a bool)."""
    return types.void(dst, doff, src, soff, n, first), _max_into_codegen


# typed Any: callers pass the six arguments, not numba's typing context
_max_into: Any = intrinsic(_max_into_typing)


@numba.njit(cache=True)
def _max_pool_nhwc_rows(x, out, kh, kw, sh, sw, ph, pw, dh, dw, r0, r1):  # type: ignore[no-untyped-def]
    # x [N, H, W, C], out [N, OH, OW, C]; output rows r0..r1-1 of the N * OH: each in-bounds
    # tap's C channels maxed into the output pixel with byte vectors (numba's own loop here
    # ran ~10x slower: it did not vectorize)
    h, w, c = x.shape[1], x.shape[2], x.shape[3]
    oh, ow = out.shape[1], out.shape[2]
    xf, of = x.reshape(-1), out.reshape(-1)
    for r in range(r0, r1):
        b = r // oh
        oy = r - b * oh
        y0 = oy * sh - ph
        i0, i1 = _taps(y0, kh, dh, h)
        for ox in range(ow):
            x0 = ox * sw - pw
            j0, j1 = _taps(x0, kw, dw, w)
            o = (r * ow + ox) * c
            if i0 == i1 or j0 == j1:  # a window entirely in the padding gives 0, as torch
                for ch in range(c):
                    of[o + ch] = 0
                continue
            first = True
            for i in range(i0, i1):
                for j in range(j0, j1):
                    at = ((b * h + y0 + i * dh) * w + x0 + j * dw) * c
                    _max_into(of, np.int64(o), xf, np.int64(at), np.int64(c), first)
                    first = False


@numba.njit(cache=True)
def _max_pool_nhwc(x, out, kh, kw, sh, sw, ph, pw, dh, dw):  # type: ignore[no-untyped-def]
    rows = x.shape[0] * out.shape[1]
    _max_pool_nhwc_rows(x, out, kh, kw, sh, sw, ph, pw, dh, dw, 0, rows)


@numba.njit(cache=True, parallel=True)
def _max_pool_nhwc_par(x, out, kh, kw, sh, sw, ph, pw, dh, dw):  # type: ignore[no-untyped-def]
    for r in numba.prange(x.shape[0] * out.shape[1]):  # each thread a run of output rows
        _max_pool_nhwc_rows(x, out, kh, kw, sh, sw, ph, pw, dh, dw, r, r + 1)


@numba.njit(cache=True, parallel=True)
def _max_pool_par(x, out, kh, kw, sh, sw, ph, pw, dh, dw):  # type: ignore[no-untyped-def]
    for p in numba.prange(x.shape[0]):
        _max_plane(x, out, p, kh, kw, sh, sw, ph, pw, dh, dw)


def max_pool2d(
    x: U8,
    kernel_size: int | tuple[int, int],
    stride: int | tuple[int, int] | None = None,
    padding: int | tuple[int, int] = 0,
    dilation: int | tuple[int, int] = 1,
    ceil_mode: bool = False,
    *,
    out: U8 | None = None,
    target: str | None = None,
) -> U8:
    """Max pooling over the last two axes of a CHW/NCHW uint8 array (qparams unchanged).

    C-contiguous or channels-last input; the result has the input's layout.
    """
    check_target(target)
    arr, planes, h, w, nhwc = _planes("x", x)
    kh, kw, sh, sw, ph, pw, dh, dw, oh, ow = _pool_geometry(
        h, w, kernel_size, stride, padding, dilation, ceil_mode, True
    )
    result, result_nhwc = _output(arr, oh, ow, out, nhwc)
    if nhwc is not None:  # channels-last: a stream over the output rows
        run = choose_kernel(
            result.size * kh * kw, "max_pool2d", _max_pool_nhwc, _max_pool_nhwc_par, stream=True
        )
        run(nhwc, result_nhwc, kh, kw, sh, sw, ph, pw, dh, dw)
        return result
    work = result.size * kh * kw if planes > 1 else 0
    kernel = choose_kernel(work, "max_pool2d", _max_pool, _max_pool_par)
    xr, outr = arr.reshape(planes, h, w), result.reshape(planes, oh, ow)
    dense = ph == pw == 0 and dh == dw == 1 and (oh - 1) * sh + kh <= h and (ow - 1) * sw + kw <= w
    if dense and kernel is _max_pool:
        _max_pool_dense(xr, outr, kh, kw, sh, sw)
        return result
    kernel(xr, outr, kh, kw, sh, sw, ph, pw, dh, dw)
    return result


# --------------------------------------------------------------------------- average pool


@numba.njit(cache=True)
def _avg_window(oy, ox, kh, kw, sh, sw, ph, pw, h, w, include_pad, divisor):  # type: ignore[no-untyped-def]
    # in-bounds window [ya, yb) x [xa, xb), its element count, and torch's divisor
    y0, x0 = oy * sh - ph, ox * sw - pw
    y1, x1 = min(y0 + kh, h + ph), min(x0 + kw, w + pw)
    ya, yb = max(y0, 0), min(y1, h)
    xa, xb = max(x0, 0), min(x1, w)
    count = (yb - ya) * (xb - xa)
    if divisor > 0:
        div = divisor
    elif include_pad:
        div = (y1 - y0) * (x1 - x0)
    else:
        div = count
    return ya, yb, xa, xb, count, div


@numba.njit(cache=True)
def _avg_plane(x, out, p, kh, kw, sh, sw, ph, pw, include_pad, divisor, ratio, zp_in, zp_out):  # type: ignore[no-untyped-def]
    h, w = x.shape[1], x.shape[2]
    zpf = np.float32(zp_out)
    for oy in range(out.shape[1]):
        for ox in range(out.shape[2]):
            ya, yb, xa, xb, count, div = _avg_window(
                oy, ox, kh, kw, sh, sw, ph, pw, h, w, include_pad, divisor
            )
            total = np.int32(0)
            for y in range(ya, yb):
                for xx in range(xa, xb):
                    total += np.int32(x[p, y, xx])
            total -= np.int32(count * zp_in)
            m = np.float32(ratio / div)
            r = np.rint(np.float32(total) * m + zpf)
            if r < 0.0:
                r = 0.0
            elif r > 255.0:
                r = 255.0
            out[p, oy, ox] = np.uint8(r)


@numba.njit(cache=True)
def _avg_pool(x, out, kh, kw, sh, sw, ph, pw, include_pad, divisor, ratio, zp_in, zp_out):  # type: ignore[no-untyped-def]
    for p in range(x.shape[0]):
        _avg_plane(x, out, p, kh, kw, sh, sw, ph, pw, include_pad, divisor, ratio, zp_in, zp_out)


@numba.njit(cache=True)
def _avg_pool_nhwc(x, out, kh, kw, sh, sw, ph, pw, include_pad, divisor, ratio, zp_in, zp_out):  # type: ignore[no-untyped-def]
    # x [N, H, W, C], out [N, OH, OW, C]; the numbers of _avg_plane, channel loop innermost
    h, w, c = x.shape[1], x.shape[2], x.shape[3]
    zpf = np.float32(zp_out)
    total = np.empty(c, np.int32)
    for b in range(x.shape[0]):
        for oy in range(out.shape[1]):
            for ox in range(out.shape[2]):
                ya, yb, xa, xb, count, div = _avg_window(
                    oy, ox, kh, kw, sh, sw, ph, pw, h, w, include_pad, divisor
                )
                for ch in range(c):
                    total[ch] = 0
                for y in range(ya, yb):
                    for xx in range(xa, xb):
                        src = x[b, y, xx]
                        for ch in range(c):
                            total[ch] += np.int32(src[ch])
                m = np.float32(ratio / div)
                dst = out[b, oy, ox]
                for ch in range(c):
                    r = np.rint(np.float32(total[ch] - np.int32(count * zp_in)) * m + zpf)
                    dst[ch] = np.uint8(min(max(r, np.float32(0.0)), np.float32(255.0)))


@numba.njit(cache=True, parallel=True)
def _avg_pool_par(x, out, kh, kw, sh, sw, ph, pw, include_pad, divisor, ratio, zp_in, zp_out):  # type: ignore[no-untyped-def]
    for p in numba.prange(x.shape[0]):
        _avg_plane(x, out, p, kh, kw, sh, sw, ph, pw, include_pad, divisor, ratio, zp_in, zp_out)


@functools.lru_cache(maxsize=256)  # qparams repeat call after call; errors are not cached
def _check_avg_multiplier(s_in: float, s_out: float, largest: int) -> None:
    """The kernel's multiplier ``float32(scale / out_scale / count)``, count up to ``largest``
    (the window size or divisor_override), must be a normal float32 number."""
    check_derived("scale / out_scale", s_in / s_out)
    check_derived(f"scale / out_scale / {largest} (the largest divisor)", s_in / s_out / largest)


def avg_pool2d(
    x: U8,
    kernel_size: int | tuple[int, int],
    stride: int | tuple[int, int] | None = None,
    padding: int | tuple[int, int] = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
    *,
    scale: float = 1.0,
    zero_point: int,
    out_scale: float | None = None,
    out_zero_point: int | None = None,
    out: U8 | None = None,
    target: str | None = None,
) -> U8:
    """Average pooling of a CHW/NCHW uint8 array (torch's quantized avg_pool2d numerics).

    C-contiguous or channels-last input; the result has the input's layout.

    The output qparams default to the input's (what torch does); only their ratio
    ``scale / out_scale`` and the zero points enter the computation.
    """
    check_target(target)
    arr, planes, h, w, nhwc = _planes("x", x)
    kh, kw, sh, sw, ph, pw, _, _, oh, ow = _pool_geometry(
        h, w, kernel_size, stride, padding, 1, ceil_mode, False
    )
    if not isinstance(count_include_pad, (bool, np.bool_)):
        raise KernelError(f"count_include_pad: expected a bool, got {count_include_pad!r}")
    divisor = 0
    if divisor_override is not None:
        divisor = check_int("divisor_override", divisor_override)
        if divisor <= 0:
            raise KernelError(f"divisor_override: must be a positive integer, got {divisor}")
    s_in = f32_scale("scale", scale)
    s_out = s_in if out_scale is None else f32_scale("out_scale", out_scale)
    _check_avg_multiplier(s_in, s_out, divisor or kh * kw)
    zp_in = check_zero_point("zero_point", zero_point, 0, 255)
    zp_out = (
        zp_in
        if out_zero_point is None
        else check_zero_point("out_zero_point", out_zero_point, 0, 255)
    )
    if kh * kw > (1 << 23):
        raise KernelError(f"kernel_size: window {(kh, kw)} too large for int32 sums")
    result, result_nhwc = _output(arr, oh, ow, out, nhwc)
    params = (kh, kw, sh, sw, ph, pw, bool(count_include_pad), divisor, s_in / s_out, zp_in, zp_out)
    if nhwc is not None:
        _avg_pool_nhwc(nhwc, result_nhwc, *params)
        return result
    work = result.size * kh * kw if planes > 1 else 0
    kernel = choose_kernel(work, "avg_pool2d", _avg_pool, _avg_pool_par)
    kernel(arr.reshape(planes, h, w), result.reshape(planes, oh, ow), *params)
    return result


# --------------------------------------------------------------------------- adaptive average


@numba.njit(cache=True)
def _window(o, out_len, in_len):  # type: ignore[no-untyped-def]
    # torch computes the bounds with float32 division
    start = int(np.floor(np.float32(o * in_len) / np.float32(out_len)))
    end = int(np.ceil(np.float32((o + 1) * in_len) / np.float32(out_len)))
    # float32 rounding could push a bound past the input for sizes above 2**24: never read
    # outside it (a no-op for every realistic size)
    start = max(0, min(start, in_len - 1))
    return start, max(start + 1, min(end, in_len))


@numba.njit(cache=True)
def _adaptive_code(total, count, r, requant, ratio, zp_in, zp_out):  # type: ignore[no-untyped-def]
    # one output code from its window's sum of codes: torch's mean when the qparams are kept,
    # else avg_pool2d's requantization
    if not requant:
        return np.uint8(min(np.rint(np.float32(total) * r), 255.0))
    m = np.float32(ratio / count)
    v = np.rint(np.float32(total - count * zp_in) * m + np.float32(zp_out))
    return np.uint8(min(max(v, np.float32(0.0)), np.float32(255.0)))


@numba.njit(cache=True)
def _adaptive_plane(x, out, p, requant, ratio, zp_in, zp_out):  # type: ignore[no-untyped-def]
    h, w = x.shape[1], x.shape[2]
    oh, ow = out.shape[1], out.shape[2]
    for oy in range(oh):
        ya, yb = _window(oy, oh, h)
        rh = np.float32(1.0) / np.float32(yb - ya)
        for ox in range(ow):
            xa, xb = _window(ox, ow, w)
            r = rh / np.float32(xb - xa)
            total = 0
            for y in range(ya, yb):
                for xx in range(xa, xb):
                    total += np.int64(x[p, y, xx])
            count = (yb - ya) * (xb - xa)
            out[p, oy, ox] = _adaptive_code(total, count, r, requant, ratio, zp_in, zp_out)


@numba.njit(cache=True)
def _adaptive(x, out, requant, ratio, zp_in, zp_out):  # type: ignore[no-untyped-def]
    for p in range(x.shape[0]):
        _adaptive_plane(x, out, p, requant, ratio, zp_in, zp_out)


@numba.njit(cache=True)
def _adaptive_nhwc(x, out, requant, ratio, zp_in, zp_out):  # type: ignore[no-untyped-def]
    # x [N, H, W, C], out [N, OH, OW, C]; the numbers of _adaptive_plane, channel loop innermost.
    # Sums run in int32 (twice the vector width of int64) over at most 2**23 codes at a time
    # (255 * 2**23 < 2**31), flushed into int64 totals.
    h, w, c = x.shape[1], x.shape[2], x.shape[3]
    oh, ow = out.shape[1], out.shape[2]
    total = np.empty(c, np.int64)
    part = np.empty(c, np.int32)
    for b in range(x.shape[0]):
        for oy in range(oh):
            ya, yb = _window(oy, oh, h)
            rh = np.float32(1.0) / np.float32(yb - ya)
            for ox in range(ow):
                xa, xb = _window(ox, ow, w)
                r = rh / np.float32(xb - xa)
                count = (yb - ya) * (xb - xa)
                rows = max(1, (1 << 23) // (xb - xa))
                for ch in range(c):
                    total[ch] = 0
                for y0 in range(ya, yb, rows):
                    for ch in range(c):
                        part[ch] = 0
                    for y in range(y0, min(yb, y0 + rows)):
                        for xx in range(xa, xb):
                            src = x[b, y, xx]
                            for ch in range(c):
                                part[ch] += np.int32(src[ch])
                    for ch in range(c):
                        total[ch] += part[ch]
                dst = out[b, oy, ox]
                for ch in range(c):
                    dst[ch] = _adaptive_code(total[ch], count, r, requant, ratio, zp_in, zp_out)


@numba.njit(cache=True, parallel=True)
def _adaptive_par(x, out, requant, ratio, zp_in, zp_out):  # type: ignore[no-untyped-def]
    for p in numba.prange(x.shape[0]):
        _adaptive_plane(x, out, p, requant, ratio, zp_in, zp_out)


def adaptive_avg_pool2d(
    x: U8,
    output_size: int | tuple[int, int],
    *,
    scale: float | None = None,
    zero_point: int | None = None,
    out_scale: float | None = None,
    out_zero_point: int | None = None,
    out: U8 | None = None,
    target: str | None = None,
) -> U8:
    """Adaptive average pooling of a CHW/NCHW uint8 array to ``output_size``.

    C-contiguous or channels-last input; the result has the input's layout.

    Without qparams the output keeps the input's (torch's quantized kernel). With
    ``scale``, ``zero_point``, ``out_scale`` and ``out_zero_point`` each window's mean is
    requantized to the output qparams in the same pass (avg_pool2d's rule); equal qparams
    give torch's numbers.
    """
    check_target(target)
    requant = _Requant.of(scale, zero_point, out_scale, out_zero_point)
    arr, run = _adaptive_plan(x, output_size, requant)
    return run(arr, out)


class _Requant(NamedTuple):
    """The arguments of the adaptive kernels' output rule (``requant`` False: qparams kept)."""

    requant: bool
    ratio: float
    zp_in: int
    zp_out: int

    @classmethod
    def of(
        cls,
        scale: float | None,
        zero_point: int | None,
        out_scale: float | None,
        out_zero_point: int | None,
    ) -> _Requant:
        if scale is None and zero_point is None and out_scale is None and out_zero_point is None:
            return _KEPT
        if scale is None or zero_point is None or out_scale is None or out_zero_point is None:
            raise KernelError(
                "adaptive_avg_pool2d: pass scale, zero_point, out_scale and out_zero_point "
                "together (to requantize the mean), or none of them (the qparams are kept)"
            )
        s_in = f32_scale("scale", scale)
        s_out = f32_scale("out_scale", out_scale)
        zp_in = check_zero_point("zero_point", zero_point, 0, 255)
        zp_out = check_zero_point("out_zero_point", out_zero_point, 0, 255)
        if (s_in, zp_in) == (s_out, zp_out):
            return _KEPT
        check_derived("scale / out_scale", s_in / s_out)
        return cls(True, s_in / s_out, zp_in, zp_out)


_KEPT = _Requant(False, 1.0, 0, 0)


class PreparedAdaptiveAvgPool2d:
    """``adaptive_avg_pool2d`` to a fixed ``output_size`` and qparams, for a layer called again
    and again on inputs of one shape and layout (a squeeze-excite's squeeze, a network's last
    pool).

    ``prepared(x)`` returns exactly ``adaptive_avg_pool2d(x, output_size, **qparams,
    target=target)``. The first call checks and plans; later calls on an input of the same
    shape, strides and dtype, at the same thread count, run that plan without the checks
    (~5 us a call).
    """

    __slots__ = ("_fast", "_requant", "output_size", "target")

    def __init__(
        self,
        output_size: int | tuple[int, int],
        *,
        scale: float | None = None,
        zero_point: int | None = None,
        out_scale: float | None = None,
        out_zero_point: int | None = None,
        target: str | None = None,
    ) -> None:
        check_target(target)
        self.output_size = _pair("output_size", output_size, minimum=1)
        self._requant = _Requant.of(scale, zero_point, out_scale, out_zero_point)
        self.target = target
        self._fast: InputPlan | None = None  # the last plan, for inputs of its layout

    def __call__(self, x: U8) -> U8:
        fast = self._fast
        if fast is not None and fast.x.fits(x) and get_num_threads() == fast.threads:
            out: U8 = fast.run(x, None)
            return out
        self._fast = None
        check_target(self.target)
        arr, run = _adaptive_plan(x, self.output_size, self._requant)
        if arr is x:
            self._fast = InputPlan(InputLayout.of(arr), get_num_threads(), run)
        return run(arr, None)


def _adaptive_plan(
    x: object, output_size: object, requant: _Requant
) -> tuple[U8, Callable[[U8, U8 | None], U8]]:
    """The checked input and the call to run on it (valid for inputs of its shape, strides
    and dtype at this thread count): ``run(x, out)``."""
    arr, planes, h, w, nhwc = _planes("x", x)
    oh, ow = _pair("output_size", output_size, minimum=1)
    if nhwc is not None and w >= 1 << 23:
        raise KernelError(
            f"x: channels-last input {w} wide; rows of 2**23 or more codes are only supported "
            "C-contiguous (pass np.ascontiguousarray(x))"
        )
    if requant.requant:
        # the largest window (torch's bounds) sets the smallest multiplier
        wh, ww = -(-h // oh) + (h % oh != 0), -(-w // ow) + (w % ow != 0)
        check_derived(
            f"scale / out_scale / {wh * ww} (the largest window)", requant.ratio / (wh * ww)
        )
    if nhwc is not None:
        return arr, functools.partial(_run_adaptive_channels_last, oh, ow, requant)
    work = arr.size if planes > 1 else 0
    kernel = choose_kernel(work, "adaptive_avg_pool2d", _adaptive, _adaptive_par)
    return arr, functools.partial(_run_adaptive_planes, kernel, planes, h, w, oh, ow, requant)


def _run_adaptive_channels_last(oh: int, ow: int, requant: _Requant, arr: U8, out: U8 | None) -> U8:
    result, result_nhwc = _output(arr, oh, ow, out, arr.transpose(0, 2, 3, 1))
    _adaptive_nhwc(arr.transpose(0, 2, 3, 1), result_nhwc, *requant)
    return result


def _run_adaptive_planes(
    kernel: Any,
    planes: int,
    h: int,
    w: int,
    oh: int,
    ow: int,
    requant: _Requant,
    arr: U8,
    out: U8 | None,
) -> U8:
    result, _ = _output(arr, oh, ow, out, None)
    kernel(arr.reshape(planes, h, w), result.reshape(planes, oh, ow), *requant)
    return result
