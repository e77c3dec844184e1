"""Depthwise conv interior blocks with ``vpdpbusd``: 64 channels per input load, exact int32 sums.

One ``vpdpbusd`` lane sums the products of four neighbouring bytes. Loaded straight from
channels-last input, the four bytes of lane ``l`` are channels ``4l .. 4l+3`` of one pixel, so a
tap runs four ``vpdpbusd`` against four weight vectors, vector ``b`` holding the weight of
channel ``4l + b`` in byte ``b`` of lane ``l`` and zeros in the other three: accumulator ``b``
sums channel ``4l + b`` alone. Against the float kernels of ``_dw_simd.py``, the 64 input bytes
are used as loaded (those widen and convert every 16 channels, two instructions on the same
ports as the multiply-adds), and each instruction still does one multiply-add per channel.

``dw64_block(kind, ...)`` computes ``P`` interior output pixels (every tap inside the input) of
one output row x 64 channels, register-blocked along W as the float blocks are: each input
vector of a kernel row is loaded once and feeds every (pixel, tap) pair that reads it, and the
row's ``4 * KW`` weight vectors stay in registers. The sums start at ``-x_zp * sum(w)`` (the
caller's ``acc0``), so they end as the GEMM's integer ``sum (x - x_zp) * (w - w_zp)``; the
weights ``w - w_zp`` must fit int8 (the caller checks; other convs keep the float kernels).

Epilogue: the rule of ``_requant.py`` per lane, with ``biasq``, ``mult`` and ``acc0`` stored in
the accumulators' channel order (``permuted_order``), the same float32 steps as the float
kernels, so the bytes are equal. Rounding leaves each code in the low byte of its lane
(``_ir.rint_clamp_codes`` without its zero-point subtraction); two levels of byte shuffles put
the four vectors' codes back in channel order, one byte add applies the zero point (exact mod
256: every code is in [0, 255]) and one 64-byte store writes them.

Both kernels take their weights and constants as one ``Dw64Weights`` record and the output
rule as the float kernels' ``DwOutput``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from quantbridge.kernels._dw_simd import OUT_RULE
from quantbridge.kernels._ir import (
    F32T,
    I8,
    I32,
    I64,
    arrays_data,
    clamp_round_splats,
    load_vec,
    record_fields,
    rint_clamp_codes,
    stack_slot,
    store_vec,
    vec_broadcast,
)
from quantbridge.kernels._vnni import declare_dot

CHANNELS = 64  # channels per block: one 64-byte input load
_LANES = 16  # int32 lanes of a zmm register
_SPLIT = 4  # accumulators per 64 channels (bytes per vpdpbusd lane)

# (kernel width, stride along W) -> (big, small) pixels per block; a one-pixel kind finishes
# short runs. 4 x P accumulators and 4 x KW weight vectors share the 32 zmm registers.
BLOCK_PIXELS = {(3, 1): (4, 2), (3, 2): (4, 2), (5, 1): (2, 1), (5, 2): (2, 1)}
# 32 channels at stride 1: one 64-byte load holds GROUPS[c] neighbouring pixels, which are
# also the input of as many neighbouring output pixels at each tap, so a vector of the kernels
# above carries that many pixels (weights and constants repeated per pixel). One thread,
# interior of 112x112, against the float kernels: 32 channels 1.13-1.25x faster; 16 channels
# (4 pixels a vector) 1.01-1.07x with 3x3 and 0.90x with 5x5, so they keep the float kernels
GROUPS = {32: 2}
BLOCK_KINDS: list[tuple[int, int, int, int]] = sorted(
    {(kw, sw, p, 1) for (kw, sw), sizes in BLOCK_PIXELS.items() for p in (*sizes, 1)}
    | {
        (kw, 1, p, g)
        for (kw, sw), sizes in BLOCK_PIXELS.items()
        if sw == 1
        for p in (*sizes, 1)
        for g in GROUPS.values()
    }
)
KIND_IDS = {kind: i for i, kind in enumerate(BLOCK_KINDS)}


class Dw64Weights(NamedTuple):
    """The 64-channel kernels' operands: channels ``0..channels-1`` (0: none; a multiple of
    64) run them, ``group`` pixels a vector (``GROUPS``: then ``channels`` is 64). ``acc0``,
    ``biasq`` and ``mult`` are in ``permuted_order``, repeated per pixel of a vector."""

    channels: int
    group: int
    w: npt.NDArray[np.int8]  # split_weights, flat: a tap every cp4 bytes
    cp4: int
    acc0: npt.NDArray[np.int32]  # -x_zp * sum(w - w_zp): where the sums start
    biasq: npt.NDArray[np.float32]
    mult: npt.NDArray[np.float32]


_VI32 = ir.VectorType(I32, _LANES)
_VF32 = ir.VectorType(F32T, _LANES)
_VB = ir.VectorType(I8, CHANNELS)


def permuted_order(cp: int) -> npt.NDArray[np.int64]:
    """Channel held by each position of the accumulators' order, for ``cp`` (a multiple of 64)
    channels: position ``64k + 16b + l`` holds channel ``64k + 4l + b``."""
    k, b, lane = np.meshgrid(
        np.arange(cp // CHANNELS), np.arange(_SPLIT), np.arange(_LANES), indexing="ij"
    )
    return (k * CHANNELS + lane * _SPLIT + b).reshape(-1)


def split_weights(w: npt.NDArray[np.int32]) -> npt.NDArray[np.int8]:
    """``[taps, cp]`` int weights (``cp`` a multiple of 64, values in int8) -> the kernels'
    ``[taps, cp * 4]`` int8: per tap and 64-channel block, 4 vectors of 64 bytes, vector ``b``
    holding channel ``4l + b``'s weight in byte ``4l + b`` and zeros elsewhere."""
    taps, cp = w.shape
    out = np.zeros((taps, cp // CHANNELS, _SPLIT, CHANNELS), np.int8)
    blocks = w.reshape(taps, cp // CHANNELS, CHANNELS).astype(np.int8)
    for b in range(_SPLIT):
        out[:, :, b, b::_SPLIT] = blocks[:, :, b::_SPLIT]
    return out.reshape(taps, cp * _SPLIT)


def _split_vectors(
    builder: ir.IRBuilder, p: ir.Value, c0: ir.Value, vt: ir.VectorType
) -> list[ir.Value]:
    """The four accumulators' vectors of a per-channel constant (``acc0``, ``biasq``,
    ``mult``, in ``permuted_order``) for the block of 64 channels at ``c0``."""
    return [
        load_vec(builder, builder.gep(p, [builder.add(c0, ir.Constant(I64, b * _LANES))]), vt)
        for b in range(_SPLIT)
    ]


def _merge_codes(builder: ir.IRBuilder, lanes_bits: list[ir.Value], zp: ir.Value) -> ir.Value:
    """Four ``<16 x i32>`` whose low bytes are ``code - zp`` (mod 256) of channels ``4l + b`` ->
    the 64 codes in channel order."""
    as_bytes = [builder.bitcast(v, _VB) for v in lanes_bits]

    def pair(a: ir.Value, b: ir.Value) -> ir.Value:
        order = [x for lane in range(_LANES) for x in (_SPLIT * lane, CHANNELS + _SPLIT * lane)]
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, 2 * _LANES), order))

    low, high = pair(as_bytes[0], as_bytes[1]), pair(as_bytes[2], as_bytes[3])
    order = [
        x for lane in range(_LANES) for x in (2 * lane, 2 * lane + 1, 32 + 2 * lane, 33 + 2 * lane)
    ]
    merged = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(I32, CHANNELS), order))
    return builder.add(merged, vec_broadcast(builder, builder.trunc(zp, I8), CHANNELS))


