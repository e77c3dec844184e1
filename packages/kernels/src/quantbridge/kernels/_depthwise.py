"""Depthwise conv (groups == in == out channels): channels-last, register-blocked, no padded copy.

Through the GEMM every channel is its own group, padded to a 32-wide panel and 4 input
channels: ~128x the useful work. Here the drivers walk output rows of unpadded NHWC input and
call the IR micro-kernels of ``_dw_simd.py`` (8 channels per vector, or 16 for the block
kernels of the AVX-512 VNNI target). ``DRIVERS`` gives each target its driver: the VNNI
target's holds AVX-512 code, the one every other target shares holds none.

- interior pixels (every tap inside the input) of 3x3 / 5x5 kernels with stride 1 or 2 along W
  and no W dilation: ``dw_block``, several pixels per call, register-blocked along W;
- on AVX-512 VNNI CPUs, whole blocks of 64 channels whose weights fit int8 run the
  ``vpdpbusd`` kernels of ``_dw_vnni.py`` instead: ``dw64_block`` for interior pixels,
  ``dw64_taps`` for every other pixel (a padding tap reads the input zero point);
- every other pixel (the padding border, kernels without a block kind) and channel tails:
  ``dw_taps`` over the pixel's in-bounds taps only. A tap in the padding would read the input
  zero point and contribute ``(x_zp - x_zp) * w = 0``, so skipping it gives the same integer:
  the zero-point-padded input copy the GEMM needs is not made.

All compute the GEMM's integer ``sum (x - x_zp) * (w - w_zp)`` exactly (float32 lanes, see
``_dw_simd.py``, or int32 lanes; at most ``MAX_TAPS`` taps) and requantize with the GEMM's
rule, so the bytes equal conv2d's through the GEMM. The float kernels serve every target
(plain LLVM vector IR); the 64-channel ones need AVX-512 VNNI.
The clamp range ``[qmin, qmax]`` comes from the caller (a clamp-table activation narrows it);
a fused activation table (``lut``) maps each finished output row while it is in L1, with no
pass at all when there is none.

Threads: output rows are split into tasks run by ``prange`` when the conv has at least
``PARALLEL_MIN_MACS`` multiply-adds; smaller ones run serially (no parallel-region launch).

A driver takes the conv as named records (NamedTuples, which numba passes as their fields),
made once per call plan: ``DwGeometry``, the float kernels' ``DwWeights`` (``_dw_simd.py``),
the 64-channel kernels' ``Dw64Weights`` (``_dw_vnni.py``) and the ``DwOutput`` rule.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple

import numpy as np
from numba import njit, prange

from quantbridge.kernels._dw_simd import (
    BLOCK_PIXELS,
    KIND_IDS,
    LANES,
    WIDE_LANES,
    dw_block,
    dw_taps,
)
from quantbridge.kernels._dw_vnni import BLOCK_PIXELS as BLOCK_PIXELS_64
from quantbridge.kernels._dw_vnni import CHANNELS as VNNI_CHANNELS
from quantbridge.kernels._dw_vnni import KIND_IDS as KIND_IDS_64
from quantbridge.kernels._dw_vnni import dw64_block, dw64_taps
from quantbridge.kernels._targets import needs_features, target_features

# taps per output for which float32 sums stay exact (255 * 255 * 256 < 2**24)
MAX_TAPS = 256

# Multiply-adds below which one thread runs the conv. ``packages/kernels/bench/bench_kernels.py
# --crossover`` (kernels README, Threads) on this AMD Zen 3: 2 threads break even at ~170K
# multiply-adds and gain 1.1-1.4x from ~0.7M.
PARALLEL_MIN_MACS = 1 << 19


class DwGeometry(NamedTuple):
    """The conv a driver runs: input ``[n, h, w, c]`` and output ``[n, oh, ow, c]`` (flat
    NHWC), kernel ``kh x kw``, stride, dilation and padding (0 on a zero-point-padded copy)."""

    n: int
    h: int
    w: int
    c: int
    oh: int
    ow: int
    kh: int
    kw: int
    sh: int
    sw: int
    dh: int
    dw: int
    ph: int
    pw: int


class Interior(IntEnum):
    """Which block kernels run a row's interior pixels: kernel width and stride along W."""

    NONE = 0  # no block kernel: every pixel takes the tap-list path
    K3_S1 = 1
    K3_S2 = 2
    K5_S1 = 3
    K5_S2 = 4


