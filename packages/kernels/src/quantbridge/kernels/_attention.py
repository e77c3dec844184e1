"""Scaled dot-product attention on uint8 codes: ``softmax(q k^T * scale + mask) v`` per
(batch, head) in one call, the result requantized or float32.

q, k and v are the codes the projections wrote, seen per head as [B, H, S, D] with any strides:
the usual transposed view of a [B, S, H * D] projection output is read in place, so no
dequantize pass and no copy runs before the attention. Per (batch, head), 8 queries a block:

- ``q k^T`` is exact: ``vpdpbusd`` on AVX-512 VNNI (q's codes times ``k - 128``, plus row
  and column corrections), else float32 FMA blocks summing the integer products (exact while
  a sum stays below 2^24: head sizes up to 256 at full-range codes); the same bytes either way;
- logits ``dot * (sq * sk * scale) + mask``; ``exp(v - max)`` of the block's rows side by
  side, unnormalized;
- ``out = sv / sum(p) * sum_j p_j (v_j - zv)`` (float32 FMA blocks), then quantized as
  ``quantize_per_tensor`` does (``rint(fma(out, 1 / scale, zero_point))``, clamped) or kept
  float32.

Keys past the last one a block's queries can see (``-inf`` or False in the mask: a padding
mask's tail, a causal mask's future) are left out in whole 32-key blocks. Their probabilities
are exactly 0, so the bytes are those of the full computation, and padded batches cost what
their visible keys cost.

The reference (dequantize, float attention, quantize) rounds its float steps in another order,
so an output code can differ from it by one step. A row whose mask is ``-inf`` (or False)
everywhere gives zeros, as torch's ``scaled_dot_product_attention`` does.

The output is a [B, H, Sq, Dv] view of a [B, Sq, H, Dv] buffer: ``out.transpose(1, 2)`` is
C-contiguous, so merging the heads back into [B, Sq, H * Dv] copies nothing.

The compiled driver takes the call as named records (NamedTuples, which numba passes as their
fields), made once per call: ``AttnCodes``, ``AttnLogits`` and ``AttnOutput``; the
``vpdpbusd`` block reads a head's packed keys as one ``VnniKeys``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from quantbridge.kernels._checks import check_array, check_scale, check_zero_point
from quantbridge.kernels._errors import KernelError
from quantbridge.kernels._float_math import FAST, RowSteps, flat_f32, scaled_row, vexp
from quantbridge.kernels._ir import (
    declare,
    load_vec,
    record_fields,
    stack_slot,
    store_vec,
    vec_broadcast,
)
from quantbridge.kernels._numba_compat import compiled_entry_point
from quantbridge.kernels._qparams import QParams, as_qparams
from quantbridge.kernels._targets import needs_features, resolve_target, target_features
from quantbridge.kernels._threads import apply_num_threads, with_threads
from quantbridge.kernels._vnni import accumulate, declare_dot

# multiply-adds below which one thread runs (a parallel launch costs ~20 us)
PARALLEL_MIN_ATTENTION_WORK = 1 << 21
# the largest head size whose integer q.k sums stay exact in float32 at full-range codes
EXACT_HEAD_SIZE = (1 << 24) // (255 * 255)
# the float block: rows x (vectors of 16 floats); 16 accumulators of the 32 zmm registers
_ROWS, _VECS, _VL = 8, 2, 16
_COLS = _VECS * _VL

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]


class AttnCodes(NamedTuple):
    """The inputs: q, k and v codes [B, H, Sq, D], [B, H, Sk, D], [B, H, Sk, Dv] (any strides)
    and their zero points."""

    q: U8
    k: U8
    v: U8
    zq: int
    zk: int
    zv: int


class AttnLogits(NamedTuple):
    """How ``q . k`` becomes logits: ``dot * scale + add[row, j]``, ``add`` the compact
    mask's rows (``_compact_mask``, flat) for (batch, head, query) sizes ``(mb, mh, mq)``,
    each 1 where it broadcasts; ``kend[row]``: one past the row's last key not hidden."""

    scale: np.float32  # q_scale * k_scale * the attention's scale
    add: F32
    kend: npt.NDArray[np.int64]
    mb: int
    mh: int
    mq: int


