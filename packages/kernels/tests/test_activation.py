"""relu / relu6 / hardtanh / clamp on codes: references written here, torch as oracle."""

from __future__ import annotations

import warnings

import numba
import numpy as np
import pytest

import quantbridge.kernels as qk
import quantbridge.kernels._quantize as _quantize_module
from quantbridge.kernels import KernelError


def ref_bound(value, scale, zp):
    t = np.float32(np.float32(value) * (np.float32(1) / np.float32(scale))) + np.float32(zp)
    return int(np.clip(np.rint(np.float64(np.float32(t))), 0, 255))


def test_relu_and_clamps_match_reference():
    rng = np.random.default_rng(0)
    for _ in range(50):
        x = rng.integers(0, 256, (4, 17)).astype(np.uint8)
        scale, zp = float(rng.uniform(0.01, 0.3)), int(rng.integers(0, 256))
        lo, hi = float(rng.uniform(-5, 1)), float(rng.uniform(-1, 9))
        np.testing.assert_array_equal(qk.relu(x, zp), np.maximum(x, zp))
        qlo, qhi = ref_bound(lo, scale, zp), ref_bound(hi, scale, zp)
        want = np.minimum(np.maximum(x, qlo), qhi)
        np.testing.assert_array_equal(qk.clamp(x, scale, zp, lo, hi), want)
        np.testing.assert_array_equal(qk.hardtanh(x, scale, zp, lo, hi), want)
        six = np.minimum(np.maximum(x, ref_bound(0.0, scale, zp)), ref_bound(6.0, scale, zp))
        np.testing.assert_array_equal(qk.relu6(x, scale, zp), six)
        np.testing.assert_array_equal(qk.clamp(x, scale, zp), x)


def test_in_place_and_bad_input():
    x = np.arange(256, dtype=np.uint8)
    assert qk.relu(x, 100, out=x) is x
    np.testing.assert_array_equal(x, np.maximum(np.arange(256), 100))
    with pytest.raises(KernelError, match="zero_point"):
        qk.relu(x, -1)
    with pytest.raises(KernelError, match="q: expected dtype uint8"):
        qk.relu(x.astype(np.int8), 0)
    with pytest.raises(KernelError, match="min_val"):
        qk.clamp(x, 0.1, 0, float("nan"))
    with pytest.raises(KernelError, match="max_val"):
        qk.clamp(x, 0.1, 0, 0.0, "6")
    with pytest.raises(KernelError, match="scale"):
        qk.hardtanh(x, 0.0, 0)
    with pytest.raises(KernelError, match="unknown kernel target"):
        qk.relu6(x, 0.1, 0, target="neon")


@pytest.mark.parametrize("target", qk.available_targets())
@pytest.mark.parametrize("threads", [1, 2])
def test_large_input_threads_and_targets(threads, target, monkeypatch):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("numba runs with fewer threads on this machine")
    x = np.random.default_rng(1).integers(0, 256, 300_001).astype(np.uint8)
    _force_threaded_path(monkeypatch, threads)
    qk.set_num_threads(threads)
    try:
        got = qk.clamp(x, 0.05, 20, -0.5, 4.0, target=target)
    finally:
        qk.set_num_threads(None)
    # numba's own per-thread count (set above to differ from the call's) is left as it was
    assert numba.get_num_threads() == (numba.config.NUMBA_NUM_THREADS if threads == 1 else 1)
    np.testing.assert_array_equal(got, np.clip(x, 10, 100))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_activations_byte_identical_to_torch():
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.ao.quantization")
    functional = torch.nn.functional
    rng = np.random.default_rng(2)
    for _ in range(80):
        shape = tuple(int(v) for v in rng.integers(1, 9, 3))
        x = rng.integers(0, 256, shape).astype(np.uint8)
        scale, zp = float(rng.uniform(0.005, 0.5)), int(rng.integers(0, 256))
        tx = torch._make_per_tensor_quantized_tensor(torch.from_numpy(x), scale, zp)
        lo, hi = float(rng.uniform(-3, 0.5)), float(rng.uniform(0.5, 8))
        # bounds on exact .5 steps exercise the rounding rule of the bound quantization
        if rng.integers(0, 2):
            lo = (np.floor(lo / scale) + 0.5) * scale
            hi = (np.floor(hi / scale) + 0.5) * scale
        pairs = [
            (functional.relu(tx), qk.relu(x, zp)),
            (functional.relu6(tx), qk.relu6(x, scale, zp)),
            (functional.hardtanh(tx, lo, hi), qk.hardtanh(x, scale, zp, lo, hi)),
            (torch.clamp(tx, lo, hi), qk.clamp(x, scale, zp, lo, hi)),
            (torch.clamp(tx, min=lo), qk.clamp(x, scale, zp, lo)),
            (torch.clamp(tx, max=hi), qk.clamp(x, scale, zp, None, hi)),
        ]
        for want, got in pairs:
            np.testing.assert_array_equal(got, want.int_repr().numpy())


def _force_threaded_path(monkeypatch, threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("numba runs with fewer threads on this machine")
    # the size threshold is tuned for speed; lower it so these inputs take the threaded path
    monkeypatch.setattr(_quantize_module, "PARALLEL_MIN_WORK", 1)
    monkeypatch.setattr(_quantize_module, "STREAM_MIN_WORK", 1)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS if threads == 1 else 1)


def test_clamp_bounds_far_outside_the_range_saturate_without_warnings():
    """A bound whose code overflows float32 (1e30 at a scale of 1e-9) saturates silently."""
    x = np.arange(256, dtype=np.uint8).reshape(16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(qk.clamp(x, 1e-9, 7, -1e30, 1e30), x)
        np.testing.assert_array_equal(qk.clamp(x, 1e-9, 7, 1e30, 3e38), np.full_like(x, 255))
        np.testing.assert_array_equal(qk.clamp(x, 1e-9, 7, -3e38, -1e30), np.zeros_like(x))
