"""Tile drivers for the IR micro-kernels: parallel over (B panel, row chunk) tiles.

One driver per (target, output mode), written out so each is a plain module-level function
(numba's ``cache=True`` keys the on-disk cache by function). A tile is one packed B panel
times up to ``mchunk`` rows; ``prange`` hands contiguous tile ranges to numba's threads, so a
thread keeps reusing the same B panel (L1/L2) across row blocks. Row tails use the smaller
kernels; rows past the end are recomputed from the last valid row and not stored.
"""

# mypy: ignore-errors

from numba import njit, prange

from quantbridge.kernels._vnni import (
    avx2_f32_1,
    avx2_f32_3,
    avx2_f32_6,
    avx2_u8_1,
    avx2_u8_3,
    avx2_u8_6,
    vnni_f32_1,
    vnni_f32_4,
    vnni_f32_8,
    vnni_u8_1,
    vnni_u8_4,
    vnni_u8_8,
    vnni_u8t_1,
    vnni_u8t_4,
    vnni_u8t_8,
)


@njit(cache=True, parallel=True, nogil=True)
def drive_vnni_u8(
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
):
    nmc = (m + mchunk - 1) // mchunk
    panel = nk * 128
    for t in prange(npanels * nmc):
        p = t // nmc
        start = (t % nmc) * mchunk
        end = min(m, start + mchunk)
        boff = p * panel
        j0 = p * 32
        i = start
        while i < end:
            left = end - i
            if left > 4:
                vnni_u8_8(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    min(left, 8),
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 8
            elif left > 1:
                vnni_u8_4(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    left,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 4
            else:
                vnni_u8_1(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    1,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 1


@njit(cache=True, nogil=True)
def serial_vnni_u8(
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
):
    nmc = (m + mchunk - 1) // mchunk
    panel = nk * 128
    for t in range(npanels * nmc):
        p = t // nmc
        start = (t % nmc) * mchunk
        end = min(m, start + mchunk)
        boff = p * panel
        j0 = p * 32
        i = start
        while i < end:
            left = end - i
            if left > 4:
                vnni_u8_8(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    min(left, 8),
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 8
            elif left > 1:
                vnni_u8_4(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    left,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 4
            else:
                vnni_u8_1(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    1,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 1


@njit(cache=True, parallel=True, nogil=True)
def drive_vnni_u8t(
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
):
    nmc = (m + mchunk - 1) // mchunk
    panel = nk * 128
    for t in prange(npanels * nmc):
        p = t // nmc
        start = (t % nmc) * mchunk
        end = min(m, start + mchunk)
        boff = p * panel
        j0 = p * 32
        i = start
        while i < end:
            left = end - i
            if left > 4:
                vnni_u8t_8(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    min(left, 8),
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 8
            elif left > 1:
                vnni_u8t_4(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    left,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 4
            else:
                vnni_u8t_1(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    1,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 1


@njit(cache=True, nogil=True)
def serial_vnni_u8t(
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
):
    nmc = (m + mchunk - 1) // mchunk
    panel = nk * 128
    for t in range(npanels * nmc):
        p = t // nmc
        start = (t % nmc) * mchunk
        end = min(m, start + mchunk)
        boff = p * panel
        j0 = p * 32
        i = start
        while i < end:
            left = end - i
            if left > 4:
                vnni_u8t_8(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    min(left, 8),
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 8
            elif left > 1:
                vnni_u8t_4(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    left,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 4
            else:
                vnni_u8t_1(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    1,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 1


@njit(cache=True, parallel=True, nogil=True)
def drive_vnni_f32(
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
):
    nmc = (m + mchunk - 1) // mchunk
    panel = nk * 128
    for t in prange(npanels * nmc):
        p = t // nmc
        start = (t % nmc) * mchunk
        end = min(m, start + mchunk)
        boff = p * panel
        j0 = p * 32
        i = start
        while i < end:
            left = end - i
            if left > 4:
                vnni_f32_8(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    min(left, 8),
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 8
            elif left > 1:
                vnni_f32_4(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    left,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 4
            else:
                vnni_f32_1(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    1,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 1


@njit(cache=True, nogil=True)
def serial_vnni_f32(
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
):
    nmc = (m + mchunk - 1) // mchunk
    panel = nk * 128
    for t in range(npanels * nmc):
        p = t // nmc
        start = (t % nmc) * mchunk
        end = min(m, start + mchunk)
        boff = p * panel
        j0 = p * 32
        i = start
        while i < end:
            left = end - i
            if left > 4:
                vnni_f32_8(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    min(left, 8),
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 8
            elif left > 1:
                vnni_f32_4(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    left,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 4
            else:
                vnni_f32_1(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    1,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 1


@njit(cache=True, parallel=True, nogil=True)
def drive_avx2_u8(
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
):
    nmc = (m + mchunk - 1) // mchunk
    panel = nk * 32
    for t in prange(npanels * nmc):
        p = t // nmc
        start = (t % nmc) * mchunk
        end = min(m, start + mchunk)
        boff = p * panel
        j0 = p * 16
        i = start
        while i < end:
            left = end - i
            if left > 3:
                avx2_u8_6(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    min(left, 6),
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 6
            elif left > 1:
                avx2_u8_3(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    left,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 3
            else:
                avx2_u8_1(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    1,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 1


@njit(cache=True, nogil=True)
def serial_avx2_u8(
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
):
    nmc = (m + mchunk - 1) // mchunk
    panel = nk * 32
    for t in range(npanels * nmc):
        p = t // nmc
        start = (t % nmc) * mchunk
        end = min(m, start + mchunk)
        boff = p * panel
        j0 = p * 16
        i = start
        while i < end:
            left = end - i
            if left > 3:
                avx2_u8_6(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    min(left, 6),
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 6
            elif left > 1:
                avx2_u8_3(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    left,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 3
            else:
                avx2_u8_1(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    1,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 1


@njit(cache=True, parallel=True, nogil=True)
def drive_avx2_f32(
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
):
    nmc = (m + mchunk - 1) // mchunk
    panel = nk * 32
    for t in prange(npanels * nmc):
        p = t // nmc
        start = (t % nmc) * mchunk
        end = min(m, start + mchunk)
        boff = p * panel
        j0 = p * 16
        i = start
        while i < end:
            left = end - i
            if left > 3:
                avx2_f32_6(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    min(left, 6),
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 6
            elif left > 1:
                avx2_f32_3(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    left,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 3
            else:
                avx2_f32_1(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    1,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 1


@njit(cache=True, nogil=True)
def serial_avx2_f32(
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
):
    nmc = (m + mchunk - 1) // mchunk
    panel = nk * 32
    for t in range(npanels * nmc):
        p = t // nmc
        start = (t % nmc) * mchunk
        end = min(m, start + mchunk)
        boff = p * panel
        j0 = p * 16
        i = start
        while i < end:
            left = end - i
            if left > 3:
                avx2_f32_6(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    min(left, 6),
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 6
            elif left > 1:
                avx2_f32_3(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    left,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 3
            else:
                avx2_f32_1(
                    a,
                    rowoffs,
                    i,
                    koffs,
                    nk,
                    bp,
                    boff,
                    c,
                    ldc,
                    1,
                    colcorr,
                    wzp,
                    rowsum,
                    biasq,
                    mult,
                    j0,
                    ozp,
                    qmin,
                    qmax,
                )
                i += 1
