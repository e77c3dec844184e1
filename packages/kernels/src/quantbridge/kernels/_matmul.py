"""Quantized matmul of two activations (attention-style), batched: [B, M, K] x [B, K, N].

``a`` is uint8; ``b`` is uint8 or int8, each with a per-tensor scale and zero point. A uint8
``b`` is shifted to int8 (``b - 128``, zero point ``b_zp - 128``) so the int8-weight kernels
apply unchanged. One call covers every batch (attention's (batch, head) pairs): one compiled
pass packs each batch's ``b`` into the target's panel layout (it is an activation, not a
weight) with its column sums, and widens ``a`` where the target needs it; then one batched
driver runs every (batch, panel, row chunk) tile, in parallel when threads allow. No Python
loop over batches, and each operand is packed exactly once per call.
The result is requantized to uint8 with the rule in ``_requant.py`` (no bias):
``clamp(rint(float32(acc) * mult) + out_zp)``, ``mult = float32(a_s * b_s) / float32(out_s)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from numba import njit, prange

from quantbridge.kernels._block_kernels import activation_offset
from quantbridge.kernels._checks import (
    check_accumulation_fits_int32,
    check_array,
    check_derived,
    check_scale,
    check_zero_point,
)
from quantbridge.kernels._epilogue_lut import NO_LUT
from quantbridge.kernels._errors import KernelError
from quantbridge.kernels._gemm import batched_drive_generic, batched_serial_generic
from quantbridge.kernels._gemm_run import NO_ADD, NO_RESIDUAL, SERIAL_BELOW
from quantbridge.kernels._gemm_simd import (
    batched_drive_a64dot_u8,
    batched_drive_a64i8mm_u8,
    batched_drive_avx2_u8,
    batched_drive_avxvnni_u8,
    batched_drive_vnni_u8,
    batched_serial_a64dot_u8,
    batched_serial_a64i8mm_u8,
    batched_serial_avx2_u8,
    batched_serial_avxvnni_u8,
    batched_serial_vnni_u8,
)
from quantbridge.kernels._linear import _fast_zp
from quantbridge.kernels._pack import K_ALIGN, layout, round_up
from quantbridge.kernels._qparams import QParams, as_qparams
from quantbridge.kernels._targets import resolve_target
from quantbridge.kernels._threads import apply_num_threads, with_threads

_BATCHED = {
    "avx512_vnni": (batched_serial_vnni_u8, batched_drive_vnni_u8),
    "avx_vnni": (batched_serial_avxvnni_u8, batched_drive_avxvnni_u8),
    "avx2": (batched_serial_avx2_u8, batched_drive_avx2_u8),
    "aarch64_i8mm": (batched_serial_a64i8mm_u8, batched_drive_a64i8mm_u8),
    "aarch64_dotprod": (batched_serial_a64dot_u8, batched_drive_a64dot_u8),
    "generic": (batched_serial_generic, batched_drive_generic),
}


def _make_prepare(parallel: bool) -> Any:
    def prepare(  # type: ignore[no-untyped-def]  # numba types the arguments
        a3, b3, shift, nr, ks, kp, lda, a_zp, offset, wzp, abuf, bp, colcorr, rowsum, widen, sums
    ):
        """Per batch g: pack ``b3[g] - shift`` (as ``w[j, k] = b[k, j]``) into ``bp``, its
        column corrections into ``colcorr``, copy/widen ``a3[g]`` into ``abuf`` (``widen``)
        and its row sums into ``rowsum`` (``sums``). ``bp``/``abuf`` arrive zeroed."""
        nb, m, k = a3.shape
        n = b3.shape[2]
        np_ = colcorr.shape[0] // nb
        bsz = np_ * kp
        npan = (n + nr - 1) // nr
        for g in prange(nb):  # a plain range when parallel=False
            base = g * bsz
            col = np.zeros(n, np.int64)
            for kk in range(k):
                s = kk // ks
                row = base + s * nr * ks + (kk - s * ks)
                # no division per element: panel by panel, a contiguous source run into
                # every ks-th byte of the panel's k step
                for p in range(npan):
                    dst = row + p * kp * nr
                    j0 = p * nr
                    for jj in range(min(nr, n - j0)):
                        v = np.int32(b3[g, kk, j0 + jj]) - shift
                        bp[dst + jj * ks] = v
                        col[j0 + jj] += v
            for j in range(np_):
                cs = col[j] if j < n else 0
                colcorr[g * np_ + j] = np.int32((offset - a_zp) * cs + k * a_zp * np.int64(wzp[j]))
            if widen:
                for i in range(m):
                    o = (g * m + i) * lda
                    for kk in range(k):
                        abuf[o + kk] = a3[g, i, kk]
            if sums:
                for i in range(m):
                    t = 0
                    for kk in range(k):
                        t += np.int32(a3[g, i, kk])
                    rowsum[g * m + i] = t

    prepare.__name__ = prepare.__qualname__ = "prepare_parallel" if parallel else "prepare_serial"
    return njit(cache=True, parallel=parallel, nogil=True)(prepare)


_prepare_parallel = _make_prepare(True)
_prepare_serial = _make_prepare(False)


def matmul(
    a: npt.NDArray[np.uint8],
    a_qparams: QParams | tuple[float, int],
    b: npt.NDArray[np.uint8] | npt.NDArray[np.int8],
    b_qparams: QParams | tuple[float, int],
    out_qparams: QParams | tuple[float, int],
    *,
    target: str | None = None,
    num_threads: int | None = None,
) -> npt.NDArray[np.uint8]:
    """uint8 ``a @ b`` for [M, K] x [K, N] or batched [B, M, K] x [B, K, N], in one call."""
    a_scale, a_zero_point = as_qparams("a_qparams", a_qparams)
    b_scale, b_zero_point = as_qparams("b_qparams", b_qparams)
    out_scale, out_zero_point = as_qparams("out_qparams", out_qparams)
    aa = check_array("a", a, np.uint8, (2, 3))
    bb = check_array("b", b, (np.uint8, np.int8), (2, 3))
    if aa.ndim != bb.ndim:
        raise KernelError(f"a and b must both be 2-D or both 3-D, got {aa.shape} and {bb.shape}")
    if aa.shape[-1] != bb.shape[-2]:
        raise KernelError(
            f"matmul: a's K={aa.shape[-1]} does not match b's K={bb.shape[-2]} "
            f"(a {aa.shape}, b {bb.shape})"
        )
    if aa.ndim == 3 and aa.shape[0] != bb.shape[0]:
        raise KernelError(f"matmul: batch sizes differ: a {aa.shape}, b {bb.shape}")
    tgt = resolve_target(target)
    unsigned = bb.dtype == np.uint8
    if unsigned:
        b_zp = _fast_zp(b_zero_point, "b_qparams.zero_point")
    else:
        b_zp = check_zero_point("b_qparams.zero_point", b_zero_point, -128, 127)
    k = int(aa.shape[-1])
    check_accumulation_fits_int32("b", k, 255, 255)
    sa = check_scale("a_qparams.scale", a_scale)
    sb = check_scale("b_qparams.scale", b_scale)
    so = check_scale("out_qparams.scale", out_scale)
    with np.errstate(all="ignore"):  # out-of-range products are refused just below
        ab = np.float32(sa) * np.float32(sb)
        mult = ab / np.float32(so)
    check_derived("a_scale * b_scale", ab)
    check_derived("a_scale * b_scale / out_scale", mult)
    a_zp = check_zero_point("a_qparams.zero_point", a_zero_point, 0, 255)
    o_zp = check_zero_point("out_qparams.zero_point", out_zero_point, 0, 255)
    threads = apply_num_threads(num_threads, "matmul")
    a3 = aa if aa.ndim == 3 else aa[None]
    b3 = bb if bb.ndim == 3 else bb[None]
    out = _batched_u8(a3, b3, 128 if unsigned else 0, b_zp - (128 if unsigned else 0), a_zp,
                      mult, o_zp, tgt, threads)  # fmt: skip
    return out if aa.ndim == 3 else out[0]


def _batched_u8(
    a3: npt.NDArray[np.uint8],
    b3: npt.NDArray[np.generic],
    shift: int,
    w_zp: int,
    a_zp: int,
    mult: np.float32,
    o_zp: int,
    target: str,
    threads: int,
) -> npt.NDArray[np.uint8]:
    """C[g] = requantize(a3[g] @ (b3[g] - shift)) for every g, through the linear kernels."""
    nb, m, k = (int(d) for d in a3.shape)
    n = int(b3.shape[2])
    nr, ks, pdt = layout(target)
    np_, kp = round_up(n, nr), round_up(k, K_ALIGN)
    lda = kp  # rows padded to whole 4-byte loads (zeros meet zero weights)
    npanels, nk = np_ // nr, kp // ks
    if threads > 1 and nb * m * np_ * nk < SERIAL_BELOW[target]:
        threads = 1  # a parallel-region launch costs more than it saves on small products
    widen = target == "avx2" or lda != k  # AVX2 reads activations as int16 pairs
    a3c = np.ascontiguousarray(a3)
    abuf = np.zeros(nb * m * lda, np.int16 if target == "avx2" else np.uint8) if widen else None
    bp = np.zeros(nb * np_ * kp, pdt)
    wzp = np.zeros(np_, np.int32)
    wzp[:n] = w_zp
    colcorr = np.empty(nb * np_, np.int32)
    rowsum = np.zeros(nb * m, np.int32)
    prepare = _prepare_serial if threads == 1 else with_threads(_prepare_parallel, threads)
    offset = activation_offset(target)
    prepare(a3c, np.ascontiguousarray(b3), shift, nr, ks, kp, lda, a_zp, offset, wzp,
            abuf if abuf is not None else np.zeros(1, np.uint8), bp, colcorr, rowsum, widen,
            w_zp != 0)  # fmt: skip
    a_flat = abuf if abuf is not None else a3c.reshape(-1)
    rowoffs = np.arange(m, dtype=np.int64) * lda
    koffs = np.arange(nk, dtype=np.int64) * ks
    c = np.empty(nb * m * np_, np.uint8)
    biasq = np.zeros(np_, np.float32)
    mults = np.full(np_, mult, np.float32)
    serial, parallel = _BATCHED[target]
    driver = serial if threads == 1 else with_threads(parallel, threads)
    args = (nb, a_flat, m * lda, rowoffs, m, koffs, nk, bp, np_ * kp, npanels, c, np_, colcorr,
            wzp, rowsum, biasq, mults, o_zp, 0, 255)  # fmt: skip
    if target == "generic":
        driver(*args, NO_LUT)
    else:
        driver(*args, max(m, 1), NO_RESIDUAL, NO_ADD, NO_LUT)
    out = c.reshape(nb, m, np_)
    return out if np_ == n else np.ascontiguousarray(out[:, :, :n])
