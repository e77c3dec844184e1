"""Memory layouts: conv reads NCHW or channels-last and writes either; elementwise kernels run
on any dense layout and keep it; the vector-tile NCHW -> padded NHWC copy equals numpy's."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import quantbridge.kernels as qk
from quantbridge.kernels import KernelError, PackedConvWeight, available_targets, conv1d, conv2d
from quantbridge.kernels._transpose import (
    nchw_into_padded_nhwc,
    nhwc_into_padded_nhwc,
    spread_copy,
)

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the conv reference, under --import-mode=importlib
    sys.path.insert(0, str(HERE))

from test_conv import reference_conv2d  # noqa: E402

TARGETS = available_targets()


def channels_last(x: np.ndarray) -> np.ndarray:
    """The same values as ``x`` [N, C, ...] stored channels-last."""
    perm = (0, *range(2, x.ndim), 1)
    return np.ascontiguousarray(x.transpose(perm)).transpose(np.argsort(perm))


def is_channels_last(x: np.ndarray) -> bool:
    return x.transpose((0, *range(2, x.ndim), 1)).flags.c_contiguous


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 2),
    groups=st.sampled_from([1, 2, 3]),
    cg=st.integers(1, 40),
    h=st.integers(1, 6),
    w=st.integers(1, 40),
    ph=st.integers(0, 2),
    pw=st.integers(0, 2),
    seed=st.integers(0, 2**32 - 1),
)
def test_padded_copies_equal_numpy(n, groups, cg, h, w, ph, pw, seed):
    # channel and width counts around the 16-wide tiles: full tiles, overlapping last tiles,
    # and the scalar path below 16
    rng = np.random.default_rng(seed)
    c, cg4 = groups * cg, -(-cg // 4) * 4
    x = rng.integers(0, 256, (n, c, h, w), dtype=np.uint8)
    hp, wp = h + 2 * ph, w + 2 * pw
    want = np.full((n, hp, wp, groups, cg4), 17, np.uint8)
    want[:, ph : ph + h, pw : pw + w, :, :cg] = x.transpose(0, 2, 3, 1).reshape(n, h, w, groups, cg)
    got = np.full((n, hp, wp, groups, cg4), 99, np.uint8)  # the border must be overwritten
    nchw_into_padded_nhwc(
        x.reshape(-1), n, c, h, w, groups, cg, cg4, ph, pw, wp, hp, 17, got.reshape(-1)
    )
    np.testing.assert_array_equal(got, want)
    got[...] = 99
    nhwc_into_padded_nhwc(
        np.ascontiguousarray(x.transpose(0, 2, 3, 1)).reshape(-1),
        n, h, w, groups, cg, cg4, ph, pw, wp, hp, 17, got.reshape(-1),
    )  # fmt: skip
    np.testing.assert_array_equal(got, want)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 2),
    cg=st.integers(1, 3),
    padded=st.booleans(),
    h=st.integers(1, 5),
    w=st.integers(16, 40),
    ph=st.integers(0, 3),
    pw=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_stem_copies_equal_numpy(n, cg, padded, h, w, ph, pw, seed):
    # 1-3 channels into 4-byte pixels (channel-padded) or unpadded ones (row-packed stems):
    # whole 16-pixel tiles and a last tile moved back, from both input layouts
    rng = np.random.default_rng(seed)
    cg4 = 4 if padded else cg
    x = rng.integers(0, 256, (n, cg, h, w), dtype=np.uint8)
    hp, wp = h + 2 * ph, w + 2 * pw
    want = np.full((n, hp, wp, cg4), 17, np.uint8)
    want[:, ph : ph + h, pw : pw + w, :cg] = x.transpose(0, 2, 3, 1)
    for nchw, src in ((True, x), (False, np.ascontiguousarray(x.transpose(0, 2, 3, 1)))):
        copy = spread_copy(nchw, 1, cg, cg4, w)
        assert copy is not None
        got = np.full((n, hp, wp, cg4), 99, np.uint8)  # the border must be overwritten
        copy(src.reshape(-1), n, h, w, 17, got.reshape(-1), ph, pw, wp, hp)
        np.testing.assert_array_equal(got, want, err_msg=f"nchw={nchw}")
    assert spread_copy(True, 1, cg, cg4, 15) is None  # narrower rows: the general copies
    assert spread_copy(True, 2, cg, cg4, w) is None


@st.composite
def wide_conv_cases(draw):
    groups = draw(st.sampled_from([1, 1, 2]))
    return dict(
        n=draw(st.integers(1, 2)),
        groups=groups,
        cg=draw(st.sampled_from([3, 4, 16, 20, 33])),
        ocg=draw(st.integers(1, 40)),
        k=draw(st.integers(1, 3)),
        h=draw(st.integers(3, 8)),
        w=draw(st.integers(3, 20)),
        stride=draw(st.integers(1, 2)),
        padding=draw(st.integers(0, 1)),
        wzp=draw(st.booleans()),
        relu=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@pytest.mark.parametrize("target", TARGETS)
@settings(max_examples=15, deadline=None)
@given(case=wide_conv_cases())
def test_conv2d_every_layout_pair_is_bit_exact(target, case):
    rng = np.random.default_rng(case["seed"])
    g, k = case["groups"], case["k"]
    c, oc = g * case["cg"], g * case["ocg"]
    x = rng.integers(0, 256, (case["n"], c, case["h"], case["w"]), dtype=np.uint8)
    w = rng.integers(-128, 128, (oc, case["cg"], k, k), dtype=np.int8)
    bias = rng.normal(0, 3, oc).astype(np.float32)
    w_zp = 2 if case["wzp"] else 0
    o_s = 0.03 * 0.01 * 60 * np.sqrt(case["cg"] * k * k)
    s, p = case["stride"], case["padding"]
    packed = PackedConvWeight(w, 0.01, w_zp, bias, stride=s, padding=p, groups=g, target=target)
    want = reference_conv2d(
        x, 0.03, 9, w, 0.01, w_zp, bias, o_s, 100, (s, s), (p, p), (1, 1), g, case["relu"]
    )
    for xin in (x, channels_last(x)):
        for cl_out in (False, True):
            got = conv2d(xin, packed, 0.03, 9, o_s, 100, relu=case["relu"], channels_last=cl_out)
            np.testing.assert_array_equal(got, want)
            assert got.shape == want.shape
            assert is_channels_last(got) if cl_out else got.flags.c_contiguous


@pytest.mark.parametrize("target", TARGETS)
def test_conv1d_channels_last(target):
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (2, 20, 30), dtype=np.uint8)
    w = rng.integers(-128, 128, (24, 20, 3), dtype=np.int8)
    packed = PackedConvWeight(w, 0.01, 0, None, padding=1, target=target)
    want = conv1d(x, packed, 0.05, 3, 1.5, 7)
    got = conv1d(channels_last(x), packed, 0.05, 3, 1.5, 7, channels_last=True)
    np.testing.assert_array_equal(got, want)
    assert is_channels_last(got)
    assert got.shape == (2, 24, 30)


def test_conv_chain_stays_channels_last_and_reads_without_copy():
    # 1x1 convs need no padding: the second conv reads the first one's output buffer itself
    rng = np.random.default_rng(4)
    x = rng.integers(0, 256, (1, 32, 9, 9), dtype=np.uint8)
    p1 = PackedConvWeight(rng.integers(-128, 128, (32, 32, 1, 1), dtype=np.int8), 0.01)
    p2 = PackedConvWeight(rng.integers(-128, 128, (16, 32, 1, 1), dtype=np.int8), 0.01)
    y = conv2d(x, p1, 0.05, 3, 0.5, 10, channels_last=True)
    z = conv2d(y, p2, 0.5, 10, 0.7, 20, channels_last=True)
    z_ref = conv2d(np.ascontiguousarray(y), p2, 0.5, 10, 0.7, 20)
    np.testing.assert_array_equal(z, z_ref)


def test_conv_rejects_other_strided_input():
    packed = PackedConvWeight(np.ones((4, 4, 3, 3), np.int8), 0.01, padding=1)
    x = np.zeros((1, 4, 8, 16), np.uint8)[..., ::2]
    with pytest.raises(KernelError, match="x: expected a C-contiguous"):
        conv2d(x, packed, 0.05, 3, 0.5, 10)


# --- elementwise kernels keep a dense layout -------------------------------------------------

X = np.random.default_rng(7).integers(0, 256, (2, 24, 5, 7), dtype=np.uint8)
XF = np.random.default_rng(8).normal(0, 2, (2, 24, 5, 7)).astype(np.float32)

UNARY = {
    "relu": lambda q, **kw: qk.relu(q, 40, **kw),
    "hardtanh": lambda q, **kw: qk.hardtanh(q, 0.1, 20, -1.0, 2.0, **kw),
    "apply_lut": lambda q, **kw: qk.apply_lut(
        q, qk.build_lut("sigmoid", 0.1, 20, 1 / 256, 0), **kw
    ),
    "requantize": lambda q, **kw: qk.requantize(q, 0.1, 20, 0.07, 128, **kw),
    "dequantize_per_tensor": lambda q, **kw: qk.dequantize_per_tensor(q, 0.1, 20, **kw),
}


@pytest.mark.parametrize("name", list(UNARY))
def test_unary_ops_keep_channels_last(name):
    fn = UNARY[name]
    want = fn(X)
    got = fn(channels_last(X))
    np.testing.assert_array_equal(got, want)
    assert is_channels_last(got)
    out = np.empty_like(channels_last(X), dtype=want.dtype)
    assert fn(channels_last(X), out=out) is out
    np.testing.assert_array_equal(out, want)
    with pytest.raises(KernelError, match="out: expected a C-contiguous"):
        fn(channels_last(X), out=np.empty(X.shape, want.dtype))


def test_quantize_keeps_a_transposed_layout():
    xt = XF.transpose(3, 1, 0, 2)  # any dense permutation, not only channels-last
    got = qk.quantize_per_tensor(xt, 0.05, 128)
    np.testing.assert_array_equal(got, qk.quantize_per_tensor(np.ascontiguousarray(xt), 0.05, 128))
    assert got.strides == np.empty_like(xt, dtype=np.uint8).strides


@pytest.mark.parametrize("kind", ["add", "add_relu", "mul", "mul_relu"])
def test_binary_ops_on_mixed_layouts(kind):
    fn = getattr(qk, kind)
    b = np.random.default_rng(9).integers(0, 256, X.shape, dtype=np.uint8)
    want = fn(X, (0.1, 20), b, (0.05, 100), (0.2, 60))
    for a_in, b_in in ((channels_last(X), channels_last(b)), (channels_last(X), b)):
        got = fn(a_in, (0.1, 20), b_in, (0.05, 100), (0.2, 60))
        np.testing.assert_array_equal(got, want)
        assert is_channels_last(got)  # the first input's layout
    got = fn(X, (0.1, 20), channels_last(b), (0.05, 100), (0.2, 60))
    np.testing.assert_array_equal(got, want)
    assert got.flags.c_contiguous


def test_non_dense_input_is_refused():
    with pytest.raises(KernelError, match="q: expected a C-contiguous"):
        qk.relu(X[:, ::2], 40)


# --- pools run channels-last loops on channels-last input ----------------------------------


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 2),
    c=st.integers(1, 70),  # max pool: 32-byte vectors and a tail
    h=st.integers(5, 9),  # a 3-tap window with dilation 2 spans 5
    w=st.integers(5, 9),
    k=st.integers(1, 3),
    stride=st.integers(1, 2),
    pad=st.integers(0, 1),
    dilation=st.integers(1, 2),
    ceil_mode=st.booleans(),
    include_pad=st.booleans(),
    out_hw=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    seed=st.integers(0, 2**32 - 1),
)
def test_pools_on_channels_last_equal_nchw(
    n, c, h, w, k, stride, pad, dilation, ceil_mode, include_pad, out_hw, seed
):
    x = np.random.default_rng(seed).integers(0, 256, (n, c, h, w), dtype=np.uint8)
    pad = min(pad, k // 2)
    calls = {
        "max": lambda a, **kw: qk.max_pool2d(a, k, stride, pad, dilation, ceil_mode, **kw),
        "avg": lambda a, **kw: qk.avg_pool2d(
            a,
            k,
            stride,
            pad,
            ceil_mode,
            include_pad,
            None,
            scale=0.1,
            zero_point=30,
            out_scale=0.13,
            out_zero_point=50,
            **kw,
        ),
        "adaptive": lambda a, **kw: qk.adaptive_avg_pool2d(a, out_hw, **kw),
        "adaptive, requantized": lambda a, **kw: qk.adaptive_avg_pool2d(
            a, out_hw, scale=0.1, zero_point=30, out_scale=0.05, out_zero_point=70, **kw
        ),
    }
    for name, fn in calls.items():
        want = fn(x)
        got = fn(channels_last(x))
        np.testing.assert_array_equal(got, want, err_msg=name)
        assert is_channels_last(got) or got.flags.c_contiguous  # 1x1 outputs are both
        out = np.empty_like(channels_last(np.empty(want.shape, np.uint8)))
        assert fn(channels_last(x), out=out) is out
        np.testing.assert_array_equal(out, want, err_msg=name)


def test_pool_out_must_match_channels_last_input():
    x = channels_last(np.zeros((1, 8, 6, 6), np.uint8))
    with pytest.raises(KernelError, match="out: expected a C-contiguous"):
        qk.max_pool2d(x, 2, out=np.empty((1, 8, 3, 3), np.uint8))
