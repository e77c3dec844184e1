"""Fuzz add / mul / add_relu / mul_relu: random shapes, dtypes, layouts and garbage arguments.

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


def _fma32(a, b, c):
    return (np.float64(a) * b.astype(np.float64) + np.float64(c)).astype(np.float32)


def ref(kind, a, sa, za, b, sb, zb, so, zo, relu):
    if kind == "add":
        sa32, sb32 = np.float32(sa), np.float32(sb)
        c = _fma32(sa32, a, sa32 * np.float32(-za)) + _fma32(sb32, b, sb32 * np.float32(-zb))
        c = c.astype(np.float32)
        if relu:
            c = np.maximum(c, np.float32(0))
        t = (c * (np.float32(1) / np.float32(so))).astype(np.float32)
    else:
        m = np.float32(np.float32(sa) * np.float32(sb)) * (np.float32(1) / np.float32(so))
        p = (a.astype(np.int32) - za) * (b.astype(np.int32) - zb)
        t = (p.astype(np.float32) * np.float32(m)).astype(np.float32)
    q = np.clip(np.rint(t.astype(np.float64)) + zo, 0, 255).astype(np.uint8)
    return np.maximum(q, np.uint8(zo)) if relu and kind == "mul" else q


@FUZZ
@given(
    st.sampled_from([("add", False), ("add", True), ("mul", False), ("mul", True)]),
    arrays(np.uint8),
    st.one_of(st.none(), arrays(np.uint8), st.just("same")),
    st.tuples(scales(), zero_points(), scales(), zero_points(), scales(), zero_points()),
)
def test_add_mul(op, a, b, params):
    kind, relu = op
    if isinstance(b, str):
        b = a.copy() if isinstance(a, np.ndarray) else a
    fn = {("add", False): qk.add, ("add", True): qk.add_relu}.get(op) or (
        qk.mul_relu if relu else qk.mul
    )
    sa, za, sb, zb, so, zo = params
    try:
        got = fn(a, sa, za, b, sb, zb, so, zo)
    except KernelError:
        return
    np.testing.assert_array_equal(got, ref(kind, a, sa, za, b, sb, zb, so, zo, relu))
