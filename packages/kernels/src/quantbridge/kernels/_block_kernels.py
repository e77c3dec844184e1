"""Register-blocked int8 GEMM micro-kernels, emitted as LLVM IR through numba ``@intrinsic``.

Plain numba loops never make LLVM emit ``vpdpbusd`` or ``vpmaddubsw``, so the inner kernels
are written as IR: one block kernel per (target, rows, output mode) computes an ``MR x NR`` block
of C over the whole reduction in vector registers and requantizes it in registers before the
single store (a separate requantization pass costs ~20 %).

Each target module (``_vnni``: AVX-512 VNNI, ``_avx_vnni``: AVX-VNNI, ``_avx2`` and
``_avx2_byte``: AVX2, ``_arm_i8mm`` and ``_arm_dotprod``: AArch64) gives its packed-B layout and
emits its multiply-accumulate step (``_pack.py`` builds the layouts); this module emits the
rest: the block loop, the prefetches and the requantizing epilogue.

A row's activations are addressed as ``a[rowoffs[r] + koffs[step] + 0..KSTEP-1]``; linear
uses ``rowoffs = i * K`` and ``koffs = KSTEP * step``, conv uses pixel offsets into padded
NHWC input and per-tap offsets (implicit im2col). Rows past ``mvalid`` recompute the last
valid row (never read out of bounds) and are not stored. A row of C holds ``ldc`` columns:
the panel's padded width, or (modes ``u8``/``u8add``/``f32``) the true N when it is a multiple
of the vector width, then the vectors of the last panel past N are neither read nor stored.
On ``avx512_vnni`` modes ``u8``/``u8add`` take any N: each vector's columns past the row's end
are masked off (byte-masked stores, and masked residual loads that never touch that memory).

Epilogue per output element (the rule in ``_requant.py``):
``v = acc + colcorr[j] - wzp[j] * rowsum[i]``; mode ``u8``:
``clamp(rint((float(v) + biasq[j]) * mult[j]) + ozp, qmin, qmax)``; mode ``f32``:
``fma(float(v), mult[j], biasq[j])`` (one rounding, as fbgemm's float output does); mode
``u8add`` (conv fused with a following quantized add, channels-last output): the u8 code ``q``
of the block, then with ``addp = [sa, pa, sb, pb, inv, floor, zp]`` and the residual code ``r``
at the same place of ``res``: ``t = max(fma(sa, q, pa) + fma(sb, r, pb), floor)``,
``clamp(rint(t * inv) + zp, 0, 255)`` -- exactly the ``add``/``add_relu`` kernel on the
conv's output codes (``floor`` is 0 for add_relu, -inf for add). Other modes ignore ``res``
and ``addp``. Modes ``u8``/``u8t``/``u8add`` then map each code ``q`` through ``lut[q]`` when
``lut`` (uint8[256], an activation fused into the epilogue) is not empty, before the store.

All block kernels go through the one module-level intrinsic ``block_kernel`` (numbered by
``KERNEL_IDS``), so numba's ``cache=True`` can reload the drivers that call them.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from quantbridge.kernels import _arm_dotprod, _arm_i8mm, _avx2, _avx2_byte, _avx_vnni, _vnni
from quantbridge.kernels._ir import (
    F32T,
    I8,
    I16,
    I32,
    I64,
    ROUND_MAGIC,
    ROUND_MAGIC_BITS,
    arrays_data,
    clamp_round_splats,
    declare,
    lanes_below,
    load_vec,
    masked_load,
    masked_store,
    pack_codes_avx512,
    rint_clamp_codes,
    rint_clamp_float,
    rint_codes_avx512,
    stack_slot,
    store_vec,
    vec_broadcast,
)

# k steps ahead that a block prefetches packed weights streaming from L2; 16 (2 KB ahead)
# was fastest of 8-64 for one-row blocks at M = 1, 768x768, and of 4-32 for VNNI's 8-row
# blocks (K = 1536 or 2304: 8-15 % faster than none, one process, interleaved)
PREFETCH_STEPS = 16
# VNNI panels of more k steps than this (24 KB, half of a 48 KB L1) no longer stay in L1
# between the row blocks that share them: their multi-row blocks prefetch ahead too. Below
# it the extra instructions cost 0-3 % (K = 384, 576) and gain nothing.
STREAMED_PANEL_STEPS = 192

_TARGETS: dict[str, ModuleType] = {
    "avx512_vnni": _vnni,
    "avx2": _avx2,
    "avx2_byte": _avx2_byte,
    "avx_vnni": _avx_vnni,
    "aarch64_i8mm": _arm_i8mm,
    "aarch64_dotprod": _arm_dotprod,
}


def block_cols(target: str) -> int:
    """Columns one micro-kernel call produces (the packed panel width NR)."""
    spec = _TARGETS[target]
    return int(spec.LANES * spec.VECTORS_PER_ROW)


def activation_offset(family: str) -> int:
    """What ``family``'s kernels subtract from every activation code (``_arm_dotprod``: 128);
    the column corrections add ``offset * sum(w)`` back, so the results are every target's."""
    spec = _TARGETS.get(family)
    return int(getattr(spec, "ACTIVATION_OFFSET", 0))


