"""conv2d_add: the fused residual block equals add(conv2d(...), other) byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import quantbridge.kernels as qk
from quantbridge.kernels import KernelError, PackedConvWeight, available_targets
from quantbridge.kernels._conv import _fusable

TARGETS = available_targets()


def channels_last(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


@st.composite
def cases(draw):
    return dict(
        n=draw(st.integers(1, 2)),
        c=draw(st.sampled_from([3, 8, 16, 33])),
        # 16/32/64 fuse on VNNI (whole 16-lane vectors), all but 20 on AVX2 (8 lanes)
        oc=draw(st.sampled_from([8, 16, 20, 24, 32, 40, 64])),
        k=draw(st.sampled_from([1, 3])),
        hw=draw(st.integers(3, 9)),
        stride=draw(st.integers(1, 2)),
        wzp=draw(st.booleans()),
        relu=draw(st.booleans()),
        relu_conv=draw(st.booleans()),
        other_cl=draw(st.booleans()),
        threads=draw(st.sampled_from([1, 2])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@pytest.mark.parametrize("target", TARGETS)
@settings(max_examples=25, deadline=None)
@given(case=cases())
def test_conv2d_add_equals_conv_then_add(target, case):
    rng = np.random.default_rng(case["seed"])
    n, c, oc, k, hw = case["n"], case["c"], case["oc"], case["k"], case["hw"]
    x = rng.integers(0, 256, (n, c, hw, hw), dtype=np.uint8)
    w = rng.integers(-128, 128, (oc, c, k, k), dtype=np.int8)
    bias = rng.normal(0, 2, oc).astype(np.float32)
    packed = PackedConvWeight(
        w, 0.01, 3 if case["wzp"] else 0, bias, stride=case["stride"], padding=k // 2,
        target=target,
    )  # fmt: skip
    conv_s = 0.04 * 0.01 * 60 * np.sqrt(c * k * k)
    y = qk.conv2d(x, packed, 0.04, 7, conv_s, 90, relu=case["relu_conv"], channels_last=True)
    other = rng.integers(0, 256, y.shape, dtype=np.uint8)
    if case["other_cl"]:
        other = channels_last(other)
    add = qk.add_relu if case["relu"] else qk.add
    want = add(y, (conv_s, 90), other, (0.06, 120), (0.09, 100))
    got = qk.conv2d_add(
        x, packed, qk.QParams(0.04, 7), (conv_s, 90), other, (0.06, 120), (0.09, 100),
        relu_conv=case["relu_conv"], relu=case["relu"], num_threads=case["threads"],
    )  # fmt: skip
    np.testing.assert_array_equal(got, want)
    assert got.transpose(0, 2, 3, 1).flags.c_contiguous  # channels-last


def test_fusion_is_taken_where_documented():
    w64 = np.zeros((64, 8, 3, 3), np.int8)
    w24 = np.zeros((24, 8, 3, 3), np.int8)
    w20 = np.zeros((20, 8, 3, 3), np.int8)
    for target in TARGETS:
        fused = target != "generic"
        assert _fusable(PackedConvWeight(w64, 0.01, target=target)) is fused
        assert _fusable(PackedConvWeight(w64, 0.01, groups=2, target=target)) is False
    if "avx2" in TARGETS:  # 24 channels are three 8-lane vectors: the rows end inside a panel
        assert _fusable(PackedConvWeight(w24, 0.01, target="avx2")) is True
        assert _fusable(PackedConvWeight(w20, 0.01, target="avx2")) is False  # part vector
    if "avx512_vnni" in TARGETS:  # masked stores and residual loads: any channel count
        assert _fusable(PackedConvWeight(w24, 0.01, target="avx512_vnni")) is True
        assert _fusable(PackedConvWeight(w20, 0.01, target="avx512_vnni")) is True


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("oc", [10, 20, 24, 40, 56, 72, 100])
@pytest.mark.parametrize("c", [16, 112])
def test_rows_ending_inside_a_panel_with_redone_rows(target, oc, c):
    # 10 ... 40 channels end part-way through a 16-column vector or a panel: the fused add
    # reads the residual and writes the output at exactly oc columns per row (VNNI: through
    # masks, even inside a vector); full-range codes make the byte kernels' pair scan redo
    # rows on the int16 kernels (AVX2), which must land in the same rows; 56, 72 and 100 run
    # their first panels in pairs on VNNI (56 ends inside the pair). The reference is
    # the generic target's conv and add, which share no code with the SIMD kernels. 112
    # input channels: K = 1008 streams its panels (VNNI's prefetching loops).
    rng = np.random.default_rng(oc)
    x = rng.integers(0, 256, (2, c, 7, 7), dtype=np.uint8)
    x[:, :, 2:5] = rng.integers(0, 60, (2, c, 3, 7), dtype=np.uint8)  # some clean rows
    w = rng.integers(-128, 128, (oc, c, 3, 3), dtype=np.int8)
    bias = rng.normal(0, 2, oc).astype(np.float32)
    packed = PackedConvWeight(w, 0.01, 0, bias, padding=1, target=target)
    generic = PackedConvWeight(w, 0.01, 0, bias, padding=1, target="generic")
    conv_s = 0.04 * 0.01 * 60 * np.sqrt(9 * c)
    y = qk.conv2d(x, generic, 0.04, 7, conv_s, 90, channels_last=True)
    other = channels_last(rng.integers(0, 256, y.shape, dtype=np.uint8))
    want = qk.add(y, (conv_s, 90), other, (0.06, 120), (0.09, 100))
    np.testing.assert_array_equal(qk.conv2d(x, packed, 0.04, 7, conv_s, 90, channels_last=True), y)
    got = qk.conv2d_add(x, packed, (0.04, 7), (conv_s, 90), other, (0.06, 120), (0.09, 100))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("oc", [24, 56, 64])
def test_sums_far_outside_the_codes_saturate(target, oc):
    # an output scale 1e10 times too small: the add's values reach past 2**31 on both sides
    # (VNNI rounds them with vcvtps2dq and clamps with saturating packs in 2- and 4-vector rows)
    rng = np.random.default_rng(oc)
    x = rng.integers(0, 256, (1, 16, 6, 6), dtype=np.uint8)
    w = rng.integers(-128, 128, (oc, 16, 1, 1), dtype=np.int8)
    packed = PackedConvWeight(w, 0.01, 0, None, target=target)
    conv_qp, other_qp, out_qp = (0.5, 90), (0.06, 120), (0.09e-10, 100)
    y = qk.conv2d(x, packed, 0.04, 7, *conv_qp, channels_last=True)
    other = channels_last(rng.integers(0, 256, y.shape, dtype=np.uint8))
    for relu in (False, True):
        add = qk.add_relu if relu else qk.add
        want = add(y, conv_qp, other, other_qp, out_qp)
        got = qk.conv2d_add(x, packed, (0.04, 7), conv_qp, other, other_qp, out_qp, relu=relu)
        np.testing.assert_array_equal(got, want)
        assert {100 if relu else 0, 255} <= set(np.unique(got).tolist())  # both ends


def test_conv2d_add_bad_other_shape():
    packed = PackedConvWeight(np.zeros((64, 8, 3, 3), np.int8), 0.01, padding=1)
    x = np.zeros((1, 8, 5, 5), np.uint8)
    with pytest.raises(KernelError, match="other: expected the conv output's shape"):
        qk.conv2d_add(
            x, packed, (0.1, 0), (0.1, 0), np.zeros((1, 64, 4, 4), np.uint8), (0.1, 0), (0.1, 0)
        )
    with pytest.raises(KernelError, match=r"conv_qparams: expected QParams\(scale, zero_point\)"):
        qk.conv2d_add(x, packed, (0.1, 0), 0.1, x, (0.1, 0), (0.1, 0))  # type: ignore[arg-type]
