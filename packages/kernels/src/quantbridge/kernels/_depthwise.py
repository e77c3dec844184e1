"""Depthwise conv (groups == in == out channels): channels-last loops, channel innermost.

Through the GEMM every channel is its own group, padded to a 32-wide panel and 4 input
channels: ~128x the useful work (a 3x3 depthwise conv over 64x56x56 took 3.6 ms, torch's 95 us).
Here each output row accumulates ``x * (w - w_zp)`` over the taps, channels innermost so the
loops vectorize, subtracts ``x_zp * sum(w - w_zp)`` and requantizes with the GEMM's rule
(``_requant.py``: ``clamp(rint((float32(v) + biasq[c]) * mult[c]) + out_zp, qmin, qmax)``),
then a fused activation table if any.
``v`` is the integer the GEMM computes (its zero-point corrections expand to the same sum).

Sums run in float32: every product is an integer of magnitude <= 255 * 255 and there are at most
256 taps (``MAX_TAPS``, checked by the caller), so every partial sum is an integer below 2**24
and exact -- float32 FMA lanes are twice as many as int64 ones, which numba would use for
``int32 * int32``. One numba implementation serves every target.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

# taps per output for which float32 sums stay exact (255 * 255 * 256 < 2**24)
MAX_TAPS = 256


def repeat_weights(wt: npt.NDArray[np.float32], ow: int) -> npt.NDArray[np.float32]:
    """``[KH, KW, OW * C]``: each tap's weights repeated for the pixels of an output row."""
    return np.ascontiguousarray(np.tile(wt, (1, 1, ow)), np.float32)


@njit(cache=True, nogil=True)
def depthwise_nhwc(  # type: ignore[no-untyped-def]  # numba types the arguments
    xp, wt, wrep, biasq, mult, a_zp, o_zp, qmin, qmax, lut, sh, sw, dh, dw, out
):  # fmt: skip
    """``out[b, oy, ox, c]`` for zero-point-padded NHWC ``xp`` [N, Hp, Wp, C].

    ``wt`` [KH, KW, C] float32 holds ``w - w_zp`` per channel, ``wrep`` the same repeated for
    ``OW`` pixels (``repeat_weights``; used when the stride along W is 1: a tap's inputs for a
    whole output row are then one contiguous run, one long vector loop); ``out`` is
    [N, OH, OW, C] uint8. Codes are clamped to ``[qmin, qmax]``, then mapped through ``lut``
    (uint8[256], a fused activation) unless it is empty.
    """
    n, oh, ow, c = out.shape
    kh, kw = wt.shape[0], wt.shape[1]
    span = ow * c
    corr = np.zeros(c, np.float32)  # x_zp * sum of each channel's weights
    for i in range(kh):
        for j in range(kw):
            for ch in range(c):
                corr[ch] += wt[i, j, ch]
    for ch in range(c):
        corr[ch] *= np.float32(a_zp)
    acc = np.empty(span, np.float32)
    zpf, lo, hi = np.float32(o_zp), np.float32(qmin), np.float32(qmax)
    mapped = lut.shape[0] > 0
    rows = xp.reshape(xp.shape[0], xp.shape[1], -1)
    for b in range(n):
        for oy in range(oh):
            for k in range(span):
                acc[k] = 0
            for i in range(kh):
                row = rows[b, oy * sh + i * dh]
                for j in range(kw):
                    if sw == 1:
                        src = row[j * dw * c : j * dw * c + span]
                        wv = wrep[i, j]
                        for k in range(span):
                            acc[k] += np.float32(src[k]) * wv[k]
                    else:
                        wv = wt[i, j]
                        for ox in range(ow):
                            at = (ox * sw + j * dw) * c
                            src = row[at : at + c]
                            dst = acc[ox * c : ox * c + c]
                            for ch in range(c):
                                dst[ch] += np.float32(src[ch]) * wv[ch]
            orow = out[b, oy].reshape(-1)
            for ox in range(ow):
                got = acc[ox * c : ox * c + c]
                res = orow[ox * c : ox * c + c]
                for ch in range(c):
                    r = np.rint(((got[ch] - corr[ch]) + biasq[ch]) * mult[ch]) + zpf
                    res[ch] = np.uint8(min(max(r, lo), hi))
            if mapped:  # the row is in L1: map it through the table before moving on
                for k in range(span):
                    orow[k] = lut[orow[k]]
