"""LLVM IR building blocks shared by the int8 micro-kernels of every SIMD target."""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils

I8 = ir.IntType(8)
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
F32T = ir.FloatType()


def declare(module: ir.Module, fnty: ir.FunctionType, name: str) -> ir.Function:
    """Declare (once) an LLVM intrinsic in ``module``."""
    return cgutils.get_or_insert_function(module, fnty, name)  # type: ignore[no-untyped-call]


def array_data(context: Any, builder: ir.IRBuilder, ty: Any, value: ir.Value) -> ir.Value:
    """The data pointer of a numba array argument ``value`` of numba type ``ty``."""
    return context.make_array(ty)(context, builder, value).data


def record_fields(
    context: Any, builder: ir.IRBuilder, ty: Any, value: ir.Value, names: tuple[str, ...]
) -> list[ir.Value]:
    """The fields ``names`` of a record argument (a NamedTuple of numba type ``ty``) of an
    intrinsic; array fields as their data pointers."""
    fields = []
    for name in names:
        i = ty.fields.index(name)
        field = builder.extract_value(value, i)
        if isinstance(ty.types[i], types.Array):
            field = array_data(context, builder, ty.types[i], field)
        fields.append(field)
    return fields


def arrays_data(
    context: Any, builder: ir.IRBuilder, sig: Any, args: Any, indices: tuple[int, ...]
) -> list[ir.Value]:
    """The data pointers of the array arguments at ``indices`` of an intrinsic's
    ``(sig, args)``."""
    return [array_data(context, builder, sig.args[i], args[i]) for i in indices]


def stack_slot(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """An entry-block stack slot; LLVM promotes these accumulators to registers."""
    return cgutils.alloca_once_value(builder, value)  # type: ignore[no-untyped-call]


def vec_broadcast(builder: ir.IRBuilder, scalar: ir.Value, lanes: int) -> ir.Value:
    vt = ir.VectorType(scalar.type, lanes)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), scalar, ir.Constant(I32, 0))
    mask = ir.Constant(ir.VectorType(I32, lanes), [0] * lanes)
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), mask)


def load_vec(builder: ir.IRBuilder, ptr: ir.Value, vt: ir.VectorType) -> ir.Value:
    v = builder.load(builder.bitcast(ptr, vt.as_pointer()))
    v.align = 1
    return v


def store_vec(builder: ir.IRBuilder, value: ir.Value, ptr: ir.Value) -> None:
    st = builder.store(value, builder.bitcast(ptr, value.type.as_pointer()))
    st.align = 1


def _suffix(vt: ir.VectorType) -> str:
    elem = "f32" if isinstance(vt.element, ir.FloatType) else f"i{vt.element.width}"
    return f"v{vt.count}{elem}.p0v{vt.count}{elem}"


def masked_load(
    builder: ir.IRBuilder, ptr: ir.Value, vt: ir.VectorType, mask: ir.Value, align: int = 1
) -> ir.Value:
    """The lanes of ``vt`` at ``ptr`` where ``mask`` (``<count x i1>``) is set, zero elsewhere;
    masked-off lanes never touch memory (they may lie past an array's end). ``align``: the
    alignment LLVM may assume, in bytes."""
    vmask = ir.VectorType(ir.IntType(1), vt.count)
    fn = declare(builder.module, ir.FunctionType(vt, [vt.as_pointer(), I32, vmask, vt]),
                 f"llvm.masked.load.{_suffix(vt)}")  # fmt: skip
    zero = ir.Constant(vt, [0.0 if isinstance(vt.element, ir.FloatType) else 0] * vt.count)
    ptr = builder.bitcast(ptr, vt.as_pointer())
    return builder.call(fn, [ptr, ir.Constant(I32, align), mask, zero])


