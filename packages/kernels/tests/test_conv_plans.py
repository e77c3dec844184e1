"""A packed conv weight reuses its per-call plan: never with stale arguments, layouts or tables.

Each call below uses one PackedConvWeight many times with arguments that differ in one thing
from the call before (qparams, relu, layout, shape, table contents, thread count), and checks
every result against the integer reference, so a plan reused across a change would fail.
"""

from __future__ import annotations

import copy
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

from quantbridge.kernels import (
    KernelError,
    PackedConvWeight,
    PreparedConv,
    PreparedConvAdd,
    add,
    available_targets,
    build_lut,
    conv1d,
    conv2d,
    conv2d_add,
    set_num_threads,
)
from quantbridge.kernels._conv import _fusable

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the references, under --import-mode=importlib
    sys.path.insert(0, str(HERE))

from test_conv import _channels_last, reference_conv2d  # noqa: E402

TARGETS = available_targets()

# (groups, in channels, out channels, kernel, padding): dense 1x1 (in place on channels-last
# input), dense 3x3 (the padded copy), depthwise 3x3, a grouped conv
SHAPES = [(1, 16, 32, 1, 0), (1, 8, 16, 3, 1), (24, 24, 24, 3, 1), (2, 4, 6, 3, 1)]


def _weight(rng, groups, c, oc, k, target):
    w = rng.integers(-63, 64, (oc, c // groups, k, k)).astype(np.int8)
    ws = rng.uniform(0.002, 0.01, oc).astype(np.float32)
    bias = rng.normal(0, 1, oc).astype(np.float32)
    return w, ws, bias


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "g{}c{}o{}k{}".format(*s[:4]))
def test_every_change_of_argument_gets_its_own_plan(target, shape):
    groups, c, oc, k, pad = shape
    rng = np.random.default_rng(7)
    w, ws, bias = _weight(rng, groups, c, oc, k, target)
    packed = PackedConvWeight(w, ws, 0, bias, padding=pad, groups=groups, target=target)
    x = rng.integers(0, 256, (2, c, 9, 7), dtype=np.uint8)
    calls = [
        dict(x=x, qp=(0.05, 3, 0.2, 100), relu=False, cl=False),
        dict(x=x, qp=(0.05, 3, 0.2, 100), relu=False, cl=False),  # the same: a reused plan
        dict(x=x, qp=(0.07, 3, 0.2, 100), relu=False, cl=False),  # input scale
        dict(x=x, qp=(0.07, 9, 0.2, 100), relu=False, cl=False),  # input zero point
        dict(x=x, qp=(0.07, 9, 0.3, 100), relu=False, cl=False),  # output scale
        dict(x=x, qp=(0.07, 9, 0.3, 90), relu=True, cl=False),  # output zero point, relu
        dict(x=_channels_last(x), qp=(0.07, 9, 0.3, 90), relu=True, cl=False),  # layout in
        dict(x=_channels_last(x), qp=(0.07, 9, 0.3, 90), relu=True, cl=True),  # layout out
        dict(x=x[:1], qp=(0.07, 9, 0.3, 90), relu=True, cl=True),  # batch
        dict(x=x[:, :, :5].copy(), qp=(0.07, 9, 0.3, 90), relu=True, cl=True),  # height
    ]
    for i, call in enumerate(calls):
        s_in, z_in, s_out, z_out = call["qp"]
        got = conv2d(
            call["x"], packed, s_in, z_in, s_out, z_out, relu=call["relu"],
            channels_last=call["cl"],
        )  # fmt: skip
        want = reference_conv2d(
            np.ascontiguousarray(call["x"]), s_in, z_in, w, ws, 0, bias, s_out, z_out,
            (1, 1), (pad, pad), (1, 1), groups, relu=call["relu"],
        )  # fmt: skip
        np.testing.assert_array_equal(got, want, err_msg=f"call {i}: {call['qp']}")
        if not call["cl"]:
            assert got.flags.c_contiguous
    # the same input codes changed in place: the plan holds no data
    x2 = x.copy()
    first = conv2d(x2, packed, 0.05, 3, 0.2, 100)
    x2[...] = 255 - x2
    np.testing.assert_array_equal(
        conv2d(x2, packed, 0.05, 3, 0.2, 100),
        reference_conv2d(x2, 0.05, 3, w, ws, 0, bias, 0.2, 100, (1, 1), (pad, pad), (1, 1), groups),
    )
    assert not np.array_equal(first, conv2d(x2, packed, 0.05, 3, 0.2, 100))


@pytest.mark.parametrize("target", TARGETS)
def test_a_table_changed_in_place_is_applied_as_it_is_now(target):
    rng = np.random.default_rng(3)
    w, ws, bias = _weight(rng, 1, 16, 32, 1, target)
    packed = PackedConvWeight(w, ws, 0, bias, target=target)
    x = rng.integers(0, 256, (1, 16, 6, 6), dtype=np.uint8)
    plain = conv2d(x, packed, 0.05, 3, 0.2, 100)
    table = build_lut(lambda v: np.clip(v, 0.0, 6.0), 0.2, 100, 0.2, 100).copy()  # a clamp
    np.testing.assert_array_equal(conv2d(x, packed, 0.05, 3, 0.2, 100, lut=table), table[plain])
    table[:] = np.arange(256, dtype=np.uint8)[::-1]  # now a table that is not a clamp
    np.testing.assert_array_equal(conv2d(x, packed, 0.05, 3, 0.2, 100, lut=table), table[plain])


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_count_changes_between_calls(threads):
    rng = np.random.default_rng(5)
    w, ws, bias = _weight(rng, 1, 32, 64, 3, "generic")
    packed = PackedConvWeight(w, ws, 0, bias, padding=1)
    x = rng.integers(0, 256, (1, 32, 40, 40), dtype=np.uint8)
    want = reference_conv2d(x, 0.05, 3, w, ws, 0, bias, 0.2, 100, (1, 1), (1, 1), (1, 1), 1)
    try:
        for n in (threads, 3 - threads, threads):
            set_num_threads(n)
            np.testing.assert_array_equal(conv2d(x, packed, 0.05, 3, 0.2, 100), want)
    finally:
        set_num_threads(None)


def test_bad_arguments_are_refused_after_a_good_call_with_the_same_shape():
    rng = np.random.default_rng(1)
    w, ws, bias = _weight(rng, 1, 8, 16, 3, "generic")
    packed = PackedConvWeight(w, ws, 0, bias, padding=1)
    x = rng.integers(0, 256, (1, 8, 6, 6), dtype=np.uint8)
    conv2d(x, packed, 0.05, 3, 0.2, 100)
    with pytest.raises(KernelError, match="zero_point"):
        conv2d(x, packed, 0.05, 300, 0.2, 100)
    with pytest.raises(KernelError, match="x_scale"):
        conv2d(x, packed, float("nan"), 3, 0.2, 100)
    with pytest.raises(KernelError, match="dtype"):
        conv2d(x.astype(np.int8), packed, 0.05, 3, 0.2, 100)
    with pytest.raises(KernelError, match="conv1d"):
        conv1d(x[:, :, 0], packed, 0.05, 3, 0.2, 100)
    strided = np.zeros((1, 8, 6, 12), np.uint8)[..., ::2]  # neither layout
    with pytest.raises(KernelError, match="strides"):
        conv2d(strided, packed, 0.05, 3, 0.2, 100)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "g{}c{}o{}k{}".format(*s[:4]))
