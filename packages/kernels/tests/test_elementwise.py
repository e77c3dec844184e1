"""Quantized add / mul (+ relu) against numpy references written here; shapes, out=, threads."""

from __future__ import annotations

import numba
import numpy as np
import pytest

import quantbridge.kernels as qk
import quantbridge.kernels._quantize as _quantize_module
from quantbridge.kernels import KernelError


def _fma32(a, b, c):
    # a * b is exact in float64 for a float32 a and a small integer b, and so is the sum with
    # the float32 c (the terms span < 53 bits), so one rounding to float32 is a true fma
    return (np.float64(a) * b.astype(np.float64) + np.float64(c)).astype(np.float32)


def _requant(t, zp):
    return np.clip(np.rint(t.astype(np.float64)) + zp, 0, 255).astype(np.uint8)


def ref_add(a, sa, za, b, sb, zb, so, zo, relu=False):
    sa32, sb32 = np.float32(sa), np.float32(sb)
    da = _fma32(sa32, a, sa32 * np.float32(-za))
    db = _fma32(sb32, b, sb32 * np.float32(-zb))
    c = (da + db).astype(np.float32)
    if relu:
        c = np.maximum(c, np.float32(0))
    return _requant((c * (np.float32(1) / np.float32(so))).astype(np.float32), zo)


def ref_mul(a, sa, za, b, sb, zb, so, zo, relu=False):
    m = np.float32(np.float32(sa) * np.float32(sb)) * (np.float32(1) / np.float32(so))
    p = (a.astype(np.int32) - za) * (b.astype(np.int32) - zb)
    q = _requant((p.astype(np.float32) * np.float32(m)).astype(np.float32), zo)
    return np.maximum(q, np.uint8(zo)) if relu else q


OPS = [
    (qk.add, ref_add, False),
    (qk.add_relu, ref_add, True),
    (qk.mul, ref_mul, False),
    (qk.mul_relu, ref_mul, True),
]


def _params(rng):
    scales = [float(rng.choice([rng.uniform(1e-3, 0.5), 0.1, 1 / 3, 2.0**-5])) for _ in range(3)]
    zps = [int(v) for v in rng.integers(0, 256, 3)]
    return scales, zps


@pytest.mark.parametrize(("op", "ref", "relu"), OPS)
def test_matches_reference(op, ref, relu):
    rng = np.random.default_rng(0)
    for _ in range(40):
        shape = tuple(int(v) for v in rng.integers(1, 9, int(rng.integers(1, 4))))
        (sa, sb, so), (za, zb, zo) = _params(rng)
        a = rng.integers(0, 256, shape).astype(np.uint8)
        b = rng.integers(0, 256, shape).astype(np.uint8)
        got = op(a, (sa, za), b, (sb, zb), (so, zo))
        assert got.shape == shape
        assert got.dtype == np.uint8
        np.testing.assert_array_equal(got, ref(a, sa, za, b, sb, zb, so, zo, relu))


def test_add_mul_of_known_values():
    a = np.array([10, 20, 30], np.uint8)  # 0.0, 1.0, 2.0 at scale 0.1, zp 10
    b = np.array([5, 5, 25], np.uint8)  # -1.0, -1.0, 3.0 at scale 0.2, zp 10
    np.testing.assert_array_equal(qk.add(a, (0.1, 10), b, (0.2, 10), (0.5, 100)), [98, 100, 110])
    np.testing.assert_array_equal(
        qk.add_relu(a, (0.1, 10), b, (0.2, 10), (0.5, 100)), [100, 100, 110]
    )
    np.testing.assert_array_equal(qk.mul(a, (0.1, 10), b, (0.2, 10), (0.5, 100)), [100, 98, 112])
    np.testing.assert_array_equal(
        qk.mul_relu(a, (0.1, 10), b, (0.2, 10), (0.5, 100)), [100, 100, 112]
    )


