"""linear / linear_dynamic: every target bit-exact against an integer numpy reference, and
byte-for-byte against torch's x86 engine where torch.ao still exists."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantbridge.kernels import (
    FloatColumns,
    KernelError,
    PackedLinearWeight,
    available_targets,
    cpu_features,
    linear,
    linear_dynamic,
    linear_float,
    quantize_per_tensor,
)

TARGETS = available_targets()
F32 = np.float32
# Weight range [low, high) for the torch differentials. Without AVX512-VNNI, torch's fbgemm adds
# each pair of uint8 x int8 products into a saturating int16 (vpmaddubsw), so its codes are not
# the exact integer result once a pair sum passes 32767 (why torch.ao's x86 qconfigs reduce
# range there). Weights in [-64, 63] keep every pair within 2 * 255 * 64 = 32640 on such hosts;
# the integer-reference tests keep the full int8 range everywhere.
TORCH_W_RANGE = (-128, 128) if "avx512vnni" in cpu_features() else (-64, 64)


def reference_linear(a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp, relu=False):
    """int64 accumulation, then the documented float32 requantization sequence."""
    n = w.shape[0]
    w_zp = np.broadcast_to(np.asarray(w_zp, np.int64), (n,))
    acc = (a.astype(np.int64) - a_zp) @ (w.astype(np.int64) - w_zp[:, None]).T
    per_channel = np.ndim(w_s) == 1
    atws = (F32(a_s) * np.broadcast_to(np.asarray(w_s, np.float64), (n,)).astype(F32)).astype(F32)
    mult = (atws / F32(o_s)).astype(F32)
    if bias is None:
        bq = np.zeros(n, F32)
    elif per_channel:
        bq = (bias.astype(F32) / atws).astype(F32)
    else:
        bq = (bias.astype(F32) * F32(F32(1) / atws[0])).astype(F32)
    x = ((acc.astype(np.int32).astype(F32) + bq).astype(F32) * mult).astype(F32)
    q = np.rint(x).astype(np.int64) + o_zp
    return np.clip(q, o_zp if relu else 0, 255).astype(np.uint8)


def _case(rng, m, k, n, per_channel, wzp_nonzero, with_bias, w_range=(-128, 128)):
    a = rng.integers(0, 256, (m, k), dtype=np.uint8)
    w = rng.integers(*w_range, (n, k), dtype=np.int8)
    w_s = rng.uniform(0.002, 0.02, n) if per_channel else float(rng.uniform(0.002, 0.02))
    if wzp_nonzero:
        w_zp = rng.integers(-20, 20, n) if per_channel else int(rng.integers(-20, 20))
    else:
        w_zp = 0
    bias = rng.normal(0, 2, n).astype(F32) if with_bias else None
    a_s, a_zp = float(rng.uniform(0.01, 0.1)), int(rng.integers(0, 256))
    # output scale sized so results spread over the uint8 range instead of saturating
    spread = float(np.sqrt(k)) * 80 * 60 * a_s * float(np.mean(w_s))
    o_s, o_zp = max(spread / 40, 1e-4), int(rng.integers(60, 200))
    return a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp


@pytest.mark.parametrize("target", TARGETS)
@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 40),
    k=st.integers(1, 200),
    n=st.integers(1, 80),
    per_channel=st.booleans(),
    wzp=st.booleans(),
    with_bias=st.booleans(),
    relu=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_linear_matches_integer_reference(target, m, k, n, per_channel, wzp, with_bias, relu, seed):
    rng = np.random.default_rng(seed)
    a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp = _case(rng, m, k, n, per_channel, wzp, with_bias)
    packed = PackedLinearWeight(w, w_s, w_zp, bias, target=target)
    got = linear(a, packed, a_s, a_zp, o_s, o_zp, relu=relu, num_threads=1)
    want = reference_linear(a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp, relu)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("n", [8, 24, 40, 1000])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_ending_inside_a_panel(target, n, threads):
    # widths that are whole 8-lane vectors but not whole 16/32-column panels: the kernels
    # write rows of exactly n columns (no padded copy to cut down)
    rng = np.random.default_rng(n)
    a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp = _case(rng, 37, 70, n, True, False, True)
    packed = PackedLinearWeight(w, w_s, w_zp, bias, target=target)
    got = linear(a, packed, a_s, a_zp, o_s, o_zp, num_threads=threads)
    want = reference_linear(a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp, False)
    np.testing.assert_array_equal(got, want)
    assert got.flags.c_contiguous


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("n", [16, 48, 144, 150])
@pytest.mark.parametrize("m", [1, 7, 9, 16, 17, 40])
def test_last_panels_within_one_vector(target, n, m):
    # N = 16, 48, 144: the last 32-column panel's rows end within its first vector (VNNI runs
    # the 1-vector kernels there: 16-row blocks, 8-row and 1-row tails); 150 ends inside it
    rng = np.random.default_rng(n * 100 + m)
    a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp = _case(rng, m, 70, n, True, False, True)
    packed = PackedLinearWeight(w, w_s, w_zp, bias, target=target)
    for threads in (1, 2):
        got = linear(a, packed, a_s, a_zp, o_s, o_zp, num_threads=threads)
        want = reference_linear(a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp, False)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("n", [48, 56, 64, 96, 150, 176])
def test_two_panel_blocks_and_their_tails(target, n):
    # VNNI runs neighbouring panels in pairs (6-row blocks of 4 vectors, 4-row blocks for a
    # tile's last rows, a single row on each panel's own kernels); 96 and 150 leave a single
    # panel after the pairs, 48 and 176 a narrow last panel that stays single; 56 ends its
    # pair's rows inside the fourth vector (masked stores)
    rng = np.random.default_rng(n)
    for m in [*range(1, 22), 26, 128]:
        _check_one_and_two_threads(rng, target, m, 52, n)
    for m in (5, 8, 14):  # the float epilogue's pair blocks
        _check_dynamic(rng, target, m, 52, n)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("n", [16, 24, 56, 64, 150])
@pytest.mark.parametrize("shrink", [1e-3, 1e-9])
def test_results_far_outside_the_codes_saturate(target, n, shrink):
    # an output scale 1e3 / 1e9 times too small: requantized values reach past 2**16 and past
    # 2**31 on both sides. VNNI's 2- and 4-vector rows round with vcvtps2dq and clamp by
    # saturating packs (large values are first lowered to 2**16), 1-vector rows clamp first:
    # every kind must give the reference's 0 / 255, and relu's floor at the zero point
    rng = np.random.default_rng(n)
    a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp = _case(rng, 13, 40, n, True, False, True)
    codes = []
    for relu in (False, True):
        for threads in (1, 2):
            got = linear(a, PackedLinearWeight(w, w_s, w_zp, bias, target=target), a_s, a_zp,
                         o_s * shrink, o_zp, relu=relu, num_threads=threads)  # fmt: skip
            want = reference_linear(a, a_s, a_zp, w, w_s, w_zp, bias, o_s * shrink, o_zp, relu)
            np.testing.assert_array_equal(got, want)
            codes.append(got)
    assert {0, 255, o_zp} <= set(np.unique(codes).tolist())  # both ends and relu's floor


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("extra", [0, 1, 18])
def test_panels_streamed_from_l2(target, extra):
    # panels of more than STREAMED_PANEL_STEPS k steps run VNNI's multi-row blocks in a loop
    # of their own (it prefetches the panel ahead): every block kind at and past the threshold
    from quantbridge.kernels._block_kernels import STREAMED_PANEL_STEPS

    k = 4 * (STREAMED_PANEL_STEPS + extra)
    rng = np.random.default_rng(extra)
    for n in (16, 64, 150):  # 1-vector last panels, 2-vector panels, both
        for m in (1, 4, 7, 13, 20, 40):  # 1-, 4-, 8- and 16-row blocks and their tails
            _check_one_and_two_threads(rng, target, m, k, n)
    _check_dynamic(rng, target, 20, k, 70)  # the float epilogue's blocks


def _check_one_and_two_threads(rng, target, m, k, n):
    """``linear`` on a random per-channel case at one and two threads against the reference."""
    a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp = _case(rng, m, k, n, True, False, True)
    packed = PackedLinearWeight(w, w_s, w_zp, bias, target=target)
    want = reference_linear(a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp)
    for threads in (1, 2):
        got = linear(a, packed, a_s, a_zp, o_s, o_zp, num_threads=threads)
        np.testing.assert_array_equal(got, want, err_msg=f"m={m} threads={threads}")


def _check_dynamic(rng, target, m, k, n):
    """``linear_dynamic`` (no bias, one thread) on random x and weights against the
    reference, within the one-ulp double rounding of its float64 emulation."""
    from quantbridge.kernels._linear import choose_dynamic_qparams

    x = (rng.normal(size=(m, k)) * 3).astype(F32)
    w = rng.integers(-128, 128, (n, k), dtype=np.int8)
    w_s = rng.uniform(0.001, 0.02, n)
    got = linear_dynamic(x, PackedLinearWeight(w, w_s, 0, None, target=target), num_threads=1)
    want = reference_dynamic(x, w, w_s, None, *choose_dynamic_qparams(x))
    np.testing.assert_array_max_ulp(got, want, maxulp=1)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_threads_and_leading_dims(target, threads):
    rng = np.random.default_rng(3)
    a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp = _case(rng, 3 * 37, 96, 70, True, True, True)
    packed = PackedLinearWeight(w, w_s, w_zp, bias, target=target)
    got = linear(a.reshape(3, 37, 96), packed, a_s, a_zp, o_s, o_zp, num_threads=threads)
    want = reference_linear(a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp)
    assert got.shape == (3, 37, 70)
    np.testing.assert_array_equal(got.reshape(-1, 70), want)


def test_all_targets_agree_on_a_larger_problem():
    rng = np.random.default_rng(11)
    a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp = _case(rng, 67, 300, 130, False, False, True)
    outs = [
        linear(a, PackedLinearWeight(w, w_s, w_zp, bias, target=t), a_s, a_zp, o_s, o_zp)
        for t in TARGETS
    ]
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    np.testing.assert_array_equal(
        outs[0], reference_linear(a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp)
    )


def test_extreme_k_zero_points_do_not_overflow():
    # worst-case magnitudes near the int32 limit still come out exact
    k = (2**31 - 1) // (255 * 255)
    a = np.full((2, k), 255, np.uint8)
    a[1] = 0
    w = np.full((3, k), -128, np.int8)
    w[1] = 127
    packed = PackedLinearWeight(w, 1e-6, 127, None, target=TARGETS[-1])
    got = linear(a, packed, 1.0, 0, 1.0, 0)
    want = reference_linear(a, 1.0, 0, w, 1e-6, 127, None, 1.0, 0)
    np.testing.assert_array_equal(got, want)


def test_reduction_that_can_overflow_int32_is_refused():
    # the bound uses the real weights: |a - a_zp| <= 255 times max |w - w_zp|
    k = (2**31 - 1) // (255 * 128) + 1
    with pytest.raises(KernelError, match="overflow int32"):
        PackedLinearWeight(np.full((1, k), -128, np.int8), 0.1)
    PackedLinearWeight(np.full((1, k), 3, np.int8), 0.1)  # small weights: provably safe


@pytest.mark.parametrize(
    ("x", "match"),
    [
        (np.zeros((2, 8), np.int8), "dtype uint8"),
        (np.zeros((2, 9), np.uint8), "does not match the weight's K=8"),
        (np.zeros((8, 2), np.uint8).T, "C-contiguous"),
        (np.zeros((0, 8), np.uint8), "zero-size"),
        ([[1] * 8], "numpy array"),
    ],
)
def test_bad_activations_raise_kernel_error(x, match):
    packed = PackedLinearWeight(np.ones((4, 8), np.int8), 0.1)
    with pytest.raises(KernelError, match=match):
        linear(x, packed, 0.1, 0, 0.1, 0)


def test_misaligned_array_is_refused():
    buf = np.zeros(8 * 4 + 1, np.uint8)
    packed = PackedLinearWeight(np.ones((4, 8), np.int8), 0.1)
    x = buf[1:].view(np.uint8).reshape(4, 8)
    assert linear(x, packed, 0.1, 0, 0.1, 0).shape == (4, 4)  # uint8 is always aligned
    fbuf = np.zeros(4 * 8 + 1, np.uint8)[1:].view(np.float32).reshape(1, 8)
    with pytest.raises(KernelError, match="not aligned"):
        linear_dynamic(fbuf, PackedLinearWeight(np.ones((4, 8), np.int8), 0.1))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"x_scale": 0.0}, "x_scale"),
        ({"x_scale": float("nan")}, "x_scale"),
        ({"out_scale": -1.0}, "out_scale"),
        ({"x_zero_point": 256}, "x_zero_point"),
        ({"out_zero_point": 1.5}, "out_zero_point"),
    ],
)
def test_bad_quantization_parameters_raise(kwargs, match):
    packed = PackedLinearWeight(np.ones((4, 8), np.int8), 0.1)
    args = {"x_scale": 0.1, "x_zero_point": 0, "out_scale": 0.1, "out_zero_point": 0} | kwargs
    with pytest.raises(KernelError, match=match):
        linear(np.zeros((2, 8), np.uint8), packed, **args)


def test_bad_weights_raise():
    with pytest.raises(KernelError, match="scale"):
        PackedLinearWeight(np.ones((4, 8), np.int8), np.ones(3))
    with pytest.raises(KernelError, match="zero point"):
        PackedLinearWeight(np.ones((4, 8), np.int8), 0.1, 200)
    with pytest.raises(KernelError, match="bias"):
        PackedLinearWeight(np.ones((4, 8), np.int8), 0.1, 0, np.ones(5, np.float32))
    with pytest.raises(KernelError, match="dtype int8"):
        PackedLinearWeight(np.ones((4, 8), np.int16), 0.1)
    with pytest.raises(KernelError, match="num_threads"):
        linear(
            np.zeros((2, 8), np.uint8),
            PackedLinearWeight(np.ones((4, 8), np.int8), 0.1),
            0.1,
            0,
            0.1,
            0,
            num_threads=0,
        )


def reference_float(a, a_s, a_zp, w, w_s, w_zp, bias):
    """int64 accumulation on codes, then one float32 fma per output."""
    n = w.shape[0]
    w_zp = np.broadcast_to(np.asarray(w_zp, np.int64), (n,))
    acc = (a.astype(np.int64) - a_zp) @ (w.astype(np.int64) - w_zp[:, None]).T
    atws = (F32(a_s) * np.broadcast_to(np.asarray(w_s, np.float64), (n,)).astype(F32)).astype(F32)
    b = np.zeros(n, np.float64) if bias is None else bias.astype(np.float64)
    # float64 holds the exact product of two float32 values; one rounding to float32 after
    return (acc.astype(np.int32).astype(F32).astype(np.float64) * atws + b).astype(F32)


def reference_dynamic(x, w, w_s, bias, scale, zp):
    """fbgemm's dynamic path: fma quantize, then as ``reference_float``."""
    inv = F32(F32(1) / F32(scale))
    q = np.clip(np.rint((x.astype(np.float64) * np.float64(inv) + zp).astype(F32)), 0, 255)
    return reference_float(q, scale, zp, w, w_s, 0, bias)


