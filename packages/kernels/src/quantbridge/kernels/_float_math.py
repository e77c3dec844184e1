"""float32 exp, erf-GELU and tanh-GELU written so LLVM vectorizes the loops that call them.

GELU runs as explicit 16-float vectors (``gelu_vectors``: the same steps written as LLVM IR;
LLVM's own vectorization of the scalar functions chose 8-float vectors and ran 3-4x slower),
the scalar functions finishing each row's last ``n % 16`` values. A softmax row
(``softmax_row``) and a LayerNorm row (``layer_norm_row``: 1.1-1.5x faster than numba's
loops) are LLVM IR over 16-float vectors too.

numba lowers ``np.exp`` and ``math.erf`` to scalar libm calls (no vector math library here),
which left a softmax or GELU loop 4-8x slower than torch's vectorized ones. These functions use
only arithmetic, ``rint``, compares/selects and an integer-to-float bit cast, all of which
LLVM turns into AVX2 (or AVX-512) instructions inside a loop.

- ``exp32(v)``: ``v`` clamped to [-87, 88]; ``n = rint(v * log2(e))``, ``r = v - n * ln2``
  (ln2 split in a high part exact in float32 and a low part), ``e^r`` by its Taylor
  polynomial to degree 7 (truncation < 6e-9 relative for ``|r| <= ln2 / 2``), times ``2^n``
  built from its exponent bits. Below -87 the result is 0 (true value < 1.7e-38).
  Within 2 float32 ulp of ``exp`` elsewhere (tested).
- ``gelu_erf(x) = x * Phi(x)`` with ``Phi`` from Abramowitz & Stegun 7.1.26 (absolute error
  of erf <= 1.5e-7): ``E = P(t) * exp(-z^2)``, ``t = 1 / (1 + p z)``, ``z = |x| / sqrt(2)``,
  ``Phi = 1 - E / 2`` for ``x >= 0`` and ``E / 2`` below (no cancellation in the tail).
- ``gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u))``,
  ``u = sqrt(2 / pi) (x + 0.044715 x^3)``: the same function as torch's ``approximate="tanh"``,
  in a form with no cancellation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from quantbridge.kernels._ir import (
    declare,
    lanes_below,
    load_vec,
    masked_load,
    masked_store,
    stack_slot,
    store_vec,
    vec_broadcast,
)

F32 = np.float32
# fastmath flags for the float kernels: reassociation (vectorized sums), FMA contraction and
# signed zeros; never nnan/ninf (masks hold -inf and finfo.min)
FAST = {"reassoc", "contract", "nsz"}

_LOG2E = F32(1.4426950408889634)
_LN2_HI = F32(0.693145751953125)  # 12 significant bits: n * _LN2_HI is exact for |n| <= 128
_LN2_LO = F32(1.4286068203094173e-06)
_EXP_LO = F32(-87.0)
_EXP_HI = F32(88.0)
# 1/k! for k = 7 .. 2
_C7 = F32(1.0 / 5040.0)
_C6 = F32(1.0 / 720.0)
_C5 = F32(1.0 / 120.0)
_C4 = F32(1.0 / 24.0)
_C3 = F32(1.0 / 6.0)
_C2 = F32(0.5)
_ONE = F32(1.0)
_ZERO = F32(0.0)
_HALF = F32(0.5)
_TWO = F32(2.0)
# Abramowitz & Stegun 7.1.26
_AS_P = F32(0.3275911)
_AS_A1 = F32(0.254829592)
_AS_A2 = F32(-0.284496736)
_AS_A3 = F32(1.421413741)
_AS_A4 = F32(-1.453152027)
_AS_A5 = F32(1.061405429)
_RSQRT2 = F32(0.7071067811865476)
_SQRT_2_OVER_PI = F32(0.7978845608028654)
_GELU_CUBIC = F32(0.044715)


@intrinsic
def _f32_from_bits(typingctx: Any, bits: Any) -> Any:
    """The float32 whose IEEE bits are the int32 ``bits`` (an LLVM bitcast; vectorizes)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        as_i32 = context.cast(builder, args[0], signature.args[0], types.int32)
        return builder.bitcast(as_i32, ir.FloatType())

    return types.float32(bits), codegen


if TYPE_CHECKING:

    def f32_from_bits(bits: int) -> float:
        """The float32 with IEEE bits ``bits`` (numba code only)."""