def test_in_place_into_an_input():
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, 1000).astype(np.uint8)
    b = rng.integers(0, 256, 1000).astype(np.uint8)
    want = ref_add(a, 0.05, 3, b, 0.07, 200, 0.1, 50)
    result = qk.add(a, (0.05, 3), b, (0.07, 200), (0.1, 50), out=a)
    assert result is a
    np.testing.assert_array_equal(a, want)
    want = ref_mul(a, 0.1, 50, b, 0.07, 200, 0.3, 9)
    assert qk.mul(a, (0.1, 50), b, (0.07, 200), (0.3, 9), out=b) is b
    np.testing.assert_array_equal(b, want)
    with pytest.raises(KernelError, match="overlaps"):  # shifted views would read written data
        qk.add(a[1:], (0.1, 0), b[1:], (0.1, 0), (0.1, 0), out=a[:-1])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((np.zeros(4, np.uint8), np.zeros(5, np.uint8)), "b: shape"),
        ((np.zeros((2, 3), np.uint8), np.zeros((3, 2), np.uint8)), "b: shape"),
        ((np.zeros((1, 3), np.uint8), np.zeros((2, 3), np.uint8)), "no broadcasting"),
        ((np.zeros(4, np.int8), np.zeros(4, np.uint8)), "a: expected dtype uint8"),
        ((np.zeros(4, np.uint8), np.zeros(4, np.float32)), "b: expected dtype uint8"),
        ((np.zeros(8, np.uint8)[::2], np.zeros(4, np.uint8)), "a: expected a C-contiguous"),
        ((np.zeros(0, np.uint8), np.zeros(0, np.uint8)), "zero-size"),
    ],
)
@pytest.mark.parametrize("op", [qk.add, qk.mul, qk.add_relu, qk.mul_relu])
def test_bad_arrays(op, args, message):
    with pytest.raises(KernelError, match=message):
        op(args[0], (0.1, 0), args[1], (0.1, 0), (0.1, 0))


@pytest.mark.parametrize("op", [qk.add, qk.mul])
def test_bad_qparams(op):
    a = np.zeros(4, np.uint8)
    with pytest.raises(KernelError, match=r"a_qparams\.scale"):
        op(a, (-1.0, 0), a, (0.1, 0), (0.1, 0))
    with pytest.raises(KernelError, match=r"b_qparams\.zero_point"):
        op(a, (0.1, 0), a, (0.1, 256), (0.1, 0))
    with pytest.raises(KernelError, match=r"out_qparams\.scale"):
        op(a, (0.1, 0), a, (0.1, 0), (float("inf"), 0))
    with pytest.raises(KernelError, match=r"out_qparams\.zero_point"):
        op(a, (0.1, 0), a, (0.1, 0), (0.1, None))
    with pytest.raises(KernelError, match="out: expected shape"):
        op(a, (0.1, 0), a, (0.1, 0), (0.1, 0), out=np.zeros(5, np.uint8))


@pytest.mark.parametrize("target", qk.available_targets())
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("op", "ref", "relu"), OPS)
def test_large_inputs_every_target_and_thread_count(op, ref, relu, threads, target, monkeypatch):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("numba runs with fewer threads on this machine")
    rng = np.random.default_rng(2)
    a = rng.integers(0, 256, (3, 70_001)).astype(np.uint8)
    b = rng.integers(0, 256, (3, 70_001)).astype(np.uint8)
    _force_threaded_path(monkeypatch, threads)
    qk.set_num_threads(threads)
    try:
        got = op(a, (0.03, 120), b, (0.05, 7), (0.08, 64), target=target)
    finally:
        qk.set_num_threads(None)
    # numba's own per-thread count (set above to differ from the call's) is left as it was
    assert numba.get_num_threads() == (numba.config.NUMBA_NUM_THREADS if threads == 1 else 1)
    np.testing.assert_array_equal(got, ref(a, 0.03, 120, b, 0.05, 7, 0.08, 64, relu))


def _force_threaded_path(monkeypatch, threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("numba runs with fewer threads on this machine")
    # the size threshold is tuned for speed; lower it so these inputs take the threaded path
    monkeypatch.setattr(_quantize_module, "PARALLEL_MIN_WORK", 1)
    monkeypatch.setattr(_quantize_module, "STREAM_MIN_WORK", 1)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS if threads == 1 else 1)


def test_qparams_must_be_pairs_and_may_be_qparams():
    a = np.arange(6, dtype=np.uint8)
    with pytest.raises(KernelError, match=r"a_qparams: expected QParams\(scale, zero_point\)"):
        qk.add(a, 0.1, a, (0.1, 0), (0.1, 0))  # type: ignore[arg-type]
    with pytest.raises(KernelError, match=r"out_qparams: expected QParams"):
        qk.mul(a, (0.1, 0), a, (0.1, 0), (0.1, 0, 0))  # type: ignore[arg-type]
    named = qk.add(a, qk.QParams(0.1, 2), a, qk.QParams(0.2, 3), qk.QParams(0.3, 4))
    np.testing.assert_array_equal(named, qk.add(a, (0.1, 2), a, (0.2, 3), (0.3, 4)))
