"""Fuzz max_pool2d / avg_pool2d / adaptive_avg_pool2d: random shapes, dtypes, garbage arguments.

Each call must either raise KernelError or return the right answer -- never crash, never
return garbage. (A segfault inside compiled code would take the whole test run down.)
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import quantbridge.kernels as qk
from quantbridge.kernels import KernelError

FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
DTYPES = [np.uint8, np.int8, np.float32, np.float64, np.int32, np.int64, np.bool_]
GARBAGE = st.one_of(
    st.none(),
    st.text(max_size=3),
    st.booleans(),
    st.just([1, 2, 3]),
    st.just(float("nan")),
    st.just(float("inf")),
    st.just(-1.0),
    st.just(0),
    st.just(1e-45),
    st.just(1e300),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
)


@st.composite
def arrays(draw, dtype=None):
    """Mostly well-formed arrays of ``dtype``; sometimes another dtype, layout or object."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(GARBAGE)
    dt = dtype if dtype is not None and kind > 2 else draw(st.sampled_from(DTYPES))
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=6))
    arr = draw(hnp.arrays(dt, shape, elements=None if dt != np.float32 else st.floats(width=32)))
    if kind == 3:
        arr = arr[..., ::2]  # non-contiguous
    if kind == 4:
        arr = np.asfortranarray(arr)
    return arr


def scales():
    return st.one_of(st.floats(1e-3, 10), GARBAGE)


def zero_points(lo=-128, hi=255):
    return st.one_of(st.integers(lo, hi), GARBAGE)


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