@pytest.mark.parametrize("target", TARGETS)
@settings(max_examples=15, deadline=None)
@given(
    m=st.integers(1, 20),
    k=st.integers(1, 120),
    n=st.integers(1, 50),
    seed=st.integers(0, 2**32 - 1),
)
def test_linear_dynamic_matches_reference(target, m, k, n, seed):
    from quantbridge.kernels._linear import choose_dynamic_qparams

    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(m, k)) * 3 + rng.normal()).astype(F32)
    w = rng.integers(-128, 128, (n, k), dtype=np.int8)
    w_s = rng.uniform(0.001, 0.02, n)
    bias = rng.normal(size=n).astype(F32)
    got = linear_dynamic(x, PackedLinearWeight(w, w_s, 0, bias, target=target), num_threads=1)
    scale, zp = choose_dynamic_qparams(x)
    want = reference_dynamic(x, w, w_s, bias, scale, zp)
    # the float64 emulation of fma can double-round; allow only that one-ulp case
    np.testing.assert_array_max_ulp(got, want, maxulp=1)
    assert np.mean(got == want) > 0.999


@pytest.mark.parametrize("target", TARGETS)
@settings(max_examples=20, deadline=None)
@given(
    m=st.integers(1, 40),
    k=st.integers(1, 200),
    n=st.integers(1, 80),
    per_channel=st.booleans(),
    wzp=st.booleans(),
    with_bias=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**32 - 1),
)
def test_linear_float_matches_integer_reference(
    target, m, k, n, per_channel, wzp, with_bias, threads, seed
):
    rng = np.random.default_rng(seed)
    a, a_s, a_zp, w, w_s, w_zp, bias, _, _ = _case(rng, m, k, n, per_channel, wzp, with_bias)
    packed = PackedLinearWeight(w, w_s, w_zp, bias, target=target)
    got = linear_float(a, packed, a_s, a_zp, num_threads=threads)
    assert got.dtype == np.float32
    assert got.shape == (m, n)
    want = reference_float(a, a_s, a_zp, w, w_s, w_zp, bias)
    # the float64 emulation of fma can double-round; allow only that one-ulp case
    np.testing.assert_array_max_ulp(got, want, maxulp=1)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_linear_float_applies_the_activation_and_keeps_leading_dims(target, activation):
    rng = np.random.default_rng(5)
    a = rng.integers(0, 256, (2, 3, 70), dtype=np.uint8)
    w = rng.integers(-128, 128, (33, 70), dtype=np.int8)
    w_s = rng.uniform(0.002, 0.02, 33)
    bias = rng.normal(size=33).astype(F32)
    packed = PackedLinearWeight(w, w_s, 0, bias, target=target)
    plain = linear_float(a, packed, 0.03, 17)
    got = linear_float(a, packed, 0.03, 17, activation=activation)
    assert got.shape == (2, 3, 33)
    want = reference_float(a.reshape(-1, 70), 0.03, 17, w, w_s, 0, bias).reshape(2, 3, 33)
    np.testing.assert_array_max_ulp(plain, want, maxulp=1)
    if activation == "relu":
        np.testing.assert_array_equal(got, np.maximum(plain, 0))
    else:
        x = plain.astype(np.float64)
        exact = 0.5 * x * (1 + np.vectorize(__import__("math").erf)(x / np.sqrt(2)))
        np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)


