"""Dynamic activation quantization for ``linear_dynamic``: range and quantize in compiled loops
that write the layout the GEMM reads (uint8 rows padded to whole 4-byte loads, or int16 for
AVX2), so nothing is copied or widened afterwards.

Per tensor (torch's rule, bit-identical to the former numpy path): one vector pass finds
``min``/``max`` and any non-finite value (from the IEEE exponent bits), the qparams come
from ``_linear.qparams_from_range``, a second pass quantizes
``q = clamp(rint(fma(x, float32(1/scale), zp)), 0, 255)`` and (when a weight zero point needs
them) sums each row.

Per row (per token), row ``i`` of ``x`` while it is in cache:

    lo = min(min_k x[i, k], 0)            hi = max(max_k x[i, k], 0)       (float32)
    scale = float32((float64(hi) - float64(lo)) / 255)
            (0.1 if that is below the smallest normal float32, e.g. an all-zero row)
    zp = clamp(rint(-float64(lo) / float64(scale)), 0, 255)
    q[i, k] = clamp(rint(fma(x[i, k], float32(1) / scale, zp)), 0, 255)   (float32)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from quantbridge.kernels._fma import fma32
from quantbridge.kernels._ir import F32T, I32, I64, declare, load_vec, stack_slot, vec_broadcast

_EXP_MASK = np.int32(0x7F800000)  # all-ones exponent: inf or NaN
_TINY = np.float32(1.1754944e-38)


_RANGE_LANES = 16  # floats per vector of ``_range`` (a zmm register; two ymm elsewhere)


def _range_codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
    (x,) = args
    arr = context.make_array(sig.args[0])(context, builder, x)
    ptr, n = arr.data, builder.extract_value(arr.shape, 0)
    vf = ir.VectorType(F32T, _RANGE_LANES)
    vi = ir.VectorType(I32, _RANGE_LANES)
    lo = stack_slot(builder, ir.Constant(vf, [float("inf")] * _RANGE_LANES))
    hi = stack_slot(builder, ir.Constant(vf, [float("-inf")] * _RANGE_LANES))
    bad = stack_slot(builder, ir.Constant(vi, [0] * _RANGE_LANES))
    expo = ir.Constant(vi, [int(_EXP_MASK)] * _RANGE_LANES)

    def take(v: ir.Value, width: int) -> None:
        """Fold ``v`` (``width`` lanes, splatted to full vectors when 1) into the slots."""
        if width == 1:
            v = vec_broadcast(builder, v, _RANGE_LANES)
        low, high = builder.load(lo), builder.load(hi)
        # compare-and-select: a NaN never replaces a bound (it is caught by its bits)
        builder.store(builder.select(builder.fcmp_ordered("<", v, low), v, low), lo)
        builder.store(builder.select(builder.fcmp_ordered(">", v, high), v, high), hi)
        ones = builder.icmp_unsigned("==", builder.and_(builder.bitcast(v, vi), expo), expo)
        builder.store(builder.or_(builder.load(bad), builder.zext(ones, vi)), bad)

    nvec = builder.udiv(n, ir.Constant(I64, _RANGE_LANES))
    with cgutils.for_range(builder, nvec) as loop:
        at = builder.gep(ptr, [builder.mul(loop.index, ir.Constant(I64, _RANGE_LANES))])
        take(load_vec(builder, at, vf), _RANGE_LANES)
    done = builder.mul(nvec, ir.Constant(I64, _RANGE_LANES))
    with cgutils.for_range(builder, builder.sub(n, done)) as loop:
        take(builder.load(builder.gep(ptr, [builder.add(done, loop.index)])), 1)
    mod = builder.module
    fmin = declare(mod, ir.FunctionType(F32T, [vf]), f"llvm.vector.reduce.fmin.v{_RANGE_LANES}f32")
    fmax = declare(mod, ir.FunctionType(F32T, [vf]), f"llvm.vector.reduce.fmax.v{_RANGE_LANES}f32")
    orr = declare(mod, ir.FunctionType(I32, [vi]), f"llvm.vector.reduce.or.v{_RANGE_LANES}i32")
    flag = builder.uitofp(builder.call(orr, [builder.load(bad)]), F32T)
    values = [builder.call(fmin, [builder.load(lo)]), builder.call(fmax, [builder.load(hi)]), flag]
    return context.make_tuple(builder, sig.return_type, values)


def _range_typing(typingctx: Any, x: Any) -> Any:
    """``(min, max, 1.0 if any value is NaN or infinite else 0.0)`` of a C-contiguous 1-D
    float32 array, 16 floats a vector (numba's own loop did not vectorize: 68 us on 49K
    floats); an empty array gives ``(inf, -inf, 0)``."""
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.layout == "C"):
        return None
    if x.dtype != types.float32:
        return None
    return types.UniTuple(types.float32, 3)(x), _range_codegen  # type: ignore[no-untyped-call]


# typed Any: callers pass the array, not numba's typing context
_range: Any = intrinsic(_range_typing)


@njit(cache=True, nogil=True)
def tensor_range(x):  # type: ignore[no-untyped-def]
    """``(min, max, any non-finite)`` of flat, C-contiguous float32 ``x``."""
    lo, hi, bad = _range(x)
    return lo, hi, bad != 0


@njit(cache=True, nogil=True, error_model="numpy")
def dynamic_qparams(lo, hi):  # type: ignore[no-untyped-def]
    """torch's dynamic activation qparams ``(scale, zero point)`` for the float64 range
    ``[lo, hi]``: uint8 [0, 255], the range widened to include 0, the scale rounded to
    float32 (0.1 when that gives 0), the zero point from whichever end loses less."""
    lo = min(lo, 0.0)
    hi = max(hi, 0.0)
    scale = np.float64(np.float32((hi - lo) / 255.0))
    if scale == 0.0 or np.isinf(1.0 / scale):
        scale = np.float64(np.float32(0.1))
    from_min = -lo / scale
    from_max = 255.0 - hi / scale
    initial = from_min if -abs(lo / scale) < 255.0 - abs(hi / scale) else from_max
    zp = np.int64(min(max(np.rint(initial), 0.0), 255.0))
    return scale, zp


@njit(cache=True, nogil=True)
def quantize_rows_fixed(x, inv, zp, out, rowsum, sums):  # type: ignore[no-untyped-def]
    """``out[i, :k] = clamp(rint(fma(x[i], inv, zp)))``, ``out[i, k:] = 0``; row sums if asked."""
    m, k = x.shape
    lda = out.shape[1]
    zf = np.float32(zp)
    lo = np.float32(0.0)
    top = np.float32(255.0)
    for i in range(m):
        for j in range(k):
            out[i, j] = min(max(np.rint(fma32(x[i, j], inv, zf)), lo), top)
        for j in range(k, lda):
            out[i, j] = 0
        if sums:
            t = np.int32(0)
            for j in range(k):
                t += np.int32(out[i, j])
            rowsum[i] = t


@njit(cache=True, nogil=True, fastmath=True)
def _row_range(x, bits, i):  # type: ignore[no-untyped-def]
    lo = np.float32(0.0)
    hi = np.float32(0.0)
    bad = np.int32(0)
    for j in range(x.shape[1]):
        v = x[i, j]
        lo = v if v < lo else lo
        hi = v if v > hi else hi
        bad |= np.int32((bits[i, j] & _EXP_MASK) == _EXP_MASK)
    return lo, hi, bad


@njit(cache=True, nogil=True)
def _quantize_rows(x, bits, out, scales, zps):  # type: ignore[no-untyped-def]
    m, k = x.shape
    lda = out.shape[1]
    lo_q = np.float32(0.0)
    top = np.float32(255.0)
    for i in range(m):
        lo, hi, bad = _row_range(x, bits, i)
        if bad != 0:
            return True
        scale = np.float32((np.float64(hi) - np.float64(lo)) / 255.0)
        if not scale >= _TINY:
            scale = np.float32(0.1)
        zp = np.rint(-np.float64(lo) / np.float64(scale))
        zp = min(max(zp, 0.0), 255.0)
        inv = np.float32(1.0) / scale
        zf = np.float32(zp)
        for j in range(k):
            out[i, j] = min(max(np.rint(fma32(x[i, j], inv, zf)), lo_q), top)
        for j in range(k, lda):
            out[i, j] = 0
        scales[i] = scale
        zps[i] = np.int32(zp)
    return False


def quantize_rows(
    x: npt.NDArray[np.float32],
    out: npt.NDArray[Any],
    scales: npt.NDArray[np.float32],
    zps: npt.NDArray[np.int32],
) -> bool:
    """Per-row rule (module docstring) on float32 [m, k] ``x`` into ``out`` [m, lda] with
    ``scales``/``zps`` [m]; True (and partial output) if ``x`` holds inf or NaN."""
    return bool(_quantize_rows(x, x.view(np.int32), out, scales, zps))
