"""Fuzz every quantize-family wrapper: random shapes, dtypes, layouts and garbage arguments.

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


def ref_quantize(x, scale, zp, lo, hi):
    inv = np.float32(1) / np.float32(scale)
    t = (x.astype(np.longdouble) * np.longdouble(inv) + zp).astype(np.float32)
    r = np.rint(np.where(np.isnan(t), hi, t).astype(np.float64))
    return np.clip(r, lo, hi).astype(np.int64)


def ref_dequantize(q, scale, zp):
    return (np.float32(scale) * (q.astype(np.int32) - zp).astype(np.float32)).astype(np.float32)


@FUZZ
@given(
    arrays(np.float32), scales(), zero_points(), st.sampled_from([np.uint8, np.int8, "int16", 3])
)
def test_quantize_per_tensor(x, scale, zp, dtype):
    try:
        got = qk.quantize_per_tensor(x, scale, zp, dtype)
    except KernelError:
        return
    info = np.iinfo(np.dtype(dtype))
    np.testing.assert_array_equal(
        got.astype(np.int64), ref_quantize(x, scale, zp, info.min, info.max)
    )


@FUZZ
@given(arrays(np.uint8), scales(), zero_points())
def test_dequantize_per_tensor(q, scale, zp):
    try:
        got = qk.dequantize_per_tensor(q, scale, zp)
    except KernelError:
        return
    np.testing.assert_array_equal(got, ref_dequantize(q, scale, zp))


@FUZZ
@given(
    arrays(np.float32),
    st.one_of(arrays(np.float64), st.lists(st.floats(1e-3, 1), max_size=4).map(np.array)),
    st.one_of(arrays(np.int64), st.lists(st.integers(-130, 260), max_size=4).map(np.array)),
    st.one_of(st.integers(-5, 5), GARBAGE),
    st.sampled_from([np.uint8, np.int8]),
)
def test_quantize_and_dequantize_per_channel(x, scales_, zps, axis, dtype):
    try:
        got = qk.quantize_per_channel(x, scales_, zps, axis, dtype)
    except KernelError:
        return
    assert got.shape == x.shape
    assert got.dtype == dtype
    back = qk.dequantize_per_channel(got, scales_, zps, axis)
    shape = [1] * x.ndim
    shape[axis] = -1
    want = (got.astype(np.float64) - zps.reshape(shape)) * scales_.astype(np.float64).reshape(shape)
    np.testing.assert_array_equal(back, want.astype(np.float32))


@FUZZ
@given(
    arrays(np.uint8), scales(), zero_points(), scales(), zero_points(), zero_points(), zero_points()
)
def test_requantize(q, s_in, z_in, s_out, z_out, qmin, qmax):
    try:
        got = qk.requantize(q, s_in, z_in, s_out, z_out, qmin, qmax)
    except KernelError:
        return
    lo = 0 if qmin is None else qmin
    hi = 255 if qmax is None else qmax
    want = ref_quantize(ref_dequantize(q, s_in, z_in), s_out, z_out, lo, hi)
    np.testing.assert_array_equal(got.astype(np.int64), want)


@FUZZ
@given(arrays(np.float32), st.one_of(arrays(), st.none()))
def test_out_argument(x, out):
    try:
        got = qk.quantize_per_tensor(x, 0.1, 3, out=out)
    except KernelError:
        return
    if out is not None:
        assert got is out
    np.testing.assert_array_equal(got.astype(np.int64), ref_quantize(x, 0.1, 3, 0, 255))
