"""Batched quantized matmul (u8 x u8, u8 x s8) against an integer numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantbridge.kernels import (
    KernelError,
    PackedLinearWeight,
    available_targets,
    linear,
    matmul,
)

TARGETS = available_targets()
F32 = np.float32


def reference_matmul(a, a_s, a_zp, b, b_s, b_zp, o_s, o_zp):
    acc = np.matmul(a.astype(np.int64) - a_zp, b.astype(np.int64) - b_zp)
    mult = F32(F32(F32(a_s) * F32(b_s)) / F32(o_s))
    q = np.rint((acc.astype(np.int32).astype(F32) * mult).astype(F32)).astype(np.int64) + o_zp
    return np.clip(q, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("target", TARGETS)
@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(1, 3),
    m=st.integers(1, 20),
    k=st.integers(1, 70),
    n=st.integers(1, 40),
    signed=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_matmul_matches_integer_reference(target, batch, m, k, n, signed, seed):
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (batch, m, k), dtype=np.uint8)
    if signed:
        b, b_zp = rng.integers(-128, 128, (batch, k, n), dtype=np.int8), int(rng.integers(-5, 5))
    else:
        b, b_zp = rng.integers(0, 256, (batch, k, n), dtype=np.uint8), int(rng.integers(0, 256))
    o_s = 0.02 * 0.03 * 80 * 80 * np.sqrt(k) / 40
    got = matmul(a, (0.02, 17), b, (0.03, b_zp), (o_s, 128), target=target, num_threads=1)
    np.testing.assert_array_equal(got, reference_matmul(a, 0.02, 17, b, 0.03, b_zp, o_s, 128))


@pytest.mark.parametrize("threads", [1, 2])
def test_matmul_2d_and_threads(threads):
    rng = np.random.default_rng(2)
    a = rng.integers(0, 256, (33, 64), dtype=np.uint8)
    b = rng.integers(0, 256, (64, 50), dtype=np.uint8)
    got = matmul(a, (0.05, 128), b, (0.05, 128), (0.5, 128), num_threads=threads)
    np.testing.assert_array_equal(got, reference_matmul(a, 0.05, 128, b, 0.05, 128, 0.5, 128))


def test_matmul_bad_input():
    a = np.zeros((2, 3, 4), np.uint8)
    with pytest.raises(KernelError, match="K=4 does not match"):
        matmul(a, (0.1, 0), np.zeros((2, 5, 6), np.uint8), (0.1, 0), (0.1, 0))
    with pytest.raises(KernelError, match="batch sizes differ"):
        matmul(a, (0.1, 0), np.zeros((3, 4, 6), np.uint8), (0.1, 0), (0.1, 0))
    with pytest.raises(KernelError, match="both be 2-D or both 3-D"):
        matmul(a, (0.1, 0), np.zeros((4, 6), np.uint8), (0.1, 0), (0.1, 0))
    with pytest.raises(KernelError, match=r"b_qparams\.zero_point"):
        matmul(a, (0.1, 0), np.zeros((2, 4, 6), np.int8), (0.1, 200), (0.1, 0))
    with pytest.raises(KernelError, match="dtype"):
        matmul(a, (0.1, 0), np.zeros((2, 4, 6), np.int16), (0.1, 0), (0.1, 0))


def per_batch_linear(a, a_qp, b, b_qp, out_qp, target):
    """The former matmul: one packed weight and one ``linear`` call per batch."""
    outs = []
    for i in range(a.shape[0]):
        if b.dtype == np.uint8:
            w, zp = (b[i].T.astype(np.int16) - 128).astype(np.int8), b_qp[1] - 128
        else:
            w, zp = b[i].T, b_qp[1]
        packed = PackedLinearWeight(np.ascontiguousarray(w), b_qp[0], zp, None, target=target)
        outs.append(linear(a[i], packed, *a_qp, *out_qp, num_threads=1))
    return np.stack(outs)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("k", "n", "signed"), [(32, 41, False), (128, 32, False), (30, 17, True)])
def test_batched_attention_shapes_equal_per_batch_linear(target, threads, k, n, signed):
    # q @ k^T ([B*H, S, D] x [B*H, D, S]) and p @ v ([B*H, S, S] x [B*H, S, D]) shapes, with
    # batches enough that the parallel driver splits them over threads
    rng = np.random.default_rng(k * n)
    a = rng.integers(0, 256, (24, 37, k), dtype=np.uint8)
    if signed:
        b, b_qp = rng.integers(-128, 128, (24, k, n), dtype=np.int8), (0.03, -3)
    else:
        b, b_qp = rng.integers(0, 256, (24, k, n), dtype=np.uint8), (0.03, 131)
    o_s = 0.02 * 0.03 * 80 * 80 * np.sqrt(k) / 40
    got = matmul(a, (0.02, 9), b, b_qp, (o_s, 120), target=target, num_threads=threads)
    want = reference_matmul(a, 0.02, 9, b, b_qp[0], b_qp[1], o_s, 120)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, per_batch_linear(a, (0.02, 9), b, b_qp, (o_s, 120), target))
