"""Tile drivers for the IR micro-kernels: parallel over (B panel, row chunk) tiles.

One driver body, instantiated per (target, output mode) and per threading (``prange`` with
``parallel=True``, a plain loop without). A tile is one packed B panel times up to ``mchunk``
rows, numbered row-chunk-major: ``prange`` hands contiguous tile ranges to numba's threads, so
when M is split (few panels, e.g. a 64-channel conv) each thread reads only its own rows of
activations, and runs a panel's rows back to back (B stays in L1 or L2) otherwise. Row tails use
the smaller kernels; rows past the end are recomputed from the last valid row and not stored. A
tile of few row blocks fetches the next panel into L2 while it runs (``_prefetch``). On VNNI a
last panel whose rows end within its first vector (N = 16, 48, 144...) runs 1-vector kernels,
and the other panels run in pairs: one block of 6 rows x 4 vectors covers two neighbouring
panels (a tile is then a pair of panels times a row chunk; a pair's last rows run as 4-row
pair blocks, a single row on each panel's own kernels).

The factory closes over ints only (kernel numbers, block sizes): numba folds them as constants,
so each driver compiles exactly as a hand-written copy did, and its on-disk cache key (which
hashes the pickled closure) is the same in every process.
"""

from __future__ import annotations

from typing import Any

from numba import njit, prange

from quantbridge.kernels._block_kernels import (
    KERNEL_IDS,
    block_cols,
    block_kernel,
    block_lanes,
    k_step,
)
from quantbridge.kernels._targets import needs_features, target_features

# target -> rows of its (big, quad, mid) blocks; the 1-row kernel ends every tail. AVX2's
# 4-row block (0: none) splits 4, 5, 7 and 8 remaining rows without computing a wasted row
# (an M = 8 GEMM ran 6 + 3 rows)
_ROWS = {
    "avx512_vnni": (8, 0, 4), "avx2": (6, 4, 3), "avx2_byte": (6, 4, 3), "avx_vnni": (6, 4, 3),
    "aarch64_i8mm": (6, 4, 3), "aarch64_dotprod": (6, 4, 3),
}  # fmt: skip
# each family's name in its drivers' names (drive_<short>_<mode>, serial_<short>_<mode>)
SHORT_NAMES = {
    "avx512_vnni": "vnni", "avx2": "avx2", "avx2_byte": "avx2b", "avx_vnni": "avxvnni",
    "aarch64_i8mm": "a64i8mm", "aarch64_dotprod": "a64dot",
}  # fmt: skip
# rows of the narrow (1-vector) blocks: 16 accumulators, as the 2-vector blocks' 8 rows
_NARROW_ROWS = 16
# rows of VNNI's 2-panel blocks (4 vectors a row: 24 accumulators). Per vpdpbusd they load
# 0.42 vectors and broadcasts where the 8 x 2 blocks load 0.63: what the other hyperthread
# of a shared core contends for (kernels DESIGN.md, "Two panels a block")
_PAIR_ROWS = 6
# rows of the 2-panel blocks that end a tile: 8 rows left run as two of these (M = 128: 20
# blocks of 6 and 2 of 4, no wasted row), 2-5 as one (its rows past the end recomputed)
_PAIR_TAIL_ROWS = 4
# tiles of at most this many blocks prefetch their next panel (see _prefetch)
_PREFETCH_MAX_BLOCKS = 32