else:
    f32_from_bits = _f32_from_bits


@njit(cache=True, fastmath=FAST, inline="always", error_model="numpy")
def exp32(v):  # type: ignore[no-untyped-def]
    """float32 ``e^v`` (see the module docstring); 0 below -87."""
    c = min(max(v, _EXP_LO), _EXP_HI)
    n = np.rint(c * _LOG2E)
    r = (c - n * _LN2_HI) - n * _LN2_LO
    p = _C7
    p = p * r + _C6
    p = p * r + _C5
    p = p * r + _C4
    p = p * r + _C3
    p = p * r + _C2
    p = p * r + _ONE
    p = p * r + _ONE
    scale = f32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))
    y = p * scale
    return _ZERO if v < _EXP_LO else y


@njit(cache=True, fastmath=FAST, inline="always", error_model="numpy")
def gelu_erf(x):  # type: ignore[no-untyped-def]
    """float32 ``x * Phi(x)`` (erf by Abramowitz & Stegun 7.1.26)."""
    z = abs(x) * _RSQRT2
    t = _ONE / (_ONE + _AS_P * z)
    poly = t * (_AS_A1 + t * (_AS_A2 + t * (_AS_A3 + t * (_AS_A4 + t * _AS_A5))))
    e = poly * exp32(-(z * z))
    phi = _ONE - _HALF * e if x >= _ZERO else _HALF * e
    return x * phi


@njit(cache=True, fastmath=FAST, inline="always", error_model="numpy")
def gelu_tanh(x):  # type: ignore[no-untyped-def]
    """float32 ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` as ``x / (1 + e^(-2u))``."""
    u = _SQRT_2_OVER_PI * (x + _GELU_CUBIC * x * x * x)
    return x / (_ONE + exp32(-_TWO * u))


# activation codes of the float GEMM epilogue (``_float_epilogue``)
ACT_NONE, ACT_RELU, ACT_GELU, ACT_GELU_TANH = 0, 1, 2, 3

_VLANES = 16  # floats per vector of ``gelu_vectors`` (a zmm register; two ymm elsewhere)