class _Epilogue:
    """The requantizing epilogue of 64 channels: four int32 accumulators -> 64 codes stored in
    channel order (see the module docstring). Its constants are loaded once per kernel."""

    def __init__(
        self,
        builder: ir.IRBuilder,
        bq_p: ir.Value,
        mu_p: ir.Value,
        c0: ir.Value,
        ozp: ir.Value,
        qmin: ir.Value,
        qmax: ir.Value,
    ) -> None:
        self.bq = _split_vectors(builder, bq_p, c0, _VF32)
        self.mu = _split_vectors(builder, mu_p, c0, _VF32)
        self.lo, self.hi, _ = clamp_round_splats(builder, ozp, qmin, qmax, _LANES)
        self.ozp = ozp

    def __call__(self, builder: ir.IRBuilder, accs: list[ir.Value], optr: ir.Value) -> None:
        no_zp = ir.Constant(_VI32, [0] * _LANES)  # the zero point goes on after the merge
        bits = []
        for b, acc in enumerate(accs):
            t = builder.fmul(builder.fadd(builder.sitofp(acc, _VF32), self.bq[b]), self.mu[b])
            bits.append(rint_clamp_codes(builder, t, self.lo, self.hi, no_zp))
        store_vec(builder, _merge_codes(builder, bits, self.ozp), optr)


