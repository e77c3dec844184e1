"""Fuzz relu / clamp / hardtanh / relu6: random shapes, dtypes, layouts and garbage arguments.

Each call must either raise KernelError or return the right answer -- never crash, never
return garbage. (A segfault inside compiled code would take the whole test run down.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import quantbridge.kernels as qk
from quantbridge.kernels import KernelError

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the shared strategies, under --import-mode=importlib
    sys.path.insert(0, str(HERE))

from fuzz_strategies import FUZZ, GARBAGE, arrays, scales, zero_points  # noqa: E402


def bound(v, scale, zp):
    t = np.float32(np.float32(v) * (np.float32(1) / np.float32(scale))) + np.float32(zp)
    return int(np.clip(np.rint(np.float64(np.float32(t))), 0, 255))


@FUZZ
@given(
    arrays(np.uint8),
    scales(),
    zero_points(),
    st.one_of(st.none(), st.floats(-10, 10), GARBAGE),
    st.one_of(st.none(), st.floats(-10, 10), GARBAGE),
)
def test_relu_clamp_hardtanh_relu6(q, scale, zp, lo, hi):
    try:
        got = qk.relu(q, zp)
    except KernelError:
        pass
    else:
        np.testing.assert_array_equal(got, np.maximum(q, zp))
    try:
        got = qk.clamp(q, scale, zp, lo, hi)
    except KernelError:
        pass
    else:
        qlo = 0 if lo is None else bound(lo, scale, zp)
        qhi = 255 if hi is None else bound(hi, scale, zp)
        np.testing.assert_array_equal(got, np.minimum(np.maximum(q, qlo), qhi))
    try:
        got = qk.relu6(q, scale, zp)
    except KernelError:
        return
    six = np.minimum(np.maximum(q, bound(0.0, scale, zp)), bound(6.0, scale, zp))
    np.testing.assert_array_equal(got, six)
    try:
        got = qk.hardtanh(
            q, scale, zp, lo if lo is not None else -1.0, hi if hi is not None else 1.0
        )
    except KernelError:
        return
    assert got.shape == q.shape
