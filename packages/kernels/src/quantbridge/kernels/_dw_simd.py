"""Depthwise conv micro-kernels in LLVM IR: 8 or 16 float32 channel lanes, exact sums.

Input and output are flat channels-last (NHWC) uint8; a vector holds one pixel's 8 (a ymm
register) or 16 (a zmm register, AVX-512 CPUs) consecutive channels. Two kernels, both ending
in the one requantizing epilogue (``_emit_requant``):

- ``dw_block(kind, ...)``: ``P`` output pixels of one output row x 8 or 16 channels, all taps in
  bounds (interior pixels). ``kind`` (a compile-time constant, ``BLOCK_KINDS``) fixes the
  vector width, the kernel width ``KW``, the stride along W ``SW`` and ``P``; kernel height and
  the H dilation are runtime values. Register blocking along W: each input vector of a kernel
  row is loaded and converted once and feeds every (pixel, tap) pair that reads it (for 3x3
  stride 1, 10 input vectors feed 24 multiply-adds), with the row's ``KW`` weight vectors held
  in registers.
  Accumulates ``sum x * w``; the caller's ``corr = x_zp * sum(w)`` is subtracted once.
- ``dw_taps(...)``: one pixel x ``nch <= 8`` channels over an explicit tap list (offsets and
  weight rows): border pixels with their in-bounds taps only (so no zero-point-padded copy of
  the input is needed), channel tails (masked loads and stores) and kernels without a
  specialized block. Accumulates ``sum (x - x_zp) * w``.

Why float32 and not int32 lanes: every product is an integer of magnitude <= 255 * 255 and a
sum has at most 256 taps (``MAX_TAPS``), so every partial sum is an integer below 2**24 and
float32 represents it exactly: ``llvm.fmuladd`` (one FMA on this CPU, or a multiply and an add
elsewhere, the same exact value either way) gives 8 multiply-adds per instruction with
no widening multiply, where AVX2 has no int32 multiply-add (``vpmulld`` is slow and
``vpmaddwd`` needs taps interleaved in pairs). Both kernels' sums are the integer the GEMM
computes, ``sum (x - x_zp) * (w - w_zp)``, so the requantization matches conv2d's bit for bit.

Epilogue (the rule of ``_requant.py``), per channel lane:
``clamp(rint(((v - corr) + biasq) * mult) + out_zp, qmin, qmax)``, upper bound last (a
clamp-table activation narrows ``[qmin, qmax]``, ``_epilogue_lut.py``).

Both kernels take their weights and constants as one ``DwWeights`` record and the output rule
as one ``DwOutput`` record (NamedTuples: numba passes them as their fields), made once per
call plan (``_conv._depthwise_plan``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from quantbridge.kernels._ir import (
    F32T,
    I8,
    I64,
    arrays_data,
    clamp_round_splats,
    declare,
    load_vec,
    masked_load,
    masked_store,
    record_fields,
    rint_clamp_codes,
    stack_slot,
    store_vec,
    vec_broadcast,
)

LANES = 8  # channels per vector: 8 float32 lanes fill a ymm register
WIDE_LANES = 16  # the block kernels' zmm form (AVX-512: twice the multiply-adds per FMA)

# (kernel width, stride along W) -> the two block sizes (output pixels per block) of its
# interior kernels; a one-pixel kind of each finishes short runs. Accumulators + one kernel
# row's weights + an input vector stay within 16 ymm registers. Measured on this Zen 3 against
# the earlier (6 | 4)-pixel blocks with one-pixel row tails (kernels DESIGN.md, "Depthwise convs"):
# 8 / 4 pixels for 3x3 stride 1, 7 / 3 for the rest (widths 7, 14, 28, 56 and 112 divide by 7).
# The 16-lane kinds have the same block sizes (32 zmm registers leave room to spare).
BLOCK_PIXELS = {(3, 1): (8, 4), (3, 2): (7, 3), (5, 1): (7, 3), (5, 2): (7, 3)}
BLOCK_KINDS: list[tuple[int, int, int, int]] = [
    (lanes, kw, sw, p)
    for lanes in (LANES, WIDE_LANES)
    for (kw, sw), sizes in BLOCK_PIXELS.items()
    for p in (*sizes, 1)
]
KIND_IDS = {kind: i for i, kind in enumerate(BLOCK_KINDS)}


class DwWeights(NamedTuple):
    """The float kernels' weights and requantization constants, ``cp`` (channels rounded up
    to ``LANES``) per tap: vector loads stay inside."""

    w: npt.NDArray[np.float32]  # [taps, cp]: w - w_zp
    cp: int
    corr: npt.NDArray[np.float32]  # [cp]: x_zp * sum(w - w_zp), subtracted by dw_block
    biasq: npt.NDArray[np.float32]  # [cp], the rule of _requant.py
    mult: npt.NDArray[np.float32]  # [cp]


class DwOutput(NamedTuple):
    """How sums become output codes: the zero point and clamp range the kernels apply, then
    ``lut`` (uint8[256], a fused activation; empty: none), which the drivers apply per row."""

    zero_point: int
    qmin: int
    qmax: int
    lut: npt.NDArray[np.uint8]


OUT_RULE = ("zero_point", "qmin", "qmax")  # the DwOutput fields the kernels read


def _vf(lanes: int) -> ir.VectorType:
    return ir.VectorType(F32T, lanes)


def _vb(lanes: int) -> ir.VectorType:
    return ir.VectorType(I8, lanes)


_VMASK = ir.VectorType(ir.IntType(1), LANES)


def _fmuladd(builder: ir.IRBuilder, lanes: int) -> ir.Function:
    vf = _vf(lanes)
    fnty = ir.FunctionType(vf, [vf, vf, vf])
    return declare(builder.module, fnty, f"llvm.fmuladd.v{lanes}f32")


def _load_u8(
    builder: ir.IRBuilder, ptr: ir.Value, mask: ir.Value | None, lanes: int = LANES
) -> ir.Value:
    """``lanes`` channels' codes as float32 lanes (masked lanes read as 0, never touch memory;
    masks are 8-lane only)."""
    if mask is None:
        raw = load_vec(builder, ptr, _vb(lanes))
    else:
        raw = masked_load(builder, ptr, _vb(LANES), mask)
    return builder.uitofp(raw, _vf(lanes))


def _store_u8(builder: ir.IRBuilder, value: ir.Value, ptr: ir.Value, mask: ir.Value | None) -> None:
    if mask is None:
        store_vec(builder, value, ptr)
    else:
        masked_store(builder, value, ptr, mask)


def _emit_requant(
    builder: ir.IRBuilder,
    v: ir.Value,
    corr: ir.Value | None,
    biasq: ir.Value,
    mult: ir.Value,
    lo: ir.Value,
    hi: ir.Value,
    zp_bits: ir.Value,
) -> ir.Value:
    """THE depthwise epilogue: float32 sums of 8 / 16 channels -> uint8 codes (``_requant.py``);
    ``lo``/``hi``/``zp_bits`` from ``_epilogue_vectors`` (``_ir.rint_clamp_codes``)."""
    lanes = v.type.count
    if corr is not None:
        v = builder.fsub(v, corr)
    t = builder.fmul(builder.fadd(v, biasq), mult)
    return builder.trunc(rint_clamp_codes(builder, t, lo, hi, zp_bits), _vb(lanes))


def _epilogue_vectors(
    builder: ir.IRBuilder,
    bq_p: ir.Value,
    mu_p: ir.Value,
    c0: ir.Value,
    ozp: ir.Value,
    qmin: ir.Value,
    qmax: ir.Value,
    lanes: int = LANES,
) -> tuple[ir.Value, ir.Value, ir.Value, ir.Value, ir.Value]:
    vf = _vf(lanes)
    bq = load_vec(builder, builder.gep(bq_p, [c0]), vf)
    mu = load_vec(builder, builder.gep(mu_p, [c0]), vf)
    return (bq, mu, *clamp_round_splats(builder, ozp, qmin, qmax, lanes))


def _make_block(lanes: int, kw: int, sw: int, pix: int) -> Any:
    """IR codegen of one ``pix`` x ``lanes`` interior block for kernel width ``kw``, stride
    ``sw``."""
    ncols = (pix - 1) * sw + kw  # input vectors per kernel row
    vf = _vf(lanes)

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        _x, xbase, rowstep, c, kh, weights, c0, output, _out, obase = args
        x_p, o_p = arrays_data(context, builder, sig, args, (0, 8))
        w_p, cp, co_p, bq_p, mu_p = record_fields(
            context, builder, sig.args[5], weights, ("w", "cp", "corr", "biasq", "mult")
        )
        ozp, qmin, qmax = record_fields(context, builder, sig.args[7], output, OUT_RULE)
        fma = _fmuladd(builder, lanes)
        accs = [stack_slot(builder, ir.Constant(vf, [0.0] * lanes)) for _ in range(pix)]
        with cgutils.for_range(builder, kh) as loop:
            i = loop.index
            xrow = builder.add(xbase, builder.mul(i, rowstep))
            wrow = builder.add(builder.mul(builder.mul(i, ir.Constant(I64, kw)), cp), c0)
            wv = [
                load_vec(
                    builder,
                    builder.gep(w_p, [builder.add(wrow, builder.mul(ir.Constant(I64, j), cp))]),
                    vf,
                )
                for j in range(kw)
            ]
            cur = [builder.load(a) for a in accs]
            for q in range(ncols):
                ptr = builder.gep(x_p, [builder.add(xrow, builder.mul(ir.Constant(I64, q), c))])
                xv = _load_u8(builder, ptr, None, lanes)
                for p in range(pix):
                    j = q - p * sw
                    if 0 <= j < kw:
                        cur[p] = builder.call(fma, [xv, wv[j], cur[p]])
            for a, v in zip(accs, cur, strict=True):
                builder.store(v, a)
        bq, mu, lo, hi, zp_bits = _epilogue_vectors(builder, bq_p, mu_p, c0, ozp, qmin, qmax, lanes)
        co = load_vec(builder, builder.gep(co_p, [c0]), vf)
        for p in range(pix):
            q8 = _emit_requant(builder, builder.load(accs[p]), co, bq, mu, lo, hi, zp_bits)
            optr = builder.gep(o_p, [builder.add(obase, builder.mul(ir.Constant(I64, p), c))])
            _store_u8(builder, q8, optr, None)
        return context.get_dummy_value()

    return codegen


_BLOCK_CODEGENS = [_make_block(*kind) for kind in BLOCK_KINDS]


def _dw_block(
    typingctx: Any,
    kind: Any,
    x: Any,
    xbase: Any,
    rowstep: Any,
    c: Any,
    kh: Any,
    weights: Any,
    c0: Any,
    output: Any,
    out: Any,
    obase: Any,
) -> Any:
    """``dw_block(KIND_IDS[(lanes, kw, sw, pixels)], x, xbase, rowstep, c, kh, weights, c0,
    output, out, obase)``, ``weights`` a ``DwWeights`` and ``output`` a ``DwOutput``.

    Pixel ``p``'s tap ``(i, j)`` reads ``x[xbase + i * rowstep + (p * sw + j) * c + 0..L-1]``
    and weights ``weights.w[(i * kw + j) * cp + c0 + 0..L-1]``; it writes ``out[obase + p * c +
    0..L-1]``, ``L = lanes``.
    ``corr``, ``biasq``, ``mult`` are read at ``c0``. All int arguments are int64.
    """
    if not isinstance(kind, types.IntegerLiteral):
        return None  # numba retries with the literal type when the value is a constant
    inner = (x, xbase, rowstep, c, kh, weights, c0, output, out, obase)
    inner_sig = types.void(*inner)
    inner_codegen = _BLOCK_CODEGENS[kind.literal_value]

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, cargs: Any) -> ir.Value:
        return inner_codegen(context, builder, inner_sig, cargs[1:])

    return types.void(kind, *inner), codegen


# typed Any: callers pass the 11 arguments, not numba's typing context
dw_block: Any = intrinsic(_dw_block)


def _emit_taps(
    context: Any, builder: ir.IRBuilder, sig: Any, args: Any, masked: bool, nch: ir.Value
) -> None:
    _x, xbase, _toffs, _twidx, ntaps, weights, c0, zpf, output, _out, obase = args[:11]
    x_p, to_p, tw_p, o_p = arrays_data(context, builder, sig, args, (0, 2, 3, 9))
    w_p, cp, bq_p, mu_p = record_fields(
        context, builder, sig.args[5], weights, ("w", "cp", "biasq", "mult")
    )
    ozp, qmin, qmax = record_fields(context, builder, sig.args[8], output, OUT_RULE)
    mask = None
    if masked:
        lane = ir.Constant(ir.VectorType(I64, LANES), list(range(LANES)))
        mask = builder.icmp_signed("<", lane, vec_broadcast(builder, nch, LANES))
    fma = _fmuladd(builder, LANES)
    vf = _vf(LANES)
    zpv = vec_broadcast(builder, builder.fptrunc(zpf, F32T) if zpf.type != F32T else zpf, LANES)
    acc = stack_slot(builder, ir.Constant(vf, [0.0] * LANES))
    with cgutils.for_range(builder, ntaps) as loop:
        t = loop.index
        off = builder.load(builder.gep(to_p, [t]))
        wi = builder.load(builder.gep(tw_p, [t]))
        xv = _load_u8(builder, builder.gep(x_p, [builder.add(xbase, off)]), mask)
        wv = load_vec(builder, builder.gep(w_p, [builder.add(builder.mul(wi, cp), c0)]), vf)
        builder.store(builder.call(fma, [builder.fsub(xv, zpv), wv, builder.load(acc)]), acc)
    bq, mu, lo, hi, zp_bits = _epilogue_vectors(builder, bq_p, mu_p, c0, ozp, qmin, qmax)
    q8 = _emit_requant(builder, builder.load(acc), None, bq, mu, lo, hi, zp_bits)
    _store_u8(builder, q8, builder.gep(o_p, [obase]), mask)


def _dw_taps(
    typingctx: Any,
    x: Any,
    xbase: Any,
    toffs: Any,
    twidx: Any,
    ntaps: Any,
    weights: Any,
    c0: Any,
    zpf: Any,
    output: Any,
    out: Any,
    obase: Any,
    nch: Any,
) -> Any:
    """One output pixel x ``nch`` (1..8) channels over ``ntaps`` listed taps, ``weights`` a
    ``DwWeights`` and ``output`` a ``DwOutput``.

    Tap ``t`` reads ``x[xbase + toffs[t] + 0..nch-1]`` and weights ``weights.w[twidx[t] * cp +
    c0 + 0..7]``; the result goes to ``out[obase + 0..nch-1]``. ``zpf`` is the input zero point
    as a float. Lanes past ``nch`` neither read nor write ``x``/``out``. All ints are int64.
    """
    sig = types.void(x, xbase, toffs, twidx, ntaps, weights, c0, zpf, output, out, obase, nch)

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        nch = args[11]
        full = builder.icmp_signed(">=", nch, ir.Constant(I64, LANES))
        with builder.if_else(full, likely=True) as (then, otherwise):
            with then:
                _emit_taps(context, builder, sig, args, False, nch)
            with otherwise:
                _emit_taps(context, builder, sig, args, True, nch)
        return context.get_dummy_value()

    return sig, codegen


# typed Any: callers pass the 12 arguments, not numba's typing context
dw_taps: Any = intrinsic(_dw_taps)