def masked_store(
    builder: ir.IRBuilder, value: ir.Value, ptr: ir.Value, mask: ir.Value, align: int = 1
) -> None:
    """Store the lanes of ``value`` where ``mask`` is set; the others' memory is untouched."""
    vt = value.type
    vmask = ir.VectorType(ir.IntType(1), vt.count)
    fn = declare(builder.module, ir.FunctionType(ir.VoidType(), [vt, vt.as_pointer(), I32, vmask]),
                 f"llvm.masked.store.{_suffix(vt)}")  # fmt: skip
    ptr = builder.bitcast(ptr, vt.as_pointer())
    builder.call(fn, [value, ptr, ir.Constant(I32, align), mask])


def lanes_below(builder: ir.IRBuilder, count: ir.Value, lanes: int) -> ir.Value:
    """``<lanes x i1>``: lane l set when ``l < count`` (an i64; any value, negative included)."""
    clamped = builder.select(
        builder.icmp_signed("<", count, ir.Constant(I64, 0)), ir.Constant(I64, 0), count
    )
    clamped = builder.select(
        builder.icmp_signed(">", clamped, ir.Constant(I64, lanes)), ir.Constant(I64, lanes), clamped
    )
    iota = ir.Constant(ir.VectorType(I32, lanes), list(range(lanes)))
    return builder.icmp_signed(
        "<", iota, vec_broadcast(builder, builder.trunc(clamped, I32), lanes)
    )


# 1.5 * 2**23: a float32 t with |t| < 2**22, plus this, lands in [2**23, 2**24) where the float
# spacing is 1, so the addition rounds t to an integer (ties to even, as rint) and leaves that
# integer in the low mantissa bits: bits(t + MAGIC) = MAGIC_BITS + rint(t)
ROUND_MAGIC = 12582912.0
ROUND_MAGIC_BITS = 0x4B400000


def clamp_round_splats(
    builder: ir.IRBuilder, zp: ir.Value, qmin: ir.Value, qmax: ir.Value, lanes: int
) -> tuple[ir.Value, ir.Value, ir.Value]:
    """Splats for ``rint_clamp_codes`` from int64 ``zp``, ``qmin``, ``qmax``: the float bounds
    ``qmin - zp`` / ``qmax - zp`` and the int32 ``MAGIC_BITS - zp``."""
    zp32 = builder.trunc(zp, I32)
    lo = builder.sitofp(builder.sub(builder.trunc(qmin, I32), zp32), F32T)
    hi = builder.sitofp(builder.sub(builder.trunc(qmax, I32), zp32), F32T)
    bits = builder.sub(ir.Constant(I32, ROUND_MAGIC_BITS), zp32)
    return (
        vec_broadcast(builder, lo, lanes),
        vec_broadcast(builder, hi, lanes),
        vec_broadcast(builder, bits, lanes),
    )


def rint_clamp_codes(
    builder: ir.IRBuilder, t: ir.Value, lo: ir.Value, hi: ir.Value, zp_bits: ir.Value
) -> ir.Value:
    """int32 lanes ``clamp(rint(t) + zp, qmin, qmax)`` from float32 lanes ``t`` (NaN -> qmin).

    Clamping first to the integral ``[qmin - zp, qmax - zp]`` gives the same integers (rint is
    monotone and keeps integers), bounds ``|t|`` below 2**22 for the magic-number rounding, and
    replaces a round, an add and a float-to-int conversion by one float add and one int
    subtract. ``lo``/``hi``/``zp_bits`` come from ``clamp_round_splats``.
    """
    t = _clamp(builder, t, lo, hi)
    lanes = t.type.count
    magic = ir.Constant(t.type, [ROUND_MAGIC] * lanes)
    bits = builder.bitcast(builder.fadd(t, magic), ir.VectorType(I32, lanes))
    return builder.sub(bits, zp_bits)


# rint(t) for t up to this bound; anything above saturates to code 255 the same way
_SATURATE_ABOVE = 65536.0