def test_linear_float_refuses_bad_arguments():
    packed = PackedLinearWeight(np.ones((4, 8), np.int8), 0.1, 0, None)
    x = np.zeros((2, 8), np.uint8)
    with pytest.raises(KernelError, match="last dimension 7"):
        linear_float(np.zeros((2, 7), np.uint8), packed, 0.1, 0)
    with pytest.raises(KernelError, match="x_zero_point"):
        linear_float(x, packed, 0.1, 300)
    with pytest.raises(KernelError, match="x_scale"):
        linear_float(x, packed, float("nan"), 0)
    with pytest.raises(KernelError, match="activation"):
        linear_float(x, packed, 0.1, 0, activation="tanh")
    with pytest.raises(KernelError, match="uint8"):
        linear_float(x.astype(np.float32), packed, 0.1, 0)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_float_adds_float_columns_and_quantizes_in_one_pass(target, activation, threads):
    # an outlier split: int8 codes for most channels, a few channels' float values and float
    # weight columns; at two threads big enough (m * n past a million) for the parallel pass
    rng = np.random.default_rng(11)
    m, k, n = (700, 40, 1536) if threads == 2 else (37, 40, 21)
    a = rng.integers(0, 256, (m, k), dtype=np.uint8)
    floats = rng.normal(size=(m, k)).astype(F32) * 30
    w = rng.integers(-128, 128, (n, k), dtype=np.int8)
    w_s = rng.uniform(0.002, 0.02, n)
    bias = rng.normal(size=n).astype(F32)
    channels = np.array([3, 17, 39])
    side = rng.normal(size=(n, 3)).astype(F32)
    packed = PackedLinearWeight(w, w_s, 0, bias, target=target)
    codes = np.empty((m, n), np.uint8)
    got = linear_float(
        a, packed, 0.03, 17, activation=activation, columns=FloatColumns(channels, side),
        float_input=floats, codes=codes, codes_qparams=(0.05, 60), num_threads=threads,
    )  # fmt: skip
    # the integer reference, then each column added by one fma (rounded once) in order
    y = reference_float(a, 0.03, 17, w, w_s, 0, bias)
    for s, c in enumerate(channels):
        y = (floats[:, c : c + 1].astype(np.float64) * side[:, s] + y).astype(F32)
    if activation == "relu":
        y = np.maximum(y, 0)
    elif activation == "gelu":
        x = y.astype(np.float64)
        y = 0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2)))
    elif activation == "gelu_tanh":
        x = y.astype(np.float64)
        y = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    if activation.startswith("gelu"):
        np.testing.assert_allclose(got, y, rtol=1e-5, atol=1e-5)
    else:  # float64 sums before the float32 rounding may round twice: one ulp
        np.testing.assert_array_max_ulp(got, y, maxulp=1)
    # the codes are exactly quantize_per_tensor's of the float result
    np.testing.assert_array_equal(codes, quantize_per_tensor(got, 0.05, 60))