class AttnOutput(NamedTuple):
    """How the weighted sums of ``v - zv`` become the result, [B, Sq, H, Dv] flat: times
    ``v_scale / sum(p)``, then into ``codes`` by quantize_per_tensor's rule (``inv`` = 1 /
    scale, zero point ``zp``) when ``quantized``, else into ``floats``; the other is empty."""

    v_scale: np.float32
    quantized: bool
    inv: np.float32
    zp: np.float32
    codes: U8
    floats: F32


class VnniKeys(NamedTuple):
    """One head's keys as ``qk_vnni`` reads them: ``kp``, k as int8 (``k - 128``), the four
    head values ``4g .. 4g + 3`` of key ``j`` at ``kp[(g * skp + j) * 4]``; ``ngroups`` such
    groups, ``skp`` keys rounded up to 32; the corrections that turn ``sum q (k - 128)`` into
    ``sum (q - zq)(k - zk)``: ``colc`` per key, ``rowc`` per query row."""

    kp: npt.NDArray[np.int8]
    colc: npt.NDArray[np.int32]
    rowc: npt.NDArray[np.int32]
    skp: int
    ngroups: int


def _block_codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
    a, aoff, lda, b, boff, ldb, c, coff, ldc, kdim = args
    a_p, b_p, c_p = (
        context.make_array(sig.args[i])(context, builder, arr).data
        for i, arr in ((0, a), (3, b), (6, c))
    )
    f32, i64 = ir.FloatType(), ir.IntType(64)
    vt = ir.VectorType(f32, _VL)
    fma = declare(builder.module, ir.FunctionType(vt, [vt, vt, vt]), f"llvm.fma.v{_VL}f32")
    zero = ir.Constant(vt, [0.0] * _VL)
    accs = [[stack_slot(builder, zero) for _ in range(_VECS)] for _ in range(_ROWS)]
    rows = [builder.add(aoff, builder.mul(lda, ir.Constant(i64, r))) for r in range(_ROWS)]
    with cgutils.for_range(builder, kdim) as loop:
        brow = builder.add(boff, builder.mul(loop.index, ldb))
        bv = [
            load_vec(builder, builder.gep(b_p, [builder.add(brow, ir.Constant(i64, v * _VL))]), vt)
            for v in range(_VECS)
        ]
        for r in range(_ROWS):
            at = builder.gep(a_p, [builder.add(rows[r], loop.index)])
            av = vec_broadcast(builder, builder.load(at), _VL)
            for v in range(_VECS):
                acc = builder.call(fma, [av, bv[v], builder.load(accs[r][v])])
                builder.store(acc, accs[r][v])
    for r in range(_ROWS):
        crow = builder.add(coff, builder.mul(ldc, ir.Constant(i64, r)))
        for v in range(_VECS):
            at = builder.gep(c_p, [builder.add(crow, ir.Constant(i64, v * _VL))])
            store_vec(builder, builder.load(accs[r][v]), at)
    return context.get_dummy_value()


@intrinsic
def _f32_block(
    typingctx: Any, a: Any, aoff: Any, lda: Any, b: Any, boff: Any, ldb: Any, c: Any, coff: Any,
    ldc: Any, kdim: Any,
) -> Any:  # fmt: skip
    """``c[8 x 32] = a[8 x kdim] @ b[kdim x 32]`` on flat float32 arrays: row ``r`` of ``a``
    at ``aoff + r * lda``, row ``k`` of ``b`` at ``boff + k * ldb``, row ``r`` of ``c`` at
    ``coff + r * ldc``; 16 vector accumulators, one FMA per ``a`` value and 16 columns."""
    if not all(map(flat_f32, (a, b, c))):
        return None
    return types.void(a, aoff, lda, b, boff, ldb, c, coff, ldc, kdim), _block_codegen


if TYPE_CHECKING:

    def f32_block(
        a: Any, aoff: int, lda: int, b: Any, boff: int, ldb: int, c: Any, coff: int, ldc: int,
        kdim: int,
    ) -> None:  # fmt: skip
        """See ``_f32_block`` (numba code only)."""

else:
    f32_block = _f32_block