def rint_codes_avx512(builder: ir.IRBuilder, t: ir.Value, zp: ir.Value) -> ir.Value:
    """int32 lanes ``rint(t) + zp`` for 16 float32 lanes, unclamped, for ``pack_codes_avx512``
    (whose saturation is the clamp to [0, 255]). ``zp``: int32 lanes in [0, 255].

    One ``vcvtps2dq`` rounding to nearest even, whatever MXCSR says. Lanes above 2**16 are
    first lowered to 2**16 (still saturating to 255); NaN stays NaN and converts to INT_MIN,
    code 0, as ``rint_clamp_codes`` gives qmin = 0."""
    vt = t.type
    bound = ir.Constant(vt, [_SATURATE_ABOVE] * vt.count)
    t = builder.select(builder.fcmp_ordered("<", bound, t), bound, t)  # vminps: NaN kept
    vi32 = ir.VectorType(I32, vt.count)
    cvt = declare(builder.module, ir.FunctionType(vi32, [vt, vi32, ir.IntType(16), I32]),
                  "llvm.x86.avx512.mask.cvtps2dq.512")  # fmt: skip
    # rounding 8: to nearest even, exceptions suppressed
    every_lane = ir.Constant(ir.IntType(16), -1)
    rounded = builder.call(
        cvt, [t, ir.Constant(vi32, [0] * vt.count), every_lane, ir.Constant(I32, 8)]
    )
    return builder.add(rounded, zp)


def pack_codes_avx512(builder: ir.IRBuilder, codes: list[ir.Value]) -> ir.Value:
    """Two or four vectors of 16 int32 codes as 16 x len(codes) bytes in lane order, each
    clamped to [0, 255] by the saturating packs (``vpackssdw``, ``vpackuswb``; one ``vpermd``
    puts the 4-byte groups back in order). Two 1-uop packs and a permute for four vectors,
    where truncating each takes two uops and a store of its own."""
    v16i32 = ir.VectorType(I32, 16)
    v32i16 = ir.VectorType(I16, 32)
    v64i8 = ir.VectorType(I8, 64)
    pack_dw = declare(builder.module, ir.FunctionType(v32i16, [v16i32, v16i32]),
                      "llvm.x86.avx512.packssdw.512")  # fmt: skip
    pack_wb = declare(builder.module, ir.FunctionType(v64i8, [v32i16, v32i16]),
                      "llvm.x86.avx512.packuswb.512")  # fmt: skip
    n = len(codes)
    if n not in (2, 4):
        raise ValueError(f"pack_codes_avx512 packs 2 or 4 vectors, not {n}")
    a, b, c, d = (codes * 2)[:4]
    # per 128-bit lane L the packs leave dword 4L + v = vector v's codes 4L .. 4L + 3
    low = builder.call(pack_dw, [a, b])
    high = low if n < 4 else builder.call(pack_dw, [c, d])
    both = builder.bitcast(builder.call(pack_wb, [low, high]), v16i32)
    order = [4 * group + v for v in range(n) for group in range(4)]
    picked = builder.shuffle_vector(
        both, ir.Constant(v16i32, ir.Undefined), ir.Constant(ir.VectorType(I32, 4 * n), order)
    )
    return builder.bitcast(picked, ir.VectorType(I8, 16 * n))


def rint_clamp_float(
    builder: ir.IRBuilder, t: ir.Value, lo: ir.Value, hi: ir.Value, magic_minus_zp: ir.Value
) -> ir.Value:
    """``rint_clamp_codes`` as float lanes (integral values), for a kernel that goes on
    computing in float: ``(clamp(t, lo, hi) + MAGIC) - (MAGIC - zp)``, both steps exact.
    ``magic_minus_zp`` holds the float ``ROUND_MAGIC - zp``."""
    t = _clamp(builder, t, lo, hi)
    magic = ir.Constant(t.type, [ROUND_MAGIC] * t.type.count)
    return builder.fsub(builder.fadd(t, magic), magic_minus_zp)


def _clamp(builder: ir.IRBuilder, t: ir.Value, lo: ir.Value, hi: ir.Value) -> ir.Value:
    """``t > lo ? t : lo`` (NaN -> lo), then ``hi < t ? hi : t``: one max and one min
    instruction on x86."""
    t = builder.select(builder.fcmp_ordered(">", t, lo), t, lo)
    return builder.select(builder.fcmp_ordered("<", hi, t), hi, t)