def vexp(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """``exp32`` on float32 lanes, the same steps as the scalar function."""
    vt = v.type
    lanes = vt.count
    mod = builder.module

    def const(x: float) -> ir.Constant:
        return ir.Constant(vt, [float(x)] * lanes)

    rint = declare(mod, ir.FunctionType(vt, [vt]), f"llvm.rint.v{lanes}f32")
    fmuladd = declare(mod, ir.FunctionType(vt, [vt, vt, vt]), f"llvm.fmuladd.v{lanes}f32")
    lo, hi = const(_EXP_LO), const(_EXP_HI)
    c = builder.select(builder.fcmp_ordered(">", v, lo), v, lo)
    c = builder.select(builder.fcmp_ordered("<", c, hi), c, hi)
    n = builder.call(rint, [builder.fmul(c, const(_LOG2E))])
    r = builder.fsub(
        builder.fsub(c, builder.fmul(n, const(_LN2_HI))), builder.fmul(n, const(_LN2_LO))
    )
    p = const(_C7)
    for k in (_C6, _C5, _C4, _C3, _C2, _ONE, _ONE):
        p = builder.call(fmuladd, [p, r, const(k)])
    vi = ir.VectorType(ir.IntType(32), lanes)
    expo = builder.add(builder.fptosi(n, vi), ir.Constant(vi, [127] * lanes))
    scale = builder.bitcast(builder.shl(expo, ir.Constant(vi, [23] * lanes)), vt)
    y = builder.fmul(p, scale)
    return builder.select(builder.fcmp_ordered("<", v, lo), const(0.0), y)


def _vgelu(builder: ir.IRBuilder, x: ir.Value, mode: int) -> ir.Value:
    """``gelu_erf`` (mode ``ACT_GELU``) or ``gelu_tanh`` on float32 lanes."""
    vt = x.type
    lanes = vt.count

    def const(v: float) -> ir.Constant:
        return ir.Constant(vt, [float(v)] * lanes)

    if mode == ACT_GELU_TANH:
        u = builder.fmul(
            const(_SQRT_2_OVER_PI),
            builder.fadd(x, builder.fmul(builder.fmul(builder.fmul(const(_GELU_CUBIC), x), x), x)),
        )
        e = vexp(builder, builder.fmul(const(-_TWO), u))
        return builder.fdiv(x, builder.fadd(const(_ONE), e))
    fabs = declare(builder.module, ir.FunctionType(vt, [vt]), f"llvm.fabs.v{lanes}f32")
    z = builder.fmul(builder.call(fabs, [x]), const(_RSQRT2))
    t = builder.fdiv(const(_ONE), builder.fadd(const(_ONE), builder.fmul(const(_AS_P), z)))
    poly = const(_AS_A5)
    for a in (_AS_A4, _AS_A3, _AS_A2, _AS_A1):
        poly = builder.fadd(const(a), builder.fmul(t, poly))
    poly = builder.fmul(t, poly)
    e = builder.fmul(poly, vexp(builder, builder.fneg(builder.fmul(z, z))))
    half_e = builder.fmul(const(_HALF), e)
    phi = builder.select(
        builder.fcmp_ordered(">=", x, const(0.0)), builder.fsub(const(_ONE), half_e), half_e
    )
    return builder.fmul(x, phi)


def _gelu_vectors_codegen(mode: int) -> Any:
    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        x, xoff, out, ooff, n = args
        x_p = context.make_array(sig.args[0])(context, builder, x).data
        o_p = context.make_array(sig.args[2])(context, builder, out).data
        vt = ir.VectorType(ir.FloatType(), _VLANES)
        i64 = ir.IntType(64)
        nvec = builder.udiv(n, ir.Constant(i64, _VLANES))
        with cgutils.for_range(builder, nvec) as loop:
            at = builder.mul(loop.index, ir.Constant(i64, _VLANES))
            v = load_vec(builder, builder.gep(x_p, [builder.add(xoff, at)]), vt)
            store_vec(builder, _vgelu(builder, v, mode), builder.gep(o_p, [builder.add(ooff, at)]))
        return builder.mul(nvec, ir.Constant(i64, _VLANES))

    return codegen


@intrinsic
def _gelu_vectors(typingctx: Any, mode: Any, x: Any, xoff: Any, out: Any, ooff: Any, n: Any) -> Any:
    """``out[ooff + j] = gelu(x[xoff + j])`` for ``j < n - n % 16``, 16 floats a vector;
    returns how many it wrote (the caller finishes the tail). ``mode`` (a literal):
    ``ACT_GELU`` or ``ACT_GELU_TANH``. numba's own loop over the scalar functions ran 3-4x
    slower (8-float vectors and a division per vector)."""
    if not isinstance(mode, types.IntegerLiteral):
        return None
    if not (flat_f32(x) and flat_f32(out)):
        return None
    inner = _gelu_vectors_codegen(mode.literal_value)

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        return inner(context, builder, types.int64(*sig.args[1:]), args[1:])

    return types.int64(mode, x, xoff, out, ooff, n), codegen


class RowSteps:
    """IR over a row of ``n`` float32 values in 16-float steps: the whole vectors with plain
    loads and stores, then the partial last one with lanes ``>= n`` masked off."""

    def __init__(self, builder: ir.IRBuilder, n: ir.Value) -> None:
        self.builder, self.n = builder, n
        self.vt = ir.VectorType(ir.FloatType(), _VLANES)
        self.zero = ir.Constant(self.vt, [0.0] * _VLANES)

    def each(self, body: Any) -> None:
        """``body(at, valid)`` for every step: ``valid`` None for whole vectors, then the lane
        mask (lanes < n) for the partial last one."""
        self.each_split(lambda at, valid, _k: body(at, valid), 1)

    def each_split(self, body: Any, ways: int) -> None:
        """``body(at, valid, k)`` for every step, as ``each``, with ``k`` cycling through
        ``0..ways-1`` over the whole vectors (``ways`` of them per loop turn, then the rest and
        the partial last one with ``k = 0``): a reduction keeps ``ways`` independent sums
        instead of one chain of dependent adds."""
        b, i64 = self.builder, ir.IntType(64)
        step = ir.Constant(i64, _VLANES)
        nfull = b.udiv(self.n, step)
        turns = b.udiv(nfull, ir.Constant(i64, ways))
        with cgutils.for_range(b, turns) as loop:
            base = b.mul(loop.index, ir.Constant(i64, _VLANES * ways))
            for k in range(ways):
                body(b.add(base, ir.Constant(i64, _VLANES * k)), None, k)
        if ways > 1:  # the whole vectors past the last full turn
            done = b.mul(turns, ir.Constant(i64, ways))
            with cgutils.for_range(b, b.sub(nfull, done)) as rest:
                body(b.mul(b.add(done, rest.index), step), None, 0)
        at = b.mul(nfull, step)
        with b.if_then(b.icmp_signed("<", at, self.n)):
            body(at, lanes_below(b, b.sub(self.n, at), _VLANES), 0)

    def _ptr(self, base: ir.Value, off: ir.Value, at: ir.Value) -> ir.Value:
        b = self.builder
        return b.bitcast(b.gep(base, [b.add(off, at)]), self.vt.as_pointer())

    def load(self, base: ir.Value, off: ir.Value, at: ir.Value, valid: ir.Value | None) -> ir.Value:
        """The step at ``base[off + at]`` (masked lanes read as 0)."""
        if valid is None:
            return load_vec(self.builder, self._ptr(base, off, at), self.vt)
        return masked_load(self.builder, self._ptr(base, off, at), self.vt, valid, align=4)

    def store(
        self, v: ir.Value, base: ir.Value, off: ir.Value, at: ir.Value, valid: ir.Value | None
    ) -> None:
        if valid is None:
            store_vec(self.builder, v, self._ptr(base, off, at))
        else:
            masked_store(self.builder, v, self._ptr(base, off, at), valid, align=4)

    def load_bytes(
        self, base: ir.Value, off: ir.Value, at: ir.Value, valid: ir.Value | None
    ) -> ir.Value:
        """The 16 uint8 codes at ``base[off + at]`` (masked lanes read as 0)."""
        b = self.builder
        vb = ir.VectorType(ir.IntType(8), _VLANES)
        ptr = b.gep(base, [b.add(off, at)])
        return load_vec(b, ptr, vb) if valid is None else masked_load(b, ptr, vb, valid)

    def store_bytes(
        self, v: ir.Value, base: ir.Value, off: ir.Value, at: ir.Value, valid: ir.Value | None
    ) -> None:
        b = self.builder
        ptr = b.gep(base, [b.add(off, at)])
        if valid is None:
            store_vec(b, v, ptr)
        else:
            masked_store(b, v, ptr, valid)

    def only(self, valid: ir.Value | None, v: ir.Value, other: ir.Value) -> ir.Value:
        """``v`` in the valid lanes, ``other`` in the masked ones."""
        return v if valid is None else self.builder.select(valid, v, other)


def codes_lanes(builder: ir.IRBuilder, y: ir.Value, inv: ir.Value, zp: ir.Value) -> ir.Value:
    """uint8 lanes of ``y`` quantized as ``quantize_per_tensor`` does:
    ``clamp(rint(fma(y, inv, zp)), 0, 255)``, NaN -> 255 (``inv``/``zp``: float32 splats)."""
    vt = y.type
    lanes = vt.count
    mod = builder.module
    fma = declare(mod, ir.FunctionType(vt, [vt, vt, vt]), f"llvm.fma.v{lanes}f32")
    rint = declare(mod, ir.FunctionType(vt, [vt]), f"llvm.rint.v{lanes}f32")
    zero, top = ir.Constant(vt, [0.0] * lanes), ir.Constant(vt, [255.0] * lanes)
    t = builder.call(fma, [y, inv, zp])
    t = builder.select(builder.fcmp_unordered("uno", t, t), top, builder.call(rint, [t]))
    t = builder.select(builder.fcmp_ordered(">", t, zero), t, zero)
    t = builder.select(builder.fcmp_ordered("<", t, top), t, top)
    return builder.trunc(
        builder.fptoui(t, ir.VectorType(ir.IntType(32), lanes)), ir.VectorType(ir.IntType(8), lanes)
    )


def _hsum(builder: ir.IRBuilder, acc: ir.Value) -> ir.Value:
    """The sum of a vector's lanes by pairwise halves (a short dependency chain, and the
    summation order every caller shares)."""
    i32 = ir.IntType(32)
    width = acc.type.count
    while width > 1:
        width //= 2
        halves = [
            builder.shuffle_vector(
                acc, acc, ir.Constant(ir.VectorType(i32, width), list(range(o, o + width)))
            )
            for o in (0, width)
        ]
        acc = builder.fadd(*halves)
    return builder.extract_element(acc, ir.Constant(i32, 0))


def _softmax_row_codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
    x, xoff, mask, moff, out, ooff, n, scale = args
    x_p = context.make_array(sig.args[0])(context, builder, x).data
    m_p = context.make_array(sig.args[2])(context, builder, mask).data
    o_p = context.make_array(sig.args[4])(context, builder, out).data
    f32 = ir.FloatType()
    row = RowSteps(builder, n)
    vt, zero = row.vt, row.zero
    rmax = declare(
        builder.module, ir.FunctionType(f32, [vt]), f"llvm.vector.reduce.fmax.v{_VLANES}f32"
    )
    minus_inf = ir.Constant(vt, [float("-inf")] * _VLANES)

    def splat(v: ir.Value) -> ir.Value:
        return vec_broadcast(builder, v, _VLANES)

    load, each, only = row.load, row.each, row.only

    def store(v: ir.Value, at: ir.Value, valid: ir.Value | None) -> None:
        row.store(v, o_p, ooff, at, valid)

    # pass 1: v = x * scale + mask (written to out), and the row's max
    scale_v = splat(scale)
    top = stack_slot(builder, minus_inf)

    def first(at: ir.Value, valid: ir.Value | None) -> None:
        v = builder.fadd(builder.fmul(load(x_p, xoff, at, valid), scale_v),
                         load(m_p, moff, at, valid))  # fmt: skip
        store(v, at, valid)
        v = only(valid, v, minus_inf)
        old = builder.load(top)
        builder.store(builder.select(builder.fcmp_ordered(">", v, old), v, old), top)

    each(first)
    top_v = splat(builder.call(rmax, [builder.load(top)]))
    # pass 2: e = exp(v - max) in place, and the row's sum
    total = stack_slot(builder, zero)

    def second(at: ir.Value, valid: ir.Value | None) -> None:
        e = vexp(builder, builder.fsub(load(o_p, ooff, at, valid), top_v))
        store(e, at, valid)
        builder.store(builder.fadd(builder.load(total), only(valid, e, zero)), total)

    each(second)
    s = _hsum(builder, builder.load(total))
    inv_v = splat(builder.fdiv(ir.Constant(f32, 1.0), s))

    # pass 3: normalize
    def third(at: ir.Value, valid: ir.Value | None) -> None:
        store(builder.fmul(load(o_p, ooff, at, valid), inv_v), at, valid)

    each(third)
    return context.get_dummy_value()


@intrinsic
def _softmax_row(
    typingctx: Any, x: Any, xoff: Any, mask: Any, moff: Any, out: Any, ooff: Any, n: Any,
    scale: Any,
) -> Any:  # fmt: skip
    """One row of ``softmax(x * scale + mask)``: ``x[xoff : xoff + n]`` and
    ``mask[moff : moff + n]`` (flat float32) into ``out[ooff : ooff + n]``, 16 floats a vector
    (the last one masked), in three passes: scale, mask and max; ``exp32`` and sum; scale by
    ``1 / sum``."""
    if not (all(map(flat_f32, (x, mask, out))) and scale == types.float32):
        return None
    return types.void(x, xoff, mask, moff, out, ooff, n, scale), _softmax_row_codegen


# layer_norm_row's compile-time flags
LN_RESIDUAL, LN_CODES = 1, 2
# independent partial sums of a LayerNorm row's reductions: one chain of dependent vector adds
# waits 4 cycles an add; four keep the loads busy instead
_LN_WAYS = 4


def _layer_norm_row_codegen(flags: int, codes_in: bool) -> Any:
    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        (x, xoff, xs, xz, r, roff, w, b, out, ooff, n, eps, codes, coff, inv, zp) = args
        aty = sig.args
        x_p, r_p, w_p, b_p, o_p, c_p = (
            context.make_array(aty[i])(context, builder, a).data
            for i, a in ((0, x), (4, r), (6, w), (7, b), (8, out), (12, codes))
        )
        f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
        row = RowSteps(builder, n)
        vt, zero = row.vt, row.zero
        vi = ir.VectorType(i32, _VLANES)
        zero_off = ir.Constant(i64, 0)

        def splat(v: ir.Value) -> ir.Value:
            return vec_broadcast(builder, v, _VLANES)

        def accumulate(slot: ir.Value, v: ir.Value) -> None:
            builder.store(builder.fadd(builder.load(slot), v), slot)

        def summed(slots: list[ir.Value]) -> ir.Value:
            """The lanes of the ``_LN_WAYS`` partial sums (pairwise), then across lanes."""
            parts = [builder.load(slot) for slot in slots]
            while len(parts) > 1:
                parts = [builder.fadd(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
            return _hsum(builder, parts[0])

        # pass 1: h = x (dequantized: xs * (code - xz)) [+ r], written to out; the row's sum
        xs_v, xz_v = splat(xs), splat(builder.trunc(xz, i32))
        totals = [stack_slot(builder, zero) for _ in range(_LN_WAYS)]

        def first(at: ir.Value, valid: ir.Value | None, k: int) -> None:
            if codes_in:
                q = builder.zext(row.load_bytes(x_p, xoff, at, valid), vi)
                h = builder.fmul(xs_v, builder.sitofp(builder.sub(q, xz_v), vt))
            else:
                h = row.load(x_p, xoff, at, valid)
            if flags & LN_RESIDUAL:
                h = builder.fadd(h, row.load(r_p, roff, at, valid))
            row.store(h, o_p, ooff, at, valid)
            accumulate(totals[k], row.only(valid, h, zero))

        row.each_split(first, _LN_WAYS)
        inv_n = builder.fdiv(ir.Constant(f32, 1.0), builder.uitofp(n, f32))
        mean_v = splat(builder.fmul(summed(totals), inv_n))
        # pass 2: the biased variance, sum((h - mean)^2) / n, from the row in cache
        squares = [stack_slot(builder, zero) for _ in range(_LN_WAYS)]

        def second(at: ir.Value, valid: ir.Value | None, k: int) -> None:
            d = builder.fsub(row.load(o_p, ooff, at, valid), mean_v)
            accumulate(squares[k], row.only(valid, builder.fmul(d, d), zero))

        row.each_split(second, _LN_WAYS)
        sqrt = declare(builder.module, ir.FunctionType(f32, [f32]), "llvm.sqrt.f32")
        var = builder.fmul(summed(squares), inv_n)
        rstd_v = splat(
            builder.fdiv(ir.Constant(f32, 1.0), builder.call(sqrt, [builder.fadd(var, eps)]))
        )
        # pass 3: y = (h - mean) * rstd * w + b; its codes as quantize_per_tensor makes them
        inv_v, zp_v = splat(inv), splat(zp)

        def third(at: ir.Value, valid: ir.Value | None) -> None:
            d = builder.fsub(row.load(o_p, ooff, at, valid), mean_v)
            y = builder.fmul(builder.fmul(d, rstd_v), row.load(w_p, zero_off, at, valid))
            y = builder.fadd(y, row.load(b_p, zero_off, at, valid))
            row.store(y, o_p, ooff, at, valid)
            if flags & LN_CODES:
                row.store_bytes(codes_lanes(builder, y, inv_v, zp_v), c_p, coff, at, valid)

        row.each(third)
        return context.get_dummy_value()

    return codegen


@intrinsic
def _layer_norm_row(
    typingctx: Any, flags: Any, x: Any, xoff: Any, xs: Any, xz: Any, r: Any, roff: Any, w: Any,
    b: Any, out: Any, ooff: Any, n: Any, eps: Any, codes: Any, coff: Any, inv: Any, zp: Any,
) -> Any:  # fmt: skip
    """One row of ``LayerNorm``: ``x[xoff : xoff + n]`` (float32, or uint8 codes dequantized
    as ``xs * (code - xz)``) plus, with ``LN_RESIDUAL`` in the literal ``flags``,
    ``r[roff : roff + n]``, into ``out[ooff : ooff + n]``; with ``LN_CODES`` also the result's
    codes ``clamp(rint(fma(y, inv, zp)), 0, 255)`` (NaN -> 255) into ``codes[coff :]``.
    16 floats a vector (the last one masked), three passes over the row: the sum; the squared
    deviations; normalize (and quantize). Sums run lane-wise then by pairwise halves."""
    if not isinstance(flags, types.IntegerLiteral):
        return None
    codes_in = isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.uint8
    byte_arrays = ((x,) if codes_in else ()) + (codes,)
    floats = (r, w, b, out) if codes_in else (x, r, w, b, out)
    if not (
        all(map(flat_u8, byte_arrays))
        and all(map(flat_f32, floats))
        and eps == xs == inv == zp == types.float32
    ):
        return None
    inner = _layer_norm_row_codegen(flags.literal_value, codes_in)
    args = (x, xoff, xs, xz, r, roff, w, b, out, ooff, n, eps, codes, coff, inv, zp)

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, cargs: Any) -> ir.Value:
        return inner(context, builder, types.void(*sig.args[1:]), cargs[1:])

    return types.void(flags, *args), codegen


def _scaled_row_codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
    x, xoff, scale, out, ooff, n, inv, zp = args
    x_p = context.make_array(sig.args[0])(context, builder, x).data
    o_p = context.make_array(sig.args[3])(context, builder, out).data
    codes = sig.args[3].dtype == types.uint8
    row = RowSteps(builder, n)
    scale_v, inv_v, zp_v = (vec_broadcast(builder, v, _VLANES) for v in (scale, inv, zp))

    def step(at: ir.Value, valid: ir.Value | None) -> None:
        y = builder.fmul(row.load(x_p, xoff, at, valid), scale_v)
        if codes:
            row.store_bytes(codes_lanes(builder, y, inv_v, zp_v), o_p, ooff, at, valid)
        else:
            row.store(y, o_p, ooff, at, valid)

    row.each(step)
    return context.get_dummy_value()


@intrinsic
def _scaled_row(
    typingctx: Any, x: Any, xoff: Any, scale: Any, out: Any, ooff: Any, n: Any, inv: Any, zp: Any
) -> Any:
    """``y = x[xoff + j] * scale`` for ``j < n``, 16 floats a vector, into ``out[ooff + j]``:
    as float32, or (a uint8 ``out``) as the codes ``quantize_per_tensor`` makes with
    ``1 / scale = inv`` and zero point ``zp``."""
    codes = isinstance(out, types.Array) and out.ndim == 1 and out.dtype == types.uint8
    if not (flat_f32(x) and ((codes and out.layout == "C") or flat_f32(out))):
        return None
    if not scale == inv == zp == types.float32:
        return None
    return types.void(x, xoff, scale, out, ooff, n, inv, zp), _scaled_row_codegen


def flat_f32(t: Any) -> bool:
    """A C-contiguous 1-D float32 array type: what the IR vectors read and write."""
    return (
        isinstance(t, types.Array) and t.ndim == 1 and t.layout == "C" and t.dtype == types.float32
    )


def flat_u8(t: Any) -> bool:
    """A C-contiguous 1-D uint8 array type (codes the IR vectors read or write)."""
    return isinstance(t, types.Array) and t.ndim == 1 and t.layout == "C" and t.dtype == types.uint8


if TYPE_CHECKING:

    def softmax_row(
        x: Any, xoff: int, mask: Any, moff: int, out: Any, ooff: int, n: int, scale: float
    ) -> None:
        """See ``_softmax_row`` (numba code only)."""

    def gelu_vectors(mode: int, x: Any, xoff: int, out: Any, ooff: int, n: int) -> int:
        """See ``_gelu_vectors`` (numba code only)."""

    def scaled_row(
        x: Any, xoff: int, scale: float, out: Any, ooff: int, n: int, inv: float, zp: float
    ) -> None:
        """See ``_scaled_row`` (numba code only)."""

    def layer_norm_row(
        flags: int, x: Any, xoff: int, xs: float, xz: int, r: Any, roff: int, w: Any, b: Any,
        out: Any, ooff: int, n: int, eps: float, codes: Any, coff: int, inv: float, zp: float,
    ) -> None:  # fmt: skip
        """See ``_layer_norm_row`` (numba code only)."""

else:
    gelu_vectors = _gelu_vectors
    softmax_row = _softmax_row
    layer_norm_row = _layer_norm_row
    scaled_row = _scaled_row


ACTIVATIONS = {"none": ACT_NONE, "relu": ACT_RELU, "gelu": ACT_GELU, "gelu_tanh": ACT_GELU_TANH}