@njit(cache=True, nogil=True)
def _split_run(n, big, alt):  # type: ignore[no-untyped-def]  # numba types the arguments
    """``(big blocks, alt blocks, one-pixel calls)`` covering a run of ``n`` pixels: the
    remainder after the big blocks goes the cheapest of three ways (see ``_make_row``)."""
    nbig = n // big
    rem = n - nbig * big
    nalt = (rem + alt - 1) // alt if n >= alt else 0
    cost_alt = nalt * alt if nalt > 0 else 1 << 30
    if nbig > 0 and big < cost_alt and big < 2 * rem:
        return nbig + 1, 0, 0  # one more big block, moved back
    if cost_alt < 2 * rem:
        return nbig, nalt, 0
    return nbig, 0, rem


def _make_row(kw: int, sw: int, wide: int) -> Any:
    """The interior pixels ``lo..hi-1`` of one output row through the ``(kw, sw)`` block kinds.

    Blocks of ``P`` pixels cover the run; the remainder goes the cheapest of three ways,
    counting a block pixel as 1 and a one-pixel call as 2 (it reloads every input vector for
    each pixel): one more ``P`` block moved back to end at ``hi``, or blocks of the second size
    ``Q`` (the last one moved back), or one-pixel calls. A moved-back block recomputes pixels
    already written, with the same bytes. Channels ``cs..c16-1`` run the ``wide``-lane kinds,
    then ``c16..c8-1`` the 8-lane ones (those before ``cs`` ran the 64-channel kinds,
    ``_make_row64``). ``wide`` is 16 for AVX-512 CPUs only: elsewhere it is 8, and the row
    holds no 16-lane code at all.
    """
    big, alt = BLOCK_PIXELS[(kw, sw)]
    kbig, kalt, kone = (KIND_IDS[(LANES, kw, sw, p)] for p in (big, alt, 1))
    wbig, walt, wone = (KIND_IDS[(wide, kw, sw, p)] for p in (big, alt, 1))
    lanes = LANES

    def row(  # type: ignore[no-untyped-def]  # numba types the arguments
        x, xrow, geo, cs, c16, c8, weights, output, out, obase, lo, hi,
    ):  # fmt: skip
        c, kh, pw = geo.c, geo.kh, geo.pw
        rowstep = geo.dh * geo.w * c
        nbig, nalt, rem = _split_run(hi - lo, big, alt)
        # the three loops stay written out: one compiled helper per block size, called three
        # times, measured 3 % slower over the 13 shapes above
        for t in range(nbig):
            ox = min(lo + t * big, hi - big)
            xb, ob = xrow + (ox * sw - pw) * c, obase + ox * c
            for c0 in range(cs, c16, wide):
                dw_block(wbig, x, xb + c0, rowstep, c, kh, weights, c0, output, out, ob + c0)
            for c0 in range(c16, c8, lanes):
                dw_block(kbig, x, xb + c0, rowstep, c, kh, weights, c0, output, out, ob + c0)
        start = lo + nbig * big
        for t in range(nalt):
            ox = min(start + t * alt, hi - alt)
            xb, ob = xrow + (ox * sw - pw) * c, obase + ox * c
            for c0 in range(cs, c16, wide):
                dw_block(walt, x, xb + c0, rowstep, c, kh, weights, c0, output, out, ob + c0)
            for c0 in range(c16, c8, lanes):
                dw_block(kalt, x, xb + c0, rowstep, c, kh, weights, c0, output, out, ob + c0)
        for ox in range(hi - rem, hi):
            xb, ob = xrow + (ox * sw - pw) * c, obase + ox * c
            for c0 in range(cs, c16, wide):
                dw_block(wone, x, xb + c0, rowstep, c, kh, weights, c0, output, out, ob + c0)
            for c0 in range(c16, c8, lanes):
                dw_block(kone, x, xb + c0, rowstep, c, kh, weights, c0, output, out, ob + c0)

    row.__name__ = row.__qualname__ = f"depthwise_row{wide}_{kw}x{kw}_s{sw}"
    return njit(cache=True, nogil=True)(row)


