"""mul_channels (squeeze-excite): kernels.mul on the broadcast tensor, without the broadcast."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import quantbridge.kernels as qk
from quantbridge.kernels import KernelError


def channels_last(x: np.ndarray) -> np.ndarray:
    order = (0, *range(2, x.ndim), 1)
    return np.ascontiguousarray(x.transpose(order)).transpose(np.argsort(order))


def reference(a, a_qp, b, b_qp, out_qp, relu):
    """Integer numpy reference: int32 product, float32 multiplier, round half to even."""
    (sa, za), (sb, zb), (so, zo) = a_qp, b_qp, out_qp
    m = np.float32(sa) * np.float32(sb) * (np.float32(1.0) / np.float32(so))
    p = (a.astype(np.int32) - za) * (np.broadcast_to(b, a.shape).astype(np.int32) - zb)
    r = np.rint(p.astype(np.float32) * m) + np.float32(zo)
    q = np.clip(r, 0, 255).astype(np.int32)
    if relu:
        q = np.maximum(q, zo)
    return q.astype(np.uint8)


@st.composite
def cases(draw):
    return dict(
        n=draw(st.integers(1, 3)),
        c=draw(st.integers(1, 40)),
        spatial=draw(st.sampled_from([(5,), (3, 4), (7, 7), (1, 1), (2, 3, 2)])),
        b_batch=draw(st.booleans()),
        a_cl=draw(st.booleans()),
        relu=draw(st.booleans()),
        swap=draw(st.booleans()),
        threads=draw(st.sampled_from([1, 2])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_equals_mul_on_the_broadcast_and_the_integer_reference(case):
    rng = np.random.default_rng(case["seed"])
    n, c, spatial = case["n"], case["c"], case["spatial"]
    a = rng.integers(0, 256, (n, c, *spatial), dtype=np.uint8)
    b = rng.integers(0, 256, (n if case["b_batch"] else 1, c, *(1,) * len(spatial)), np.uint8)
    a_qp, b_qp, out_qp = (0.03, int(rng.integers(0, 256))), (1 / 256, 0), (0.02, 40)
    if case["swap"]:  # the scale operand's qparams first: the same product
        a_qp, b_qp = b_qp, a_qp
    if case["a_cl"]:
        a = channels_last(a)
    qk.set_num_threads(case["threads"])
    try:
        got = qk.mul_channels(a, a_qp, b, b_qp, out_qp, relu=case["relu"])
    finally:
        qk.set_num_threads(None)
    assert got.shape == a.shape
    assert got.strides == a.strides  # a's layout
    full = np.ascontiguousarray(np.broadcast_to(b, a.shape))
    mul = qk.mul_relu if case["relu"] else qk.mul
    np.testing.assert_array_equal(got, mul(np.ascontiguousarray(a), a_qp, full, b_qp, out_qp))
    np.testing.assert_array_equal(got, reference(a, a_qp, b, b_qp, out_qp, case["relu"]))


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_the_multiplier_rounds_in_float32_not_float64(layout):
    # (250 - 0) * (3 - 0) * m is exactly 4.5 in float32 but 4.50000004 in float64 with these
    # scales: a product formed in double rounds to 5 where torch's float32 gives 4
    a_qp, b_qp, out_qp = (0.03, 0), (0.004, 0), (0.02, 0)
    a = np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16).repeat(2, axis=1)
    b = np.full((1, 2, 1, 1), 3, np.uint8)
    want = reference(a, a_qp, b, b_qp, out_qp, False)
    assert want[0, 0, 15, 10] == 4  # a = 250: the tie, rounded to even
    if layout == "channels_last":
        a = channels_last(a)
    got = qk.mul_channels(a, a_qp, b, b_qp, out_qp)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, qk.mul(a, a_qp, np.broadcast_to(b, a.shape), b_qp, out_qp))


def test_large_channels_last_input_runs_in_parallel_chunks():
    rng = np.random.default_rng(1)
    a = channels_last(rng.integers(0, 256, (1, 96, 56, 56), dtype=np.uint8))
    b = rng.integers(0, 256, (1, 96, 1, 1), dtype=np.uint8)
    qk.set_num_threads(2)
    try:
        got = qk.mul_channels(a, (0.05, 3), b, (1 / 256, 0), (0.04, 9))
    finally:
        qk.set_num_threads(None)
    np.testing.assert_array_equal(got, reference(a, (0.05, 3), b, (1 / 256, 0), (0.04, 9), False))


@pytest.mark.parametrize(
    ("b_shape", "match"),
    [
        ((2, 8, 4, 1), "not one value per"),
        ((2, 4, 1, 1), "not one value per"),
        ((2, 8), "not one value per"),
        ((3, 8, 1, 1), "not one value per"),
    ],
)
def test_shapes_that_are_not_per_channel_are_refused(b_shape, match):
    a = np.zeros((2, 8, 4, 4), np.uint8)
    with pytest.raises(KernelError, match=match):
        qk.mul_channels(a, (0.1, 0), np.zeros(b_shape, np.uint8), (0.1, 0), (0.1, 0))


def test_bad_qparams_and_dtypes_are_refused_by_name():
    a = np.zeros((1, 4, 2, 2), np.uint8)
    b = np.zeros((1, 4, 1, 1), np.uint8)
    with pytest.raises(KernelError, match=r"b_qparams\.zero_point"):
        qk.mul_channels(a, (0.1, 0), b, (0.1, 300), (0.1, 0))
    with pytest.raises(KernelError, match=r"out_qparams\.scale"):
        qk.mul_channels(a, (0.1, 0), b, (0.1, 0), (0.0, 0))
    with pytest.raises(KernelError, match="b: expected dtype uint8"):
        qk.mul_channels(a, (0.1, 0), b.astype(np.int8), (0.1, 0), (0.1, 0))
    with pytest.raises(KernelError, match="a: expected"):
        qk.mul_channels(a[:, :, ::2], (0.1, 0), b, (0.1, 0), (0.1, 0))


def test_checked_qparams_are_remembered_but_errors_are_not():
    # the derived constants are cached per set of qparams; a list pair (unhashable) still
    # runs, and a bad set raises on every call, not only the first
    rng = np.random.default_rng(5)
    a = channels_last(rng.integers(0, 256, (1, 16, 3, 3), dtype=np.uint8))
    b = rng.integers(0, 256, (1, 16, 1, 1), dtype=np.uint8)
    qps = ((0.02, 7), (0.01, 3), (0.05, 11))
    want = reference(a, *qps[:1], b, *qps[1:], relu=False)
    for _ in range(2):
        np.testing.assert_array_equal(qk.mul_channels(a, qps[0], b, qps[1], qps[2]), want)
        got = qk.mul_channels(a, list(qps[0]), b, list(qps[1]), list(qps[2]))
        np.testing.assert_array_equal(got, want)
        with pytest.raises(KernelError, match=r"a_qparams\.zero_point"):
            qk.mul_channels(a, (0.02, -1), b, qps[1], qps[2])
        with pytest.raises(KernelError, match=r"a_qparams\.zero_point"):
            qk.mul_channels(a, [0.02, -1], b, qps[1], qps[2])


@pytest.mark.parametrize("relu", [False, True])
def test_prepared_equals_mul_channels_either_way_round_through_layout_changes(relu):
    rng = np.random.default_rng(8)
    a = rng.integers(0, 256, (2, 24, 5, 6), dtype=np.uint8)
    b = rng.integers(0, 256, (2, 24, 1, 1), dtype=np.uint8)
    a_cl = channels_last(a)
    a_qp, b_qp, out_qp = (0.03, 17), (1 / 256, 0), (0.02, 40)
    prepared = qk.PreparedMulChannels(a_qp, b_qp, out_qp, relu=relu)
    swapped = qk.PreparedMulChannels(b_qp, a_qp, out_qp, relu=relu)  # per-channel one first
    # repeats take the fast path; a change of layout, shape or thread count plans again
    for i, (x, threads) in enumerate(
        [(a_cl, 1), (a_cl, 1), (a, 1), (a, 2), (a_cl, 2), (a[:1].copy(), 1), (a_cl, 1)]
    ):
        f = b[: x.shape[0]]
        qk.set_num_threads(threads)
        try:
            want = qk.mul_channels(x, a_qp, f, b_qp, out_qp, relu=relu)
            got = prepared(x, f)
            got_swapped = swapped(f, x)
        finally:
            qk.set_num_threads(None)
        np.testing.assert_array_equal(want, reference(x, a_qp, f, b_qp, out_qp, relu))
        for result, which in ((got, prepared), (got_swapped, swapped)):
            np.testing.assert_array_equal(result, want, err_msg=f"call {i}")
            assert result.strides == want.strides
            assert which._fast is not None
            assert which._fast.threads == threads  # planned for this thread count
    assert prepared._fast.swapped is False
    assert swapped._fast.swapped is True


def test_prepared_refuses_bad_arguments_by_name():
    with pytest.raises(KernelError, match="b_qparams"):
        qk.PreparedMulChannels((0.03, 17), 0.5, (0.02, 40))  # type: ignore[arg-type]
    with pytest.raises(KernelError, match="zero_point"):
        qk.PreparedMulChannels((0.03, 17), (0.5, 300), (0.02, 40))
    prepared = qk.PreparedMulChannels((0.03, 17), (1 / 256, 0), (0.02, 40))
    a = np.zeros((1, 8, 3, 3), np.uint8)
    prepared(a, np.zeros((1, 8, 1, 1), np.uint8))  # a good call first: no slipping through
    with pytest.raises(KernelError, match="dtype"):
        prepared(a.astype(np.int8), np.zeros((1, 8, 1, 1), np.uint8))
    with pytest.raises(KernelError, match="not one value per"):
        prepared(a, np.zeros((1, 4, 1, 1), np.uint8))
