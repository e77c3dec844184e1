"""Compiled kernels of ``linear_weight_only``: group-quantized int4 / int8 weights times float32
activations quantized per call to int8 per group (the rule in ``_weight_only``).

One driver per (target, bits, threading), each one compiled function: it quantizes the
activation rows (``quantize_groups``: plain LLVM vector IR, no target-specific instruction,
so the same bytes on every target) and then runs the tiles, a tile being one packed panel of
output features times a chunk of rows. ``prange`` splits the tiles into contiguous runs: at
M = 1 (decode) each thread streams its own share of the panels, the GEMV parallel over output
features; at M > 1 (prefill) a block of rows reuses each weight vector it loads.

The SIMD targets' block kernels are LLVM IR emitted through one module-level intrinsic,
``wo_block(kind, ...)`` (``kind``: a compile-time constant, a number of ``KERNEL_IDS``): a
block is ``rows`` activation rows times one panel of ``2 * lanes`` output features over the
whole reduction. Per group of ``group_size`` values it sums the integer products in int32
lanes, exactly, starts them at ``-o * xsum`` (``o`` the weight's offset, below) and then adds
``float32(isum) * (sw * sx)`` to a float32 accumulator: a ``vcvtdq2ps``, two ``vmulps`` and a
``vaddps``, never an FMA (the IR carries no ``contract`` flag and numba compiles without
fast-math, so LLVM keeps each rounding). The stores are masked: a panel may end past N.

Integer dot products (the weight is the unsigned operand, the activation code the signed one):

- ``avx512_vnni``: ``vpdpbusd`` on zmm (16 output features a vector, 2 vectors a panel);
- ``avx_vnni``: VEX ``vpdpbusd`` on ymm (8 a vector);
- ``avx2``: ``vpmaddubsw`` then ``vpmaddwd`` by ones. 4-bit weights are nibbles in [0, 15],
  so a pair is at most 2 * 15 * 127 = 3810 and eight pairs (one 32-value unit) add up in
  int16 before one ``vpmaddwd``. 8-bit weights use the sign trick: ``vpabsb(w)`` as the
  unsigned operand and ``vpsignb(x, w)`` as the signed one, each pair at most
  2 * 128 * 127 = 32512, so nothing saturates (a code of -128 included);
- ``generic``: plain numba loops over the same layout as ``avx_vnni``.

Stored codes are ``code + shift`` and ``o = zp + shift`` (``zp`` = 0 for symmetric weights),
so ``sum (code - zp) * qx = sum stored * qx - o * sum qx`` (``_weight_only.code_shift``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from quantbridge.kernels._ir import (
    F32T,
    I8,
    I16,
    I32,
    I64,
    arrays_data,
    declare,
    lanes_below,
    load_vec,
    masked_store,
    stack_slot,
    store_vec,
    vec_broadcast,
)
from quantbridge.kernels._targets import needs_features, target_features

# activation values a unit of the block kernels covers (the smallest group size)
UNIT = 32
# int32 lanes of one vector, per SIMD target; a panel is VECTORS of them
LANES = {"avx512_vnni": 16, "avx_vnni": 8, "avx2": 8}
VECTORS = 2
# output features per packed panel, per target (generic: avx_vnni's layout)
PANEL = {**{t: lanes * VECTORS for t, lanes in LANES.items()}, "generic": 16}
# rows of the multi-row block (prefill), the fastest measured at M = 512 (DESIGN.md): 4 x 2
# zmm with two int32 chains each (16 int32 and 8 float32 accumulators of 32 registers); on
# the 16-register targets 3 x 2 ymm (avx_vnni) and 2 x 2 (avx2, whose sign trick and int16
# sums need temporaries)
ROWS = {"avx512_vnni": 4, "avx_vnni": 3, "avx2": 2}
_EXP_MASK = 0x7F800000  # |x| bits at or above this: inf or NaN


# --------------------------------------------------------------------------- activation rows


_QL = 16  # float32 lanes of the activation quantizer's vectors (a group is 2, 4 or 8)


def _quantize_codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
    """``quantize_groups``, group after group of the flat rows: the groups of a C-contiguous
    [m, k] array are its consecutive runs of ``gs`` values."""
    xa = context.make_array(sig.args[0])(context, builder, args[0])
    gs = context.cast(builder, args[1], sig.args[1], types.int64)
    x_p, q_p, s_p, t_p = xa.data, *arrays_data(context, builder, sig, args, (2, 3, 4))
    ng = builder.sdiv(builder.extract_value(xa.shape, 1), gs)  # groups a row
    groups = builder.mul(builder.extract_value(xa.shape, 0), ng)
    vi = ir.VectorType(I32, _QL)
    vf = ir.VectorType(F32T, _QL)
    vb = ir.VectorType(I8, _QL)
    mod = builder.module
    smax = declare(mod, ir.FunctionType(I32, [vi]), f"llvm.vector.reduce.smax.v{_QL}i32")
    vsum = declare(mod, ir.FunctionType(I32, [vi]), f"llvm.vector.reduce.add.v{_QL}i32")
    rint = declare(mod, ir.FunctionType(vf, [vf]), f"llvm.rint.v{_QL}f32")
    bad = stack_slot(builder, ir.Constant(I64, -1))
    top = stack_slot(builder, ir.Constant(vi, [0] * _QL))
    total = stack_slot(builder, ir.Constant(vi, [0] * _QL))
    lo = ir.Constant(vf, [-127.0] * _QL)
    hi = ir.Constant(vf, [127.0] * _QL)
    nv = builder.sdiv(gs, ir.Constant(I64, _QL))

    with cgutils.for_range(builder, groups) as group:
        g = group.index
        start = builder.mul(g, gs)
        # max |x| as IEEE bits (integer order is float order there); inf and NaN above
        builder.store(ir.Constant(vi, [0] * _QL), top)
        with cgutils.for_range(builder, nv) as vec:
            at = builder.add(start, builder.mul(vec.index, ir.Constant(I64, _QL)))
            bits = load_vec(builder, builder.gep(x_p, [at]), vi)
            bits = builder.and_(bits, ir.Constant(vi, [0x7FFFFFFF] * _QL))
            old = builder.load(top)
            builder.store(builder.select(builder.icmp_signed(">", bits, old), bits, old), top)
        biggest = builder.call(smax, [builder.load(top)])
        finite = builder.icmp_signed("<", biggest, ir.Constant(I32, _EXP_MASK))
        with builder.if_then(builder.not_(finite), likely=False):
            first = builder.icmp_signed("<", builder.load(bad), ir.Constant(I64, 0))
            builder.store(builder.select(first, builder.sdiv(g, ng), builder.load(bad)), bad)
        scale = builder.fdiv(builder.bitcast(biggest, F32T), ir.Constant(F32T, 127.0))
        builder.store(scale, builder.gep(s_p, [g]))
        builder.store(ir.Constant(vi, [0] * _QL), total)
        # codes 0 for a group whose scale is 0 (all zero, or underflowing) and a non-finite
        # one (refused by the caller)
        live = builder.and_(finite, builder.fcmp_ordered("!=", scale, ir.Constant(F32T, 0.0)))
        splat = vec_broadcast(builder, scale, _QL)
        with builder.if_else(live) as (some, zero):
            with some, cgutils.for_range(builder, nv) as vec:
                at = builder.add(start, builder.mul(vec.index, ir.Constant(I64, _QL)))
                q = builder.fdiv(load_vec(builder, builder.gep(x_p, [at]), vf), splat)
                q = builder.call(rint, [q])  # half to even
                q = builder.select(builder.fcmp_ordered(">", q, hi), hi, q)
                q = builder.select(builder.fcmp_ordered("<", q, lo), lo, q)
                codes = builder.fptosi(q, vi)
                builder.store(builder.add(builder.load(total), codes), total)
                store_vec(builder, builder.trunc(codes, vb), builder.gep(q_p, [at]))
            with zero, cgutils.for_range(builder, nv) as vec:
                at = builder.add(start, builder.mul(vec.index, ir.Constant(I64, _QL)))
                store_vec(builder, ir.Constant(vb, [0] * _QL), builder.gep(q_p, [at]))
        builder.store(builder.call(vsum, [builder.load(total)]), builder.gep(t_p, [g]))
    return builder.load(bad)


def _quantize_typing(typingctx: Any, x: Any, gs: Any, qx: Any, sx: Any, xsum: Any) -> Any:
    """``_quantize_rows(x, gs, qx, sx, xsum)``: see ``quantize_groups`` (numba code only)."""
    dtypes = (types.float32, types.int8, types.float32, types.int32)
    for array, dtype in zip((x, qx, sx, xsum), dtypes, strict=True):
        if not (isinstance(array, types.Array) and array.ndim == 2 and array.layout == "C"):
            return None
        if array.dtype != dtype:
            return None
    if not isinstance(gs, types.Integer):
        return None
    return types.int64(x, gs, qx, sx, xsum), _quantize_codegen


# typed Any: callers pass the arrays, not numba's typing context
_quantize_rows: Any = intrinsic(_quantize_typing)


@njit(cache=True, nogil=True)
def quantize_groups(x, gs, qx, sx, xsum):  # type: ignore[no-untyped-def]
    """Rows of float32 ``x`` [m, k] as int8 codes per group of ``gs`` (a multiple of 16):
    ``sx[i, g] = max|x| / 127`` (float32 division), ``qx = clamp(rint(x / sx), -127, 127)``
    (float32 division, all 0 when ``sx`` is 0), ``xsum[i, g]`` the sum of the group's codes.
    Returns the first row holding NaN or infinity (the codes of its non-finite groups are 0),
    else -1. LLVM vector IR of 16 lanes, no target-specific instruction: the same on every
    target (numba's loops stayed scalar, 1.8 cycles a value)."""
    return _quantize_rows(x, gs, qx, sx, xsum)


# --------------------------------------------------------------------------- SIMD block kernels


def _dot_vnni(builder: ir.IRBuilder, width: int) -> Any:
    """``acc + vpdpbusd(w (u8), x (s8))``: four products summed into each int32 lane."""
    vi32 = ir.VectorType(I32, width)
    fn = declare(builder.module, ir.FunctionType(vi32, [vi32, vi32, vi32]),
                 f"llvm.x86.avx512.vpdpbusd.{32 * width}")  # fmt: skip

    def dot(acc: ir.Value, w: ir.Value, x: ir.Value) -> ir.Value:
        return builder.call(fn, [acc, builder.bitcast(w, vi32), builder.bitcast(x, vi32)])

    return dot


def _make_block(target: str, bits: int, rows: int) -> Any:
    """IR codegen of a ``rows`` x one-panel block (see the module docstring)."""
    lanes = LANES[target]
    nr = lanes * VECTORS
    nvec = VECTORS
    vnni = target != "avx2"
    # two int32 accumulator chains per vector hide vpdpbusd's 4-cycle latency: one row
    # streaming its panel, and the 4-row zmm blocks (M = 512: 8-bit 1.14x, 4-bit 1.0x);
    # AVX2's adds chain only vpaddd (latency 1), avx_vnni's 3 x 2 blocks have no registers
    ku = 2 if vnni and (rows == 1 or target == "avx512_vnni") else 1
    vi32 = ir.VectorType(I32, lanes)
    vf32 = ir.VectorType(F32T, lanes)
    vbytes = ir.VectorType(I8, 4 * lanes)
    vi16 = ir.VectorType(I16, 2 * lanes)
    bytes_per_value = nr * bits // 8  # packed code bytes per k value of a panel

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        xq_p, sx_p, xs_p, c_p, s_p, z_p, b_p, o_p = arrays_data(
            context, builder, sig, args, tuple(range(8))
        )
        i0, rvalid, p, k, ng, units, n, asym, shift = (
            context.cast(builder, v, t, types.int64)
            for v, t in zip(args[8:], sig.args[8:], strict=True)
        )

        def const(v: int) -> ir.Value:
            return ir.Constant(I64, v)

        mod = builder.module
        if vnni:
            dot = _dot_vnni(builder, lanes)
        else:
            maddubs = declare(mod, ir.FunctionType(vi16, [vbytes, vbytes]),
                              "llvm.x86.avx2.pmadd.ub.sw")  # fmt: skip
            maddwd = declare(mod, ir.FunctionType(vi32, [vi16, vi16]), "llvm.x86.avx2.pmadd.wd")
            psign = declare(mod, ir.FunctionType(vbytes, [vbytes, vbytes]),
                            "llvm.x86.avx2.psign.b")  # fmt: skip
            vabs = declare(mod, ir.FunctionType(vbytes, [vbytes, ir.IntType(1)]),
                           "llvm.abs.v32i8")  # fmt: skip
            ones = ir.Constant(vi16, [1] * (2 * lanes))
        # rows past rvalid repeat the last valid one (computed, never stored)
        last = builder.sub(rvalid, const(1))
        xrow, qrow = [], []
        for r in range(rows):
            ridx = builder.select(builder.icmp_signed("<", const(r), last), const(r), last)
            row = builder.add(i0, ridx)
            xrow.append(builder.mul(row, k))
            qrow.append(builder.mul(row, ng))
        cpanel = builder.mul(p, builder.mul(k, const(bytes_per_value)))
        spanel = builder.mul(p, builder.mul(ng, const(nr)))
        cvec = [const(v * lanes * 4) for v in range(nvec)]  # a vector's bytes in a k step
        svec = [const(v * lanes) for v in range(nvec)]  # its scales in a group
        zero_i = ir.Constant(vi32, [0] * lanes)
        zero_f = ir.Constant(vf32, [0.0] * lanes)
        facc = [[stack_slot(builder, zero_f) for _ in range(nvec)] for _ in range(rows)]
        iacc = [
            [[stack_slot(builder, zero_i) for _ in range(ku)] for _ in range(nvec)]
            for _ in range(rows)
        ]
        is_asym = builder.icmp_signed("!=", asym, const(0))
        shift32 = builder.trunc(shift, I32)
        shift_v = vec_broadcast(builder, shift32, lanes)
        gs = builder.mul(units, const(UNIT))

        def load_x(r: int, at: ir.Value) -> ir.Value:
            """The four activation codes at ``x[row r][at]`` broadcast to every int32 lane."""
            ptr = builder.gep(xq_p, [builder.add(xrow[r], at)])
            word = builder.load(builder.bitcast(ptr, I32.as_pointer()))
            word.align = 1
            return vec_broadcast(builder, word, lanes)

        def unit(kb: ir.Value) -> None:
            """Products of the 32 k values from ``kb`` into the int32 accumulators."""
            cb = builder.add(cpanel, builder.mul(kb, const(bytes_per_value)))
            chain = 0
            partial: list[list[Any]] = [[None] * nvec for _ in range(rows)]  # AVX2 4-bit
            for step in range(UNIT // 4 if bits == 8 else UNIT // 8):
                at = builder.add(cb, const(step * nr * 4))
                raw = [
                    load_vec(builder, builder.gep(c_p, [builder.add(at, cvec[v])]), vbytes)
                    for v in range(nvec)
                ]
                if bits == 8:  # one k step of four values a vector
                    pieces = [(raw, 4 * step)]
                else:  # low nibbles: k step 2 * step; high nibbles: the next one
                    low = [builder.and_(w, ir.Constant(vbytes, [15] * 4 * lanes)) for w in raw]
                    high = [builder.lshr(w, ir.Constant(vbytes, [4] * 4 * lanes)) for w in raw]
                    pieces = [(low, 8 * step), (high, 8 * step + 4)]
                for ws, kx in pieces:
                    if not vnni and bits == 8:
                        absw = [builder.call(vabs, [w, ir.Constant(ir.IntType(1), 0)]) for w in ws]
                    for r in range(rows):
                        xv = builder.bitcast(load_x(r, builder.add(kb, const(kx))), vbytes)
                        for v in range(nvec):
                            if vnni:
                                slot = iacc[r][v][chain % ku]
                                builder.store(dot(builder.load(slot), ws[v], xv), slot)
                            elif bits == 8:  # |w| x sign(x, w): pairs at most 2 * 128 * 127
                                pairs = builder.call(
                                    maddubs, [absw[v], builder.call(psign, [xv, ws[v]])]
                                )
                                slot = iacc[r][v][0]
                                wide = builder.call(maddwd, [pairs, ones])
                                builder.store(builder.add(builder.load(slot), wide), slot)
                            else:  # nibbles: the eight pairs of a unit add up in int16
                                pairs = builder.call(maddubs, [ws[v], xv])
                                old = partial[r][v]
                                partial[r][v] = pairs if old is None else builder.add(old, pairs)
                    chain += 1
            if not vnni and bits == 4:
                for r in range(rows):
                    for v in range(nvec):
                        slot = iacc[r][v][0]
                        wide = builder.call(maddwd, [partial[r][v], ones])
                        builder.store(builder.add(builder.load(slot), wide), slot)

        with cgutils.for_range(builder, ng) as group:
            g = group.index
            soff = builder.add(spanel, builder.mul(g, const(nr)))
            # the int32 sums start at -o * xsum with o = zp + shift: a vector multiply per
            # output vector when asymmetric, one broadcast per row when symmetric
            totals = [
                builder.load(builder.gep(xs_p, [builder.add(qrow[r], g)])) for r in range(rows)
            ]
            with builder.if_else(is_asym) as (asymmetric, symmetric):
                with asymmetric:
                    offsets = []
                    for v in range(nvec):
                        at = builder.gep(z_p, [builder.add(soff, svec[v])])
                        zp = builder.zext(load_vec(builder, at, ir.VectorType(I8, lanes)), vi32)
                        offsets.append(builder.add(zp, shift_v))
                    starts_asym = [
                        [builder.sub(zero_i, builder.mul(o, vec_broadcast(builder, t, lanes)))
                         for o in offsets]
                        for t in totals
                    ]  # fmt: skip
                    asym_end = builder.block
                with symmetric:
                    starts_sym = [
                        vec_broadcast(builder, builder.neg(builder.mul(t, shift32)), lanes)
                        for t in totals
                    ]
                    sym_end = builder.block
            starts = [[builder.phi(vi32) for _ in range(nvec)] for _ in range(rows)]
            for r in range(rows):  # (phis first: they open the merge block)
                for v in range(nvec):
                    starts[r][v].add_incoming(starts_asym[r][v], asym_end)
                    starts[r][v].add_incoming(starts_sym[r], sym_end)
                    for c in range(ku):
                        builder.store(starts[r][v] if c == 0 else zero_i, iacc[r][v][c])
            kg = builder.mul(g, gs)
            with cgutils.for_range(builder, units) as u:
                unit(builder.add(kg, builder.mul(u.index, const(UNIT))))
            # acc = acc + float32(isum) * (sw * sx), each operation rounded on its own
            scales = [
                load_vec(builder, builder.gep(s_p, [builder.add(soff, svec[v])]), vf32)
                for v in range(nvec)
            ]
            for r in range(rows):
                sx_r = builder.load(builder.gep(sx_p, [builder.add(qrow[r], g)]))
                sx_v = vec_broadcast(builder, sx_r, lanes)
                for v in range(nvec):
                    isum = builder.load(iacc[r][v][0])
                    for c in range(1, ku):
                        isum = builder.add(isum, builder.load(iacc[r][v][c]))
                    scale = builder.fmul(scales[v], sx_v)
                    term = builder.fmul(builder.sitofp(isum, vf32), scale)
                    builder.store(builder.fadd(builder.load(facc[r][v]), term), facc[r][v])
        for v in range(nvec):
            col = builder.add(builder.mul(p, const(nr)), const(v * lanes))
            cols = lanes_below(builder, builder.sub(n, col), lanes)
            bias = load_vec(builder, builder.gep(b_p, [col]), vf32)
            for r in range(rows):
                with builder.if_then(builder.icmp_signed("<", const(r), rvalid)):
                    at = builder.add(builder.mul(builder.add(i0, const(r)), n), col)
                    value = builder.fadd(builder.load(facc[r][v]), bias)
                    masked_store(builder, value, builder.gep(o_p, [at]), cols)
        return context.get_dummy_value()

    return codegen


# (target, bits, rows) of every block kernel; its index is its number (drivers name kernels
# by number: ints as closure constants pickle the same in every process, which numba's cache
# key needs)
_BLOCKS = [
    (target, bits, rows) for target in LANES for bits in (4, 8) for rows in (ROWS[target], 1)
]
KERNEL_IDS: dict[tuple[str, int, int], int] = {block: i for i, block in enumerate(_BLOCKS)}
_CODEGENS = [_make_block(*block) for block in _BLOCKS]


def _wo_block(
    typingctx: Any, kind: Any, xq: Any, sx: Any, xsum: Any, codes: Any, scales: Any, zps: Any,
    bias: Any, out: Any, i0: Any, rvalid: Any, p: Any, k: Any, ng: Any, units: Any, n: Any,
    asym: Any, shift: Any,
) -> Any:  # fmt: skip
    """``wo_block(KERNEL_IDS[(target, bits, rows)], xq, sx, xsum, codes, scales, zps, bias,
    out, i0, rvalid, p, k, ng, units, n, asym, shift)``: rows ``i0 .. i0 + rvalid - 1`` of
    ``out`` (flat [m, n]) on panel ``p``. ``kind`` must be a compile-time constant."""
    if not isinstance(kind, types.IntegerLiteral):
        return None  # numba retries with the literal type when the value is a constant
    for array in (xq, sx, xsum, codes, scales, zps, bias, out):
        if not (isinstance(array, types.Array) and array.ndim == 1 and array.layout == "C"):
            return None
    for scalar in (i0, rvalid, p, k, ng, units, n, asym, shift):
        if not isinstance(scalar, types.Integer):
            return None
    inner = types.void(xq, sx, xsum, codes, scales, zps, bias, out, i0, rvalid, p, k, ng,
                       units, n, asym, shift)  # fmt: skip
    inner_codegen = _CODEGENS[kind.literal_value]

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, cargs: Any) -> ir.Value:
        return inner_codegen(context, builder, inner, cargs[1:])

    return types.void(kind, *inner.args), codegen


# typed Any: callers pass the 18 arguments, not numba's typing context
wo_block: Any = intrinsic(_wo_block)


# --------------------------------------------------------------------------- drivers


def _make_driver(target: str, bits: int, parallel: bool) -> Any:
    rbig = ROWS[target]
    big = KERNEL_IDS[(target, bits, rbig)]
    one = KERNEL_IDS[(target, bits, 1)]

    def driver(  # type: ignore[no-untyped-def]  # numba types the arguments
        x, gs, codes, scales, zps, asym, shift, bias, out, npanels, mchunk, bits,
    ):  # fmt: skip
        # (bits: the generic driver's argument, unused here: this one is compiled per bits)
        m, k = x.shape
        ng = k // gs
        n = out.shape[1]
        qx = np.empty((m, k), np.int8)
        sx = np.empty((m, ng), np.float32)
        xsum = np.empty((m, ng), np.int32)
        bad = quantize_groups(x, gs, qx, sx, xsum)
        if bad >= 0:
            return bad
        qf = qx.reshape(-1)
        sf = sx.reshape(-1)
        xf = xsum.reshape(-1)
        of = out.reshape(-1)
        units = gs // UNIT
        nmc = (m + mchunk - 1) // mchunk
        for t in prange(nmc * npanels):  # a plain range when parallel=False
            p = t % npanels
            start = (t // npanels) * mchunk
            end = min(m, start + mchunk)
            i = start
            while end - i > 1:  # 2 or more rows left: the multi-row block
                rows = min(end - i, rbig)
                wo_block(big, qf, sf, xf, codes, scales, zps, bias, of, i, rows, p, k, ng,
                         units, n, asym, shift)  # fmt: skip
                i += rows
            if i < end:
                wo_block(one, qf, sf, xf, codes, scales, zps, bias, of, i, 1, p, k, ng,
                         units, n, asym, shift)  # fmt: skip
        return -1

    prefix = "wo_drive" if parallel else "wo_serial"
    driver.__name__ = driver.__qualname__ = f"{prefix}_{target}_{bits}"
    return needs_features(
        target_features(target), njit(cache=True, parallel=parallel, nogil=True)(driver)
    )


def _make_generic(parallel: bool) -> Any:
    nr = PANEL["generic"]

    def driver(  # type: ignore[no-untyped-def]  # numba types the arguments
        x, gs, codes, scales, zps, asym, shift, bias, out, npanels, mchunk, bits,
    ):  # fmt: skip
        m, k = x.shape
        ng = k // gs
        n = out.shape[1]
        qx = np.empty((m, k), np.int8)
        sx = np.empty((m, ng), np.float32)
        xsum = np.empty((m, ng), np.int32)
        bad = quantize_groups(x, gs, qx, sx, xsum)
        if bad >= 0:
            return bad
        per_value = nr * bits // 8
        nmc = (m + mchunk - 1) // mchunk
        for t in prange(nmc * npanels):  # a plain range when parallel=False
            p = t % npanels
            start = (t // npanels) * mchunk
            end = min(m, start + mchunk)
            acc = np.empty(nr, np.float32)
            isum = np.empty(nr, np.int32)
            cpanel = p * k * per_value
            for i in range(start, end):
                acc[:] = 0.0
                for g in range(ng):
                    isum[:] = 0
                    for kk in range(g * gs, (g + 1) * gs):
                        xv = np.int32(qx[i, kk])
                        if bits == 8:  # [k // 4][nr][4]
                            base = cpanel + (kk >> 2) * nr * 4 + (kk & 3)
                            for j in range(nr):
                                isum[j] += np.int32(codes[base + 4 * j]) * xv
                        else:  # [k // 8][nr][4], k % 8 >= 4 in the high nibbles
                            base = cpanel + (kk >> 3) * nr * 4 + (kk & 3)
                            sh = ((kk >> 2) & 1) * 4
                            for j in range(nr):
                                isum[j] += np.int32((codes[base + 4 * j] >> sh) & 15) * xv
                    total = xsum[i, g]
                    sxg = sx[i, g]
                    at = (p * ng + g) * nr
                    for j in range(nr):
                        off = shift + (np.int32(zps[at + j]) if asym else np.int32(0))
                        exact = np.int32(isum[j] - off * total)
                        acc[j] = acc[j] + np.float32(exact) * (scales[at + j] * sxg)
                for j in range(min(nr, n - p * nr)):
                    out[i, p * nr + j] = acc[j] + bias[p * nr + j]
        return -1

    prefix = "wo_drive" if parallel else "wo_serial"
    driver.__name__ = driver.__qualname__ = f"{prefix}_generic"
    return njit(cache=True, parallel=parallel, nogil=True)(driver)


# (target, bits, parallel) -> driver; generic: (generic, 0, parallel), bits an argument
DRIVERS: dict[tuple[str, int, bool], Any] = {
    **{
        (target, bits, parallel): _make_driver(target, bits, parallel)
        for target in LANES
        for bits in (4, 8)
        for parallel in (False, True)
    },
    **{("generic", 0, parallel): _make_generic(parallel) for parallel in (False, True)},
}