@njit(inline="always")
def _prefetch(p, npanels, boff, panel, rows, big_rows, i):  # type: ignore[no-untyped-def]
    # A model's layers evict each other's weights from L2, so the first block run on a panel
    # streams it from L3 while the others find it in L2: a loss that matters when a tile has
    # few blocks (ResNet-18's last convs, 7 blocks of 8 rows on 147 KB panels, ran 1.2-1.5x
    # slower without this). There the blocks on panel p fetch panel p + 1 into L2, each its
    # own slice at its fraction of the pace, so the L3 traffic runs behind the arithmetic of
    # the whole tile. Up to 32 blocks (a 14x14 plane, BERT's 128 rows) it still gained 1-2 %
    # (ResNet-18/50, BERT at batch 1, one process, interleaved against 8); tiles of more
    # blocks fetch nothing (the first block's share of the panel is too small to matter).
    # Blocks of two panels fetch nothing either (see the driver): this serves single panels.
    # Returns the block_kernel arguments of the block at row i of the tile: (start of its
    # slice, log2 of the slice count or -1 for no prefetch).
    blocks = (rows + big_rows - 1) // big_rows
    blk = i // big_rows
    if p + 1 >= npanels or blocks > _PREFETCH_MAX_BLOCKS:
        return boff, -1
    shift = 0
    while (2 << shift) <= blocks:
        shift += 1
    if blk >= (1 << shift):  # 5-7 blocks share 4 slices: the last ones fetch nothing
        return boff, -1
    return boff + panel + blk * (panel >> shift), shift