def _make_row64(kw: int, sw: int, group: int) -> Any:
    """``_make_row`` for channels ``0..weights64.channels-1`` through the ``vpdpbusd`` kinds of
    ``_dw_vnni.py``, with their own block sizes. ``group`` > 1 (stride 1, C = 64 / group): a
    vector holds ``group`` pixels, blocks are counted in vectors, and a run that does not end
    on a whole vector ends with one vector moved back to ``hi`` (the run has at least
    ``group`` pixels)."""
    big, alt = BLOCK_PIXELS_64[(kw, sw)]
    kbig, kalt, kone = (KIND_IDS_64[(kw, sw, p, group)] for p in (big, alt, 1))
    step = VNNI_CHANNELS
    gbig, galt = big * group, alt * group

    def row64(  # type: ignore[no-untyped-def]  # numba types the arguments
        x, xrow, geo, weights64, output, out, obase, lo, hi,
    ):  # fmt: skip
        c, kh, pw = geo.c, geo.kh, geo.pw
        rowstep = geo.dh * geo.w * c
        nv = (hi - lo) // group
        end = lo + nv * group  # where the whole vectors end
        nbig, nalt, rem = _split_run(nv, big, alt)
        start = lo + nbig * gbig
        # blocks of 64 channels outermost: a block's weights (12 vectors for 3x3) stay in L1
        # along the row (measured no faster or slower than pixels outermost, 960x7x7 included)
        for c0 in range(0, weights64.channels, step):
            for t in range(nbig):
                ox = min(lo + t * gbig, end - gbig)
                xb, ob = xrow + (ox * sw - pw) * c + c0, obase + ox * c + c0
                dw64_block(kbig, x, xb, rowstep, c, kh, weights64, c0, output, out, ob)
            for t in range(nalt):
                ox = min(start + t * galt, end - galt)
                xb, ob = xrow + (ox * sw - pw) * c + c0, obase + ox * c + c0
                dw64_block(kalt, x, xb, rowstep, c, kh, weights64, c0, output, out, ob)
            for v in range(rem):
                ox = end - (rem - v) * group
                xb, ob = xrow + (ox * sw - pw) * c + c0, obase + ox * c + c0
                dw64_block(kone, x, xb, rowstep, c, kh, weights64, c0, output, out, ob)
            if end < hi:
                ox = hi - group
                xb, ob = xrow + (ox * sw - pw) * c + c0, obase + ox * c + c0
                dw64_block(kone, x, xb, rowstep, c, kh, weights64, c0, output, out, ob)

    suffix = "" if group == 1 else f"_g{group}"
    row64.__name__ = row64.__qualname__ = f"depthwise_row64_{kw}x{kw}_s{sw}{suffix}"
    return njit(cache=True, nogil=True)(row64)


_row64_3s1, _row64_3s2, _row64_5s1, _row64_5s2 = (_make_row64(kw, sw, 1) for kw, sw in BLOCK_PIXELS)
# 32 channels at stride 1 (GROUPS of _dw_vnni: 2 pixels a vector)
_row32_3s1, _row32_5s1 = (_make_row64(kw, 1, 2) for kw in (3, 5))


# the interior rows of each (kernel width, stride) block kind, 8 and 16 lanes (module-level
# tuples: the jit cache hardening finds dispatchers one level down)
_ROWS_8 = tuple(_make_row(kw, sw, LANES) for kw, sw in BLOCK_PIXELS)
_ROWS_16 = tuple(_make_row(kw, sw, WIDE_LANES) for kw, sw in BLOCK_PIXELS)


@njit(cache=True, nogil=True)
def _interior(geo):  # type: ignore[no-untyped-def]  # numba types the argument
    """The block kernels of ``geo``'s interior pixels (none with a dilation along W)."""
    if geo.dw != 1:
        return Interior.NONE
    if geo.kw == 3 and geo.sw == 1:
        return Interior.K3_S1
    if geo.kw == 3 and geo.sw == 2:
        return Interior.K3_S2
    if geo.kw == 5 and geo.sw == 1:
        return Interior.K5_S1
    if geo.kw == 5 and geo.sw == 2:
        return Interior.K5_S2
    return Interior.NONE