@pytest.mark.skipif("avx2" not in TARGETS, reason="the pair guard serves the avx2 byte kernels")
def test_linear_float_columns_and_codes_on_rows_the_pair_guard_redoes():
    # 8-bit weights on AVX2's byte kernels: a few rows whose codes could saturate a pair are
    # recomputed on the int16 kernels, and their float columns, activation and codes with them
    rng = np.random.default_rng(5)
    m, k, n = 64, 32, 40
    w = rng.integers(-60, 61, (n, k), dtype=np.int8)
    w[:, 0:2] = 127  # pair (0, 1) can saturate vpmaddubsw once both codes are high
    a = rng.integers(0, 100, (m, k), dtype=np.uint8)
    a[[5, 33, 62], 0:2] = 255  # three unsafe rows of 64: the guard redoes only those
    floats = rng.normal(size=(m, k)).astype(F32) * 30
    w_s = rng.uniform(0.002, 0.02, n)
    bias = rng.normal(size=n).astype(F32)
    channels = np.array([4, 9])
    side = rng.normal(size=(n, 2)).astype(F32)
    packed = PackedLinearWeight(w, w_s, 0, bias, target="avx2")
    codes = np.empty((m, n), np.uint8)
    got = linear_float(
        a, packed, 0.03, 17, activation="relu", columns=FloatColumns(channels, side),
        float_input=floats, codes=codes, codes_qparams=(0.05, 60), num_threads=1,
    )  # fmt: skip
    y = reference_float(a, 0.03, 17, w, w_s, 0, bias)
    for s, c in enumerate(channels):
        y = (floats[:, c : c + 1].astype(np.float64) * side[:, s] + y).astype(F32)
    np.testing.assert_array_max_ulp(got, np.maximum(y, 0), maxulp=1)
    np.testing.assert_array_equal(codes, quantize_per_tensor(got, 0.05, 60))