def test_prepared_conv_equals_conv2d_through_layout_and_shape_changes(target, shape):
    groups, c, oc, k, pad = shape
    rng = np.random.default_rng(11)
    w, ws, bias = _weight(rng, groups, c, oc, k, target)
    packed = PackedConvWeight(w, ws, 0, bias, padding=pad, groups=groups, target=target)
    table = build_lut(lambda v: np.tanh(v), 0.2, 100, 0.01, 128)
    x = rng.integers(0, 256, (2, c, 9, 7), dtype=np.uint8)
    xcl = _channels_last(x)  # the same shape, other strides: each way round below
    inputs = [xcl, xcl, x, x, xcl, x[:1].copy(), xcl, x, xcl]
    for relu, lut, cl in ((False, None, False), (True, None, True), (False, table, True)):
        prepared = PreparedConv(packed, (0.05, 3), (0.2, 100), relu=relu, channels_last=cl,
                                lut=lut)  # fmt: skip
        for i, xin in enumerate(inputs):  # repeats take the fast path, changes plan again
            want = conv2d(xin, packed, 0.05, 3, 0.2, 100, relu=relu, channels_last=cl, lut=lut)
            got = prepared(xin)
            np.testing.assert_array_equal(got, want, err_msg=f"input {i}, relu {relu}")
            assert got.strides == want.strides
            assert prepared._fast is not None
            assert prepared._fast.x.shape == xin.shape