def _make_block(kw: int, sw: int, pix: int, group: int) -> Any:
    """IR codegen of one interior block of ``pix`` vectors of 64 bytes: 64 channels of one
    pixel each, or (``group`` > 1, stride 1) ``64 / group`` channels of ``group`` pixels."""
    step = sw * group  # input pixels from one vector's first pixel to the next one's
    ncols = (pix - 1) * step + kw  # input vectors per kernel row

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        _x, xbase, rowstep, c, kh, weights, c0, output, _out, obase = args
        x_p, o_p = arrays_data(context, builder, sig, args, (0, 8))
        w_p, cp4, a0_p, bq_p, mu_p = record_fields(
            context, builder, sig.args[5], weights, ("w", "cp4", "acc0", "biasq", "mult")
        )
        ozp, qmin, qmax = record_fields(context, builder, sig.args[7], output, OUT_RULE)
        dot = declare_dot(builder.module, _VI32, _VI32)

        def at(p: ir.Value, base: ir.Value, offset: int) -> ir.Value:
            return builder.gep(p, [builder.add(base, ir.Constant(I64, offset))])

        starts = _split_vectors(builder, a0_p, c0, _VI32)
        accs = [[stack_slot(builder, starts[b]) for b in range(_SPLIT)] for _ in range(pix)]
        wblock = builder.mul(c0, ir.Constant(I64, _SPLIT))  # the block's weights within a tap
        with cgutils.for_range(builder, kh) as loop:
            i = loop.index
            xrow = builder.add(xbase, builder.mul(i, rowstep))
            wrow = builder.add(builder.mul(builder.mul(i, ir.Constant(I64, kw)), cp4), wblock)
            wv = []
            for j in range(kw):
                tap = builder.add(wrow, builder.mul(ir.Constant(I64, j), cp4))
                wv.append(
                    [
                        builder.bitcast(load_vec(builder, at(w_p, tap, b * CHANNELS), _VB), _VI32)
                        for b in range(_SPLIT)
                    ]
                )
            cur = [[builder.load(a) for a in row] for row in accs]
            for q in range(ncols):
                ptr = builder.gep(x_p, [builder.add(xrow, builder.mul(ir.Constant(I64, q), c))])
                xv = builder.bitcast(load_vec(builder, ptr, _VB), _VI32)
                for p in range(pix):
                    j = q - p * step
                    if 0 <= j < kw:
                        for b in range(_SPLIT):
                            cur[p][b] = builder.call(dot, [cur[p][b], xv, wv[j][b]])
            for row_slots, row_vals in zip(accs, cur, strict=True):
                for a, v in zip(row_slots, row_vals, strict=True):
                    builder.store(v, a)
        store = _Epilogue(builder, bq_p, mu_p, c0, ozp, qmin, qmax)
        for p in range(pix):
            at_p = builder.mul(ir.Constant(I64, p * group), c)
            store(
                builder,
                [builder.load(a) for a in accs[p]],
                builder.gep(o_p, [builder.add(obase, at_p)]),
            )
        return context.get_dummy_value()

    return codegen


_BLOCK_CODEGENS = [_make_block(*kind) for kind in BLOCK_KINDS]


