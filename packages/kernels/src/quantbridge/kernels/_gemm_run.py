"""Dispatch one packed GEMM to the target's tile driver, with padding and thread setup."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from quantbridge.kernels import _gemm_simd
from quantbridge.kernels._block_kernels import block_lanes
from quantbridge.kernels._epilogue_lut import NO_LUT
from quantbridge.kernels._float_epilogue import (
    FloatEpilogue,
    finish_rows,
    put_codes,
    rows_of,
)
from quantbridge.kernels._gemm import drive_generic, serial_generic
from quantbridge.kernels._lut import apply_table, table_as_pass
from quantbridge.kernels._pack import layout, round_up
from quantbridge.kernels._pair_guard import (
    PairGuard,
    any_high_code,
    gather_rows,
    split_steps,
    unsafe_rows_of_high,
)
from quantbridge.kernels._threads import with_threads

# (kernel family, output mode) -> its tile driver, parallel and (one thread: plain loops, no
# parallel-region launch, which costs ~20 us per call) serial
_FAMILIES = ("avx512_vnni", "avx2", "avx2_byte", "avx_vnni", "aarch64_i8mm", "aarch64_dotprod")
_DRIVERS = {
    (f, mode): getattr(_gemm_simd, f"drive_{_gemm_simd.SHORT_NAMES[f]}_{mode}")
    for f in _FAMILIES
    for mode in ("u8", "f32", "u8add")
}
_SERIAL = {
    (f, mode): getattr(_gemm_simd, f"serial_{_gemm_simd.SHORT_NAMES[f]}_{mode}")
    for f in _FAMILIES
    for mode in ("u8", "f32", "u8add")
}
# what the drivers get for ``res``/``addp`` when no residual add is fused
NO_RESIDUAL = np.zeros(0, np.uint8)
NO_ADD = np.zeros(0, np.float32)


# m * Np * k-steps below which one thread runs the GEMM, per kernel family. A parallel region
# costs ~20 us to launch and join on an idle machine. ``packages/kernels/bench/bench_kernels.py
# --crossover`` (README, Threads) measured the 1 vs 2 thread crossover of a pointwise conv on
# this AMD Zen 3 (avx2) at ~0.8M multiply-adds (1.08x) and 1.8M (1.21x): 1 << 19 k steps is
# ~1M multiply-adds for the int16 kernels (2 per step) and ~2M for the byte kernels (4 per
# step, ~1.3x faster per multiply-add). avx512_vnni, on a 2-core Xeon: 1.1x at 1.8M
# multiply-adds, 1.3x from 7M, so 1 << 19 k steps (~2M multiply-adds) too (it was 1 << 22,
# which left most of MobileNetV2's convs on one thread: 0.97x at 2 threads, now 1.3x).
# Every caller reads this one dict, so the crossover bench lifts it everywhere.
SERIAL_BELOW = {
    "avx512_vnni": 1 << 19, "avx_vnni": 1 << 19, "avx2": 1 << 19, "avx2_byte": 1 << 19,
    "aarch64_i8mm": 1 << 19, "aarch64_dotprod": 1 << 19, "generic": 1 << 22,
}  # fmt: skip

_NR = {t: layout(t)[0] for t in (*_FAMILIES, "generic")}
_LANES = {t: block_lanes(t) for t in _FAMILIES}


def serial_driver(target: str, mode: str) -> Any:
    """The one-thread IR driver for ``target`` (None for generic, which has none)."""
    return _SERIAL.get((target, mode))


def parallel_driver(target: str, mode: str) -> Any:
    """The parallel IR driver for ``target`` (None for generic); run it under ``with_threads``."""
    return _DRIVERS.get((target, mode))


def row_chunk(m: int, npanels: int, threads: int) -> int:
    """Rows per tile: whole M when panels alone keep every thread busy, else split M."""
    if threads == 1 or npanels >= 4 * threads:
        return max(m, 1)
    chunks = -(-4 * threads // npanels)
    return max(8, round_up(-(-m // chunks), 8))


def gemm_runner(
    target: str,
    rowoffs: npt.NDArray[np.int64],
    koffs: npt.NDArray[np.int64],
    bp: npt.NDArray[np.integer],
    n: int,
    colcorr: npt.NDArray[np.int32],
    wzp: npt.NDArray[np.int32],
    biasq: npt.NDArray[np.float32],
    mult: npt.NDArray[np.float32],
    out_zero_point: int,
    qmin: int,
    f32_out: bool,
    threads: int,
    fused_add: bool = False,
    lut: npt.NDArray[np.uint8] = NO_LUT,
    qmax: int = 255,
    guard: PairGuard | None = None,
) -> Any:
    """``run(a, rowsum, residual, add_params, epilogue) -> C[M, n]``: ``run_gemm`` with what
    does not depend on the activations, their row sums, a fused add's operand or the float
    epilogue (the thread and driver choice and the argument tuple) made once; a conv's call
    plan keeps it. ``guard`` (byte kernels on weights past 7 bits): rows a saturating pair could
    spoil are recomputed on the int16 kernels (``_pair_guard``)."""
    if guard is not None and target == "avx2_byte":

        def same_epilogue(family: str, rows: Any, steps: Any, packed: Any, nthreads: int) -> Any:
            return gemm_runner(
                family, rows, steps, packed, n, colcorr, wzp, biasq, mult, out_zero_point,
                qmin, f32_out, nthreads, fused_add, lut, qmax,
            )  # fmt: skip

        return _guarded_runner(rowoffs, koffs, bp, threads, guard, same_epilogue)
    m = rowoffs.shape[0]
    nk = koffs.shape[0]
    np_ = colcorr.shape[0]
    if threads > 1 and m * np_ * nk < SERIAL_BELOW[target]:
        threads = 1  # a parallel-region launch costs more than it saves on small products
    npanels = np_ // _NR[target]
    dtype = np.float32 if f32_out else np.uint8
    mchunk = m if threads == 1 else row_chunk(m, npanels, threads)
    widen = target == "avx2"  # the AVX2 kernels read activations as int16 pairs
    generic = target == "generic"
    # u8 rows of exactly n columns when n ends on a vector (any n on VNNI: masked stores): no
    # padded columns to cut off after (and a fused add's residual, laid out like C, is the
    # caller's [M, n] array itself)
    whole_rows = not (generic or f32_out) and (target == "avx512_vnni" or n % _LANES[target] == 0)
    ldc = n if whole_rows else np_
    if generic:
        drive = serial_generic if threads == 1 else with_threads(drive_generic, threads)
    else:
        mode = "f32" if f32_out else ("u8add" if fused_add else "u8")
        drive = _SERIAL[(target, mode)]
        if threads > 1:
            drive = with_threads(_DRIVERS[(target, mode)], threads)

    # with VBMI a table pass over the stored codes is ~20x cheaper than the epilogue's
    # lane-by-lane lookup (a pointwise conv 24->144 at 56x56 with hardswish: 3.6x the conv
    # alone fused, 1.1x as a pass): the drivers get no table and the pass runs after them
    table_pass = table_as_pass(lut) and not generic and not f32_out
    drive_lut = NO_LUT if table_pass else lut

    def run(
        a: npt.NDArray[Any],
        rowsum: npt.NDArray[np.int32],
        residual: npt.NDArray[np.uint8] | None = None,
        add_params: npt.NDArray[np.float32] | None = None,
        epilogue: FloatEpilogue | None = None,
    ) -> npt.NDArray[np.generic]:
        out = np.empty((m, ldc), dtype)
        c = out.reshape(-1)
        if widen and a.dtype != np.int16:
            a = a.astype(np.int16)
        if generic:
            drive(a, rowoffs, m, koffs, nk, bp, npanels, c, np_, colcorr, wzp, rowsum, biasq,
                  mult, out_zero_point, qmin, qmax, mchunk, f32_out, lut)  # fmt: skip
        else:
            drive(a, rowoffs, m, koffs, nk, bp, npanels, c, ldc, colcorr, wzp, rowsum, biasq,
                  mult, out_zero_point, qmin, qmax, mchunk,
                  NO_RESIDUAL if residual is None else residual,
                  NO_ADD if add_params is None else add_params, drive_lut)  # fmt: skip
            if table_pass:
                apply_table(c, lut, c, threads)
        if epilogue is not None:
            finish_rows(epilogue, c, ldc, m, threads)
        return out if ldc == n else np.ascontiguousarray(out[:, :n])

    return run


def _guarded_runner(
    rowoffs: npt.NDArray[np.int64],
    koffs: npt.NDArray[np.int64],
    bp: npt.NDArray[np.integer],
    threads: int,
    guard: PairGuard,
    runner: Any,
) -> Any:
    """``gemm_runner``'s ``run`` for the byte kernels on 8-bit weights: exact for any codes.
    ``runner(family, rowoffs, koffs, packed B, threads)`` makes a runner with this call's
    epilogue, for the byte kernels and for the int16 ones that redo the unsafe rows."""
    m = rowoffs.shape[0]
    run_byte = runner("avx2_byte", rowoffs, koffs, bp, threads)
    exact: list[Any] = []  # the int16 runner over every row, made on first need
    steps = 2 * koffs.shape[0]
    nbytes = guard.npix * guard.pixel_bytes

    def run(
        a: npt.NDArray[Any],
        rowsum: npt.NDArray[np.int32],
        residual: npt.NDArray[np.uint8] | None = None,
        add_params: npt.NDArray[np.float32] | None = None,
        epilogue: FloatEpilogue | None = None,
    ) -> npt.NDArray[np.generic]:
        # the usual call has no code of 128 or more: one scan, then the byte kernels
        if not any_high_code(a, nbytes):
            return run_byte(a, rowsum, residual, add_params, epilogue)  # type: ignore[no-any-return]
        rows = unsafe_rows_of_high(a, guard, m)
        if rows is None:
            return run_byte(a, rowsum, residual, add_params, epilogue)  # type: ignore[no-any-return]
        if 4 * rows.shape[0] > m:  # mostly unsafe (e.g. full-range activations): int16 only
            if not exact:
                exact.append(
                    runner("avx2", rowoffs, split_steps(koffs), guard.pack_exact(), threads)
                )
            return exact[0](a, rowsum, residual, add_params, epilogue)  # type: ignore[no-any-return]
        out: npt.NDArray[np.generic] = run_byte(a, rowsum, residual, add_params, epilogue)
        dense = gather_rows(a, rowoffs, rows, koffs)
        fix = runner(
            "avx2", np.arange(rows.shape[0], dtype=np.int64) * dense.shape[1],
            np.arange(steps, dtype=np.int64) * 2, guard.pack_exact(), 1,
        )  # fmt: skip
        res = None if residual is None else residual.reshape(m, -1)[rows].reshape(-1)
        part = None if epilogue is None else rows_of(epilogue, rows)  # the redone rows' own
        out[rows] = fix(dense.reshape(-1), rowsum[rows], res, add_params, part)
        if epilogue is not None and part is not None:
            put_codes(epilogue, part, rows)
        return out

    return run


def run_gemm(
    target: str,
    a: npt.NDArray[np.uint8],
    rowoffs: npt.NDArray[np.int64],
    koffs: npt.NDArray[np.int64],
    bp: npt.NDArray[np.integer],
    n: int,
    colcorr: npt.NDArray[np.int32],
    wzp: npt.NDArray[np.int32],
    rowsum: npt.NDArray[np.int32],
    biasq: npt.NDArray[np.float32],
    mult: npt.NDArray[np.float32],
    out_zero_point: int,
    qmin: int,
    f32_out: bool,
    threads: int,
    residual: npt.NDArray[np.uint8] | None = None,
    add_params: npt.NDArray[np.float32] | None = None,
    epilogue: FloatEpilogue | None = None,
    lut: npt.NDArray[np.uint8] = NO_LUT,
    qmax: int = 255,
    guard: PairGuard | None = None,
) -> npt.NDArray[np.generic]:
    """C[M, n] for activations addressed by ``rowoffs``/``koffs`` and packed B ``bp``.

    ``a`` is flat uint8; every address the kernels form stays inside it (checked by the
    callers' construction of ``rowoffs`` and ``koffs``). With ``residual`` (flat uint8 laid out
    like C, so ``n`` must be the padded width) and ``add_params``, the u8 result goes through
    the fused add of mode ``u8add`` (``_vnni.py``); IR targets only. ``epilogue``
    (``f32_out`` only, ``_float_epilogue``): what follows ``fma(acc, mult, bias)`` on the
    float output (row scales, float columns, activation, codes), block by block. ``a`` may
    arrive already widened to int16 for ``avx2``. ``lut`` (uint8[256] or
    empty, see ``_epilogue_lut``) maps the u8 codes, clamped to ``[qmin, qmax]``, before the
    store. ``guard``: see ``gemm_runner``.
    """
    run = gemm_runner(target, rowoffs, koffs, bp, n, colcorr, wzp, biasq, mult, out_zero_point,
                      qmin, f32_out, threads, residual is not None, lut, qmax, guard)  # fmt: skip
    out: npt.NDArray[np.generic] = run(a, rowsum, residual, add_params, epilogue)
    return out
