"""The AVX2 byte kernels (``vpmaddubsw``) run every weight; within [-64, 64] they are exact for
any activations, up to the saturation boundary. Wider weights are guarded (test_pair_guard.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantbridge.kernels import (
    PackedConvWeight,
    PackedLinearWeight,
    available_targets,
    conv2d,
    conv2d_add,
    linear,
    linear_dynamic,
)

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the references, under --import-mode=importlib
    sys.path.insert(0, str(HERE))

from test_conv import reference_conv2d  # noqa: E402
from test_linear import _case, reference_dynamic, reference_linear  # noqa: E402

F32 = np.float32
needs_avx2 = pytest.mark.skipif("avx2" not in available_targets(), reason="needs an AVX2 CPU")


@needs_avx2
@pytest.mark.parametrize(
    ("low", "high", "limit"),
    [(-64, 64, 510), (-65, 0, 504), (0, 65, 504), (-128, 127, 256), (-127, 127, 258)],
)
def test_avx2_runs_every_weight_on_byte_kernels_guarded_past_7_bits(low, high, limit):
    w = np.zeros((5, 9), np.int8)
    w[0, 0], w[4, 8] = low, high
    packed = PackedLinearWeight(w, 0.01, target="avx2")
    assert packed.kernel == "avx2_byte"
    assert packed.pair_limit == limit  # min(32767 // high, 32768 // -low), at most 510
    assert packed.guarded == (limit < 510)
    assert ("7-bit weights" in repr(packed)) == (not packed.guarded)
    assert ("guarded" in repr(packed)) == packed.guarded
    generic = PackedLinearWeight(w, 0.01, target="generic")
    assert generic.kernel == "generic"
    assert not generic.guarded


@needs_avx2
def test_a_conv_chooses_one_family_for_all_groups():
    w = np.zeros((4, 2, 3, 3), np.int8)
    w[0] = 100  # only the first group is past 7 bits: only its pairs need the guard
    packed = PackedConvWeight(w, 0.01, groups=2, target="avx2")
    assert packed.kernel == "avx2_byte"
    assert {g.kernel for g in packed.groups_packed} == {"avx2_byte"}
    assert [g.guarded for g in packed.groups_packed] == [True, False]


@needs_avx2
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("sign", [1, -1])
def test_pair_sums_at_the_saturation_boundary_are_exact(sign, threads):
    # every pair of products is 2 * 255 * 64 = 32640 (or -32640), next to int16's limit
    m, k, n = 13, 64, 40
    a = np.full((m, k), 255, np.uint8)
    w = np.full((n, k), 64 * sign, np.int8)
    w[1::2, ::3] = -64 * sign  # mixed signs as well
    packed = PackedLinearWeight(w, 0.001, 0, None, target="avx2")
    assert packed.kernel == "avx2_byte"
    # the sign-mixed rows come out near 128 +- 33, the uniform rows near 128 +- 104
    got = linear(a, packed, 0.01, 0, 0.1, 128, num_threads=threads)
    want = reference_linear(a, 0.01, 0, w, 0.001, 0, None, 0.1, 128)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got)) > 1  # not a saturated constant


@needs_avx2
@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 30),
    k=st.integers(1, 200),
    n=st.integers(1, 70),
    per_channel=st.booleans(),
    wzp=st.booleans(),
    relu=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**32 - 1),
)
def test_linear_on_byte_kernels_matches_integer_reference(
    m, k, n, per_channel, wzp, relu, threads, seed
):
    rng = np.random.default_rng(seed)
    a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp = _case(
        rng, m, k, n, per_channel, wzp, True, w_range=(-64, 65)
    )
    packed = PackedLinearWeight(w, w_s, w_zp, bias, target="avx2")
    assert packed.kernel == "avx2_byte"
    got = linear(a, packed, a_s, a_zp, o_s, o_zp, relu=relu, num_threads=threads)
    want = reference_linear(a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp, relu)
    np.testing.assert_array_equal(got, want)


@needs_avx2
@pytest.mark.parametrize("activation", ["none", "relu"])
def test_linear_dynamic_on_byte_kernels_matches_reference(activation):
    from quantbridge.kernels._linear import choose_dynamic_qparams

    rng = np.random.default_rng(5)
    x = (rng.normal(size=(70, 150)) * 3 + 0.5).astype(F32)
    w = rng.integers(-64, 65, (90, 150), dtype=np.int8)
    w_s = rng.uniform(0.001, 0.02, 90)
    bias = rng.normal(size=90).astype(F32)
    packed = PackedLinearWeight(w, w_s, 0, bias, target="avx2")
    assert packed.kernel == "avx2_byte"
    got = linear_dynamic(x, packed, activation=activation, num_threads=1)
    want = reference_dynamic(x, w, w_s, bias, *choose_dynamic_qparams(x))
    if activation == "relu":
        want = np.maximum(want, F32(0))
    np.testing.assert_array_max_ulp(got, want, maxulp=1)
    assert np.mean(got == want) > 0.999
    generic = PackedLinearWeight(w, w_s, 0, bias, target="generic")
    np.testing.assert_array_equal(
        got, linear_dynamic(x, generic, activation=activation, num_threads=1)
    )


@needs_avx2
@pytest.mark.parametrize(
    ("c", "oc", "k", "stride", "groups"),
    [(3, 32, 3, 2, 1), (3, 16, 7, 2, 1), (24, 40, 1, 1, 1), (17, 33, 3, 1, 1), (8, 12, 3, 1, 2)],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_conv_on_byte_kernels_matches_integer_reference(c, oc, k, stride, groups, threads):
    rng = np.random.default_rng(c * 100 + oc)
    x = rng.integers(0, 256, (2, c, 19, 21), dtype=np.uint8)
    w = rng.integers(-64, 65, (oc, c // groups, k, k), dtype=np.int8)
    w_s = rng.uniform(0.002, 0.02, oc)
    bias = rng.normal(0, 2, oc).astype(F32)
    packed = PackedConvWeight(
        w, w_s, 0, bias, stride=stride, padding=k // 2, groups=groups, target="avx2"
    )
    assert packed.kernel == "avx2_byte"
    o_s = float(np.sqrt(c * k * k)) * 60 * 40 * 0.05 * float(np.mean(w_s)) / 40
    got = conv2d(x, packed, 0.05, 3, o_s, 100, num_threads=threads)
    want = reference_conv2d(
        x, 0.05, 3, w, w_s, 0, bias, o_s, 100, (stride, stride), (k // 2, k // 2), (1, 1), groups
    )
    np.testing.assert_array_equal(got, want)


@needs_avx2
def test_conv_add_on_byte_kernels_equals_conv_then_add():
    from quantbridge.kernels import add

    rng = np.random.default_rng(9)
    x = rng.integers(0, 256, (1, 32, 14, 14), dtype=np.uint8)
    other = rng.integers(0, 256, (1, 48, 14, 14), dtype=np.uint8)
    w = rng.integers(-64, 65, (48, 32, 1, 1), dtype=np.int8)
    packed = PackedConvWeight(w, 0.01, 0, None, target="avx2")
    assert packed.kernel == "avx2_byte"
    conv = conv2d(x, packed, 0.05, 3, 0.9, 120)
    want = add(conv, (0.9, 120), other, (0.3, 7), (1.1, 60))
    got = conv2d_add(x, packed, (0.05, 3), (0.9, 120), other, (0.3, 7), (1.1, 60))
    np.testing.assert_array_equal(got, want)


@needs_avx2
@pytest.mark.parametrize("w_range", [(-64, 65), (-128, 128)], ids=["byte", "guarded"])
@pytest.mark.parametrize("m", list(range(1, 20)))
def test_every_row_count_splits_into_exact_blocks(w_range, m):
    # rows run as blocks of 6, 4, 3 and 1 (4, 5, 7 and 8 remaining rows take the 4-row block):
    # every count up to three big blocks, u8 and float output, against the int64 reference
    rng = np.random.default_rng(m)
    a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp = _case(rng, m, 40, 48, True, False, True, w_range)
    packed = PackedLinearWeight(w, w_s, w_zp, bias, target="avx2")
    np.testing.assert_array_equal(
        linear(a, packed, a_s, a_zp, o_s, o_zp),
        reference_linear(a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp),
    )
    from quantbridge.kernels._linear import choose_dynamic_qparams

    x = rng.normal(0, 1, (m, 40)).astype(np.float32)
    want = reference_dynamic(x, w, w_s, bias, *choose_dynamic_qparams(x))
    np.testing.assert_array_equal(linear_dynamic(x, packed), want)