def test_linear_float_refuses_mismatched_columns_and_codes():
    packed = PackedLinearWeight(np.ones((4, 8), np.int8), 0.1, 0, None)
    x, floats = np.zeros((2, 8), np.uint8), np.zeros((2, 8), F32)
    cols = FloatColumns([1, 5], np.ones((4, 2), F32))
    with pytest.raises(KernelError, match="columns, float_input: give both"):
        linear_float(x, packed, 0.1, 0, columns=cols)
    with pytest.raises(KernelError, match="float_input: expected x's shape"):
        linear_float(x, packed, 0.1, 0, columns=cols, float_input=floats[:1])
    with pytest.raises(KernelError, match="does not fit the weight"):
        linear_float(x, packed, 0.1, 0, columns=FloatColumns([8], np.ones((4, 1), F32)),
                     float_input=floats)  # fmt: skip
    with pytest.raises(KernelError, match="codes, codes_qparams: give both"):
        linear_float(x, packed, 0.1, 0, codes=np.empty((2, 4), np.uint8))
    with pytest.raises(KernelError, match=r"codes: expected a uint8 array of shape \(2, 4\)"):
        linear_float(x, packed, 0.1, 0, codes=np.empty((2, 8), np.uint8), codes_qparams=(0.1, 0))
    with pytest.raises(KernelError, match="codes_qparams zero point"):
        linear_float(x, packed, 0.1, 0, codes=np.empty((2, 4), np.uint8), codes_qparams=(0.1, 300))
    with pytest.raises(KernelError, match="one column per channel"):
        FloatColumns([1, 2], np.ones((4, 3), F32))
    with pytest.raises(KernelError, match="must be finite"):
        FloatColumns([1], np.full((4, 1), np.nan, F32))
    with pytest.raises(KernelError, match="non-empty 1-D integer"):
        FloatColumns([], np.ones((4, 0), F32))


