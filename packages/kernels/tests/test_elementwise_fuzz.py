"""Fuzz add / mul / add_relu / mul_relu: random shapes, dtypes, layouts and garbage arguments.

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

from fuzz_strategies import FUZZ, arrays, scales, zero_points  # noqa: E402


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
        got = fn(a, (sa, za), b, (sb, zb), (so, zo))
    except KernelError:
        return
    np.testing.assert_array_equal(got, ref(kind, a, sa, za, b, sb, zb, so, zo, relu))