def _dw64_block(
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
    """``dw64_block(KIND_IDS[(kw, sw, pixels, group)], x, xbase, rowstep, c, kh, weights, c0,
    output, out, obase)``, ``weights`` a ``Dw64Weights`` and ``output`` a ``DwOutput``.

    Vector ``p``'s tap ``(i, j)`` reads ``x[xbase + i * rowstep + (p * sw * group + j) * c +
    0..63]`` and the weight vectors ``weights.w[(i * kw + j) * cp4 + 4 * c0 + 0..255]``
    (``split_weights``); it writes ``out[obase + p * group * c + 0..63]``. ``acc0``, ``biasq``,
    ``mult`` are read at ``c0 .. c0 + 63`` in ``permuted_order``. With ``group`` > 1, ``c`` is
    ``64 / group`` and the weights and constants hold the ``c`` channels ``group`` times. All
    int arguments are int64; ``c0`` a multiple of 64.
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
dw64_block: Any = intrinsic(_dw64_block)


def _dw64_taps(
    typingctx: Any,
    x: Any,
    xbase: Any,
    toffs: Any,
    inside: Any,
    ntaps: Any,
    weights: Any,
    c0: Any,
    xzp: Any,
    output: Any,
    out: Any,
    obase: Any,
) -> Any:
    """One output pixel x 64 channels over all ``ntaps`` taps of its window, for pixels whose
    window reaches into the padding: tap ``t`` reads ``x[xbase + toffs[t] + 0..63]`` when
    ``inside[t]`` is nonzero, else 64 bytes of the input zero point ``xzp`` (what a
    zero-point-padded copy would hold there, never touching ``x``). Weights are tap ``t``'s
    vectors ``weights.w[t * cp4 + 4 * c0 + 0..255]``; ``acc0``, ``biasq``, ``mult`` as
    ``dw64_block``. The result goes to ``out[obase + 0..63]``. All ints are int64.
    """
    sig = types.void(x, xbase, toffs, inside, ntaps, weights, c0, xzp, output, out, obase)

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, cargs: Any) -> ir.Value:
        _x, xbase, _toffs, _inside, ntaps, weights, c0, xzp, output, _out, obase = cargs
        x_p, to_p, in_p, o_p = arrays_data(context, builder, sig, cargs, (0, 2, 3, 9))
        w_p, cp4, a0_p, bq_p, mu_p = record_fields(
            context, builder, sig.args[5], weights, ("w", "cp4", "acc0", "biasq", "mult")
        )
        ozp, qmin, qmax = record_fields(context, builder, sig.args[8], output, OUT_RULE)
        dot = declare_dot(builder.module, _VI32, _VI32)
        pad = vec_broadcast(builder, builder.trunc(xzp, I8), CHANNELS)
        pad_i32 = builder.bitcast(pad, _VI32)
        accs = [stack_slot(builder, v) for v in _split_vectors(builder, a0_p, c0, _VI32)]
        wblock = builder.mul(c0, ir.Constant(I64, _SPLIT))
        with cgutils.for_range(builder, ntaps) as loop:
            t = loop.index
            off = builder.load(builder.gep(to_p, [t]))
            ok = builder.icmp_signed(
                "!=", builder.load(builder.gep(in_p, [t])), ir.Constant(I64, 0)
            )
            # a padding tap's offset may point anywhere: only an inside tap loads from x
            safe = builder.select(ok, builder.add(xbase, off), xbase)
            loaded = builder.bitcast(load_vec(builder, builder.gep(x_p, [safe]), _VB), _VI32)
            xv = builder.select(ok, loaded, pad_i32)
            wt = builder.add(builder.mul(t, cp4), wblock)
            for b in range(_SPLIT):
                wv = load_vec(
                    builder,
                    builder.gep(w_p, [builder.add(wt, ir.Constant(I64, b * CHANNELS))]),
                    _VB,
                )
                acc = builder.call(dot, [builder.load(accs[b]), xv, builder.bitcast(wv, _VI32)])
                builder.store(acc, accs[b])
        store = _Epilogue(builder, bq_p, mu_p, c0, ozp, qmin, qmax)
        store(builder, [builder.load(a) for a in accs], builder.gep(o_p, [obase]))
        return context.get_dummy_value()

    return sig, codegen


# typed Any: callers pass the 11 arguments, not numba's typing context
dw64_taps: Any = intrinsic(_dw64_taps)
