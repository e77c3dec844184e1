"""lstm_sequence / gru_sequence: bit-identical to their definition, one ``linear_dynamic`` and one
cell call per time step, on every target, both directions, strided inputs and threads; steps the
compiled loop hands back; argument errors."""

from __future__ import annotations

import numpy as np
import pytest

from quantbridge import kernels as K

TARGETS = K.available_targets()


def _weight(
    rng: np.random.Generator,
    gates: int,
    hidden: int,
    target: str,
    *,
    bits: int = 7,
    per_channel: bool = True,
    zero_point: bool = False,
    bias: bool = True,
    scale: float = 0.01,
) -> K.PackedLinearWeight:
    n = gates * hidden
    top = 2 ** (bits - 1)
    w = rng.integers(-top + (bits == 7), top, (n, hidden)).astype(np.int8)
    s = (rng.random(n) * scale + scale / 4).astype(np.float32) if per_channel else scale
    zp = rng.integers(-3, 4, n) if zero_point else 0
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    return K.PackedLinearWeight(w, s, zp, b, target)


def _stepwise(
    gi: np.ndarray,
    packed: K.PackedLinearWeight,
    h: np.ndarray,
    c: np.ndarray | None,
    reverse: bool,
    threads: int,
) -> tuple[np.ndarray, ...]:
    """The definition: one dynamic linear and one cell per step, in order."""
    out = np.empty((gi.shape[0], h.shape[0], h.shape[1]), np.float32)
    order = range(gi.shape[0] - 1, -1, -1) if reverse else range(gi.shape[0])
    for t in order:
        gh = K.linear_dynamic(h, packed, num_threads=threads)
        if c is None:
            h = K.gru_cell(gi[t], gh, h)
        else:
            h, c = K.lstm_cell(gi[t], gh, c)
        out[t] = h
    return (out, h) if c is None else (out, h, c)


def _run(
    gi: np.ndarray,
    packed: K.PackedLinearWeight,
    h0: np.ndarray,
    c0: np.ndarray | None,
    reverse: bool,
    threads: int,
) -> tuple[np.ndarray, ...]:
    if c0 is None:
        return K.gru_sequence(gi, packed, h0, reverse=reverse, num_threads=threads)
    return K.lstm_sequence(gi, packed, h0, c0, reverse=reverse, num_threads=threads)


