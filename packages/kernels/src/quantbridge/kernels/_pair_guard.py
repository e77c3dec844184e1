"""Exact AVX2 byte GEMMs on 8-bit weights: find and redo the rows a saturating pair spoils.

The byte kernels (``_avx2_byte.py``) read four activation codes per k step and add the
products of codes (k, k+1) and (k+2, k+3) in a saturating int16. For weights whose codes
pass [-64, 64] such a pair can leave the int16 range, but only when its two codes add up to
more than the weight's ``pair_limit`` (at least 256): two codes below 128 never can. With
torch.ao's x86 activations (``reduce_range``: calibrated codes in [0, 127]) a code of 128 or
more is an outlier, and a pair past the limit is rarer still.

``unsafe_rows`` scans the activation buffer 64 bytes at a time (an OR of eight words shows
whether any code reaches 128), then the few blocks that do, and flags each pixel (a run of
``pixel_bytes``: a conv's input pixel, a linear's row) holding a pair past the limit; it maps
pixels to GEMM rows (a conv row reads every pixel of its window). ``_gemm_run.gemm_runner``
then runs the byte kernels and recomputes those rows on the int16 ``avx2`` kernels, exact for
every code, with the same epilogue; when codes of 128 or more are everywhere, or more than a
quarter of the rows are flagged, it runs the int16 kernels alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from numba import njit

_HIGH = np.uint64(0x8080808080808080)  # bit 7 of each byte: a code of 128 or more


class PairGuard(NamedTuple):
    """What the guard of one GEMM call needs.

    ``limit``: the weight's ``pair_limit``; ``npix`` pixels of ``pixel_bytes`` codes each
    start the activation buffer; ``aligned``: the kernels pair codes at even buffer offsets
    (every k step starts at a multiple of 4), so only a flagged code's neighbour (offset
    ``i ^ 1``) can be its partner; otherwise any code of 128 or more flags its pixel.
    ``to_rows``: pixel flags ``uint8[npix]`` -> row flags ``bool[M]`` (None: rows are
    pixels). ``pack_exact()``: the same weight in the int16 ``avx2`` layout (packed when a
    call first needs it: most weights never do).
    """

    limit: int
    npix: int
    pixel_bytes: int
    aligned: bool
    to_rows: Callable[[npt.NDArray[np.uint8]], npt.NDArray[np.bool_]] | None
    pack_exact: Callable[[], npt.NDArray[np.int16]]


@njit(cache=True, nogil=True)
def _hot_blocks(a, nbytes, hot):  # type: ignore[no-untyped-def]  # numba types the arguments
    # the 64-byte blocks of ``a[:nbytes]`` holding a code of 128 or more (only those can hold
    # a pair past the limit), the tail past the last whole block as one more. Records the
    # first ``len(hot)`` of them and stops counting past ``len(hot)`` (then every row is
    # redone anyway). The inner OR is branch-free: this pass runs on every call and reads the
    # whole buffer (~40 GB/s here); the uint64 view is made here, not in Python, since the
    # clean call (the common one) is only this call
    blocks = nbytes // 64
    words = a[: 64 * blocks].view(np.uint64)
    cap = hot.shape[0]
    n = 0
    for b in range(blocks):
        acc = np.uint64(0)
        for u in range(8):
            acc |= words[8 * b + u]
        if acc & _HIGH:
            if n == cap:
                return n + 1
            hot[n] = b
            n += 1
    for i in range(64 * blocks, nbytes):
        if a[i] >= 128:
            if n == cap:
                return n + 1
            hot[n] = blocks
            return n + 1
    return n


@njit(cache=True, nogil=True)
def _flag_pixels(buf, nbytes, hot, nhot, pixel_bytes, aligned, limit, flags):  # type: ignore[no-untyped-def]  # numba types the arguments
    # the pairs of the hot blocks, one flag per pixel
    found = 0
    skip = 0  # bytes before this offset belong to flagged pixels
    for h in range(nhot):
        lo = 64 * hot[h]
        for i in range(max(lo, skip), min(lo + 64, nbytes)):
            v = np.int32(buf[i])
            if v < 128 or i < skip:
                continue
            j = i ^ 1
            partner = np.int32(buf[j]) if j < nbytes else np.int32(0)
            if aligned and v + partner <= limit:
                continue
            p = i // pixel_bytes
            flags[p] = 1
            found += 1
            skip = (p + 1) * pixel_bytes  # the rest of this pixel cannot matter
    return found


@njit(cache=True, nogil=True)
def any_high_code(a, nbytes):  # type: ignore[no-untyped-def]  # numba types the arguments
    # whether a[:nbytes] holds a code of 128 or more: one compiled call that stops at the
    # first such block and allocates nothing (the common clean call is only this)
    return _hot_blocks(a, nbytes, np.empty(0, np.int64)) > 0  # records nothing: "any?"


def unsafe_rows(a: npt.NDArray[Any], guard: PairGuard, m: int) -> npt.NDArray[np.int64] | None:
    """Indices of the ``m`` GEMM rows whose activations hold a pair past the limit (None:
    none). All rows (``arange(m)``) when codes of 128 or more fill over a quarter of the
    buffer's 64-byte blocks: then the int16 kernels run alone."""
    if not any_high_code(a, guard.npix * guard.pixel_bytes):  # the common clean call
        return None
    return unsafe_rows_of_high(a, guard, m)


