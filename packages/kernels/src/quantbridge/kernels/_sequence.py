"""One direction of a dynamic int8 LSTM / GRU layer over a whole sequence, in one compiled call.

Step ``t`` is exactly ``state = cell(gi[t], linear_dynamic(h, packed_hh), state)``: the hidden
state's per-tensor dynamic qparams (``_dynamic_act``'s rule), its quantized rows in the layout
the weight's kernels read, the GEMM on the weight's float-output driver, then ``_recurrent``'s
cell, with no Python between steps. On a 2-layer, 512-wide LSTM at batch 8 the per-step calls
around the kernels took about a sixth of the time.

A step the compiled loop does not take (a non-finite hidden state, a range too small for a
float32 scale, scale products near float32's limits) is handed back and run through
``linear_dynamic`` itself, which computes it or raises its error; the loop then resumes.

The loop takes its arguments as named records (NamedTuples, which numba passes as their
fields): ``SeqInputs``, ``SeqState``, the hidden weight's ``SeqWeight`` (made once per weight)
and the per-step buffers' ``SeqScratch``, made once per call.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from numba import njit, types
from numba.extending import overload

from quantbridge.kernels._block_kernels import activation_offset
from quantbridge.kernels._checks import F32_TINY, check_array
from quantbridge.kernels._dynamic_act import dynamic_qparams, quantize_rows_fixed, tensor_range
from quantbridge.kernels._epilogue_lut import NO_LUT
from quantbridge.kernels._errors import KernelError
from quantbridge.kernels._gemm_run import (
    NO_ADD,
    NO_RESIDUAL,
    SERIAL_BELOW,
    parallel_driver,
    row_chunk,
    serial_driver,
)
from quantbridge.kernels._linear import (
    PRODUCT_CEILING,
    PRODUCT_FLOOR,
    PackedLinearWeight,
    column_corrections,
    linear_dynamic,
)
from quantbridge.kernels._numba_compat import compiled_entry_point
from quantbridge.kernels._recurrent import _gru_rows, _lstm_rows, gru_cell, lstm_cell
from quantbridge.kernels._targets import needs_features, target_features
from quantbridge.kernels._threads import apply_num_threads, with_threads

F32 = npt.NDArray[np.float32]

# kernel family -> driver number of ``_gemm_f32`` (generic has no IR driver: Python steps)
_FAMILIES = ("avx2_byte", "avx2", "avx512_vnni", "avx_vnni", "aarch64_i8mm", "aarch64_dotprod")
_DRIVERS = [serial_driver(f, "f32") for f in _FAMILIES] + [
    parallel_driver(f, "f32") for f in _FAMILIES
]
_TINY = np.float64(F32_TINY)


class SeqInputs(NamedTuple):
    """The input projections, biases included: ``gi[t, b, j]`` is ``gi[t * step + b * row + j]``
    of this flat view (``_flat_view``). ``steps`` steps, run last to first when ``reverse``."""

    gi: F32
    step: int
    row: int
    steps: int
    reverse: bool


class SeqState(NamedTuple):
    """The state, updated in place step by step (a GRU's ``c`` is its ``h``), and the
    outputs: ``out[t] = h`` after step ``t``."""

    h: F32  # [B, H]
    c: F32  # [B, H]
    out: F32  # [T, B, H]


class SeqWeight(NamedTuple):
    """The packed hidden weight as its float-output driver reads it, and the constants a
    step's dynamic scale is checked and folded with."""

    bp: npt.NDArray[Any]  # the packed panels
    koffs: npt.NDArray[np.int64]  # activation offset of each k step
    npanels: int
    colsum: npt.NDArray[np.int64]  # the column corrections' terms (``column_corrections``)
    wzp: npt.NDArray[np.int32]
    k_true: int
    has_wzp: bool
    scales: F32  # weight scales, zero-padded to n_padded
    span_lo: float  # the smallest and largest weight scale
    span_hi: float
    bias: F32  # zero-padded to n_padded


class SeqScratch(NamedTuple):
    """One step's buffers: the hidden state's codes ``a`` (rows at ``rowoffs``, their sums),
    the step's column corrections and scale products, the GEMM's result ``gh`` and the new
    state ``fresh``; ``mchunk``: the driver's rows per task."""

    a: npt.NDArray[Any]  # [B, lda]: uint8 codes, int16 for the avx2 kernels
    rowoffs: npt.NDArray[np.int64]
    rowsum: npt.NDArray[np.int32]
    colcorr: npt.NDArray[np.int32]  # [n_padded]
    mult: F32  # [n_padded]
    gh: F32  # [B, n_padded]
    fresh: F32  # [B * H]
    mchunk: int


def _gemm_f32(which: int, a: Any, gh: F32, m: int, weight: SeqWeight, scratch: SeqScratch) -> None:
    """Compiled code only: ``gh = a @ weight`` on the float-output driver number ``which`` (a
    constant), ``a`` and ``gh`` being ``scratch.a`` and ``scratch.gh`` flat (``m`` rows), made
    once per sequence: a reshape costs a helper call."""
    raise NotImplementedError


@overload(_gemm_f32, prefer_literal=True)
def _gemm_f32_impl(which, a, gh, m, weight, scratch):  # type: ignore[no-untyped-def]  # numba's types
    if not isinstance(which, types.IntegerLiteral):
        return None
    drive = _DRIVERS[which.literal_value]

    def impl(which, a, gh, m, weight, scratch):  # type: ignore[no-untyped-def]
        w, s = weight, scratch
        drive(a, s.rowoffs, m, w.koffs, w.koffs.shape[0], w.bp, w.npanels, gh, s.gh.shape[1],
              s.colcorr, w.wzp, s.rowsum, w.bias, s.mult, 0, 0, 255, s.mchunk, NO_RESIDUAL,
              NO_ADD, NO_LUT)  # fmt: skip

    return impl


def _make_loop(which: int, lstm: bool) -> Any:
    """The compiled time loop on driver ``which`` for an LSTM (``lstm``) or a GRU."""
    family = _FAMILIES[which % len(_FAMILIES)]
    offset = activation_offset(family)  # a constant of the compiled loop

    def loop(first, inputs, state, weight, scratch):  # type: ignore[no-untyped-def]
        """Steps ``first ..`` of the sequence; returns the first step not taken."""
        gi, h, wt, sc = inputs.gi, state.h, weight, scratch
        batch, hidden = h.shape
        ldc = sc.gh.shape[1]
        flat_h = h.reshape(-1)
        flat_c = state.c.reshape(-1)
        flat_a = sc.a.reshape(-1)
        flat_gh = sc.gh.reshape(-1)
        fresh = sc.fresh
        steps = inputs.steps
        for s in range(first, steps):
            t = steps - 1 - s if inputs.reverse else s
            lo, hi, bad = tensor_range(flat_h)
            if bad:
                return s
            scale, zp = dynamic_qparams(np.float64(lo), np.float64(hi))
            # the cases ``linear_dynamic`` refuses or checks element by element
            if not (scale >= _TINY and scale * wt.span_lo > PRODUCT_FLOOR and
                    scale * wt.span_hi < PRODUCT_CEILING):  # fmt: skip
                return s
            inv = np.float32(np.float32(1.0) / np.float32(scale))
            quantize_rows_fixed(h, inv, zp, sc.a, sc.rowsum, wt.has_wzp)
            column_corrections(zp, wt.colsum, wt.wzp, wt.k_true, offset, sc.colcorr)
            fs = np.float32(scale)
            for j in range(sc.mult.shape[0]):
                sc.mult[j] = wt.scales[j] * fs
            _gemm_f32(which, flat_a, flat_gh, batch, wt, sc)
            # new state into ``fresh``, then copied back: an output that aliases an input
            # keeps the cell's loop scalar
            if lstm:
                _lstm_rows(gi, t * inputs.step, inputs.row, flat_gh, ldc, flat_c, flat_h, fresh,
                           batch, hidden)  # fmt: skip
                flat_c[:] = fresh
            else:
                _gru_rows(gi, t * inputs.step, inputs.row, flat_gh, ldc, flat_h, fresh, batch,
                          hidden)  # fmt: skip
                flat_h[:] = fresh
            state.out[t] = h
        return steps

    kind = "lstm" if lstm else "gru"
    loop.__name__ = loop.__qualname__ = f"sequence_{kind}_{which}"
    return needs_features(target_features(family), njit(cache=True, nogil=True)(loop))


_LOOPS = {(w, lstm): _make_loop(w, lstm) for w in range(len(_DRIVERS)) for lstm in (True, False)}


def _check(
    gi: object, packed: object, h0: object, c0: object | None, gates: int
) -> tuple[F32, PackedLinearWeight, F32, F32 | None]:
    if not isinstance(packed, PackedLinearWeight):
        raise KernelError(f"packed: expected a PackedLinearWeight, got {type(packed).__name__}")
    hidden = packed.k
    if packed.n != gates * hidden:
        raise KernelError(
            f"packed: the hidden weight must be [{gates} * hidden, hidden]; got "
            f"[{packed.n}, {packed.k}]"
        )
    g = check_array("gi", gi, np.float32, 3, contiguous=False)
    h = check_array("h0", h0, np.float32, 2, contiguous=False)
    batch = h.shape[0]
    if h.shape[1] != hidden:
        raise KernelError(f"h0: expected shape ({batch}, {hidden}), got {h.shape}")
    if g.shape[1:] != (batch, gates * hidden):
        raise KernelError(
            f"gi: expected shape [T, {batch}, {gates * hidden}] (steps, batch, gates stacked on "
            f"the last axis), got {g.shape}"
        )
    if g.strides[2] != 4:
        raise KernelError(f"gi: the gate axis must be contiguous (got strides {g.strides})")
    c = None
    if c0 is not None:
        c = check_array("c0", c0, np.float32, 2, contiguous=False)
        if c.shape != h.shape:
            raise KernelError(f"c0: expected shape {h.shape}, got {c.shape}")
    return g, packed, h, c


def _flat_view(gi: F32) -> tuple[F32, int, int]:
    """``(flat, step stride, row stride)``: ``gi[t, b, j]`` is ``flat[t * st + b * sb + j]``.

    A view with non-negative strides (e.g. one direction's columns of a wider array) is read in
    place through a flat view spanning its elements: every address between two elements of an
    array lies in its one buffer, and the bytes between rows are never used. Anything else is
    copied. Either way read-only: one argument type for the compiled loop."""
    st, sb, sj = gi.strides
    if sj == 4 and st >= 0 and sb >= 0 and st % 4 == 0 and sb % 4 == 0:
        steps, batch, width = gi.shape
        extent = (steps - 1) * (st // 4) + (batch - 1) * (sb // 4) + width
        flat = np.lib.stride_tricks.as_strided(gi, (extent,), (4,), writeable=False)
        return flat, st // 4, sb // 4
    dense = np.ascontiguousarray(gi).reshape(-1)
    dense.flags.writeable = False
    return dense, gi.shape[1] * gi.shape[2], gi.shape[2]


class _WeightPlan(NamedTuple):
    """A hidden weight's kernel family, its ``SeqWeight`` record and the compiled loops'
    entry points by ``(which, lstm)``."""

    family: str
    record: SeqWeight
    entries: dict[tuple[int, bool], Any]


# per hidden weight, made by its first sequence. The weight's arrays never change and every
# other argument is made here with fixed types (``_run``), so a loop's argument types, and so
# its compiled entry point, are fixed per weight
_PLANS: weakref.WeakKeyDictionary[PackedLinearWeight, _WeightPlan] = weakref.WeakKeyDictionary()


def _weight_plan(packed: PackedLinearWeight) -> _WeightPlan:
    plan = _PLANS.get(packed)
    if plan is None:
        family, bp, koffs = packed.kernel, packed.packed, packed.koffs
        if packed.guarded:  # 8-bit weights: dynamic codes span [0, 255], the int16 kernels
            family, bp, koffs = "avx2", packed.exact_packed(), packed._exact_koffs
        span_lo, span_hi = packed._scale_span
        record = SeqWeight(
            bp, koffs, packed.npanels, packed.colsum, packed.zero_points, packed.k_true,
            packed.has_weight_zp, packed.epilogue_unit()[1], span_lo, span_hi,
            packed.bias_padded,
        )  # fmt: skip
        plan = _PLANS[packed] = _WeightPlan(family, record, {})
    return plan


def _run(
    gi: F32,
    packed: PackedLinearWeight,
    h: F32,
    c: F32,
    lstm: bool,
    reverse: bool,
    threads: int,
) -> F32:
    """Run every step, updating ``h``/``c`` in place; returns the [T, B, H] outputs."""
    steps, batch, hidden = gi.shape[0], h.shape[0], h.shape[1]
    out = np.empty((steps, batch, hidden), np.float32)
    step = 0
    if packed.kernel in _FAMILIES:
        family, weight, entries = _weight_plan(packed)
        n = packed.n_padded
        parallel = threads > 1 and batch * n * weight.koffs.shape[0] >= SERIAL_BELOW[family]
        which = _FAMILIES.index(family) + (len(_FAMILIES) if parallel else 0)
        key = (which, lstm)
        scratch = SeqScratch(
            np.empty((batch, packed.lda), np.int16 if family == "avx2" else np.uint8),
            packed.rows(batch)[0],
            np.empty(batch, np.int32),
            np.empty(n, np.int32),
            np.empty(n, np.float32),
            np.empty((batch, n), np.float32),
            np.empty(batch * hidden, np.float32),
            row_chunk(batch, weight.npanels, threads) if parallel else batch,
        )
        inputs = SeqInputs(*_flat_view(gi), steps, reverse)
        state = SeqState(h, c, out)
        # after the first call on this weight, the loop's compiled entry point: numba types
        # record arguments in Python on every call (+2.5 us a call, measured)
        entry = entries.get(key)
        while step < steps:
            args = (step, inputs, state, weight, scratch)
            loop = _LOOPS[key] if entry is None else entry
            step = (with_threads(loop, threads) if parallel else loop)(*args)
            if entry is None:
                entry = compiled_entry_point(_LOOPS[key], args)
                if entry is not None:  # None after a dry run's record (targets/dry_run.py)
                    entries[key] = entry
            if step < steps:  # a step the loop hands back: the checked path
                _python_step(gi, packed, h, c, out, step, lstm, reverse, threads)
                step += 1
        return out
    for step in range(steps):
        _python_step(gi, packed, h, c, out, step, lstm, reverse, threads)
    return out


def _python_step(
    gi: F32, packed: PackedLinearWeight, h: F32, c: F32, out: F32,
    step: int, lstm: bool, reverse: bool, threads: int,
) -> None:  # fmt: skip
    t = gi.shape[0] - 1 - step if reverse else step
    try:
        gh = linear_dynamic(h, packed, num_threads=threads)
    except KernelError as err:
        raise KernelError(f"hidden state entering time step {t}: {err}") from None
    if lstm:
        h[...], c[...] = lstm_cell(gi[t], gh, c)
    else:
        h[...] = gru_cell(gi[t], gh, h)
    out[t] = h


def lstm_sequence(
    gi: F32,
    packed_hh: PackedLinearWeight,
    h0: F32,
    c0: F32,
    *,
    reverse: bool = False,
    num_threads: int | None = None,
) -> tuple[F32, F32, F32]:
    """One direction of a dynamic int8 LSTM layer over a whole sequence: ``(out, h_n, c_n)``.

    ``gi``: float32 [T, B, 4H], the input projections with their bias (gate axis contiguous;
    a column slice of a wider array works). ``packed_hh``: the hidden weight [4H, H] with the
    hidden bias. ``h0``, ``c0``: float32 [B, H]. Steps run ``t = 0 .. T-1`` (``reverse``:
    ``T-1 .. 0``), each exactly
    ``h, c = lstm_cell(gi[t], linear_dynamic(h, packed_hh), c); out[t] = h``.
    """
    g, packed, h, c = _check(gi, packed_hh, h0, c0, 4)
    assert c is not None
    threads = apply_num_threads(num_threads, "lstm_sequence")
    h, c = h.copy(), c.copy()
    out = _run(g, packed, h, c, True, bool(reverse), threads)
    return out, h, c


def gru_sequence(
    gi: F32,
    packed_hh: PackedLinearWeight,
    h0: F32,
    *,
    reverse: bool = False,
    num_threads: int | None = None,
) -> tuple[F32, F32]:
    """One direction of a dynamic int8 GRU layer over a whole sequence: ``(out, h_n)``.

    ``gi``: float32 [T, B, 3H] (see ``lstm_sequence``); ``packed_hh``: [3H, H] with the hidden
    bias; ``h0``: float32 [B, H]. Each step is exactly
    ``h = gru_cell(gi[t], linear_dynamic(h, packed_hh), h); out[t] = h``.
    """
    g, packed, h, _ = _check(gi, packed_hh, h0, None, 3)
    threads = apply_num_threads(num_threads, "gru_sequence")
    h = h.copy()
    out = _run(g, packed, h, h, False, bool(reverse), threads)
    return out, h