def test_prepared_conv_1d_and_its_table_is_a_copy():
    rng = np.random.default_rng(4)
    w = rng.integers(-63, 64, (16, 8, 3)).astype(np.int8)
    packed = PackedConvWeight(w, 0.01, 0, None, padding=1)
    x = rng.integers(0, 256, (2, 8, 11), dtype=np.uint8)
    table = np.arange(256, dtype=np.uint8)[::-1].copy()
    prepared = PreparedConv(packed, (0.05, 3), (0.2, 100), lut=table)
    want = conv1d(x, packed, 0.05, 3, 0.2, 100, lut=table.copy())
    np.testing.assert_array_equal(prepared(x), want)
    table[:] = 7  # the caller's array changes; the prepared call keeps the table it was given
    np.testing.assert_array_equal(prepared(x), want)
    np.testing.assert_array_equal(prepared(x.copy()), want)


@pytest.mark.parametrize("threads", [1, 2])
def test_prepared_conv_follows_the_thread_setting(threads):
    rng = np.random.default_rng(5)
    w, ws, bias = _weight(rng, 1, 32, 64, 3, "generic")
    packed = PackedConvWeight(w, ws, 0, bias, padding=1)
    x = rng.integers(0, 256, (1, 32, 40, 40), dtype=np.uint8)
    want = reference_conv2d(x, 0.05, 3, w, ws, 0, bias, 0.2, 100, (1, 1), (1, 1), (1, 1), 1)
    prepared = PreparedConv(packed, (0.05, 3), (0.2, 100))
    try:
        for n in (threads, 3 - threads, threads):
            set_num_threads(n)
            np.testing.assert_array_equal(prepared(x), want)
            assert prepared._fast is not None
            assert prepared._fast.threads == n  # planned for n
    finally:
        set_num_threads(None)
    fixed = PreparedConv(packed, (0.05, 3), (0.2, 100), num_threads=1)
    np.testing.assert_array_equal(fixed(x), want)


def test_prepared_conv_refuses_bad_arguments_by_name():
    rng = np.random.default_rng(1)
    w, ws, bias = _weight(rng, 1, 8, 16, 3, "generic")
    packed = PackedConvWeight(w, ws, 0, bias, padding=1)
    x = rng.integers(0, 256, (1, 8, 6, 6), dtype=np.uint8)
    with pytest.raises(KernelError, match="packed"):
        PreparedConv(w, (0.05, 3), (0.2, 100))  # type: ignore[arg-type]
    with pytest.raises(KernelError, match="x_qparams"):
        PreparedConv(packed, 0.05, (0.2, 100))  # type: ignore[arg-type]
    with pytest.raises(KernelError, match="num_threads"):
        PreparedConv(packed, (0.05, 3), (0.2, 100), num_threads=0)
    prepared = PreparedConv(packed, (0.05, 3), (0.2, 100))
    prepared(x)  # a good call first: the next ones must not slip through its fast path
    with pytest.raises(KernelError, match="dtype"):
        prepared(x.astype(np.int8))
    with pytest.raises(KernelError, match="has 4 channels but the weight expects 8"):
        prepared(x[:, :4].copy())
    with pytest.raises(KernelError, match="zero_point"):
        PreparedConv(packed, (0.05, 300), (0.2, 100))(x)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("oc", [20, 64])  # 20: fused on VNNI only (AVX2 needs whole vectors)
