"""Hypothesis strategies shared by the ``test_*_fuzz.py`` files: well-formed and broken arrays,
scales and zero points, and argument garbage. Every fuzzed call must raise KernelError or
return the right answer -- never crash, never return garbage.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

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
