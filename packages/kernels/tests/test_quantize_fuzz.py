"""Fuzz every quantize-family wrapper: random shapes, dtypes, layouts and garbage arguments.

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