@njit(cache=True, nogil=True)
def _vnni_interior(  # type: ignore[no-untyped-def]  # numba types them
    interior, x, xrow, geo, weights64, output, out, obase, lo, hi,
):  # fmt: skip
    """The 64-channel ``vpdpbusd`` blocks of a row's interior."""
    if weights64.group == 2:  # stride 1
        if interior == Interior.K3_S1:
            _row32_3s1(x, xrow, geo, weights64, output, out, obase, lo, hi)
        else:
            _row32_5s1(x, xrow, geo, weights64, output, out, obase, lo, hi)
    elif interior == Interior.K3_S1:
        _row64_3s1(x, xrow, geo, weights64, output, out, obase, lo, hi)
    elif interior == Interior.K3_S2:
        _row64_3s2(x, xrow, geo, weights64, output, out, obase, lo, hi)
    elif interior == Interior.K5_S1:
        _row64_5s1(x, xrow, geo, weights64, output, out, obase, lo, hi)
    else:
        _row64_5s2(x, xrow, geo, weights64, output, out, obase, lo, hi)


@njit(cache=True, nogil=True)
def _no_vnni_interior(  # type: ignore[no-untyped-def]  # numba types them
    interior, x, xrow, geo, weights64, output, out, obase, lo, hi,
):  # fmt: skip
    """Targets without AVX-512 VNNI: their packed weights have no 64-channel blocks."""


@njit(cache=True, nogil=True)
def _no_vnni_taps(  # type: ignore[no-untyped-def]  # numba types them
    x, base, aoffs, ains, ntap, weights64, c0, xzp, output, out, obase,
):  # fmt: skip
    """Targets without AVX-512 VNNI: their packed weights have no 64-channel blocks."""