def _assert_same(got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert g.dtype == np.float32
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("lstm", [True, False])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(
    ("bits", "per_channel", "zero_point", "bias"),
    [
        (7, True, False, True),
        (8, True, False, True),
        (7, False, True, False),
        (8, False, True, True),
    ],
)
def test_sequence_equals_its_steps(
    target: str, lstm: bool, reverse: bool, bits: int, per_channel: bool, zero_point: bool,
    bias: bool,
) -> None:  # fmt: skip
    gates = 4 if lstm else 3
    rng = np.random.default_rng([gates, bits, int(reverse), int(zero_point)])
    steps, batch, hidden = 9, 5, 24
    packed = _weight(rng, gates, hidden, target, bits=bits, per_channel=per_channel,
                     zero_point=zero_point, bias=bias)  # fmt: skip
    gi = (rng.standard_normal((steps, batch, gates * hidden)) * 2).astype(np.float32)
    h0 = rng.standard_normal((batch, hidden)).astype(np.float32)
    c0 = rng.standard_normal((batch, hidden)).astype(np.float32) if lstm else None
    got = _run(gi, packed, h0, c0, reverse, 1)
    _assert_same(got, _stepwise(gi, packed, h0, c0, reverse, 1))
    assert not np.array_equal(got[0][0], got[0][-1])  # the state moved
    np.testing.assert_array_equal(got[1], got[0][0 if reverse else -1])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("layout", ["columns", "reversed", "transposed"])
def test_strided_gate_inputs(target: str, layout: str) -> None:
    """One direction's columns of a wider array (read in place), and layouts that get copied."""
    rng = np.random.default_rng(3)
    steps, batch, hidden = 6, 3, 16
    packed = _weight(rng, 4, hidden, target)
    dense = (rng.standard_normal((steps, batch, 4 * hidden)) * 2).astype(np.float32)
    if layout == "columns":
        wide = rng.standard_normal((steps, batch, 12 * hidden)).astype(np.float32)
        wide[:, :, 4 * hidden : 8 * hidden] = dense
        gi = wide[:, :, 4 * hidden : 8 * hidden]
    elif layout == "reversed":
        gi = dense[::-1].copy()[::-1]
    else:
        gi = np.ascontiguousarray(dense.transpose(1, 0, 2)).transpose(1, 0, 2)
    np.testing.assert_array_equal(gi, dense)
    h0 = np.zeros((batch, hidden), np.float32)
    c0 = np.zeros((batch, hidden), np.float32)
    _assert_same(K.lstm_sequence(gi, packed, h0, c0), _stepwise(dense, packed, h0, c0, False, 1))


@pytest.mark.parametrize("lstm", [True, False])
def test_threads_run_the_parallel_gemm_and_agree(lstm: bool) -> None:
    # 8 rows x 1024 columns x 64 k-steps: past the one-thread threshold of every target
    rng = np.random.default_rng(4)
    gates = 4 if lstm else 3
    steps, batch, hidden = 4, 8, 256
    packed = _weight(rng, gates, hidden, None, bits=8)
    gi = rng.standard_normal((steps, batch, gates * hidden)).astype(np.float32)
    h0 = rng.standard_normal((batch, hidden)).astype(np.float32)
    c0 = rng.standard_normal((batch, hidden)).astype(np.float32) if lstm else None
    want = _stepwise(gi, packed, h0, c0, False, 1)
    before = K.get_num_threads()
    _assert_same(_run(gi, packed, h0, c0, False, 2), want)
    assert K.get_num_threads() == before


def test_inputs_are_not_modified_and_empty_sequences_are_refused() -> None:
    rng = np.random.default_rng(5)
    packed = _weight(rng, 4, 8, None)
    gi = rng.standard_normal((3, 2, 32)).astype(np.float32)
    h0 = rng.standard_normal((2, 8)).astype(np.float32)
    c0 = rng.standard_normal((2, 8)).astype(np.float32)
    copies = [a.copy() for a in (gi, h0, c0)]
    K.lstm_sequence(gi, packed, h0, c0, reverse=True)
    for a, b in zip((gi, h0, c0), copies, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(K.KernelError, match=r"gi: zero-size array \(shape \(0, 2, 32\)\)"):
        K.lstm_sequence(gi[:0], packed, h0, c0)
    with pytest.raises(K.KernelError, match=r"gi: zero-size array \(shape \(4, 0, 24\)\)"):
        K.gru_sequence(np.zeros((4, 0, 24), np.float32), _weight(rng, 3, 8, None),
                       np.zeros((0, 8), np.float32))  # fmt: skip


@pytest.mark.parametrize("target", TARGETS)
def test_steps_handed_back_to_the_checked_path(target: str) -> None:
    """Scale products below twice float32's smallest normal are checked one by one: those steps
    leave the compiled loop, run through ``linear_dynamic`` (which accepts them here) and the
    loop resumes, with the same numbers."""
    rng = np.random.default_rng(6)
    steps, batch, hidden = 7, 2, 8
    # saturated gates: c grows by one per step, h = tanh(c) climbs towards 1, so every
    # step's activation scale is ~h_max / 255 and its products with these weight scales
    # fall in [1.17e-38, 2.35e-38); the first step's h0 = 0 takes scale 0.1, far above
    packed = _weight(rng, 4, hidden, target, scale=4.5e-36, per_channel=False, bias=False)
    gi = np.full((steps, batch, 4 * hidden), 30.0, np.float32)
    h0 = np.zeros((batch, hidden), np.float32)
    c0 = np.zeros((batch, hidden), np.float32)
    got = K.lstm_sequence(gi, packed, h0, c0)
    _assert_same(got, _stepwise(gi, packed, h0, c0, False, 1))
    assert got[1].min() > 0.99
    # weight scales 20x smaller: step 0 (scale 0.1) still passes the check, step 1's products
    # are below float32's smallest normal and are refused, naming the step
    small = _weight(rng, 4, hidden, target, scale=2e-37, per_channel=False, bias=False)
    with pytest.raises(K.KernelError, match=r"time step 1: x's dynamic scale \(0\.00"):
        K.lstm_sequence(gi, small, h0, c0)


@pytest.mark.parametrize("target", TARGETS)
def test_errors_name_the_time_step(target: str) -> None:
    rng = np.random.default_rng(7)
    packed = _weight(rng, 4, 8, target)
    gi = np.zeros((5, 2, 32), np.float32)
    h0 = np.zeros((2, 8), np.float32)
    c0 = np.zeros((2, 8), np.float32)
    bad = h0.copy()
    bad[1, 3] = np.nan
    with pytest.raises(K.KernelError, match="time step 0: x: contains NaN or infinity"):
        K.lstm_sequence(gi, packed, bad, c0)
    with pytest.raises(K.KernelError, match="time step 4: x: contains NaN or infinity"):
        K.lstm_sequence(gi, packed, bad, c0, reverse=True)
    tiny = np.full((2, 8), 1e-40, np.float32)
    with pytest.raises(K.KernelError, match="time step 0: x: its dynamic activation scale"):
        K.gru_sequence(np.zeros((5, 2, 24), np.float32), _weight(rng, 3, 8, target), tiny)
    # a NaN arriving through the input projections is caught at the next step
    gi_nan = gi.copy()
    gi_nan[2, 0, 0] = np.nan
    with pytest.raises(K.KernelError, match="time step 3: x: contains NaN"):
        K.lstm_sequence(gi_nan, packed, h0, c0)


def test_argument_errors() -> None:
    rng = np.random.default_rng(8)
    packed = _weight(rng, 4, 8, None)
    gi = np.zeros((3, 2, 32), np.float32)
    h0 = np.zeros((2, 8), np.float32)
    with pytest.raises(K.KernelError, match="packed: expected a PackedLinearWeight"):
        K.lstm_sequence(gi, np.zeros((32, 8), np.int8), h0, h0)  # type: ignore[arg-type]
    with pytest.raises(K.KernelError, match=r"hidden weight must be \[4 \* hidden, hidden\]"):
        K.lstm_sequence(gi, _weight(rng, 3, 8, None), h0, h0)
    with pytest.raises(K.KernelError, match=r"gi: expected shape \[T, 2, 32\]"):
        K.lstm_sequence(gi[:, :, :16], packed, h0, h0)
    with pytest.raises(K.KernelError, match=r"h0: expected shape \(2, 8\)"):
        K.lstm_sequence(gi, packed, np.zeros((2, 9), np.float32), h0)
    with pytest.raises(K.KernelError, match=r"c0: expected shape \(2, 8\)"):
        K.lstm_sequence(gi, packed, h0, np.zeros((3, 8), np.float32))
    with pytest.raises(K.KernelError, match="gate axis must be contiguous"):
        K.lstm_sequence(np.zeros((3, 2, 64), np.float32)[:, :, ::2], packed, h0, h0)
    with pytest.raises(K.KernelError, match="gi: expected dtype float32, got float64"):
        K.lstm_sequence(gi.astype(np.float64), packed, h0, h0)
