"""Calls that reach every kernel family at one and two threads, for the dry run.

The kernels suite reaches most parallel drivers only after an assertion that a dry run fails
(its feature kernels leave their outputs unwritten), so these calls assert nothing: each
shape is chosen to cross the family's thread threshold. Run by ``dry_run`` only.
"""

from __future__ import annotations

import numpy as np
import pytest
from reach_weight_only import test_weight_only_linear  # noqa: F401  (collected here too)

import quantbridge.kernels as qk

RNG = np.random.default_rng(0)


@pytest.fixture(params=[1, 2], autouse=True)
def threads(request):
    qk.set_num_threads(request.param)
    yield request.param
    qk.set_num_threads(None)


def test_depthwise(threads):
    for c, k, stride in ((64, 3, 1), (128, 5, 2), (32, 3, 1), (24, 3, 2)):
        x = RNG.integers(0, 256, (2, c, 56, 56), dtype=np.uint8)
        w = RNG.integers(-100, 100, (c, 1, k, k), dtype=np.int8)
        packed = qk.PackedConvWeight(w, 0.01, 0, None, stride=stride, padding=k // 2, groups=c)
        qk.conv2d(x, packed, 0.05, 3, 0.1, 7)
        qk.conv2d(x, packed, 0.05, 3, 0.1, 7, channels_last=True)


def test_gemm_convs_and_linear(threads):
    x = RNG.integers(0, 256, (2, 64, 28, 28), dtype=np.uint8)
    for w in (
        RNG.integers(-128, 128, (128, 64, 3, 3), dtype=np.int8),
        RNG.integers(-60, 60, (128, 64, 1, 1), dtype=np.int8),
    ):
        packed = qk.PackedConvWeight(w, 0.01, 0, None, padding=w.shape[2] // 2)
        y = qk.conv2d(x, packed, 0.05, 3, 0.1, 7)
        qk.conv2d(x, packed, 0.05, 3, 0.1, 7, channels_last=True)
        qk.conv2d_add(x, packed, (0.05, 3), (0.1, 7), y, (0.1, 7), (0.2, 5), relu=True)
    a = RNG.integers(0, 256, (256, 512), dtype=np.uint8)
    lin = qk.PackedLinearWeight(RNG.integers(-128, 128, (512, 512), dtype=np.int8), 0.01)
    qk.linear(a, lin, 0.05, 3, 0.1, 7)
    qk.linear_dynamic(RNG.standard_normal((256, 512)).astype(np.float32), lin)
    # float output with float columns and codes: m * n past the parallel pass's threshold
    a = RNG.integers(0, 256, (2048, 512), dtype=np.uint8)
    cols = qk.FloatColumns([3, 100], RNG.standard_normal((512, 2)).astype(np.float32))
    floats = RNG.standard_normal((2048, 512)).astype(np.float32)
    codes = np.empty((2048, 512), np.uint8)
    for activation in ("none", "gelu"):
        qk.linear_float(a, lin, 0.05, 3, activation=activation, columns=cols, float_input=floats,
                        codes=codes, codes_qparams=(0.1, 7))  # fmt: skip


def test_matmul_and_attention(threads):
    a = RNG.integers(0, 256, (8, 128, 64), dtype=np.uint8)
    b = RNG.integers(0, 256, (8, 64, 128), dtype=np.uint8)
    qk.matmul(a, (0.05, 3), b, (0.05, 3), (0.1, 7))
    q = RNG.integers(0, 256, (2, 8, 128, 64), dtype=np.uint8)
    qk.attention(q, q, q, (0.05, 128), (0.05, 128), (0.05, 128), out_qparams=(0.01, 128))


@pytest.mark.parametrize("gates", [4, 3], ids=["lstm", "gru"])
def test_sequences(threads, gates):
    hidden, batch = 256, 64
    w = RNG.integers(-128, 128, (gates * hidden, hidden), dtype=np.int8)
    packed = qk.PackedLinearWeight(w, 0.01)
    gi = RNG.standard_normal((4, batch, gates * hidden)).astype(np.float32)
    h0 = np.zeros((batch, hidden), np.float32)
    if gates == 4:
        qk.lstm_sequence(gi, packed, h0, h0)
    else:
        qk.gru_sequence(gi, packed, h0)


def test_lookup_tables(threads):
    table = RNG.integers(0, 256, 256, dtype=np.uint8)
    qk.apply_lut(RNG.integers(0, 256, 1 << 20, dtype=np.uint8), table)


def test_bench_peak_probe(threads):
    # packages/kernels/bench/bench_kernels.py, on the PYTHONPATH test_target_matrix sets
    import bench_kernels

    if qk.target_supported("avx512_vnni"):  # as the bench itself asks before probing
        bench_kernels._peak_one(1)
        bench_kernels._peak_many(1, threads)
