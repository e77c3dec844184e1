"""Hostile qparams and array types at every public entry point.

Kernels compute with float32 scales, so a scale (or a product/ratio of scales a kernel forms)
that is 0, subnormal, infinite or NaN in float32 must be refused with a KernelError naming the
argument -- before, ``x_scale=1e-50`` or ``1e39`` was accepted and every output came back 0.
ndarray subclasses: ``np.memmap`` and plain subclasses compute exactly like ndarrays;
``np.matrix`` is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import quantbridge.kernels as qk
from quantbridge.kernels import KernelError

F32_TINY = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)
# 0, negative, subnormal in float32 (1e-40), below float32 entirely (1e-50), above it (1e39)
BAD_SCALES = [0.0, -1.0, 1e-40, 1e-50, 1e39, math.inf, -math.inf, math.nan]
GOOD = 0.05

rng = np.random.default_rng(0)
X2 = rng.integers(0, 256, (3, 8), dtype=np.uint8)
W2 = rng.integers(-100, 100, (4, 8), dtype=np.int8)
B4 = rng.standard_normal(4).astype(np.float32)
XC = rng.integers(0, 256, (1, 4, 5, 5), dtype=np.uint8)
WC = rng.integers(-100, 100, (4, 2, 3, 3), dtype=np.int8)  # groups=2
WDW = rng.integers(-100, 100, (4, 1, 3, 3), dtype=np.int8)  # depthwise
XL = rng.integers(0, 256, (1, 4, 7), dtype=np.uint8)
WL = rng.integers(-100, 100, (4, 4, 3), dtype=np.int8)
Q = rng.integers(0, 256, (2, 3, 4), dtype=np.uint8)
F = rng.standard_normal((2, 3, 4)).astype(np.float32)
CH3 = np.array([0.1, 0.2, 0.3])
ZP3 = np.array([1, 2, 3], np.int32)


def _linear(x_scale: float = GOOD, w_scale: Any = GOOD, out_scale: float = GOOD) -> object:
    return qk.linear(X2, qk.PackedLinearWeight(W2, w_scale, 0, B4), x_scale, 3, out_scale, 5)


def _dynamic(w_scale: Any = GOOD) -> object:
    return qk.linear_dynamic(F.reshape(-1, 4), qk.PackedLinearWeight(W2[:, :4].copy(), w_scale))


def _conv2d(x_scale: float = GOOD, w_scale: Any = GOOD, out_scale: float = GOOD) -> object:
    pc = qk.PackedConvWeight(WC, w_scale, 0, B4, padding=1, groups=2)
    return qk.conv2d(XC, pc, x_scale, 3, out_scale, 5)


def _depthwise(x_scale: float = GOOD, w_scale: Any = GOOD, out_scale: float = GOOD) -> object:
    pc = qk.PackedConvWeight(WDW, w_scale, 0, B4, padding=1, groups=4)
    return qk.conv2d(XC, pc, x_scale, 3, out_scale, 5)


def _conv1d(x_scale: float = GOOD, w_scale: Any = GOOD, out_scale: float = GOOD) -> object:
    return qk.conv1d(XL, qk.PackedConvWeight(WL, w_scale, 0, B4), x_scale, 3, out_scale, 5)


def _conv2d_add(
    x_scale: float = GOOD,
    w_scale: Any = GOOD,
    conv_scale: float = GOOD,
    other_scale: float = GOOD,
    out_scale: float = GOOD,
) -> object:
    pc = qk.PackedConvWeight(WC[:, :2].repeat(2, axis=1), w_scale, 0, B4, padding=1)
    return qk.conv2d_add(
        XC, pc, (x_scale, 3), (conv_scale, 4), XC, (other_scale, 6), (out_scale, 5)
    )


def _matmul(a_scale: float = GOOD, b_scale: float = GOOD, out_scale: float = GOOD) -> object:
    return qk.matmul(X2, (a_scale, 3), X2.T.copy(), (b_scale, 4), (out_scale, 5))


def _binary(op: Callable[..., object]) -> Callable[..., object]:
    def call(a_scale: float = GOOD, b_scale: float = GOOD, out_scale: float = GOOD) -> object:
        return op(Q, (a_scale, 3), Q, (b_scale, 4), (out_scale, 5))

    return call


def _avg_pool(scale: float = GOOD, out_scale: float = GOOD) -> object:
    return qk.avg_pool2d(Q, 2, scale=scale, zero_point=3, out_scale=out_scale, out_zero_point=4)


def _embedding(scale: float = 0.5, bias: float = 0.0) -> object:
    packed = qk.pack_embedding_8bit(rng.standard_normal((5, 4)).astype(np.float32))
    packed.scale[3], packed.bias[3] = scale, bias
    return qk.embedding_bag(packed, np.array([0, 3, 1]), np.array([0, 2]))


# (entry point, argument named in the error, call with that argument set to a value)
SCALE_CASES: list[tuple[str, str, Callable[[Any], object]]] = [
    ("linear", "x_scale", lambda s: _linear(x_scale=s)),
    ("linear", "out_scale", lambda s: _linear(out_scale=s)),
    ("linear", "weight scale", lambda s: _linear(w_scale=s)),
    ("linear per-channel", "weight scale[2]", lambda s: _linear(w_scale=[0.1, 0.1, s, 0.1])),
    ("linear_dynamic", "weight scale", lambda s: _dynamic(w_scale=s)),
    ("linear_dynamic per-channel", "weight scale[1]", lambda s: _dynamic([0.1, s, 0.1, 0.1])),
    ("conv2d", "x_scale", lambda s: _conv2d(x_scale=s)),
    ("conv2d", "out_scale", lambda s: _conv2d(out_scale=s)),
    ("conv2d per-channel", "weight scale[3]", lambda s: _conv2d(w_scale=[0.1, 0.1, 0.1, s])),
    ("depthwise", "x_scale", lambda s: _depthwise(x_scale=s)),
    ("depthwise", "out_scale", lambda s: _depthwise(out_scale=s)),
    ("depthwise per-channel", "weight scale[0]", lambda s: _depthwise(w_scale=[s, 0.1, 0.1, 0.1])),
    ("conv1d", "x_scale", lambda s: _conv1d(x_scale=s)),
    ("conv1d", "out_scale", lambda s: _conv1d(out_scale=s)),
    ("conv1d", "weight scale", lambda s: _conv1d(w_scale=s)),
    ("conv2d_add", "x_qparams.scale", lambda s: _conv2d_add(x_scale=s)),
    ("conv2d_add", "conv_qparams.scale", lambda s: _conv2d_add(conv_scale=s)),
    ("conv2d_add", "other_qparams.scale", lambda s: _conv2d_add(other_scale=s)),
    ("conv2d_add", "out_qparams.scale", lambda s: _conv2d_add(out_scale=s)),
    ("matmul", "a_qparams.scale", lambda s: _matmul(a_scale=s)),
    ("matmul", "b_qparams.scale", lambda s: _matmul(b_scale=s)),
    ("matmul", "out_qparams.scale", lambda s: _matmul(out_scale=s)),
    ("quantize_per_tensor", "scale", lambda s: qk.quantize_per_tensor(F, s, 3)),
    (
        "quantize_per_channel",
        "scales[2]",
        lambda s: qk.quantize_per_channel(F, np.array([0.1, 0.2, s]), ZP3, 1),
    ),
    ("dequantize_per_tensor", "scale", lambda s: qk.dequantize_per_tensor(Q, s, 3)),
    (
        "dequantize_per_channel",
        "scales[0]",
        lambda s: qk.dequantize_per_channel(Q, np.array([s, 0.2, 0.3]), ZP3, 1),
    ),
    ("requantize", "in_scale", lambda s: qk.requantize(Q, s, 3, GOOD, 4)),
    ("requantize", "out_scale", lambda s: qk.requantize(Q, GOOD, 3, s, 4)),
    ("build_lut", "in_scale", lambda s: qk.build_lut("sigmoid", s, 3, GOOD, 4)),
    ("build_lut", "out_scale", lambda s: qk.build_lut(np.tanh, GOOD, 3, s, 4)),
    ("clamp", "scale", lambda s: qk.clamp(Q, s, 3, -1.0, 1.0)),
    ("hardtanh", "scale", lambda s: qk.hardtanh(Q, s, 3)),
    ("relu6", "scale", lambda s: qk.relu6(Q, s, 3)),
    ("avg_pool2d", "scale", lambda s: _avg_pool(scale=s)),
    ("avg_pool2d", "out_scale", lambda s: _avg_pool(out_scale=s)),
]


def _binary_case(op: Callable[..., object], arg: str) -> Callable[[Any], object]:
    return lambda s: _binary(op)(**{arg: s})


SCALE_CASES += [
    (op.__name__, arg.replace("_scale", "_qparams.scale"), _binary_case(op, arg))
    for op in (qk.add, qk.add_relu, qk.mul, qk.mul_relu)
    for arg in ("a_scale", "b_scale", "out_scale")
]
CASE_IDS = [f"{entry}-{arg}" for entry, arg, _ in SCALE_CASES]


@pytest.mark.parametrize(("entry", "arg", "call"), SCALE_CASES, ids=CASE_IDS)
def test_good_scale_is_accepted(entry: str, arg: str, call: Callable[[Any], object]) -> None:
    # the control: each table row runs with a normal scale, so a refusal below is the scale's
    call(GOOD)


@pytest.mark.parametrize("bad", BAD_SCALES, ids=repr)
@pytest.mark.parametrize(("entry", "arg", "call"), SCALE_CASES, ids=CASE_IDS)
def test_bad_scale_is_refused_naming_the_argument(
    entry: str, arg: str, call: Callable[[Any], object], bad: float
) -> None:
    with pytest.raises(KernelError) as info:
        call(bad)
    assert arg in str(info.value)


# Left out on purpose: inside a per-channel list numpy makes True 1.0 (and a nested list a
# ragged array, refused by numpy before the kernel sees it); avg_pool2d's out_scale=None means
# "the input's scale".
NON_NUMERIC_CASES = [
    (entry, arg, call, bad)
    for entry, arg, call in SCALE_CASES
    for bad in ("0.1", b"0.1", True, None, [0.1], 1j)
    if not ("[" in arg and isinstance(bad, (bool, list)))
    and not (entry == "avg_pool2d" and arg == "out_scale" and bad is None)
]


@pytest.mark.parametrize(
    ("entry", "arg", "call", "bad"),
    NON_NUMERIC_CASES,
    ids=[f"{e}-{a}-{b!r}" for e, a, _, b in NON_NUMERIC_CASES],
)
def test_non_numeric_scale_is_refused(
    entry: str, arg: str, call: Callable[[Any], object], bad: object
) -> None:
    with pytest.raises(KernelError) as info:
        call(bad)
    assert arg.split("[")[0] in str(info.value)


# float64 values that are not normal float32 numbers (or not > 0)
NOT_F32_NORMAL = st.one_of(
    st.floats(min_value=-1e300, max_value=0.0),
    st.floats(min_value=0.0, max_value=F32_TINY * (1 - 2**-22), exclude_min=True),
    st.floats(min_value=F32_MAX * (1 + 2**-24), allow_infinity=True),
    st.just(math.nan),
    st.sampled_from([1e-40, 1e-50, 1e39]),
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(case=st.sampled_from(SCALE_CASES), bad=NOT_F32_NORMAL)
def test_random_bad_scales_are_refused(
    case: tuple[str, str, Callable[[Any], object]], bad: float
) -> None:
    _, arg, call = case
    with pytest.raises(KernelError, match=arg.replace("[", r"\[").replace("]", r"\]")):
        call(bad)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(
    case=st.sampled_from(SCALE_CASES),
    good=st.floats(min_value=1e-3, max_value=1e3),
)
def test_random_normal_scales_are_accepted(
    case: tuple[str, str, Callable[[Any], object]], good: float
) -> None:
    case[2](good)


# Scales that are each fine but whose product/ratio, as the kernel forms it, is not.
DERIVED_CASES: list[tuple[str, str, Callable[[], object]]] = [
    (
        "linear",
        "x_scale * weight scale is subnormal",
        lambda: _linear(x_scale=1e-20, w_scale=1e-20),
    ),
    ("linear", "x_scale * weight scale overflows", lambda: _linear(x_scale=1e20, w_scale=1e20)),
    (
        "linear",
        "x_scale * weight scale / out_scale underflows",
        lambda: _linear(x_scale=1e-20, w_scale=1e-10, out_scale=1e20),
    ),
    (
        "linear per-channel",
        "x_scale * weight scale for output channel 2",
        lambda: _linear(x_scale=1e-10, w_scale=[0.1, 0.1, 1e-30, 0.1]),
    ),
    (
        "linear",
        "bias / (x_scale * weight scale) for output channel",
        lambda: qk.linear(
            X2, qk.PackedLinearWeight(W2, 1e-10, 0, np.full(4, 1e30, np.float32)), 1e-10, 3, GOOD, 5
        ),
    ),
    (
        "linear_dynamic",
        "x's dynamic scale",
        lambda: qk.linear_dynamic(
            np.full((2, 8), 1e-12, np.float32), qk.PackedLinearWeight(W2, 1e-30)
        ),
    ),
    (
        "conv2d groups",
        "x_scale * weight scale for output channel 3",
        lambda: _conv2d(x_scale=1e-10, w_scale=[0.1, 0.1, 0.1, 1e-30]),
    ),
    (
        "depthwise",
        "x_scale * weight scale / out_scale for output channel 1",
        lambda: _depthwise(x_scale=1e-10, w_scale=[0.1, 1e-10, 0.1, 0.1], out_scale=1e20),
    ),
    (
        "conv1d",
        "x_scale * weight scale / out_scale",
        lambda: _conv1d(x_scale=1e-20, w_scale=1e-10, out_scale=1e20),
    ),
    (
        "conv2d_add",
        "x_scale * weight scale underflows",
        lambda: _conv2d_add(x_scale=1e-30, w_scale=1e-30),
    ),
    ("conv2d_add", "1 / out_qparams.scale", lambda: _conv2d_add(out_scale=1e38)),
    ("matmul", "a_scale * b_scale is subnormal", lambda: _matmul(a_scale=1e-20, b_scale=1e-20)),
    (
        "matmul",
        "a_scale * b_scale / out_scale overflows",
        lambda: _matmul(a_scale=1e20, b_scale=1e10, out_scale=1e-20),
    ),
    ("mul", "a_scale * b_scale underflows", lambda: _binary(qk.mul)(a_scale=1e-30, b_scale=1e-30)),
    (
        "mul_relu",
        "a_scale * b_scale / out_scale",
        lambda: _binary(qk.mul_relu)(a_scale=1e-20, b_scale=1e-10, out_scale=1e20),
    ),
    ("add", "1 / out_qparams.scale", lambda: _binary(qk.add)(out_scale=1e38)),
    ("quantize_per_tensor", "1 / scale", lambda: qk.quantize_per_tensor(F, 1e38, 3)),
    (
        "quantize_per_channel",
        "1 / scales[1]",
        lambda: qk.quantize_per_channel(F, np.array([0.1, 1e38, 0.1]), ZP3, 1),
    ),
    ("requantize", "1 / out_scale", lambda: qk.requantize(Q, GOOD, 3, 2e38, 4)),
    ("build_lut", "1 / out_scale", lambda: qk.build_lut("exp", GOOD, 3, 1e38, 4)),
    ("clamp", "1 / scale", lambda: qk.clamp(Q, 1e38, 3, 0.0, 1.0)),
    ("avg_pool2d", "scale / out_scale", lambda: _avg_pool(scale=1e-30, out_scale=1e10)),
    (
        "avg_pool2d",
        "scale / out_scale / 4 (the largest divisor)",
        lambda: _avg_pool(scale=3e-20, out_scale=1e18),
    ),
]


@pytest.mark.parametrize(
    ("entry", "message", "call"), DERIVED_CASES, ids=[f"{e}-{m}" for e, m, _ in DERIVED_CASES]
)
def test_derived_products_out_of_float32_range_are_refused(
    entry: str, message: str, call: Callable[[], object]
) -> None:
    with pytest.raises(KernelError) as info:
        call()
    assert message in str(info.value)


def test_extreme_but_normal_scales_compute_like_the_integer_reference() -> None:
    # tiny scales whose products stay normal are accepted and not flushed to 0
    x_scale, w_scale, out_scale = 1e-19, 1e-15, 1e-31
    pw = qk.PackedLinearWeight(W2, w_scale, 0, None, target="generic")
    got = qk.linear(X2, pw, x_scale, 3, out_scale, 5)
    acc = (X2.astype(np.int64) - 3) @ W2.astype(np.int64).T
    mult = np.float32(np.float32(x_scale) * np.float32(w_scale)) / np.float32(out_scale)
    want = np.clip(np.rint(acc.astype(np.float32) * mult) + 5, 0, 255).astype(np.uint8)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got)) > 2  # not all saturated: the numbers really went through


@pytest.mark.parametrize(
    "value", [F32_TINY, F32_MAX, float(np.float32(F32_TINY)), 1e-38 * 1.2, 3.4e38]
)
def test_float32_boundaries_are_accepted(value: float) -> None:
    qk.dequantize_per_tensor(Q, value, 3)


@pytest.mark.parametrize(
    "value", [float(np.nextafter(np.float32(F32_TINY), np.float32(0))), F32_TINY / 2, 3.5e38]
)
def test_just_outside_float32_normal_range_is_refused(value: float) -> None:
    with pytest.raises(KernelError, match="scale"):
        qk.dequantize_per_tensor(Q, value, 3)


def test_embedding_rows_need_finite_qparams() -> None:
    _embedding()  # control
    _embedding(scale=0.0)  # a constant row has scale 0 (torch's packing does this)
    for scale, bias in ((math.nan, 0.0), (math.inf, 0.0), (0.5, -math.inf), (0.5, math.nan)):
        with pytest.raises(KernelError, match="row 3"):
            _embedding(scale=scale, bias=bias)


ZP_CASES: list[tuple[str, Callable[[], object]]] = [
    ("x_zero_point", lambda: qk.linear(X2, qk.PackedLinearWeight(W2, GOOD), GOOD, 256, GOOD, 0)),
    ("out_zero_point", lambda: qk.linear(X2, qk.PackedLinearWeight(W2, GOOD), GOOD, 0, GOOD, -1)),
    ("weight", lambda: qk.PackedLinearWeight(W2, GOOD, 128)),
    ("weight", lambda: qk.PackedConvWeight(WC, GOOD, np.array([0, 0, -129, 0]), groups=2)),
    (
        "x_zero_point",
        lambda: qk.conv2d(XC, qk.PackedConvWeight(WC, GOOD, groups=2), GOOD, 300, GOOD, 0),
    ),
    ("a_qparams.zero_point", lambda: qk.matmul(X2, (GOOD, -1), X2.T.copy(), (GOOD, 0), (GOOD, 0))),
    ("b_qparams.zero_point", lambda: qk.matmul(X2, (GOOD, 0), W2.T.copy(), (GOOD, 128), (GOOD, 0))),
    ("zero_point", lambda: qk.quantize_per_tensor(F, GOOD, 128, np.int8)),
    ("zero_point", lambda: qk.dequantize_per_tensor(Q.view(np.int8), GOOD, -129)),
    ("zero_points", lambda: qk.quantize_per_channel(F, CH3, np.array([0, 256, 0]), 1)),
    ("in_zero_point", lambda: qk.requantize(Q, GOOD, 256, GOOD, 0)),
    ("b_qparams.zero_point", lambda: qk.add(Q, (GOOD, 0), Q, (GOOD, 2**40), (GOOD, 0))),
    ("out_qparams.zero_point", lambda: qk.mul(Q, (GOOD, 0), Q, (GOOD, 0), (GOOD, 1.5))),
    ("zero_point", lambda: qk.relu(Q, True)),
    ("zero_point", lambda: qk.clamp(Q, GOOD, -3)),
    ("out_zero_point", lambda: qk.build_lut("tanh", GOOD, 0, GOOD, 256)),
    ("out_zero_point", lambda: _avg_pool_zp(300)),
]


def _avg_pool_zp(zp: int) -> object:
    return qk.avg_pool2d(Q, 2, zero_point=3, out_zero_point=zp)


@pytest.mark.parametrize(("arg", "call"), ZP_CASES, ids=[a for a, _ in ZP_CASES])
def test_zero_points_outside_the_dtype_are_refused(arg: str, call: Callable[[], object]) -> None:
    with pytest.raises(KernelError) as info:
        call()
    assert arg in str(info.value)


# --------------------------------------------------------------------------- array subclasses


def _memmap(tmp: Path, a: np.ndarray, name: str) -> np.memmap:
    mm = np.memmap(tmp / name, dtype=a.dtype, mode="w+", shape=a.shape)
    mm[...] = a
    return mm


class _Tagged(np.ndarray):
    """A plain ndarray subclass (no behaviour of its own)."""


SUBCLASS_CALLS: list[tuple[str, Callable[[Callable[[np.ndarray], np.ndarray]], object]]] = [
    (
        "linear",
        lambda wrap: qk.linear(wrap(X2), qk.PackedLinearWeight(W2, 0.02, 0, B4), 0.1, 3, 0.2, 5),
    ),
    (
        "linear_dynamic",
        lambda wrap: qk.linear_dynamic(
            wrap(F.reshape(-1, 4)), qk.PackedLinearWeight(W2[:, :4].copy(), 0.02)
        ),
    ),
    (
        "conv2d",
        lambda wrap: qk.conv2d(
            wrap(XC), qk.PackedConvWeight(WC, 0.02, 0, B4, groups=2), 0.1, 3, 0.2, 5
        ),
    ),
    ("matmul", lambda wrap: qk.matmul(wrap(X2), (0.1, 3), wrap(X2.T.copy()), (0.1, 4), (0.5, 5))),
    ("add", lambda wrap: qk.add(wrap(Q), (0.1, 3), wrap(Q), (0.2, 4), (0.3, 5))),
    ("quantize_per_tensor", lambda wrap: qk.quantize_per_tensor(wrap(F), 0.02, 128)),
    (
        "dequantize_per_channel",
        lambda wrap: qk.dequantize_per_channel(wrap(Q), wrap(CH3), wrap(ZP3), 1),
    ),
    ("apply_lut", lambda wrap: qk.apply_lut(wrap(Q), qk.build_lut("sigmoid", 0.1, 3, 1 / 256, 0))),
    ("max_pool2d", lambda wrap: qk.max_pool2d(wrap(Q), 2)),
    (
        "embedding_bag",
        lambda wrap: qk.embedding_bag(
            qk.pack_embedding_8bit(F.reshape(6, 4)),
            wrap(np.array([0, 5, 2])),
            wrap(np.array([0, 1])),
        ),
    ),
]


@pytest.mark.parametrize(("entry", "call"), SUBCLASS_CALLS, ids=[e for e, _ in SUBCLASS_CALLS])
def test_memmap_and_subclass_inputs_give_the_ndarray_result(
    entry: str, call: Callable[[Callable[[np.ndarray], np.ndarray]], object], tmp_path: Path
) -> None:
    names = iter(range(100))
    want = call(lambda a: a)
    from_memmap = call(lambda a: _memmap(tmp_path, a, f"{next(names)}.bin"))
    from_subclass = call(lambda a: a.view(_Tagged))
    for got in (from_memmap, from_subclass):
        assert type(got) is np.ndarray
        np.testing.assert_array_equal(got, want)  # type: ignore[arg-type]


def test_memmap_out_is_written(tmp_path: Path) -> None:
    out = np.memmap(tmp_path / "out.bin", dtype=np.uint8, mode="w+", shape=Q.shape)
    qk.add(Q, (0.1, 3), Q, (0.2, 4), (0.3, 5), out=out)
    np.testing.assert_array_equal(np.asarray(out), qk.add(Q, (0.1, 3), Q, (0.2, 4), (0.3, 5)))


@pytest.mark.parametrize(
    ("entry", "call"),
    [
        ("linear", lambda m: qk.linear(m, qk.PackedLinearWeight(W2, 0.02), 0.1, 3, 0.2, 5)),
        ("add", lambda m: qk.add(m, (0.1, 3), m, (0.2, 4), (0.3, 5))),
        ("quantize_per_tensor", lambda m: qk.quantize_per_tensor(m, 0.1, 3)),
        ("add out=", lambda m: qk.add(X2, (0.1, 3), X2, (0.2, 4), (0.3, 5), out=np.asmatrix(X2))),
    ],
    ids=["linear", "add", "quantize_per_tensor", "add-out"],
)
@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_np_matrix_is_refused_clearly(entry: str, call: Callable[[Any], object]) -> None:
    m = np.asmatrix(F.reshape(6, 4)) if entry == "quantize_per_tensor" else np.asmatrix(X2)
    with pytest.raises(KernelError, match=r"np\.matrix is not supported"):
        call(m)
