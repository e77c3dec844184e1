"""Fuzz max_pool2d / avg_pool2d / adaptive_avg_pool2d: random shapes, dtypes, garbage arguments.

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

SIZES = st.one_of(
    st.integers(-1, 5), st.tuples(st.integers(0, 5), st.integers(0, 5)), st.just([]), GARBAGE
)


@FUZZ
@given(
    arrays(np.uint8),
    SIZES,
    st.one_of(st.none(), SIZES),
    SIZES,
    SIZES,
    st.one_of(st.booleans(), GARBAGE),
)
def test_max_pool2d(x, kernel, stride, padding, dilation, ceil_mode):
    try:
        got = qk.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode)
    except KernelError:
        return
    assert got.dtype == np.uint8
    assert got.shape[:-2] == x.shape[:-2]
    assert got.size > 0
    assert got.max() <= x.max()


@FUZZ
@given(
    arrays(np.uint8),
    SIZES,
    st.one_of(st.none(), SIZES),
    SIZES,
    st.booleans(),
    st.one_of(st.booleans(), GARBAGE),
    st.one_of(st.none(), st.integers(-2, 20), GARBAGE),
    scales(),
    zero_points(),
)
def test_avg_pool2d(x, kernel, stride, padding, ceil_mode, include_pad, divisor, scale, zp):
    try:
        got = qk.avg_pool2d(
            x, kernel, stride, padding, ceil_mode, include_pad, divisor, scale=scale, zero_point=zp
        )
    except KernelError:
        return
    assert got.dtype == np.uint8
    assert got.shape[:-2] == x.shape[:-2]


@FUZZ
@given(arrays(np.uint8), SIZES)
def test_adaptive_avg_pool2d(x, size):
    try:
        got = qk.adaptive_avg_pool2d(x, size)
    except KernelError:
        return
    assert got.shape[:-2] == x.shape[:-2]
    assert got.min() >= x.min()
    assert got.max() <= x.max()
