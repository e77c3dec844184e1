"""Fuzz build_lut / apply_lut: random shapes, dtypes, layouts and garbage arguments.

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


@FUZZ
@given(
    arrays(np.uint8),
    st.one_of(arrays(np.uint8), st.just("table")),
    st.one_of(st.sampled_from(sorted(qk.LUT_FUNCTIONS)), st.just(abs), GARBAGE),
    st.tuples(scales(), zero_points(), scales(), zero_points()),
)
def test_build_and_apply_lut(q, table, fn, params):
    try:
        built = qk.build_lut(fn, *params)
    except KernelError:
        built = None
    if built is not None:
        assert built.shape == (256,)
        assert built.dtype == np.uint8
    if isinstance(table, str):
        table = built
    try:
        got = qk.apply_lut(q, table)
    except KernelError:
        return
    np.testing.assert_array_equal(got, table[q])