def test_linear_dynamic_rejects_non_finite_input():
    packed = PackedLinearWeight(np.ones((2, 4), np.int8), 0.1)
    with pytest.raises(KernelError, match="NaN or infinity"):
        linear_dynamic(np.array([[1.0, np.nan, 0, 0]], F32), packed)


# ---- differential against torch's x86 engine (skips once torch.ao is gone) ----


def _torch():
    pytest.importorskip("torch.ao.quantization")
    import torch

    if "x86" not in torch.backends.quantized.supported_engines:
        pytest.skip("torch was built without the x86 quantized engine")
    torch.backends.quantized.engine = "x86"
    return torch


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("relu", [False, True])
def test_linear_byte_identical_to_torch(target, per_channel, relu):
    torch = _torch()
    rng = np.random.default_rng(100 + per_channel + 2 * relu)
    for m, k, n in [(1, 64, 48), (17, 130, 33), (64, 256, 96)]:
        a, a_s, a_zp, w, w_s, _, bias, o_s, o_zp = _case(
            rng, m, k, n, per_channel, False, True, TORCH_W_RANGE
        )
        if per_channel:
            wq = torch._make_per_channel_quantized_tensor(
                torch.from_numpy(w), torch.from_numpy(w_s), torch.zeros(n, dtype=torch.int64), 0
            )
        else:
            wq = torch._make_per_tensor_quantized_tensor(torch.from_numpy(w), w_s, 0)
        aq = torch._make_per_tensor_quantized_tensor(torch.from_numpy(a), a_s, a_zp)
        tp = torch.ops.quantized.linear_prepack(wq, torch.from_numpy(bias))
        op = torch.ops.quantized.linear_relu if relu else torch.ops.quantized.linear
        want = op(aq, tp, o_s, o_zp).int_repr().numpy()
        packed = PackedLinearWeight(w, w_s, 0, bias, target=target)
        got = linear(a, packed, a_s, a_zp, o_s, o_zp, relu=relu)
        np.testing.assert_array_equal(got, want)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("target", TARGETS)
