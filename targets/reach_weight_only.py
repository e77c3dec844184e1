"""Calls that reach every weight-only linear driver (``kernels.linear_weight_only``) at one and
two threads, for the dry run: 4- and 8-bit weights, symmetric and asymmetric, one row (decode)
and many (prefill). Like ``reach_kernels.py`` they assert nothing.

``reach_kernels.py`` imports the test, so the dry run's record step collects it there.
"""

from __future__ import annotations

import numpy as np
import pytest

import quantbridge.kernels as qk

RNG = np.random.default_rng(0)


@pytest.fixture(params=[1, 2], autouse=True)
def threads(request):
    qk.set_num_threads(request.param)
    yield request.param
    qk.set_num_threads(None)


@pytest.mark.parametrize("bits", [4, 8])
def test_weight_only_linear(threads, bits):
    n, k = 512, 1024  # 256 KB and more of weights: past the parallel threshold at 2 threads
    top = 1 << (bits - 1)
    codes = RNG.integers(-top, top, (n, k)).astype(np.int8)
    scales = RNG.uniform(0.01, 0.02, (n, k // 32)).astype(np.float32)
    zero_points = RNG.integers(0, 2 * top, (n, k // 32)).astype(np.uint8)
    weights = (
        qk.pack_group_weight(codes, scales, bits=bits, group_size=32),
        qk.pack_group_weight((codes.astype(np.int16) + top).astype(np.uint8), scales,
                             zero_points, bits=bits, group_size=32),
    )  # fmt: skip
    for packed in weights:
        for m in (1, 37):
            qk.linear_weight_only(RNG.standard_normal((m, k)).astype(np.float32), packed)
