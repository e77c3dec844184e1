"""The ``generic`` target: portable numba loops over the same packed data as ``avx512_vnni``.

Correctness first: no intrinsics, int64 accumulation (wrapped to int32 at the end, which is
exact because the wrappers refuse reductions whose true sum could leave int32), and the same
float32 requantization sequence as the vector kernels, so every target is bit-identical.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from quantbridge.kernels._fma import fma32


def _make_generic(parallel: bool) -> Any:
    # one loop body, compiled with ``prange`` (parallel=True) and as a plain loop: at one thread
    # or on small work, waking numba's pool costs milliseconds on a busy machine
    def driver(  # type: ignore[no-untyped-def]  # numba types the arguments
        a,
        rowoffs,
        m,
        koffs,
        nk,
        bp,
        npanels,
        c,
        ldc,
        colcorr,
        wzp,
        rowsum,
        biasq,
        mult,
        ozp,
        qmin,
        qmax,
        mchunk,
        f32_out,
        lut,
    ):
        nmc = (m + mchunk - 1) // mchunk
        panel = nk * 128
        for t in prange(npanels * nmc):  # a plain range when parallel=False
            p = t % npanels  # row-chunk-major, as the IR drivers
            start = (t // npanels) * mchunk
            end = min(m, start + mchunk)
            boff = p * panel
            for i in range(start, end):
                rbase = rowoffs[i]
                for jj in range(32):
                    acc = 0
                    for s in range(nk):
                        off = rbase + koffs[s]
                        bo = boff + s * 128 + jj * 4
                        for u in range(4):
                            acc += np.int64(a[off + u]) * np.int64(bp[bo + u])
                    j = p * 32 + jj
                    v = np.int32(
                        np.int64(np.int32(acc)) + colcorr[j] - np.int64(wzp[j]) * rowsum[i]
                    )
                    fv = np.float32(v)
                    if f32_out:
                        c[i * ldc + j] = fma32(fv, mult[j], biasq[j])
                    else:
                        x = np.rint((fv + biasq[j]) * mult[j])
                        x = min(max(x, np.float32(-1.0e9)), np.float32(1.0e9))
                        q = np.int64(x) + ozp
                        q = min(max(q, qmin), qmax)
                        if lut.shape[0]:  # a fused activation table (uint8[256])
                            q = np.int64(lut[q])
                        c[i * ldc + j] = q

    driver.__name__ = driver.__qualname__ = "drive_generic" if parallel else "serial_generic"
    return njit(cache=True, parallel=parallel, nogil=True)(driver)


drive_generic = _make_generic(True)
serial_generic = _make_generic(False)


@njit(cache=True, nogil=True)
def quantize_u8_fma(x, inv_scale, zero_point, out):  # type: ignore[no-untyped-def]
    """``out = clamp(rint(fma(x, 1/scale, zp)), 0, 255)`` in float32 (fbgemm's Quantize)."""
    zp = np.float32(zero_point)
    for i in range(x.shape[0]):
        v = np.rint(fma32(x[i], inv_scale, zp))
        out[i] = min(max(v, np.float32(0.0)), np.float32(255.0))


def _make_generic_batched(parallel: bool) -> Any:
    # ``nb`` independent GEMMs (see ``_gemm_simd._make_batched_driver``), one batch per task
    def batched(  # type: ignore[no-untyped-def]  # numba types the arguments
        nb, a, asz, rowoffs, m, koffs, nk, bp, bsz, npanels, c, ldc, colcorr, wzp, rowsum,
        biasq, mult, ozp, qmin, qmax, lut,
    ):  # fmt: skip
        for g in prange(nb):  # a plain range when parallel=False
            serial_generic(
                a[g * asz : (g + 1) * asz], rowoffs, m, koffs, nk, bp[g * bsz : (g + 1) * bsz],
                npanels, c[g * m * ldc : (g + 1) * m * ldc], ldc,
                colcorr[g * ldc : (g + 1) * ldc], wzp, rowsum[g * m : (g + 1) * m], biasq, mult,
                ozp, qmin, qmax, max(m, 1), False, lut,
            )  # fmt: skip

    name = "batched_drive_generic" if parallel else "batched_serial_generic"
    batched.__name__ = batched.__qualname__ = name
    return njit(cache=True, parallel=parallel, nogil=True)(batched)


batched_drive_generic = _make_generic_batched(True)
batched_serial_generic = _make_generic_batched(False)