def _qk_vnni_codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
    q, qoff, qld, mvalid, keys, i0, j0, out = args
    q_p, o_p = (
        context.make_array(sig.args[i])(context, builder, arr).data for i, arr in ((0, q), (7, out))
    )
    kp_p, cc_p, rc_p, skp, ngroups = record_fields(
        context, builder, sig.args[4], keys, ("kp", "colc", "rowc", "skp", "ngroups")
    )
    i64, i32 = ir.IntType(64), ir.IntType(32)
    # block (i0, j0): keys j0.. at byte 4 * j0 of each group of skp keys, logits row r at
    # out[j0 + r * skp], the corrections at colc[j0..] and rowc[i0..]
    koff = builder.mul(j0, ir.Constant(i64, 4))
    gstride = builder.mul(skp, ir.Constant(i64, 4))
    ooff, ldo, coff, roff = j0, skp, j0, i0
    vi32 = ir.VectorType(i32, _VL)
    vf32 = ir.VectorType(ir.FloatType(), _VL)
    bvt = ir.VectorType(ir.IntType(8), 4 * _VL)
    dot = declare_dot(builder.module, vi32, bvt)
    # rows past mvalid repeat the last valid one (never read past the head's rows)
    last = builder.sub(mvalid, ir.Constant(i64, 1))
    rows = []
    for r in range(_ROWS):
        rr = ir.Constant(i64, r)
        ridx = builder.select(builder.icmp_signed("<", rr, last), rr, last)
        rows.append(builder.add(qoff, builder.mul(ridx, qld)))
    # the accumulators start from the column corrections
    ccs = [
        load_vec(builder, builder.gep(cc_p, [builder.add(coff, ir.Constant(i64, v * _VL))]), vi32)
        for v in range(_VECS)
    ]
    accs = [[stack_slot(builder, ccs[v]) for v in range(_VECS)] for _ in range(_ROWS)]
    with cgutils.for_range(builder, ngroups) as loop:
        kb = builder.add(koff, builder.mul(loop.index, gstride))
        bvecs = [
            load_vec(builder, builder.gep(kp_p, [builder.add(kb, ir.Constant(i64, 64 * v))]), bvt)
            for v in range(_VECS)
        ]
        at = builder.mul(loop.index, ir.Constant(i64, 4))
        for r in range(_ROWS):
            word = builder.load(
                builder.bitcast(builder.gep(q_p, [builder.add(rows[r], at)]), i32.as_pointer())
            )
            word.align = 1
            words = vec_broadcast(builder, word, _VL)
            for v in range(_VECS):
                acc = accumulate(builder, dot, builder.load(accs[r][v]), words, bvecs[v])
                builder.store(acc, accs[r][v])
    for r in range(_ROWS):
        rc = builder.load(builder.gep(rc_p, [builder.add(roff, ir.Constant(i64, r))]))
        rc_v = vec_broadcast(builder, rc, _VL)
        orow = builder.add(ooff, builder.mul(ldo, ir.Constant(i64, r)))
        for v in range(_VECS):
            total = builder.sitofp(builder.add(builder.load(accs[r][v]), rc_v), vf32)
            at = builder.gep(o_p, [builder.add(orow, ir.Constant(i64, v * _VL))])
            store_vec(builder, total, at)
    return context.get_dummy_value()


@intrinsic
def _qk_vnni(
    typingctx: Any, q: Any, qoff: Any, qld: Any, mvalid: Any, keys: Any, i0: Any, j0: Any,
    out: Any,
) -> Any:  # fmt: skip
    """The 8 x 32 block ``(i0, j0)`` of integer ``q . k`` logits with ``vpdpbusd`` (AVX-512
    VNNI only), the keys a ``VnniKeys``.

    Row ``r`` of q: ``ngroups * 4`` uint8 codes at byte ``qoff + min(r, mvalid - 1) * qld`` of
    ``q``'s data (query ``i0 + r``). ``out[j0 + r * skp + j]`` (float32, exact) = ``acc +
    colc[j0 + j] + rowc[i0 + r]``: the corrections make it ``sum (q - zq)(k - zk)``."""
    if not (isinstance(q, types.Array) and q.dtype == types.uint8):
        return None
    if not (isinstance(keys, types.NamedTuple) and keys.fields == VnniKeys._fields):
        return None
    kp, colc, rowc, skp, ngroups = keys.types
    if not (skp == ngroups == i0 == j0 == types.int64):  # the codegen's i64 values
        return None
    if not (isinstance(kp, types.Array) and kp.dtype == types.int8 and kp.layout == "C"):
        return None
    for t in (colc, rowc):
        if not (isinstance(t, types.Array) and t.dtype == types.int32 and t.layout == "C"):
            return None
    if not flat_f32(out):
        return None
    return types.void(q, qoff, qld, mvalid, keys, i0, j0, out), _qk_vnni_codegen