def block_lanes(target: str) -> int:
    """Columns per vector of the micro-kernels (a C row may end at any multiple of it)."""
    return int(_TARGETS[target].LANES)


def k_step(target: str) -> int:
    """k values consumed per step (the koffs granularity)."""
    return int(_TARGETS[target].K_STEP)


def _store_transposed(
    builder: ir.IRBuilder,
    rows: list[ir.Value],
    c_p: ir.Value,
    j0: ir.Value,
    col0: int,
    ldc: ir.Value,
    r0: ir.Value,
    mvalid: ir.Value,
) -> None:
    """Store an ``mr x lanes`` uint8 block channel-major: ``c[(j0+col0+ch)*ldc + r0 + r]``.

    Used for conv's NCHW output (rows are pixels, columns channels): a full block is
    transposed in registers and stored as one ``mr``-byte run per channel; a partial block
    stores its valid bytes one by one.
    """
    mr = len(rows)
    lanes = rows[0].type.count
    full = builder.icmp_signed("==", mvalid, ir.Constant(I64, mr))
    with builder.if_else(full) as (then, otherwise):
        with then:
            vecs = list(rows)
            while len(vecs) > 1:  # concatenate pairwise (mr is a power of two)
                width = vecs[0].type.count
                vecs = [
                    builder.shuffle_vector(
                        vecs[i],
                        vecs[i + 1],
                        ir.Constant(ir.VectorType(I32, 2 * width), list(range(2 * width))),
                    )
                    for i in range(0, len(vecs), 2)
                ]
            block = vecs[0]
            undef = ir.Constant(block.type, ir.Undefined)
            order = [r * lanes + ch for ch in range(lanes) for r in range(mr)]
            tblock = builder.shuffle_vector(
                block, undef, ir.Constant(ir.VectorType(I32, mr * lanes), order)
            )
            for ch in range(lanes):
                base = builder.add(
                    builder.mul(builder.add(j0, ir.Constant(I64, col0 + ch)), ldc), r0
                )
                ptr = builder.gep(c_p, [base])
                if mr == 1:
                    byte = builder.extract_element(tblock, ir.Constant(I32, ch))
                    builder.store(byte, ptr)
                else:
                    run = builder.shuffle_vector(
                        tblock,
                        undef,
                        ir.Constant(ir.VectorType(I32, mr), [ch * mr + r for r in range(mr)]),
                    )
                    store_vec(builder, run, ptr)
        with otherwise:
            for r in range(mr):
                with builder.if_then(builder.icmp_signed("<", ir.Constant(I64, r), mvalid)):
                    for ch in range(lanes):
                        base = builder.add(
                            builder.mul(builder.add(j0, ir.Constant(I64, col0 + ch)), ldc),
                            builder.add(r0, ir.Constant(I64, r)),
                        )
                        byte = builder.extract_element(rows[r], ir.Constant(I32, ch))
                        builder.store(byte, builder.gep(c_p, [base]))