def test_prepared_conv_add_equals_conv2d_add_through_layout_and_shape_changes(target, oc):
    rng = np.random.default_rng(oc)
    w, ws, bias = _weight(rng, 1, 16, oc, 3, target)
    packed = PackedConvWeight(w, ws, 0, bias, padding=1, target=target)
    table = build_lut(lambda v: np.tanh(v), 0.09, 100, 0.01, 128).copy()
    x = rng.integers(0, 256, (2, 16, 9, 7), dtype=np.uint8)
    other = rng.integers(0, 256, (2, oc, 9, 7), dtype=np.uint8)
    xcl, ocl = _channels_last(x), _channels_last(other)
    # repeats take the fast path; a change of either input's layout or shape plans again
    pairs = [(xcl, ocl), (xcl, ocl), (x, ocl), (x, other), (x, other), (xcl, other),
             (x[:1].copy(), other[:1].copy()), (xcl, ocl)]  # fmt: skip
    qps = ((0.05, 3), (0.3, 90), (0.06, 120), (0.09, 100))
    for relu_conv, relu, lut in ((False, False, None), (True, True, None), (False, True, table)):
        prepared = PreparedConvAdd(packed, *qps, relu_conv=relu_conv, relu=relu, lut=lut)
        for i, (xin, oin) in enumerate(pairs):
            want = conv2d_add(xin, packed, qps[0], qps[1], oin, *qps[2:], relu_conv=relu_conv,
                              relu=relu, lut=lut)  # fmt: skip
            got = prepared(xin, oin)
            np.testing.assert_array_equal(got, want, err_msg=f"inputs {i}, relu {relu}")
            assert got.strides == want.strides
            if _fusable(packed):  # the plan is kept for the next call
                assert prepared._fast is not None
                assert prepared._fast.other.shape == oin.shape
            else:  # conv then add: nothing to keep
                assert prepared._fast is None
    if lut is not None:  # the caller's table changes; the prepared call keeps its copy
        want = prepared(xcl, ocl)
        lut[:] = 7
        np.testing.assert_array_equal(prepared(xcl, ocl), want)


@pytest.mark.skipif(
    TARGETS == ["generic"], reason="conv2d_add runs fused (planned once) on avx2 / avx512_vnni only"
)
@pytest.mark.parametrize("threads", [1, 2])
def test_prepared_conv_add_follows_the_thread_setting(threads):
    rng = np.random.default_rng(6)
    w, ws, bias = _weight(rng, 1, 32, 64, 3, "generic")
    packed = PackedConvWeight(w, ws, 0, bias, padding=1)
    x = rng.integers(0, 256, (1, 32, 40, 40), dtype=np.uint8)
    other = _channels_last(rng.integers(0, 256, (1, 64, 40, 40), dtype=np.uint8))
    qps = ((0.05, 3), (0.3, 90), (0.06, 120), (0.09, 100))
    want = conv2d_add(x, packed, qps[0], qps[1], other, *qps[2:], num_threads=1)
    prepared = PreparedConvAdd(packed, *qps)
    try:
        for n in (threads, 3 - threads, threads):
            set_num_threads(n)
            np.testing.assert_array_equal(prepared(x, other), want)
            assert prepared._fast is not None
            assert prepared._fast.threads == n  # planned for n
    finally:
        set_num_threads(None)