def test_linear_dynamic_byte_identical_to_torch(target):
    torch = _torch()
    rng = np.random.default_rng(7)
    for per_channel in (False, True):
        m, k, n = 23, 150, 41
        x = (rng.normal(size=(m, k)) * 4 + 0.5).astype(F32)
        w = rng.integers(*TORCH_W_RANGE, (n, k), dtype=np.int8)
        bias = rng.normal(size=n).astype(F32)
        if per_channel:
            w_s = rng.uniform(0.001, 0.02, n)
            wq = torch._make_per_channel_quantized_tensor(
                torch.from_numpy(w), torch.from_numpy(w_s), torch.zeros(n, dtype=torch.int64), 0
            )
        else:
            w_s = 0.01
            wq = torch._make_per_tensor_quantized_tensor(torch.from_numpy(w), w_s, 0)
        tp = torch.ops.quantized.linear_prepack(wq, torch.from_numpy(bias))
        want = torch.ops.quantized.linear_dynamic(torch.from_numpy(x), tp, False).numpy()
        got = linear_dynamic(x, PackedLinearWeight(w, w_s, 0, bias, target=target))
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("target", TARGETS)
def test_k_mismatch_equal_to_padded_k_is_refused(target):
    # K=5 is padded to 8 internally; an 8-wide input must still be refused
    packed = PackedLinearWeight(np.ones((4, 5), np.int8), 0.1, target=target)
    with pytest.raises(KernelError, match="K=5"):
        linear(np.zeros((2, 8), np.uint8), packed, 0.1, 0, 0.1, 0, num_threads=1)