if TYPE_CHECKING:

    def qk_vnni(
        q: Any, qoff: int, qld: int, mvalid: int, keys: VnniKeys, i0: int, j0: int, out: Any
    ) -> None:
        """See ``_qk_vnni`` (numba code only)."""

else:
    qk_vnni = _qk_vnni


def _exp_block_codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
    x, xoff, ld, mask, moffs, n, scale, sums = args
    x_p, m_p, mo_p, s_p = (
        context.make_array(sig.args[i])(context, builder, arr).data
        for i, arr in ((0, x), (3, mask), (4, moffs), (7, sums))
    )
    f32, i64 = ir.FloatType(), ir.IntType(64)
    row = RowSteps(builder, n)
    vt, zero, load, each = row.vt, row.zero, row.load, row.each
    mod = builder.module
    rmax = declare(mod, ir.FunctionType(f32, [vt]), f"llvm.vector.reduce.fmax.v{_VL}f32")
    radd = declare(mod, ir.FunctionType(f32, [f32, vt]), f"llvm.vector.reduce.fadd.v{_VL}f32")
    fma = declare(mod, ir.FunctionType(vt, [vt, vt, vt]), f"llvm.fma.v{_VL}f32")
    minus_inf = ir.Constant(vt, [float("-inf")] * _VL)
    xrows = [builder.add(xoff, builder.mul(ld, ir.Constant(i64, r))) for r in range(_ROWS)]
    mrows = [builder.load(builder.gep(mo_p, [ir.Constant(i64, r)])) for r in range(_ROWS)]
    scale_v = vec_broadcast(builder, scale, _VL)

    def store(v: ir.Value, off: ir.Value, at: ir.Value, valid: ir.Value | None) -> None:
        row.store(v, x_p, off, at, valid)

    # pass 1: v = x * scale + mask in place; the eight rows' maxima side by side
    tops = [stack_slot(builder, minus_inf) for _ in range(_ROWS)]

    def first(at: ir.Value, valid: ir.Value | None) -> None:
        for r in range(_ROWS):
            v = builder.call(fma, [load(x_p, xrows[r], at, valid), scale_v,
                                   load(m_p, mrows[r], at, valid)])  # fmt: skip
            store(v, xrows[r], at, valid)
            v = row.only(valid, v, minus_inf)
            old = builder.load(tops[r])
            builder.store(builder.select(builder.fcmp_ordered(">", v, old), v, old), tops[r])

    each(first)
    top_v = [vec_broadcast(builder, builder.call(rmax, [builder.load(t)]), _VL) for t in tops]
    # pass 2: e = exp(v - max) in place, and each row's sum
    totals = [stack_slot(builder, zero) for _ in range(_ROWS)]

    def second(at: ir.Value, valid: ir.Value | None) -> None:
        for r in range(_ROWS):
            e = vexp(builder, builder.fsub(load(x_p, xrows[r], at, valid), top_v[r]))
            store(e, xrows[r], at, valid)
            e = row.only(valid, e, zero)
            builder.store(builder.fadd(builder.load(totals[r]), e), totals[r])

    each(second)
    for r in range(_ROWS):
        total = builder.call(radd, [ir.Constant(f32, 0.0), builder.load(totals[r])])
        builder.store(total, builder.gep(s_p, [ir.Constant(i64, r)]))
    return context.get_dummy_value()