def unsafe_rows_of_high(
    a: npt.NDArray[Any], guard: PairGuard, m: int
) -> npt.NDArray[np.int64] | None:
    """``unsafe_rows`` for a buffer already known to hold a code of 128 or more."""
    nbytes = guard.npix * guard.pixel_bytes
    hot = np.empty(nbytes // 256 + 1, np.int64)
    nhot = _hot_blocks(a, nbytes, hot)
    if nhot > hot.shape[0]:  # codes of 128 and more everywhere (full-range activations)
        return np.arange(m, dtype=np.int64)
    flags = np.zeros(guard.npix, np.uint8)
    found = _flag_pixels(a, nbytes, hot, nhot, guard.pixel_bytes, guard.aligned, guard.limit,
                         flags)  # fmt: skip
    if not found:
        return None
    rows = flags.view(np.bool_) if guard.to_rows is None else guard.to_rows(flags)
    found_rows = np.flatnonzero(rows)
    # a strided conv may read none of the flagged pixels
    return found_rows if found_rows.shape[0] else None


@njit(cache=True, nogil=True)
def _window_rows(flags, n, hp, wp, oh, ow, kh, kw, sh, sw, dh, dw, rows):  # type: ignore[no-untyped-def]  # numba types the arguments
    # each flagged pixel marks the output pixels whose window reads it (few pixels are flagged)
    for p in range(flags.shape[0]):
        if flags[p] == 0:
            continue
        b, rem = divmod(p, hp * wp)
        y, x = divmod(rem, wp)
        for i in range(kh):
            ty = y - i * dh
            if ty < 0 or ty % sh != 0 or ty // sh >= oh:
                continue
            for j in range(kw):
                tx = x - j * dw
                if tx < 0 or tx % sw != 0 or tx // sw >= ow:
                    continue
                rows[(b * oh + ty // sh) * ow + tx // sw] = True


def window_rows(
    pixels: tuple[int, int, int],
    out: tuple[int, int],
    kernel: tuple[int, int],
    stride: tuple[int, ...],
    dilation: tuple[int, ...],
) -> Callable[[npt.NDArray[np.uint8]], npt.NDArray[np.bool_]]:
    """``to_rows`` of a conv: output pixel (b, y, x) reads input pixels (b, y * sh + i * dh,
    x * sw + j * dw) of the (padded) buffer of ``pixels`` = (n, hp, wp)."""
    n, hp, wp = pixels
    oh, ow = out

    def to_rows(flags: npt.NDArray[np.uint8]) -> npt.NDArray[np.bool_]:
        rows = np.zeros(n * oh * ow, np.bool_)
        _window_rows(flags, n, hp, wp, oh, ow, kernel[0], kernel[1], stride[0], stride[1],
                     dilation[0], dilation[1], rows)  # fmt: skip
        return rows

    return to_rows


def split_steps(koffs: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The int16 kernels' k steps (2 codes each) over the byte kernels' (4 codes each)."""
    return np.stack([koffs, koffs + 2], axis=1).reshape(-1)


@njit(cache=True, nogil=True)
def _gather_rows(flat, rowoffs, rows, koffs, out):  # type: ignore[no-untyped-def]  # numba types the arguments
    # the k steps of each chosen row, side by side: a dense [rows, 4 * steps] matrix
    for r in range(rows.shape[0]):
        base = rowoffs[rows[r]]
        for s in range(koffs.shape[0]):
            o = base + koffs[s]
            for u in range(4):
                out[r, 4 * s + u] = flat[o + u]


def gather_rows(
    flat: npt.NDArray[np.uint8],
    rowoffs: npt.NDArray[np.int64],
    rows: npt.NDArray[np.int64],
    koffs: npt.NDArray[np.int64],
) -> npt.NDArray[np.uint8]:
    """The activations of GEMM rows ``rows`` as a dense uint8 [len(rows), 4 * k steps]."""
    out = np.empty((rows.shape[0], 4 * koffs.shape[0]), np.uint8)
    _gather_rows(flat, rowoffs, rows, koffs, out)
    return out