@pytest.mark.parametrize("target", TARGETS)
def test_read_only_and_writeable_inputs_alternate(target):
    # the one-thread fast path caches a compiled entry point per input writeability
    rng = np.random.default_rng(21)
    a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp = _case(rng, 9, 64, 40, False, True, True)
    packed = PackedLinearWeight(w, w_s, w_zp, bias, target=target)
    want = reference_linear(a, a_s, a_zp, w, w_s, w_zp, bias, o_s, o_zp)
    frozen = a.copy()
    frozen.flags.writeable = False
    for x in (a, frozen, a, frozen):
        np.testing.assert_array_equal(linear(x, packed, a_s, a_zp, o_s, o_zp, num_threads=1), want)
        np.testing.assert_array_equal(
            linear(x[:1], packed, a_s, a_zp, o_s, o_zp, num_threads=1), want[:1]
        )


@pytest.mark.parametrize("bad", [0, -1, 10_000, True, 2.0, "2"])
def test_bad_thread_counts_are_refused_even_for_tiny_products(bad):
    packed = PackedLinearWeight(np.ones((4, 8), np.int8), 0.1)
    with pytest.raises(KernelError, match="num_threads"):
        linear(np.ones((1, 8), np.uint8), packed, 0.1, 0, 0.1, 0, num_threads=bad)


@pytest.mark.parametrize("n_out", [32, 50])
def test_leading_dimensions_take_the_one_thread_path_with_the_same_bytes(n_out):
    # [B, S, K] activations (a transformer's) are rows of the 2-D product, on one thread too
    rng = np.random.default_rng(n_out)
    x = rng.integers(0, 256, (2, 7, 40), dtype=np.uint8)
    w = rng.integers(-128, 128, (n_out, 40), dtype=np.int8)
    packed = PackedLinearWeight(w, 0.02, 0, rng.normal(0, 1, n_out).astype(np.float32))
    table = rng.integers(0, 256, 256, dtype=np.uint8)
    for lut in (None, table):
        flat = linear(x.reshape(14, 40), packed, 0.05, 3, 0.3, 128, lut=lut, num_threads=1)
        got = linear(x, packed, 0.05, 3, 0.3, 128, lut=lut, num_threads=1)
        assert got.shape == (2, 7, n_out)
        np.testing.assert_array_equal(got.reshape(14, n_out), flat)
        two = linear(x, packed, 0.05, 3, 0.3, 128, lut=lut, num_threads=2)
        np.testing.assert_array_equal(two, got)


def test_serial_block_rows():
    from quantbridge.kernels._linear import (
        SERIAL_BLOCK_BYTES,
        SERIAL_WHOLE_BYTES,
        serial_block_rows,
    )

    # activations that fit stay one block; larger ones split into whole 8-row blocks
    assert serial_block_rows(128, 384) == 128
    assert serial_block_rows(SERIAL_WHOLE_BYTES // 1536, 1536) == SERIAL_WHOLE_BYTES // 1536
    rows = serial_block_rows(2048, 1536)
    assert rows % 8 == 0
    assert rows >= 8
    assert rows * 1536 <= SERIAL_BLOCK_BYTES
    assert serial_block_rows(4, 1 << 22) == 8  # never below one 8-row block


@pytest.mark.parametrize("target", TARGETS)
def test_one_thread_blocks_of_rows_give_the_reference(target, monkeypatch):
    # the one-thread GEMM walks the panels over blocks of rows (tiny budgets here: 3 blocks of
    # 40 rows and a 7-row tail), with the same bytes as the reference
    from quantbridge.kernels import _linear as linear_module

    monkeypatch.setattr(linear_module, "SERIAL_WHOLE_BYTES", 1024)
    monkeypatch.setattr(linear_module, "SERIAL_BLOCK_BYTES", 40 * 200)
    rng = np.random.default_rng(7)
    m, k, n = 127, 200, 70
    a = rng.integers(0, 256, (m, k), dtype=np.uint8)
    w = rng.integers(-128, 128, (n, k), dtype=np.int8)
    w_s = rng.uniform(0.002, 0.02, n)
    bias = rng.normal(0, 2, n).astype(F32)
    packed = PackedLinearWeight(w, w_s, 0, bias, target=target)
    assert linear_module.serial_block_rows(m, packed.lda) == 40
    got = linear(a, packed, 0.05, 7, 0.9, 120, num_threads=1)
    want = reference_linear(a, 0.05, 7, w, w_s, 0, bias, 0.9, 120)
    np.testing.assert_array_equal(got, want)