def test_prepared_conv_add_refuses_bad_arguments_by_name():
    rng = np.random.default_rng(2)
    w, ws, bias = _weight(rng, 1, 8, 16, 3, "generic")
    packed = PackedConvWeight(w, ws, 0, bias, padding=1)
    x = rng.integers(0, 256, (1, 8, 6, 6), dtype=np.uint8)
    other = rng.integers(0, 256, (1, 16, 6, 6), dtype=np.uint8)
    qps = ((0.05, 3), (0.3, 90), (0.06, 120), (0.09, 100))
    with pytest.raises(KernelError, match="packed"):
        PreparedConvAdd(w, *qps)  # type: ignore[arg-type]
    with pytest.raises(KernelError, match="other_qparams"):
        PreparedConvAdd(packed, qps[0], qps[1], 0.06, qps[3])  # type: ignore[arg-type]
    with pytest.raises(KernelError, match="num_threads"):
        PreparedConvAdd(packed, *qps, num_threads=0)
    prepared = PreparedConvAdd(packed, *qps)
    prepared(x, other)  # a good call first: the next ones must not slip through its fast path
    with pytest.raises(KernelError, match="dtype"):
        prepared(x, other.astype(np.int8))
    with pytest.raises(KernelError, match="other: expected the conv output's shape"):
        prepared(x, other[:, :8].copy())
    with pytest.raises(KernelError, match="zero_point"):
        PreparedConvAdd(packed, qps[0], (0.3, 300), *qps[2:])(x, other)


def _pointwise_16_to_32(seed, target):
    """(rng, a 16 -> 32 channel 1x1 conv weight, channels-last 5x5 input codes)."""
    rng = np.random.default_rng(seed)
    w, ws, bias = _weight(rng, 1, 16, 32, 1, target)
    packed = PackedConvWeight(w, ws, 0, bias, target=target)
    return rng, packed, _channels_last(rng.integers(0, 256, (1, 16, 5, 5), dtype=np.uint8))


@pytest.mark.parametrize("target", TARGETS)
def test_conv2d_add_plans_follow_the_add_qparams_and_the_residual(target):
    rng, packed, x = _pointwise_16_to_32(11, target)
    cases = [((0.1, 120), (0.3, 128)), ((0.1, 120), (0.3, 128)), ((0.2, 7), (0.4, 0))]
    for other_qp, out_qp in cases:
        other = rng.integers(0, 256, (1, 32, 5, 5), dtype=np.uint8)
        got = conv2d_add(x, packed, (0.05, 3), (0.2, 100), other, other_qp, out_qp)
        conv = conv2d(x, packed, 0.05, 3, 0.2, 100)
        np.testing.assert_array_equal(got, add(conv, (0.2, 100), other, other_qp, out_qp))


@pytest.mark.parametrize("target", TARGETS)
def test_conv2d_and_conv2d_add_with_the_same_table_do_not_share_a_plan(target):
    # conv2d folds a clamp table into its clamp range; conv2d_add maps the add's codes with it
    rng, packed, x = _pointwise_16_to_32(13, target)
    other = rng.integers(0, 256, (1, 32, 5, 5), dtype=np.uint8)
    table = build_lut(lambda v: np.clip(v, 0.0, 6.0), 0.2, 100, 0.2, 100)
    conv = conv2d(x, packed, 0.05, 3, 0.2, 100)
    np.testing.assert_array_equal(
        conv2d(x, packed, 0.05, 3, 0.2, 100, channels_last=True, lut=table), table[conv]
    )
    got = conv2d_add(x, packed, (0.05, 3), (0.2, 100), other, (0.2, 100), (0.2, 100), lut=table)
    np.testing.assert_array_equal(got, table[add(conv, (0.2, 100), other, (0.2, 100), (0.2, 100))])


def test_a_weight_with_plans_pickles_and_copies():
    rng = np.random.default_rng(17)
    w, ws, bias = _weight(rng, 1, 8, 16, 3, "generic")
    packed = PackedConvWeight(w, ws, 0, bias, padding=1)
    x = rng.integers(0, 256, (1, 8, 6, 6), dtype=np.uint8)
    want = conv2d(x, packed, 0.05, 3, 0.2, 100)  # makes a plan
    for other in (pickle.loads(pickle.dumps(packed)), copy.deepcopy(packed)):
        np.testing.assert_array_equal(conv2d(x, other, 0.05, 3, 0.2, 100), want)