@intrinsic
def _exp_block(
    typingctx: Any, x: Any, xoff: Any, ld: Any, mask: Any, moffs: Any, n: Any, scale: Any,
    sums: Any,
) -> Any:  # fmt: skip
    """Eight rows of unnormalized softmax in place: ``x[xoff + r * ld + j]`` for ``j < n``
    becomes ``exp(v - max_j v)`` with ``v = x * scale + mask[moffs[r] + j]``, and
    ``sums[r]`` their sum. The rows run side by side (eight independent dependency chains)."""
    if not (flat_f32(x) and flat_f32(mask) and flat_f32(sums) and scale == types.float32):
        return None
    if not (isinstance(moffs, types.Array) and moffs.dtype == types.int64 and moffs.ndim == 1):
        return None
    return types.void(x, xoff, ld, mask, moffs, n, scale, sums), _exp_block_codegen


if TYPE_CHECKING:

    def exp_block(
        x: Any, xoff: int, ld: int, mask: Any, moffs: Any, n: int, scale: float, sums: Any
    ) -> None:
        """See ``_exp_block`` (numba code only)."""

else:
    exp_block = _exp_block


def _make_heads(parallel: bool, vnni: bool) -> Any:
    def heads(codes, logits, output, nchunks):  # type: ignore[no-untyped-def]
        """Every (batch, head) pair, in ``nchunks`` runs."""
        q, k, v, zq, zk, zv = codes
        logit_scale, madd, kend, mb, mh, mq = logits
        v_scale, quantized, inv, ozp, outq, outf = output
        nb, nh, sq, d = q.shape
        sk = k.shape[2]
        dv = v.shape[3]
        # padded sizes: whole 8-row, 32-column blocks; the padding holds zeros
        sqp = (sq + 7) // 8 * 8
        skp = (sk + 31) // 32 * 32
        dvp = (dv + 31) // 32 * 32
        ng = d // 4
        ntasks = nb * nh
        # (batch, head) pairs in nchunks runs, each with its own scratch: allocated and its
        # padding zeroed once, every head writing the same unpadded part
        for chunk in prange(nchunks):  # a plain range when parallel=False
            kp = np.zeros(ng * skp * 4 if vnni else 0, np.int8)
            colc = np.zeros(skp, np.int32)
            rowc = np.zeros(sqp, np.int32)
            qf = np.zeros(0 if vnni else sqp * d, np.float32)
            kt = np.zeros(0 if vnni else d * skp, np.float32)
            vf = np.zeros(skp * dvp, np.float32)
            probs = np.zeros(8 * skp, np.float32)  # logits, then exp(logit - max) in place
            o = np.empty(8 * dvp, np.float32)
            sums = np.empty(8, np.float32)
            moffs = np.zeros(8, np.int64)
            keys = VnniKeys(kp, colc, rowc, skp, ng)
            for t in range(chunk * ntasks // nchunks, (chunk + 1) * ntasks // nchunks):
                b = t // nh
                h = t - b * nh
                qoff = b * q.strides[0] + h * q.strides[1]
                qld = q.strides[2]
                mrow_b = (b if mb > 1 else 0) * mh + (h if mh > 1 else 0)
                # keys past the last one any query of this head sees are never read as such
                # (see kb below): k and v are converted up to there, in whole 32-key blocks
                klim = 0
                for mi in range(mq):
                    klim = max(klim, kend[mrow_b * mq + mi])
                sku = min(sk, max(32, (klim + 31) // 32 * 32))
                if vnni:
                    # k as int8 (k - 128), four head values of each key together; the
                    # corrections that turn sum q (k - 128) into sum (q - zq)(k - zk)
                    for j in range(sku):
                        ksum = 0
                        for c in range(d):
                            kv = np.int32(k[b, h, j, c])
                            ksum += kv
                            kp[((c >> 2) * skp + j) * 4 + (c & 3)] = np.int8(kv - 128)
                        colc[j] = d * zq * zk - zq * ksum
                    for i in range(sq):
                        qsum = 0
                        for c in range(d):
                            qsum += np.int32(q[b, h, i, c])
                        rowc[i] = (128 - zk) * qsum
                else:
                    # q and k (transposed) as float32 code offsets, contiguous
                    for i in range(sq):
                        for c in range(d):
                            qf[i * d + c] = np.float32(np.int32(q[b, h, i, c]) - zq)
                    for j in range(sku):
                        for c in range(d):
                            kt[c * skp + j] = np.float32(np.int32(k[b, h, j, c]) - zk)
                for j in range(sku):
                    for c in range(dv):
                        vf[j * dvp + c] = np.float32(np.int32(v[b, h, j, c]) - zv)
                for i0 in range(0, sq, 8):
                    rows = min(8, sq - i0)
                    seen = 0  # the keys these 8 rows can see end here: the rest is -inf
                    for r in range(8):  # rows past sq repeat the last one's mask row
                        moffs[r] = (mrow_b * mq + (i0 + min(r, rows - 1) if mq > 1 else 0)) * sk
                        seen = max(seen, kend[moffs[r] // sk])
                    # whole 32-key blocks up to there: a hidden key's exp is exactly 0, so
                    # leaving out the keys past the last visible one (a padding mask's tail, a
                    # causal mask's future) changes no sum
                    kb = min(skp, max(32, (seen + 31) // 32 * 32))
                    for j0 in range(0, kb, 32):
                        if vnni:
                            qk_vnni(q, qoff + i0 * qld, qld, rows, keys, i0, j0, probs)
                        else:
                            f32_block(qf, i0 * d, d, kt, j0, skp, probs, j0, skp, d)
                    exp_block(probs, 0, skp, madd, moffs, min(kb, sk), logit_scale, sums)
                    for c0 in range(0, dvp, 32):
                        f32_block(probs, 0, skp, vf, c0, dvp, o, c0, dvp, kb)
                    for r in range(rows):
                        at = ((b * sq + i0 + r) * nh + h) * dv
                        # a row whose mask hides every key gives zeros
                        dead = kend[moffs[r] // sk] == 0
                        scale = np.float32(0.0) if dead else v_scale / sums[r]
                        if quantized:  # quantize_per_tensor's rule
                            scaled_row(o, r * dvp, scale, outq, at, dv, inv, ozp)
                        else:
                            scaled_row(o, r * dvp, scale, outf, at, dv, inv, ozp)

    name = ("attention_vnni_" if vnni else "attention_") + ("parallel" if parallel else "serial")
    heads.__name__ = heads.__qualname__ = name
    compiled = njit(cache=True, parallel=parallel, nogil=True, fastmath=FAST, error_model="numpy")(
        heads
    )
    return needs_features(target_features("avx512_vnni"), compiled) if vnni else compiled


# [vnni][parallel]: the VNNI ones compile on first use only, on CPUs that have it
_HEADS = ((_make_heads(False, False), _make_heads(True, False)),
          (_make_heads(False, True), _make_heads(True, True)))  # fmt: skip
# the array flags in numba's type of q, k and v: C / F contiguous (the layout), writeable
_TYPE_FLAGS = 0x1 | 0x2 | 0x400  # NPY_ARRAY_C_CONTIGUOUS | F_CONTIGUOUS | WRITEABLE
# the output a call does not write (AttnOutput): empty, shared
_NO_CODES = np.empty(0, np.uint8)
_NO_FLOATS = np.empty(0, np.float32)
# the compiled entry points by (vnni, parallel, q, k and v's flags & _TYPE_FLAGS)
_ENTRIES: dict[tuple[bool, bool, int, int, int], Any] = {}


def _codes(name: str, x: object) -> npt.NDArray[np.uint8]:
    a = check_array(name, x, np.uint8, 4, contiguous=False)
    if 0 in a.shape:
        raise KernelError(f"{name}: expected no empty dimension, got shape {a.shape}")
    return a


def _compact_mask(
    mask: object, shape: tuple[int, int, int, int]
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], tuple[int, int, int]]:
    """The additive float32 mask as contiguous rows [mb * mh * mq, Sk], where each row's
    visible keys end (``kend``: one past the last key not hidden, 0 for a row that hides every
    key), and (mb, mh, mq): each 1 where the mask broadcasts (a size-1 or stride-0 dimension,
    e.g. an ``expand``-ed padding mask), so nothing is copied per head or query."""
    sk = shape[3]
    if mask is None:
        return np.zeros((1, sk), np.float32), np.array([sk], np.int64), (1, 1, 1)
    m = check_array("mask", mask, (np.float32, np.bool_), None, contiguous=False)
    if not 1 <= m.ndim <= 4:
        raise KernelError(f"mask: expected 1 to 4 dimensions, got shape {m.shape}")
    m4: npt.NDArray[Any] = m.reshape((1,) * (4 - m.ndim) + m.shape)
    for axis in range(4):
        if m4.shape[axis] not in (1, shape[axis]):
            raise KernelError(
                f"mask: shape {m.shape} does not broadcast to the attention's [B, H, Sq, Sk] = "
                f"{list(shape)} (dimension {axis - 4 + m.ndim} has {m4.shape[axis]})"
            )
    if m4.shape[3] != sk:
        m4 = np.broadcast_to(m4, (*m4.shape[:3], sk))
    # a repeated (stride-0) leading dimension is read once
    m4 = m4[tuple(slice(0, 1) if m4.strides[a] == 0 else slice(None) for a in range(3))]
    dims = (int(m4.shape[0]), int(m4.shape[1]), int(m4.shape[2]))
    add = np.empty((dims[0] * dims[1] * dims[2], sk), np.float32)
    kend = np.empty(add.shape[0], np.int64)
    is_bool = m4.dtype == np.bool_
    rows = np.ascontiguousarray(m4).reshape(-1, sk)
    _mask_rows(rows.view(np.uint8) if is_bool else rows, is_bool, add, kend)
    return add, kend, dims


@njit(cache=True, nogil=True)
def _mask_rows(m, is_bool, add, kend):  # type: ignore[no-untyped-def]  # numba types the arguments
    """``add`` [rows, Sk]: the mask rows ``m`` (C-contiguous) as an additive float32 mask
    (``is_bool``: a bool mask viewed as uint8, nonzero -> 0, zero -> -inf); ``kend[row]``: one
    past the row's last key that is not -inf (0: every key hidden). One compiled pass:
    numpy's where / any took ~35 us for a 128x128 mask."""
    rows, sk = m.shape
    minus_inf = np.float32(-np.inf)
    for row in range(rows):
        end = 0
        for j in range(sk):
            if is_bool:
                f = np.float32(0.0) if m[row, j] != 0 else minus_inf
            else:
                f = np.float32(m[row, j])
            add[row, j] = f
            if f != minus_inf:
                end = j + 1
        kend[row] = end


def attention(
    q: npt.NDArray[np.uint8],
    k: npt.NDArray[np.uint8],
    v: npt.NDArray[np.uint8],
    q_qparams: QParams | tuple[float, int],
    k_qparams: QParams | tuple[float, int],
    v_qparams: QParams | tuple[float, int],
    *,
    mask: npt.NDArray[np.float32] | npt.NDArray[np.bool_] | None = None,
    scale: float | None = None,
    causal: bool = False,
    out_qparams: QParams | tuple[float, int] | None = None,
    target: str | None = None,
    num_threads: int | None = None,
) -> npt.NDArray[Any]:
    """``softmax(q @ k^T * scale + mask) @ v`` on uint8 codes [B, H, Sq, D], [B, H, Sk, D],
    [B, H, Sk, Dv] (any strides).

    ``scale`` defaults to ``1 / sqrt(D)``. ``mask``: float32 (added to the logits) or bool
    (True takes part), broadcasting to [B, H, Sq, Sk]. ``causal``: query ``i`` sees keys
    ``j <= i`` (torch's ``is_causal``; not together with ``mask``). With ``out_qparams`` the
    result is uint8 codes, else float32; either way a [B, H, Sq, Dv] view whose
    ``transpose(1, 2)`` is C-contiguous (module docstring).
    """
    qa, ka, va = _codes("q", q), _codes("k", k), _codes("v", v)
    nb, nh, sq, d = (int(n) for n in qa.shape)
    sk, dv = int(ka.shape[2]), int(va.shape[3])
    if ka.shape[:2] != (nb, nh) or va.shape[:2] != (nb, nh):
        raise KernelError(
            f"q, k, v: expected the same batch and head dimensions, got {qa.shape}, {ka.shape}, "
            f"{va.shape} (repeat k/v heads for grouped-query attention)"
        )
    if ka.shape[3] != d or va.shape[2] != sk:
        raise KernelError(
            f"q, k, v: expected k [B, H, Sk, {d}] and v [B, H, Sk, Dv] matching q {qa.shape}, "
            f"got k {ka.shape} and v {va.shape}"
        )
    if d > EXACT_HEAD_SIZE:
        raise KernelError(f"q: head size {d} is past the exact limit {EXACT_HEAD_SIZE}")
    params = []
    for name, qp in (("q_qparams", q_qparams), ("k_qparams", k_qparams), ("v_qparams", v_qparams)):
        s, zp = as_qparams(name, qp)
        params.append(
            (check_scale(f"{name}.scale", s), check_zero_point(f"{name}.zero_point", zp, 0, 255))
        )
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(sc):
        raise KernelError(f"scale: expected a finite number, got {scale!r}")
    logit_scale = np.float32(params[0][0] * params[1][0] * sc)
    v_scale = np.float32(params[2][0])
    if not math.isfinite(logit_scale):  # math's: a tenth of numpy's cost on a scalar
        raise KernelError(f"q_scale * k_scale * scale = {logit_scale} is not a finite float32")
    if causal:
        if mask is not None:
            raise KernelError("mask and causal: give one (fold the causal part into the mask)")
        mask = np.tri(sq, sk, dtype=np.bool_)[None, None]
    madd, kend, (mb, mh, mq) = _compact_mask(mask, (nb, nh, sq, sk))
    out: npt.NDArray[Any]  # [B, Sq, H, Dv]
    if out_qparams is None:
        out = np.empty((nb, sq, nh, dv), np.float32)
        output = AttnOutput(v_scale, False, np.float32(1.0), np.float32(0.0), _NO_CODES,
                            out.reshape(-1))  # fmt: skip
    else:
        so, zo = as_qparams("out_qparams", out_qparams)
        so = check_scale("out_qparams.scale", so)
        zo = check_zero_point("out_qparams.zero_point", zo, 0, 255)
        out = np.empty((nb, sq, nh, dv), np.uint8)
        output = AttnOutput(v_scale, True, np.float32(1.0) / np.float32(so), np.float32(zo),
                            out.reshape(-1), _NO_FLOATS)  # fmt: skip
    # q . k on vpdpbusd where the CPU has it (q read 4 codes at a time: a head size of a
    # multiple of 4, each row contiguous); float32 FMA blocks otherwise
    vnni = resolve_target(target) == "avx512_vnni" and d % 4 == 0
    if vnni and (qa.strides[3] != 1 or min(qa.strides) < 0):
        qa = np.ascontiguousarray(qa)
    threads = apply_num_threads(num_threads, "attention")
    work = nb * nh * sq * sk * (d + dv)
    parallel = not (threads == 1 or work < PARALLEL_MIN_ATTENTION_WORK or nb * nh < 2)
    chunks = min(nb * nh, threads) if parallel else 1
    args = (
        AttnCodes(qa, ka, va, params[0][1], params[1][1], params[2][1]),
        AttnLogits(logit_scale, madd.reshape(-1), kend, mb, mh, mq),
        output,
        chunks,
    )
    # every argument but q, k and v has one type: their layouts and writeability pick the
    # driver's compiled entry point, found through numba's dispatcher by the first call;
    # later calls skip its type dispatch, which types records in Python (+8 us a call)
    key = (vnni, parallel, qa.flags.num & _TYPE_FLAGS, ka.flags.num & _TYPE_FLAGS,
           va.flags.num & _TYPE_FLAGS)  # fmt: skip
    entry = _ENTRIES.get(key)
    fn = _HEADS[vnni][parallel] if entry is None else entry
    (with_threads(fn, threads) if parallel else fn)(*args)
    if entry is None:
        entry = compiled_entry_point(fn, args)
        if entry is not None:  # None after a dry run's record (targets/dry_run.py)
            _ENTRIES[key] = entry
    heads_view: npt.NDArray[Any] = out.transpose(0, 2, 1, 3)
    return heads_view
