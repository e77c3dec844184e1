"""Fuzz embedding_bag and row packing: random shapes, dtypes, layouts and garbage arguments.

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

from fuzz_strategies import FUZZ, GARBAGE, arrays  # noqa: E402

PACKED = [
    qk.pack_embedding_8bit(np.linspace(-1, 1, 40, dtype=np.float32).reshape(8, 5)),
    qk.pack_embedding_4bit(np.linspace(-1, 1, 48, dtype=np.float32).reshape(8, 6)),
]


def ref_sum(packed, indices, offsets):
    data = packed.data.astype(np.int64)
    if packed.bit_width == 4:
        codes = np.empty((data.shape[0], 2 * data.shape[1]), np.int64)
        codes[:, 0::2], codes[:, 1::2] = data & 15, data >> 4
        data = codes
    bounds = [*offsets.tolist(), len(indices)]
    out = np.zeros((len(offsets), packed.embedding_dim), np.float32)
    for b in range(len(offsets)):
        for row in indices[bounds[b] : bounds[b + 1]]:
            sc, bi = packed.scale[row], packed.bias[row]
            prod = np.float64(sc) * data[row].astype(np.float64)
            out[b] = (prod + (out[b] + bi).astype(np.float64)).astype(np.float32)
    return out


@FUZZ
@given(
    st.one_of(st.sampled_from(PACKED), GARBAGE),
    st.one_of(arrays(np.int64), st.lists(st.integers(-3, 10), max_size=8).map(np.array)),
    st.one_of(st.none(), arrays(np.int32), st.lists(st.integers(-2, 9), max_size=5).map(np.array)),
    st.one_of(st.sampled_from(["sum", "mean", "max"]), GARBAGE),
    st.one_of(st.none(), arrays(np.float32)),
    st.one_of(st.booleans(), GARBAGE),
)
def test_embedding_bag(packed, indices, offsets, mode, weights, last):
    try:
        got = qk.embedding_bag(packed, indices, offsets, mode, weights, last)
    except KernelError:
        return
    assert got.dtype == np.float32
    assert got.shape[1] == packed.embedding_dim
    if mode == "sum" and weights is None and indices.ndim == 1 and not last:
        np.testing.assert_array_equal(got, ref_sum(packed, indices, offsets))


@FUZZ
@given(arrays(np.float32), st.sampled_from([8, 4]))
def test_packing(weight, bits):
    pack = qk.pack_embedding_8bit if bits == 8 else qk.pack_embedding_4bit
    try:
        packed = pack(weight)
    except KernelError:
        return
    assert packed.data.shape[0] == weight.shape[0]
    back = qk.from_fused_rows(qk.to_fused_rows(packed), bits)
    np.testing.assert_array_equal(back.data, packed.data)


@FUZZ
@given(st.one_of(arrays(np.uint8), GARBAGE), st.one_of(st.sampled_from([8, 4]), GARBAGE))
def test_fused_rows(fused, bits):
    try:
        packed = qk.from_fused_rows(fused, bits)
    except KernelError:
        return
    np.testing.assert_array_equal(qk.to_fused_rows(packed), fused)


@FUZZ
@given(st.one_of(st.sampled_from(PACKED), GARBAGE))
def test_to_fused_rows_refuses_garbage(packed):
    try:
        fused = qk.to_fused_rows(packed)
    except KernelError:
        return
    assert fused.shape[0] == packed.data.shape[0]