def _make_driver(vnni: bool, parallel: bool) -> Any:
    """A depthwise driver: the VNNI one runs 64-channel ``vpdpbusd`` blocks and 16-lane float
    blocks; the other, for every other target, holds no AVX-512 code (LLVM cannot select it
    for a CPU without AVX-512, and aborts the process rather than raise)."""
    lanes = LANES
    wide = WIDE_LANES if vnni else LANES
    interior64 = _vnni_interior if vnni else _no_vnni_interior
    taps64 = dw64_taps if vnni else _no_vnni_taps
    row_3s1, row_3s2, row_5s1, row_5s2 = _ROWS_16 if vnni else _ROWS_8

    def driver(  # type: ignore[no-untyped-def]  # numba types the arguments
        x, zpf, geo, weights, weights64, output, out, rows_per_task,
    ):  # fmt: skip
        """``out`` [N*OH*OW*C] from ``x`` [N*H*W*C] (both flat NHWC uint8, ``geo`` a
        ``DwGeometry``), ``zpf`` the input zero point as a float.

        Codes are clamped to ``output``'s ``[qmin, qmax]``, then mapped through its ``lut``
        (uint8[256], a fused activation, ``_epilogue_lut.py``) unless it is empty. On the VNNI
        target the interior blocks run 16 channels per vector.
        ``weights64.channels`` (0, or a multiple of 64 on the VNNI target): the interior of
        channels ``0..channels-1`` runs the 64-channel ``vpdpbusd`` blocks. With its ``group``
        > 1 (C = 64 / group, stride 1, ``channels`` = 64) those blocks carry ``group`` pixels a
        vector, the constants repeated per pixel; border pixels stay on the float kernels.
        """
        n, h, w, c, oh, ow, kh, kw, sh, sw, dh, dw, ph, pw = geo
        lut = output.lut
        mapped = lut.shape[0] > 0
        xzp = np.int64(zpf)
        c64, group = weights64.channels, weights64.group
        step64 = VNNI_CHANNELS
        interior = _interior(geo)
        c8 = c - c % lanes
        c16 = c - c % wide
        ntap = kh * kw
        # tap offsets from the window origin, for interior pixels' channel tail
        full_offs = np.empty(ntap, np.int64)
        full_idx = np.empty(ntap, np.int64)
        for i in range(kh):
            for j in range(kw):
                full_offs[i * kw + j] = (i * dh * w + j * dw) * c
                full_idx[i * kw + j] = i * kw + j
        # interior columns: every tap of pixels lo..hi-1 lies inside the row
        lo = (pw + sw - 1) // sw
        right = w - 1 - (kw - 1) * dw + pw
        hi = min(right // sw + 1, ow) if right >= 0 else 0
        lo = min(lo, hi)
        total = n * oh
        ntask = (total + rows_per_task - 1) // rows_per_task
        for task in prange(ntask):  # a plain range when parallel=False
            toffs = np.empty(ntap, np.int64)
            tidx = np.empty(ntap, np.int64)
            aoffs = np.empty(ntap, np.int64)
            ains = np.empty(ntap, np.int64)
            for r in range(task * rows_per_task, min(total, (task + 1) * rows_per_task)):
                b = r // oh
                oy = r - b * oh
                iy0 = oy * sh - ph
                obase = r * ow * c
                img = b * h * w * c
                rlo, rhi = 0, 0
                if iy0 >= 0 and iy0 + (kh - 1) * dh < h:
                    rlo, rhi = lo, hi
                xrow = img + iy0 * w * c
                if interior != Interior.NONE and rlo < rhi:
                    vnni_c = 0  # channels this row's interior runs on the vpdpbusd kinds
                    if c64 > 0 and (group == 1 or rhi - rlo >= group):
                        vnni_c = c64 if group == 1 else c
                        interior64(interior, x, xrow, geo, weights64, output, out, obase, rlo,
                                   rhi)  # fmt: skip
                    if vnni_c < c8:  # full vectors left after the vpdpbusd blocks
                        if interior == Interior.K3_S1:
                            row_3s1(x, xrow, geo, vnni_c, c16, c8, weights, output, out, obase,
                                    rlo, rhi)  # fmt: skip
                        elif interior == Interior.K3_S2:
                            row_3s2(x, xrow, geo, vnni_c, c16, c8, weights, output, out, obase,
                                    rlo, rhi)  # fmt: skip
                        elif interior == Interior.K5_S1:
                            row_5s1(x, xrow, geo, vnni_c, c16, c8, weights, output, out, obase,
                                    rlo, rhi)  # fmt: skip
                        else:
                            row_5s2(x, xrow, geo, vnni_c, c16, c8, weights, output, out, obase,
                                    rlo, rhi)  # fmt: skip
                    if c8 < c:  # the channel tail of the interior pixels
                        for ox in range(rlo, rhi):
                            dw_taps(x, xrow + (ox * sw - pw) * c + c8, full_offs, full_idx,
                                    ntap, weights, c8, zpf, output, out, obase + ox * c + c8,
                                    c - c8)  # fmt: skip
                else:
                    rlo, rhi = 0, 0  # no block kernel: every pixel takes the tap-list path
                for ox in range(ow):
                    if rlo <= ox < rhi:
                        continue
                    nt = 0  # this pixel's in-bounds taps
                    for i in range(kh):
                        iy = iy0 + i * dh
                        for j in range(kw):
                            ix = ox * sw - pw + j * dw
                            inside = 0 <= iy < h and 0 <= ix < w
                            # every tap, for the 64-channel kernel (a padding tap reads xzp)
                            aoffs[i * kw + j] = (iy * w + ix) * c if inside else 0
                            ains[i * kw + j] = 1 if inside else 0
                            if inside:
                                toffs[nt] = (iy * w + ix) * c
                                tidx[nt] = i * kw + j
                                nt += 1
                    for c0 in range(0, c64 if group == 1 else 0, step64):
                        taps64(x, img + c0, aoffs, ains, ntap, weights64, c0, xzp, output, out,
                               obase + ox * c + c0)  # fmt: skip
                    for c0 in range(c64 if group == 1 else 0, c, lanes):
                        dw_taps(x, img + c0, toffs, tidx, nt, weights, c0, zpf, output, out,
                                obase + ox * c + c0, min(lanes, c - c0))  # fmt: skip
                if mapped:  # the row is in L1: map it through the table before moving on
                    for k in range(obase, obase + ow * c):
                        out[k] = lut[out[k]]

    name = f"depthwise_{'vnni' if vnni else 'float'}_{'parallel' if parallel else 'serial'}"
    # a distinct module-level qualname per driver: its own cache index file
    driver.__name__ = driver.__qualname__ = name
    compiled = njit(cache=True, parallel=parallel, nogil=True)(driver)
    return needs_features(target_features("avx512_vnni"), compiled) if vnni else compiled


# (serial driver, parallel driver)
_VNNI_DRIVERS = (_make_driver(True, False), _make_driver(True, True))
_FLOAT_DRIVERS = (_make_driver(False, False), _make_driver(False, True))
DRIVERS = {
    "avx512_vnni": _VNNI_DRIVERS,
    "avx_vnni": _FLOAT_DRIVERS,
    "avx2": _FLOAT_DRIVERS,
    "aarch64_i8mm": _FLOAT_DRIVERS,
    "aarch64_dotprod": _FLOAT_DRIVERS,
    "generic": _FLOAT_DRIVERS,
}