def _lookup(
    builder: ir.IRBuilder, has_lut: ir.Value, lut_p: ir.Value, codes: ir.Value, outv: ir.Value
) -> ir.Value:
    """``lut[codes]`` lane by lane when a table is fused, else ``outv`` (the codes as i8).

    ``codes`` (i32 or i8 lanes) are already in [0, 255], so every load is inside the table.
    """
    before = builder.block
    with builder.if_then(has_lut, likely=False):
        looked = outv
        for lane in range(codes.type.count):
            at = builder.zext(builder.extract_element(codes, ir.Constant(I32, lane)), I64)
            looked = builder.insert_element(
                looked, builder.load(builder.gep(lut_p, [at])), ir.Constant(I32, lane)
            )
        looked_end = builder.block
    merged = builder.phi(outv.type)
    merged.add_incoming(looked, looked_end)
    merged.add_incoming(outv, before)
    return merged


def _make_kernel(target: str, mr: int, ku: int, mode: str, nvec: int) -> Any:
    """IR codegen for an ``mr x (nvec vectors)`` block of a panel of ``NR`` columns, ``ku``
    interleaved k accumulators; with more vectors than a panel holds (VNNI's 4-vector blocks)
    the block spans two neighbouring panels, the second ``nk`` k steps of packed B further."""
    spec = _TARGETS[target]
    lanes, kstep, belt = spec.LANES, spec.K_STEP, spec.B_ELEMENT
    nr = lanes * spec.VECTORS_PER_ROW  # the packed panel's width: its k steps' stride
    vi32 = ir.VectorType(I32, lanes)
    vf32 = ir.VectorType(F32T, lanes)
    bvt = ir.VectorType(belt, lanes * kstep)  # one vector of packed B: lanes cols x kstep

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        (_a, _rowoffs, r0, _koffs, nk, _bp, boff, _c, ldc, mvalid) = args[:10]
        (_colcorr, _wzp, _rowsum, _biasq, _mult, j0, ozp, qmin, qmax, _res, _addp,
         lut) = args[10:22]  # fmt: skip
        pfoff, pfshift = args[22:]
        aty = sig.args
        a_p, ro_p, ko_p, b_p, c_p, cc_p, wz_p, rs_p, bq_p, mu_p, res_p, ap_p, lut_p = arrays_data(
            context, builder, sig, args, (0, 1, 3, 5, 7, 10, 11, 12, 13, 14, 19, 20, 21)
        )
        # a fused activation table (uint8[256], checked by the callers) or none (empty)
        lut_n = context.make_array(aty[21])(context, builder, lut).nitems
        has_lut = builder.icmp_signed(">", lut_n, ir.Constant(I64, 0))
        mod = builder.module
        dot = spec.declare_dot(mod, vi32, bvt)
        prefetch = declare(
            mod,
            ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]),
            "llvm.prefetch.p0i8",
        )
        vfma = declare(mod, ir.FunctionType(vf32, [vf32, vf32, vf32]), f"llvm.fma.v{lanes}f32")
        # row base offsets, duplicating the last valid row for rows past mvalid
        last = builder.sub(mvalid, ir.Constant(I64, 1))
        rbase = []
        for r in range(mr):
            rr = ir.Constant(I64, r)
            ridx = builder.select(builder.icmp_signed("<", rr, last), rr, last)
            rbase.append(builder.load(builder.gep(ro_p, [builder.add(r0, ridx)])))
        zero = ir.Constant(vi32, [0] * lanes)
        # the first accumulator set starts from the column correction: one add fewer per output
        ccs = [
            load_vec(
                builder, builder.gep(cc_p, [builder.add(j0, ir.Constant(I64, v * lanes))]), vi32
            )
            for v in range(nvec)
        ]
        accs = [
            [
                [stack_slot(builder, ccs[v] if u == 0 else zero) for v in range(nvec)]
                for u in range(ku)
            ]
            for _ in range(mr)
        ]
        panel_elems = ir.Constant(I64, nr * kstep)
        line_elems = 64 * 8 // belt.width  # packed B elements per cache line
        step_lines = max(1, nr * kstep // line_elems)
        nouter = builder.sdiv(nk, ir.Constant(I64, ku))
        # a block wider than a panel (VNNI's 4-vector blocks) spans two neighbouring panels:
        # its vectors past the first panel's read the next one, pair_off elements further
        per_panel = nr // lanes
        pair_off = builder.mul(nk, panel_elems)
        # what the prefetch ahead fetches, as (packed B elements from a step's start, in the
        # second panel): VNNI the lines its ku steps' vectors read PREFETCH_STEPS later (a
        # 1-vector block reads half of each step); AVX2 ku * nvec lines in a row
        if target == "avx512_vnni":
            per_vec = lanes * kstep
            ahead_lines = sorted(
                {(((PREFETCH_STEPS + u) * nr * kstep + (v % per_panel) * per_vec)
                  // line_elems * line_elems, v >= per_panel)
                 for u in range(ku) for v in range(nvec)}
            )  # fmt: skip
        else:
            ahead_lines = [
                (PREFETCH_STEPS * nr * kstep + line * line_elems, False)
                for line in range(ku * nvec)
            ]

        def emit_step(step: ir.Value, u: int, prefetch_ahead: bool, next_panel: bool) -> None:
            koff = builder.load(builder.gep(ko_p, [step]))
            into_panel = builder.mul(step, panel_elems)
            bbase = builder.add(boff, into_panel)
            if next_panel:
                # the driver's share of the weights it runs next, fetched into L2 at 1/2^pfshift
                # of this block's pace (see _gemm_simd): they arrive from L3 behind the arithmetic
                # (each of a step's cache lines, so that a whole-pace block misses none)
                for line in range(step_lines):
                    at = builder.add(into_panel, ir.Constant(I64, line * line_elems))
                    ahead = builder.add(pfoff, builder.ashr(at, pfshift))
                    builder.call(
                        prefetch,
                        [builder.bitcast(builder.gep(b_p, [ahead]), I8.as_pointer()),
                         ir.Constant(I32, 0), ir.Constant(I32, 2), ir.Constant(I32, 1)],
                    )  # fmt: skip
            if prefetch_ahead:
                # the weights stream from L2 (one row, or a panel past L1): fetch ahead
                for elems, second in ahead_lines:
                    ahead = builder.add(bbase, ir.Constant(I64, elems))
                    if second:
                        ahead = builder.add(ahead, pair_off)
                    pf_ptr = builder.bitcast(builder.gep(b_p, [ahead]), I8.as_pointer())
                    builder.call(
                        prefetch,
                        [pf_ptr, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)],
                    )
            bvecs = []
            for v in range(nvec):
                vbase = builder.add(bbase, pair_off) if v >= per_panel else bbase
                at = builder.add(vbase, ir.Constant(I64, (v % per_panel) * lanes * kstep))
                bvecs.append(load_vec(builder, builder.gep(b_p, [at]), bvt))
            for r in range(mr):
                aptr = builder.gep(a_p, [builder.add(rbase[r], koff)])
                # the step's k activations of this row, as one i32 broadcast to every lane
                word = builder.load(builder.bitcast(aptr, I32.as_pointer()))
                word.align = 1
                a_words = vec_broadcast(builder, word, lanes)
                for acc_slot, b in zip(accs[r][u], bvecs, strict=True):
                    acc = spec.accumulate(builder, dot, builder.load(acc_slot), a_words, b)
                    builder.store(acc, acc_slot)

        def emit_loop(next_panel: bool, ahead: bool) -> None:
            with cgutils.for_range(builder, nouter) as loop:
                for u in range(ku):
                    step = builder.add(
                        builder.mul(loop.index, ir.Constant(I64, ku)), ir.Constant(I64, u)
                    )
                    emit_step(step, u, ahead and u == 0, next_panel)
            if ku > 1:  # the steps past the last full interleave, on the first accumulator set
                done = builder.mul(nouter, ir.Constant(I64, ku))
                with cgutils.for_range(builder, builder.sub(nk, done)) as rest:
                    emit_step(builder.add(done, rest.index), 0, False, next_panel)

        def emit_loops(next_panel: bool) -> None:
            if mr == 1 or target != "avx512_vnni":  # one row streams the weights from L2
                emit_loop(next_panel, mr == 1)
                return
            streamed = builder.icmp_signed(">", nk, ir.Constant(I64, STREAMED_PANEL_STEPS))
            with builder.if_else(streamed) as (large, small):
                with large:
                    emit_loop(next_panel, True)
                with small:
                    emit_loop(next_panel, False)

        # a copy of the loop per case, so the one that prefetches nothing (pfshift < 0, most
        # blocks; a panel that stays in L1) carries no per-step test. Blocks of two panels
        # never fetch the next ones (faster without it, measured: _gemm_simd)
        if nvec > per_panel:
            emit_loops(False)
        else:
            fetch = builder.icmp_signed(">=", pfshift, ir.Constant(I64, 0))
            with builder.if_else(fetch, likely=False) as (with_prefetch, without):
                with with_prefetch:
                    emit_loops(True)
                with without:
                    emit_loops(False)
        # epilogue, in registers
        ozp_v = vec_broadcast(builder, builder.sitofp(builder.trunc(ozp, I32), F32T), lanes)
        lo_v, hi_v, zpbits_v = clamp_round_splats(builder, ozp, qmin, qmax, lanes)
        if mode == "u8add":  # addp: [sa, pa, sb, pb, inv, floor, zp] (see the module docstring)
            addv = [
                vec_broadcast(
                    builder, builder.load(builder.gep(ap_p, [ir.Constant(I64, k)])), lanes
                )
                for k in range(7)
            ]
            # the add's own rounding bounds: codes [0, 255] around its zero point
            add_zp = addv[6]
            add_lo = builder.fsub(ir.Constant(vf32, [0.0] * lanes), add_zp)
            add_hi = builder.fsub(ir.Constant(vf32, [255.0] * lanes), add_zp)
            add_bits = builder.sub(
                ir.Constant(vi32, [ROUND_MAGIC_BITS] * lanes), builder.fptosi(add_zp, vi32)
            )
            mzp_v = builder.fsub(ir.Constant(vf32, [ROUND_MAGIC] * lanes), ozp_v)
            add_zp_i = builder.fptosi(add_zp, vi32)
        # AVX2 u8 rows (2 vectors of 8 codes) are packed to bytes with vpackssdw/vpackuswb
        packed_rows = mode in ("u8", "u8add") and lanes == 8 and nvec == 2
        masked_cols = mode in ("u8", "u8add") and target == "avx512_vnni"
        # VNNI rows of 2 or 4 vectors: codes rounded by vcvtps2dq, unclamped, then the row's
        # vectors packed to bytes with saturation (the clamp to [0, 255]), qmin/qmax applied to
        # the bytes, and stored at once: ~1.5 uops a vector fewer than clamp, round, truncate
        packed_wide = masked_cols and nvec > 1
        if packed_wide:
            ozp_i = vec_broadcast(builder, builder.trunc(ozp, I32), lanes)
            row_bytes = ir.VectorType(I8, lanes * nvec)
            qmin_b = vec_broadcast(builder, builder.trunc(qmin, I8), lanes * nvec)
            qmax_b = vec_broadcast(builder, builder.trunc(qmax, I8), lanes * nvec)
        row_codes: list[list[ir.Value]] = [[] for _ in range(mr)]
        if packed_rows:
            v16i16 = ir.VectorType(I16, 16)
            pack_dw = declare(mod, ir.FunctionType(v16i16, [vi32, vi32]), "llvm.x86.avx2.packssdw")
            pack_wb = declare(
                mod, ir.FunctionType(ir.VectorType(I8, 32), [v16i16, v16i16]),
                "llvm.x86.avx2.packuswb",
            )  # fmt: skip
        for v in range(nvec):
            jv = builder.add(j0, ir.Constant(I64, v * lanes))
            wz = load_vec(builder, builder.gep(wz_p, [jv]), vi32)
            bq = load_vec(builder, builder.gep(bq_p, [jv]), vf32)
            mu = load_vec(builder, builder.gep(mu_p, [jv]), vf32)
            raw = []
            for r in range(mr):
                acc = builder.load(accs[r][0][v])
                for u in range(1, ku):
                    acc = builder.add(acc, builder.load(accs[r][u][v]))
                raw.append(acc)
            # - wzp[j] * rowsum[i], skipped for the usual all-zero weight zero points
            wz_any = builder.icmp_unsigned(
                "!=",
                builder.bitcast(wz, ir.IntType(32 * lanes)),
                ir.Constant(ir.IntType(32 * lanes), 0),
            )
            before = builder.block
            with builder.if_then(wz_any, likely=False):
                fixed = []
                for r in range(mr):
                    ridx = builder.add(r0, ir.Constant(I64, r))
                    valid = builder.icmp_signed("<", ir.Constant(I64, r), mvalid)
                    rs = builder.load(builder.gep(rs_p, [builder.select(valid, ridx, r0)]))
                    fixed.append(
                        builder.sub(raw[r], builder.mul(wz, vec_broadcast(builder, rs, lanes)))
                    )
                fixed_end = builder.block
            vals = []
            for r in range(mr):  # phis first: they must open the merge block
                val = builder.phi(vi32)
                val.add_incoming(fixed[r], fixed_end)
                val.add_incoming(raw[r], before)
                vals.append(val)
            row_vals: list[ir.Value] = []
            # a row of C may end inside the panel (ldc = N, a multiple of the vector width, when
            # the caller wants no padded columns): vectors past it are neither read nor stored
            in_row = builder.icmp_signed("<", jv, ldc)
            # VNNI u8 rows end anywhere (ldc = N): the vector's columns before the row's end,
            # stored and (a fused add) read through masks that never touch memory past it
            cols = lanes_below(builder, builder.sub(ldc, jv), lanes) if masked_cols else None
            for r in range(mr):
                fv = builder.sitofp(vals[r], vf32)
                ridx = builder.add(r0, ir.Constant(I64, r))
                cidx = builder.add(builder.mul(ridx, ldc), jv)
                if mode in ("u8", "u8t", "u8add"):
                    t = builder.fmul(builder.fadd(fv, bq), mu)
                    if mode == "u8add":
                        x = rint_clamp_float(builder, t, lo_v, hi_v, mzp_v)
                        # x is the conv's output code; add the residual code as the add kernel
                        # does: fma(sa, qa, pa) + fma(sb, qb, pb), floor, rint(t * inv) + zp
                        sa, pa, sb, pb, inv, floor = addv[:6]  # addv[6]: add_bits above
                        # rows past mvalid and vectors past the row read the block's first
                        # row and vector instead (inside the residual; never stored)
                        valid = builder.and_(
                            builder.icmp_signed("<", ir.Constant(I64, r), mvalid), in_row
                        )
                        if cols is not None:
                            none = ir.Constant(cols.type, [0] * lanes)
                            rq = masked_load(builder, builder.gep(res_p, [cidx]),
                                             ir.VectorType(I8, lanes),
                                             builder.select(valid, cols, none))  # fmt: skip
                        else:
                            ridx0 = builder.add(builder.mul(r0, ldc), j0)
                            at = builder.select(valid, cidx, ridx0)
                            rq = load_vec(
                                builder, builder.gep(res_p, [at]), ir.VectorType(I8, lanes)
                            )
                        rf = builder.uitofp(rq, vf32)
                        t = builder.fadd(
                            builder.call(vfma, [sa, x, pa]), builder.call(vfma, [sb, rf, pb])
                        )
                        t = builder.select(builder.fcmp_ordered("<", t, floor), floor, t)
                        # clamp(rint(t * inv) + zp, 0, 255), rounded as the conv's code
                        t = builder.fmul(t, inv)
                        if packed_wide:  # the add's [0, 255] clamp is the packs' saturation
                            row_codes[r].append(rint_codes_avx512(builder, t, add_zp_i))
                            continue
                        codes = rint_clamp_codes(builder, t, add_lo, add_hi, add_bits)
                    elif packed_wide:
                        row_codes[r].append(rint_codes_avx512(builder, t, ozp_i))
                        continue
                    else:
                        # clamp to [qmin - zp, qmax - zp], round by the magic-number add, + zp
                        # as an int subtract: the integers of rint, + zp, clamp (NaN -> qmin)
                        codes = rint_clamp_codes(builder, t, lo_v, hi_v, zpbits_v)
                    if packed_rows:  # stored a whole row at a time, below
                        row_codes[r].append(codes)
                        continue
                    outv = builder.trunc(codes, ir.VectorType(I8, lanes))
                    outv = _lookup(builder, has_lut, lut_p, codes, outv)
                else:
                    outv = builder.call(vfma, [fv, mu, bq])
                if mode == "u8t":
                    row_vals.append(outv)
                    continue
                stored = builder.and_(builder.icmp_signed("<", ir.Constant(I64, r), mvalid), in_row)
                with builder.if_then(stored):
                    if cols is not None:
                        masked_store(builder, outv, builder.gep(c_p, [cidx]), cols)
                    else:
                        store_vec(builder, outv, builder.gep(c_p, [cidx]))
            if mode == "u8t":
                _store_transposed(builder, row_vals, c_p, j0, v * lanes, ldc, r0, mvalid)
        for r in range(mr) if packed_wide else []:
            outv = pack_codes_avx512(builder, row_codes[r])
            if mode == "u8":  # qmin/qmax (a fused relu or clamp) on the bytes
                outv = builder.select(builder.icmp_unsigned("<", outv, qmin_b), qmin_b, outv)
                outv = builder.select(builder.icmp_unsigned("<", qmax_b, outv), qmax_b, outv)
            outv = _lookup(builder, has_lut, lut_p, outv, outv)
            cidx = builder.add(builder.mul(builder.add(r0, ir.Constant(I64, r)), ldc), j0)
            with builder.if_then(builder.icmp_signed("<", ir.Constant(I64, r), mvalid)):
                row_cols = lanes_below(builder, builder.sub(ldc, j0), row_bytes.count)
                masked_store(builder, outv, builder.gep(c_p, [cidx]), row_cols)
        for r, (lo, hi) in enumerate(row_codes if packed_rows else []):
            # the row's 16 codes, all in [0, 255], as 16 bytes: two saturating packs and one
            # lane fix-up instead of two truncations, and one store instead of two
            words = builder.call(pack_dw, [lo, hi])  # lo0-3 hi0-3 | lo4-7 hi4-7 (int16)
            both = builder.call(pack_wb, [words, words])  # per 128-bit lane: 8 bytes, twice
            v16 = ir.VectorType(I32, 16)
            order = [0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23]
            undef = ir.Constant(both.type, ir.Undefined)
            outv = builder.shuffle_vector(both, undef, ir.Constant(v16, order))
            codes = builder.shuffle_vector(lo, hi, ir.Constant(v16, list(range(16))))
            outv = _lookup(builder, has_lut, lut_p, codes, outv)
            cidx = builder.add(builder.mul(builder.add(r0, ir.Constant(I64, r)), ldc), j0)
            with builder.if_then(builder.icmp_signed("<", ir.Constant(I64, r), mvalid)):
                whole = builder.icmp_signed("<", builder.add(j0, ir.Constant(I64, lanes)), ldc)
                with builder.if_else(whole, likely=True) as (both, first):
                    with both:
                        store_vec(builder, outv, builder.gep(c_p, [cidx]))
                    with first:  # the row ends after the panel's first vector
                        half = builder.shuffle_vector(
                            outv, ir.Constant(outv.type, ir.Undefined),
                            ir.Constant(ir.VectorType(I32, lanes), list(range(lanes))),
                        )  # fmt: skip
                        store_vec(builder, half, builder.gep(c_p, [cidx]))
        return context.get_dummy_value()

    return codegen


# (target, rows, k accumulator sets, mode, vectors a row) of every block kernel; its index is
# its number. Rows per block: 8 of 2 vectors fill 16 of the 32 zmm registers for VNNI; AVX2
# has 16 ymm registers, so 6 rows (12 accumulators), and 4 rows for 4, 5, 7 or 8 remaining
# rows. The 1-row kernels split k over 4 accumulator sets to hide the 4-cycle latency.
# ``u8t``: conv's NCHW output, channel-major transposed stores (VNNI only). VNNI's narrow
# kernels (1 vector a row, 16 rows) run a last panel whose second vector lies wholly past N
# (N = 16, 48, 144...), which the 2-vector kernels would compute for nothing. VNNI's 4-vector
# kernels (6 rows, 24 accumulators; 4 rows for a tile's last rows) run two neighbouring panels
# at once: 0.42 loads per vpdpbusd instead of 0.63, which a busy sibling hyperthread slows
# less. 12 rows x 2 vectors would load as few, but LLVM hoists the 12 broadcasts and spills.
_BLOCKS = [
    (target, mr, ku, mode, vectors)
    for target, sizes, modes, vectors in (
        ("avx512_vnni", ((8, 1), (4, 2), (1, 4)), ("u8", "f32", "u8t", "u8add"), 2),
        ("avx512_vnni", ((16, 1), (8, 2), (1, 4)), ("u8", "u8add"), 1),
        ("avx512_vnni", ((6, 1), (4, 1)), ("u8", "f32", "u8add"), 4),
        ("avx2", ((6, 1), (4, 1), (3, 2), (1, 4)), ("u8", "f32", "u8add"), 2),
        ("avx2_byte", ((6, 1), (4, 1), (3, 2), (1, 4)), ("u8", "f32", "u8add"), 2),
        ("avx_vnni", ((6, 1), (4, 1), (3, 2), (1, 4)), ("u8", "f32", "u8add"), 2),
        # NEON: 32 registers of 4 lanes; 6 rows x 4 vectors = 24 accumulators
        ("aarch64_i8mm", ((6, 1), (4, 1), (3, 2), (1, 4)), ("u8", "f32", "u8add"), 4),
        ("aarch64_dotprod", ((6, 1), (4, 1), (3, 2), (1, 4)), ("u8", "f32", "u8add"), 4),
    )
    for mode in modes
    for mr, ku in sizes
]
# Drivers name kernels by number: plain ints as closure constants pickle deterministically,
# which numba's on-disk cache key needs. Keys: (target, rows, mode, vectors a row).
KERNEL_IDS: dict[tuple[str, int, str, int], int] = {
    (target, mr, mode, vectors): i for i, (target, mr, _, mode, vectors) in enumerate(_BLOCKS)
}
_CODEGENS = [_make_kernel(*block) for block in _BLOCKS]


def _block_kernel(
    typingctx: Any,
    kind: Any,
    a: Any,
    rowoffs: Any,
    r0: Any,
    koffs: Any,
    nk: Any,
    bp: Any,
    boff: Any,
    c: Any,
    ldc: Any,
    mvalid: Any,
    colcorr: Any,
    wzp: Any,
    rowsum: Any,
    biasq: Any,
    mult: Any,
    j0: Any,
    ozp: Any,
    qmin: Any,
    qmax: Any,
    res: Any,
    addp: Any,
    lut: Any,
    pfoff: Any,
    pfshift: Any,
) -> Any:
    """``block_kernel(KERNEL_IDS[(target, rows, mode, vectors)], <that block kernel's 24
    arguments>)``.

    ``kind`` must be a compile-time constant; the call then is exactly that block kernel.
    """
    if not isinstance(kind, types.IntegerLiteral):
        return None  # numba retries with the literal type when the value is a constant
    args = (a, rowoffs, r0, koffs, nk, bp, boff, c, ldc, mvalid, colcorr, wzp, rowsum)
    inner_sig = types.void(*args, biasq, mult, j0, ozp, qmin, qmax, res, addp, lut, pfoff, pfshift)
    inner_codegen = _CODEGENS[kind.literal_value]

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, cargs: Any) -> ir.Value:
        return inner_codegen(context, builder, inner_sig, cargs[1:])

    return types.void(kind, *inner_sig.args), codegen


# typed Any: callers pass the 25 arguments, not numba's typing context
block_kernel: Any = intrinsic(_block_kernel)
