"""LSTM / GRU cell kernels against a float64 numpy reference of the same equations."""

from __future__ import annotations

import numpy as np
import pytest

from quantbridge import kernels as K
from quantbridge.kernels._recurrent import tanh_f32


def _sigmoid(v: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-v))


def test_tanh_error_bound() -> None:
    x = np.linspace(-30, 30, 600_001, dtype=np.float32)
    got = tanh_f32(x).astype(np.float64)
    assert np.abs(got - np.tanh(x.astype(np.float64))).max() < 4e-7
    assert tanh_f32(np.array([0.0], np.float32))[0] == 0.0
    assert got.max() <= 1.0
    assert got.min() >= -1.0


@pytest.mark.parametrize(("batch", "hidden"), [(1, 1), (3, 17), (8, 64)])
def test_lstm_cell(batch: int, hidden: int) -> None:
    rng = np.random.default_rng(batch * hidden)
    gi = (rng.standard_normal((batch, 4 * hidden)) * 3).astype(np.float32)
    gh = (rng.standard_normal((batch, 4 * hidden)) * 3).astype(np.float32)
    c = rng.standard_normal((batch, hidden)).astype(np.float32)
    h_out, c_out = K.lstm_cell(gi, gh, c)
    g = gi.astype(np.float64) + gh
    i, f, gg, o = np.split(g, 4, axis=1)
    c_ref = _sigmoid(f) * c + _sigmoid(i) * np.tanh(gg)
    h_ref = _sigmoid(o) * np.tanh(c_ref)
    assert h_out.dtype == np.float32
    assert c_out.shape == (batch, hidden)
    np.testing.assert_allclose(c_out, c_ref, rtol=0, atol=2e-6)
    np.testing.assert_allclose(h_out, h_ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize(("batch", "hidden"), [(1, 1), (3, 17), (8, 64)])
def test_gru_cell(batch: int, hidden: int) -> None:
    rng = np.random.default_rng(7 + batch * hidden)
    gi = (rng.standard_normal((batch, 3 * hidden)) * 3).astype(np.float32)
    gh = (rng.standard_normal((batch, 3 * hidden)) * 3).astype(np.float32)
    h = rng.standard_normal((batch, hidden)).astype(np.float32)
    got = K.gru_cell(gi, gh, h)
    ir, iz, in_ = np.split(gi.astype(np.float64), 3, axis=1)
    hr, hz, hn = np.split(gh.astype(np.float64), 3, axis=1)
    r, z = _sigmoid(ir + hr), _sigmoid(iz + hz)
    n = np.tanh(in_ + r * hn)
    np.testing.assert_allclose(got, (1 - z) * n + z * h, rtol=0, atol=2e-6)


@pytest.mark.parametrize("scale", [5.0, 30.0])
def test_cells_keep_their_accuracy_on_large_states(scale: float) -> None:
    # the cells divide over common denominators (products of up to three q's): with states
    # far from 0 the error must stay a few float32 ulps of the state carried in
    rng = np.random.default_rng(int(scale))
    ulps = 8 * float(np.finfo(np.float32).eps)
    gi = (rng.standard_normal((8, 4 * 512)) * 3).astype(np.float32)
    gh = (rng.standard_normal((8, 4 * 512)) * 3).astype(np.float32)
    c = (rng.standard_normal((8, 512)) * scale).astype(np.float32)
    h_out, c_out = K.lstm_cell(gi, gh, c)
    i, f, gg, o = np.split(gi.astype(np.float64) + gh, 4, axis=1)
    c_ref = _sigmoid(f) * c + _sigmoid(i) * np.tanh(gg)
    assert np.all(np.abs(c_out - c_ref) <= ulps * (np.abs(c) + 1))
    # h' from the c' computed: its own error, not c's carried through tanh
    np.testing.assert_allclose(h_out, _sigmoid(o) * np.tanh(c_out), rtol=0, atol=2e-6)
    gi3, gh3 = gi[:, : 3 * 512], gh[:, : 3 * 512]
    got = K.gru_cell(gi3, gh3, c)
    ir, iz, in_ = np.split(gi3.astype(np.float64), 3, axis=1)
    hr, hz, hn = np.split(gh3.astype(np.float64), 3, axis=1)
    r, z = _sigmoid(ir + hr), _sigmoid(iz + hz)
    want = (1 - z) * np.tanh(in_ + r * hn) + z * c
    assert np.all(np.abs(got - want) <= ulps * (np.abs(c) + 1))


def test_strided_gates_accepted() -> None:
    rng = np.random.default_rng(0)
    both = rng.standard_normal((2, 8 * 5)).astype(np.float32)
    gh = rng.standard_normal((2, 4 * 5)).astype(np.float32)
    c = np.zeros((2, 5), np.float32)
    view = both[:, 4 * 5 :]  # one direction's gates of a stacked projection
    np.testing.assert_array_equal(
        K.lstm_cell(view, gh, c)[0], K.lstm_cell(np.ascontiguousarray(view), gh, c)[0]
    )


def test_bad_input_refused() -> None:
    gi = np.zeros((2, 12), np.float32)
    with pytest.raises(K.KernelError, match=r"gi: expected shape \[B, 4 \* hidden\]"):
        K.lstm_cell(np.zeros((2, 10), np.float32), gi[:, :10], np.zeros((2, 2), np.float32))
    with pytest.raises(K.KernelError, match=r"c: expected shape \(2, 3\)"):
        K.lstm_cell(gi, gi, np.zeros((2, 4), np.float32))
    with pytest.raises(K.KernelError, match="same shape"):
        K.gru_cell(gi, np.zeros((3, 12), np.float32), np.zeros((2, 4), np.float32))
    with pytest.raises(K.KernelError, match="dtype float32"):
        K.gru_cell(gi.astype(np.float64), gi, np.zeros((2, 4), np.float32))
    with pytest.raises(K.KernelError, match="gate axis must be contiguous"):
        K.gru_cell(np.zeros((12, 2), np.float32).T, gi, np.zeros((2, 4), np.float32))
