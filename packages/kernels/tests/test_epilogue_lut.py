"""An activation table fused into conv/linear/conv2d_add equals apply_lut on the result."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import quantbridge.kernels as qk
from quantbridge.kernels import KernelError, PackedConvWeight, PackedLinearWeight
from quantbridge.kernels import _depthwise as depthwise_module
from quantbridge.kernels._epilogue_lut import NO_LUT, epilogue_lut

TARGETS = qk.available_targets()


def channels_last(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


def _table(kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "random":  # no structure the kernels could exploit
        return rng.integers(0, 256, 256, dtype=np.uint8)
    if kind == "clamp":  # relu6 with shared qparams: folded into the clamp range
        lo, hi = sorted(int(v) for v in rng.integers(0, 256, 2))
        return np.clip(np.arange(256), lo, hi).astype(np.uint8)
    if kind == "hardswish":  # a real activation, as the lowering builds it (read-only)
        return qk.build_lut("hardswish", 0.05, 128, 0.04, 10)
    raise AssertionError(kind)


@st.composite
def conv_cases(draw):
    groups_kind = draw(st.sampled_from(["dense", "grouped", "depthwise"]))
    c = draw(st.sampled_from([4, 8, 16]))
    if groups_kind == "dense":
        groups, oc = 1, draw(st.sampled_from([8, 16, 32, 40]))
    elif groups_kind == "grouped":
        groups, oc = 2, draw(st.sampled_from([8, 16]))
    else:
        groups, oc = c, c
    return dict(
        n=draw(st.integers(1, 2)),
        c=c,
        oc=oc,
        groups=groups,
        k=draw(st.sampled_from([1, 3])),
        hw=draw(st.integers(3, 9)),
        stride=draw(st.integers(1, 2)),
        wzp=draw(st.booleans()),
        relu=draw(st.booleans()),
        x_cl=draw(st.booleans()),
        out_cl=draw(st.booleans()),
        dims=draw(st.sampled_from([1, 2])),
        table=draw(st.sampled_from(["random", "clamp", "hardswish"])),
        threads=draw(st.sampled_from([1, 2])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@pytest.mark.parametrize("target", TARGETS)
@settings(max_examples=40, deadline=None)
@given(case=conv_cases())
def test_conv_with_lut_equals_conv_then_apply_lut(target, case):
    rng = np.random.default_rng(case["seed"])
    n, c, oc, k, hw, dims = case["n"], case["c"], case["oc"], case["k"], case["hw"], case["dims"]
    cg = c // case["groups"]
    if dims == 2:
        x = rng.integers(0, 256, (n, c, hw, hw), dtype=np.uint8)
        w = rng.integers(-128, 128, (oc, cg, k, k), dtype=np.int8)
        if case["x_cl"]:
            x = channels_last(x)
        conv = qk.conv2d
    else:
        x = rng.integers(0, 256, (n, c, hw + 4), dtype=np.uint8)
        w = rng.integers(-128, 128, (oc, cg, k), dtype=np.int8)
        conv = qk.conv1d
    bias = rng.normal(0, 2, oc).astype(np.float32)
    packed = PackedConvWeight(
        w, 0.01, 3 if case["wzp"] else 0, bias, stride=case["stride"], padding=k // 2,
        groups=case["groups"], target=target,
    )  # fmt: skip
    out_s = 0.04 * 0.01 * 60 * np.sqrt(cg * k * k)
    table = _table(case["table"], rng)
    kw = dict(relu=case["relu"], channels_last=case["out_cl"], num_threads=case["threads"])
    plain = conv(x, packed, 0.04, 7, out_s, 90, **kw)
    want = qk.apply_lut(plain, table)
    got = conv(x, packed, 0.04, 7, out_s, 90, lut=table, **kw)
    assert got.shape == plain.shape
    assert got.strides == plain.strides  # the same layout
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", ["random", "clamp", "hardswish"])
@pytest.mark.parametrize(("k", "stride"), [(3, 1), (3, 2), (5, 1), (5, 2), (3, (2, 3))])
def test_depthwise_blocks_with_lut_serial_and_parallel(target, kind, k, stride, monkeypatch):
    # interior block kernels, border and channel-tail tap kernels (35 channels), the driver
    # without a block kind (stride 3 along W), and the parallel driver at this size
    monkeypatch.setattr(depthwise_module, "PARALLEL_MIN_MACS", 1)
    rng = np.random.default_rng(k * 10 + (stride if isinstance(stride, int) else 7))
    c = 35
    x = channels_last(rng.integers(0, 256, (2, c, 11, 27), dtype=np.uint8))
    w = rng.integers(-128, 128, (c, 1, k, k), dtype=np.int8)
    packed = PackedConvWeight(
        w, rng.uniform(0.002, 0.02, c), rng.integers(-128, 128, c),
        rng.normal(0, 3, c).astype(np.float32), stride=stride, padding=k // 2, groups=c,
        target=target,
    )  # fmt: skip
    assert packed.depthwise
    table = _table(kind, rng)
    for relu in (False, True):
        for threads in (1, 2):
            kw = dict(relu=relu, channels_last=True, num_threads=threads)
            plain = qk.conv2d(x, packed, 0.03, 9, 0.05 * k, 100, **kw)
            got = qk.conv2d(x, packed, 0.03, 9, 0.05 * k, 100, lut=table, **kw)
            np.testing.assert_array_equal(got, qk.apply_lut(plain, table))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", ["random", "clamp", "hardswish"])
@pytest.mark.parametrize("m", [1, 3, 7, 40])  # the one-thread fast path and the general one
@pytest.mark.parametrize("n_out", [8, 32, 50])
def test_linear_with_lut_equals_linear_then_apply_lut(target, kind, m, n_out):
    rng = np.random.default_rng(m * 100 + n_out)
    x = rng.integers(0, 256, (m, 24), dtype=np.uint8)
    w = rng.integers(-128, 128, (n_out, 24), dtype=np.int8)
    packed = PackedLinearWeight(w, 0.02, 0, rng.normal(0, 1, n_out).astype(np.float32), target)
    table = _table(kind, rng)
    for relu in (False, True):
        want = qk.apply_lut(qk.linear(x, packed, 0.05, 3, 0.3, 128, relu=relu), table)
        got = qk.linear(x, packed, 0.05, 3, 0.3, 128, relu=relu, lut=table)
        np.testing.assert_array_equal(got, want)
    # leading dims and more than one thread
    x3 = rng.integers(0, 256, (2, m, 24), dtype=np.uint8)
    want = qk.apply_lut(qk.linear(x3, packed, 0.05, 3, 0.3, 128, num_threads=2), table)
    got = qk.linear(x3, packed, 0.05, 3, 0.3, 128, num_threads=2, lut=table)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", ["random", "clamp"])
@pytest.mark.parametrize("oc", [16, 32, 40])  # fused epilogue and the two-kernel fallback
@pytest.mark.parametrize("relu", [False, True])
def test_conv2d_add_with_lut_maps_the_sum(target, kind, oc, relu):
    rng = np.random.default_rng(oc)
    x = rng.integers(0, 256, (2, 8, 6, 6), dtype=np.uint8)
    w = rng.integers(-128, 128, (oc, 8, 3, 3), dtype=np.int8)
    packed = PackedConvWeight(w, 0.01, 0, None, padding=1, target=target)
    conv_qp, other_qp, out_qp = (0.7, 90), (0.06, 120), (0.09, 100)
    other = rng.integers(0, 256, (2, oc, 6, 6), dtype=np.uint8)
    table = _table(kind, rng)
    plain = qk.conv2d_add(x, packed, (0.04, 7), conv_qp, other, other_qp, out_qp, relu=relu)
    got = qk.conv2d_add(
        x, packed, (0.04, 7), conv_qp, other, other_qp, out_qp, relu=relu, lut=table
    )
    np.testing.assert_array_equal(got, qk.apply_lut(plain, table))


def test_a_clamp_table_narrows_the_range_and_others_stay_tables():
    clamp = np.clip(np.arange(256), 20, 200).astype(np.uint8)
    assert epilogue_lut(clamp, 0)[:2] == (20, 200)
    assert epilogue_lut(clamp, 0)[2] is NO_LUT
    assert epilogue_lut(clamp, 50)[:2] == (50, 200)  # relu's floor above the table's
    lo, hi, table = epilogue_lut(clamp, 0, fold=False)
    assert (lo, hi) == (0, 255)
    assert np.array_equal(table, clamp)
    other = clamp.copy()
    other[100] = 7
    lo, hi, table = epilogue_lut(other, 0)
    assert (lo, hi) == (0, 255)
    assert np.array_equal(table, other)
    other[100] = 100  # changed in place back to the clamp: keyed by content, not identity
    assert epilogue_lut(other, 0)[2] is NO_LUT
    assert epilogue_lut(None, 9) == (9, 255, NO_LUT)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (np.zeros(255, np.uint8), "256 entries"),
        (np.zeros(256, np.int8), "dtype uint8"),
        (np.zeros((16, 16), np.uint8), "1-D"),
        (np.zeros(512, np.uint8)[::2], "C-contiguous"),
        ([0] * 256, "numpy array"),
    ],
)
def test_bad_tables_are_refused_by_name(bad, match):
    x = np.zeros((1, 8, 4, 4), np.uint8)
    conv = PackedConvWeight(np.ones((16, 8, 1, 1), np.int8), 0.01)
    lin = PackedLinearWeight(np.ones((16, 8), np.int8), 0.01)
    other = np.zeros((1, 16, 4, 4), np.uint8)
    calls = [
        lambda: qk.conv2d(x, conv, 0.1, 0, 0.1, 0, lut=bad),
        lambda: qk.linear(x[0, :, 0, :4].T.copy(), lin, 0.1, 0, 0.1, 0, lut=bad),
        lambda: qk.conv2d_add(x, conv, (0.1, 0), (0.1, 0), other, (0.1, 0), (0.1, 0), lut=bad),
    ]
    for call in calls:
        with pytest.raises(KernelError, match=f"lut: .*{match}"):
            call()