def _make_driver(target: str, mode: str, parallel: bool) -> Any:
    big_rows, quad_rows, mid_rows = _ROWS[target]
    vectors = block_cols(target) // block_lanes(target)
    big = KERNEL_IDS[(target, big_rows, mode, vectors)]
    quad = KERNEL_IDS[(target, quad_rows, mode, vectors)] if quad_rows else big
    mid = KERNEL_IDS[(target, mid_rows, mode, vectors)]
    one = KERNEL_IDS[(target, 1, mode, vectors)]
    # a last panel whose rows end within its first vector (ldc = N) runs the 1-vector kernels
    narrow = (target, _NARROW_ROWS, mode, 1) in KERNEL_IDS
    narrow_big = KERNEL_IDS[(target, _NARROW_ROWS, mode, 1)] if narrow else big
    narrow_mid = KERNEL_IDS[(target, _NARROW_ROWS // 2, mode, 1)] if narrow else big
    narrow_one = KERNEL_IDS[(target, 1, mode, 1)] if narrow else big
    # pairs of neighbouring panels run as one block of 2 * vectors a row where there is one
    paired = (target, _PAIR_ROWS, mode, 2 * vectors) in KERNEL_IDS
    pair = KERNEL_IDS[(target, _PAIR_ROWS, mode, 2 * vectors)] if paired else big
    pair_tail = KERNEL_IDS[(target, _PAIR_TAIL_ROWS, mode, 2 * vectors)] if paired else big
    lanes = block_lanes(target)
    nr = block_cols(target)
    panel_step = nr * k_step(target)  # packed B elements per k step of one panel

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
        res,
        addp,
        lut,
    ):
        nmc = (m + mchunk - 1) // mchunk
        panel = nk * panel_step
        # groups of panels: pairs first (a last panel that runs the narrow kernels stays
        # single), then the single panels left
        pairable = npanels - 1 if narrow and ldc - (npanels - 1) * nr <= lanes else npanels
        npairs = pairable // 2 if paired else 0
        ngroups = npanels - npairs
        for t in prange(ngroups * nmc):  # a plain range when parallel=False
            g = t % ngroups  # row-chunk-major: a thread keeps its rows (activations)
            start = (t // ngroups) * mchunk
            end = min(m, start + mchunk)
            first = 2 * g if g < npairs else g + npairs
            i = start
            if g < npairs:  # the rows on both panels at once, but a last one
                boff = first * panel
                # no next-panel prefetch: a pair's blocks ran 0.86-0.97x the time of the same
                # blocks fetching the next pair (one process, interleaved), and as fast in
                # ResNet-18/50 and MobileNetV2
                blocks = (end - i) // _PAIR_ROWS
                if (end - i) % _PAIR_ROWS == 2 and blocks > 0:
                    blocks -= 1  # 6 + 2 rows left run as 4 + 4
                for _ in range(blocks):
                    block_kernel(
                        pair, a, rowoffs, i, koffs, nk, bp, boff, c, ldc, _PAIR_ROWS,
                        colcorr, wzp, rowsum, biasq, mult, first * nr, ozp, qmin, qmax, res,
                        addp, lut, boff, -1,
                    )  # fmt: skip
                    i += _PAIR_ROWS
                while end - i >= 2:
                    block_kernel(
                        pair_tail, a, rowoffs, i, koffs, nk, bp, boff, c, ldc,
                        min(end - i, _PAIR_TAIL_ROWS), colcorr, wzp, rowsum, biasq, mult,
                        first * nr, ozp, qmin, qmax, res, addp, lut, boff, -1,
                    )  # fmt: skip
                    i += min(end - i, _PAIR_TAIL_ROWS)
            tail = i  # the rows a pair leaves (fewer than a block), or all of a single panel's
            for p in range(first, first + 2 if g < npairs else first + 1):
                boff = p * panel
                j0 = p * nr
                i = tail
                if narrow and ldc - j0 <= lanes:  # (the last panel: nothing to prefetch)
                    while i < end:
                        left = end - i
                        if left > _NARROW_ROWS // 2:
                            block_kernel(
                                narrow_big, a, rowoffs, i, koffs, nk, bp, boff, c, ldc,
                                min(left, _NARROW_ROWS), colcorr, wzp, rowsum, biasq, mult, j0, ozp,
                                qmin, qmax, res, addp, lut, boff, -1,
                            )  # fmt: skip
                            i += _NARROW_ROWS
                        elif left > 1:
                            block_kernel(
                                narrow_mid, a, rowoffs, i, koffs, nk, bp, boff, c, ldc, left,
                                colcorr, wzp, rowsum, biasq, mult, j0, ozp, qmin, qmax, res, addp,
                                lut, boff, -1,
                            )  # fmt: skip
                            i += _NARROW_ROWS // 2
                        else:
                            block_kernel(
                                narrow_one, a, rowoffs, i, koffs, nk, bp, boff, c, ldc, 1, colcorr,
                                wzp, rowsum, biasq, mult, j0, ozp, qmin, qmax, res, addp, lut,
                                boff, -1,
                            )  # fmt: skip
                            i += 1
                while i < end:
                    left = end - i
                    pfoff, pfshift = _prefetch(
                        p, npanels, boff, panel, end - start, big_rows, i - start
                    )
                    if left > mid_rows and (
                        quad_rows == 0 or left > 2 * quad_rows or left == big_rows
                    ):
                        block_kernel(
                            big, a, rowoffs, i, koffs, nk, bp, boff, c, ldc, min(left, big_rows),
                            colcorr, wzp, rowsum, biasq, mult, j0, ozp, qmin, qmax, res, addp, lut,
                            pfoff, pfshift,
                        )  # fmt: skip
                        i += big_rows
                    elif quad_rows != 0 and left >= quad_rows:
                        block_kernel(
                            quad, a, rowoffs, i, koffs, nk, bp, boff, c, ldc, quad_rows,
                            colcorr, wzp, rowsum, biasq, mult, j0, ozp, qmin, qmax, res, addp, lut,
                            pfoff, pfshift,
                        )  # fmt: skip
                        i += quad_rows
                    elif left > 1:
                        block_kernel(
                            mid, a, rowoffs, i, koffs, nk, bp, boff, c, ldc, left,
                            colcorr, wzp, rowsum, biasq, mult, j0, ozp, qmin, qmax, res, addp, lut,
                            pfoff, pfshift,
                        )  # fmt: skip
                        i += mid_rows
                    else:
                        block_kernel(
                            one, a, rowoffs, i, koffs, nk, bp, boff, c, ldc, 1,
                            colcorr, wzp, rowsum, biasq, mult, j0, ozp, qmin, qmax, res, addp, lut,
                            pfoff, pfshift,
                        )  # fmt: skip
                        i += 1

    prefix = "drive" if parallel else "serial"
    # a distinct module-level qualname per driver: its own cache index file, stable across runs
    driver.__name__ = driver.__qualname__ = f"{prefix}_{SHORT_NAMES[target]}_{mode}"
    return needs_features(
        target_features(target), njit(cache=True, parallel=parallel, nogil=True)(driver)
    )


def _make_batched_driver(target: str, parallel: bool) -> Any:
    """Mode ``u8`` over ``nb`` independent GEMMs (attention's (batch, head) pairs) in one call.

    Batch ``g`` reads ``a[g*asz:]`` (rows addressed by ``rowoffs``, shared), its own packed B
    ``bp[g*bsz:]``, column corrections ``colcorr[g*ldc:]`` and row sums ``rowsum[g*m:]``, and
    writes rows ``g*m ..`` of ``c`` ([nb*m, ldc]). Tiles are (batch, panel, row chunk),
    batch-major, so ``prange`` spreads whole batches over the threads.
    """
    big_rows, quad_rows, mid_rows = _ROWS[target]
    vectors = block_cols(target) // block_lanes(target)
    big = KERNEL_IDS[(target, big_rows, "u8", vectors)]
    quad = KERNEL_IDS[(target, quad_rows, "u8", vectors)] if quad_rows else big
    mid = KERNEL_IDS[(target, mid_rows, "u8", vectors)]
    one = KERNEL_IDS[(target, 1, "u8", vectors)]
    nr = block_cols(target)
    panel_step = nr * k_step(target)

    def driver(  # type: ignore[no-untyped-def]  # numba types the arguments
        nb, a, asz, rowoffs, m, koffs, nk, bp, bsz, npanels, c, ldc, colcorr, wzp, rowsum,
        biasq, mult, ozp, qmin, qmax, mchunk, res, addp, lut,
    ):  # fmt: skip
        nmc = (m + mchunk - 1) // mchunk
        per = npanels * nmc
        panel = nk * panel_step
        for t in prange(nb * per):  # a plain range when parallel=False
            g = t // per
            tt = t - g * per
            p = tt % npanels
            start = (tt // npanels) * mchunk
            end = min(m, start + mchunk)
            ag = a[g * asz : (g + 1) * asz]
            bg = bp[g * bsz : (g + 1) * bsz]
            cg = c[g * m * ldc : (g + 1) * m * ldc]
            ccg = colcorr[g * ldc : (g + 1) * ldc]
            rsg = rowsum[g * m : (g + 1) * m]
            boff = p * panel
            j0 = p * nr
            i = start
            while i < end:
                left = end - i
                pfoff, pfshift = _prefetch(
                    p, npanels, boff, panel, end - start, big_rows, i - start
                )
                if left > mid_rows and (quad_rows == 0 or left > 2 * quad_rows or left == big_rows):
                    block_kernel(
                        big, ag, rowoffs, i, koffs, nk, bg, boff, cg, ldc, min(left, big_rows),
                        ccg, wzp, rsg, biasq, mult, j0, ozp, qmin, qmax, res, addp, lut,
                        pfoff, pfshift,
                    )  # fmt: skip
                    i += big_rows
                elif quad_rows != 0 and left >= quad_rows:
                    block_kernel(
                        quad, ag, rowoffs, i, koffs, nk, bg, boff, cg, ldc, quad_rows,
                        ccg, wzp, rsg, biasq, mult, j0, ozp, qmin, qmax, res, addp, lut,
                        pfoff, pfshift,
                    )  # fmt: skip
                    i += quad_rows
                elif left > 1:
                    block_kernel(
                        mid, ag, rowoffs, i, koffs, nk, bg, boff, cg, ldc, left,
                        ccg, wzp, rsg, biasq, mult, j0, ozp, qmin, qmax, res, addp, lut,
                        pfoff, pfshift,
                    )  # fmt: skip
                    i += mid_rows
                else:
                    block_kernel(
                        one, ag, rowoffs, i, koffs, nk, bg, boff, cg, ldc, 1,
                        ccg, wzp, rsg, biasq, mult, j0, ozp, qmin, qmax, res, addp, lut,
                        pfoff, pfshift,
                    )  # fmt: skip
                    i += 1

    prefix = "batched_drive" if parallel else "batched_serial"
    driver.__name__ = driver.__qualname__ = f"{prefix}_{SHORT_NAMES[target]}_u8"
    return needs_features(
        target_features(target), njit(cache=True, parallel=parallel, nogil=True)(driver)
    )


drive_vnni_u8 = _make_driver("avx512_vnni", "u8", True)
serial_vnni_u8 = _make_driver("avx512_vnni", "u8", False)
drive_vnni_u8t = _make_driver("avx512_vnni", "u8t", True)
serial_vnni_u8t = _make_driver("avx512_vnni", "u8t", False)
drive_vnni_u8add = _make_driver("avx512_vnni", "u8add", True)
serial_vnni_u8add = _make_driver("avx512_vnni", "u8add", False)
drive_vnni_f32 = _make_driver("avx512_vnni", "f32", True)
serial_vnni_f32 = _make_driver("avx512_vnni", "f32", False)
drive_avx2_u8 = _make_driver("avx2", "u8", True)
serial_avx2_u8 = _make_driver("avx2", "u8", False)
drive_avx2_u8add = _make_driver("avx2", "u8add", True)
serial_avx2_u8add = _make_driver("avx2", "u8add", False)
drive_avx2_f32 = _make_driver("avx2", "f32", True)
serial_avx2_f32 = _make_driver("avx2", "f32", False)
drive_avx2b_u8 = _make_driver("avx2_byte", "u8", True)
serial_avx2b_u8 = _make_driver("avx2_byte", "u8", False)
drive_avx2b_u8add = _make_driver("avx2_byte", "u8add", True)
serial_avx2b_u8add = _make_driver("avx2_byte", "u8add", False)
drive_avx2b_f32 = _make_driver("avx2_byte", "f32", True)
serial_avx2b_f32 = _make_driver("avx2_byte", "f32", False)
batched_drive_vnni_u8 = _make_batched_driver("avx512_vnni", True)
batched_serial_vnni_u8 = _make_batched_driver("avx512_vnni", False)
batched_drive_avx2_u8 = _make_batched_driver("avx2", True)
batched_serial_avx2_u8 = _make_batched_driver("avx2", False)
batched_drive_avx2b_u8 = _make_batched_driver("avx2_byte", True)
batched_serial_avx2b_u8 = _make_batched_driver("avx2_byte", False)
drive_avxvnni_u8 = _make_driver("avx_vnni", "u8", True)
serial_avxvnni_u8 = _make_driver("avx_vnni", "u8", False)
drive_avxvnni_u8add = _make_driver("avx_vnni", "u8add", True)
serial_avxvnni_u8add = _make_driver("avx_vnni", "u8add", False)
drive_avxvnni_f32 = _make_driver("avx_vnni", "f32", True)
serial_avxvnni_f32 = _make_driver("avx_vnni", "f32", False)
batched_drive_avxvnni_u8 = _make_batched_driver("avx_vnni", True)
batched_serial_avxvnni_u8 = _make_batched_driver("avx_vnni", False)
drive_a64i8mm_u8 = _make_driver("aarch64_i8mm", "u8", True)
serial_a64i8mm_u8 = _make_driver("aarch64_i8mm", "u8", False)
drive_a64i8mm_u8add = _make_driver("aarch64_i8mm", "u8add", True)
serial_a64i8mm_u8add = _make_driver("aarch64_i8mm", "u8add", False)
drive_a64i8mm_f32 = _make_driver("aarch64_i8mm", "f32", True)
serial_a64i8mm_f32 = _make_driver("aarch64_i8mm", "f32", False)
batched_drive_a64i8mm_u8 = _make_batched_driver("aarch64_i8mm", True)
batched_serial_a64i8mm_u8 = _make_batched_driver("aarch64_i8mm", False)
drive_a64dot_u8 = _make_driver("aarch64_dotprod", "u8", True)
serial_a64dot_u8 = _make_driver("aarch64_dotprod", "u8", False)
drive_a64dot_u8add = _make_driver("aarch64_dotprod", "u8add", True)
serial_a64dot_u8add = _make_driver("aarch64_dotprod", "u8add", False)
drive_a64dot_f32 = _make_driver("aarch64_dotprod", "f32", True)
serial_a64dot_f32 = _make_driver("aarch64_dotprod", "f32", False)
batched_drive_a64dot_u8 = _make_batched_driver("aarch64_dotprod", True)
batched_serial_a64dot_u8 = _make_batched_driver("aarch64_dotprod", False)
