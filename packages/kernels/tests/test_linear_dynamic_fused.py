"""linear_dynamic's in-kernel activation quantization: per tensor bit-identical to the former
numpy path (min/max, quantize, then the GEMM); per row against a float64/int64 reference of the
documented rule; the fused relu/GELU epilogue against the unfused output."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantbridge.kernels import KernelError, PackedLinearWeight, available_targets, linear_dynamic
from quantbridge.kernels._gemm_run import run_gemm
from quantbridge.kernels._linear import (
    _activation_rows,
    _rows_and_sums,
    choose_dynamic_qparams,
    quantize_activation,
)
from quantbridge.kernels._pair_guard import split_steps

TARGETS = available_targets()
F32 = np.float32


def former_linear_dynamic(x, packed, threads=1):
    """The previous linear_dynamic: numpy range, numpy-side quantize, then the GEMM."""
    a_s, a_zp = choose_dynamic_qparams(x)
    xq = quantize_activation(x, a_s, a_zp)
    a, m, lead = _activation_rows(xq, packed, "x")
    rowoffs, rowsum = _rows_and_sums(a, m, packed)
    biasq, mult = packed.epilogue(a_s, None)
    kernel, bp, koffs = packed.kernel, packed.packed, packed.koffs
    if packed.guarded:  # 8-bit weights on avx2: the exact int16 kernels, as linear_dynamic
        kernel, bp, koffs = "avx2", packed.exact_packed(), split_steps(packed.koffs)
    out = run_gemm(kernel, a, rowoffs, koffs, bp, packed.n,
                   packed.colcorr(a_zp), packed.zero_points, rowsum, biasq, mult, 0, 0, True,
                   threads)  # fmt: skip
    return out.reshape((*lead, packed.n))


def _weights(rng, n, k, per_channel, wzp_nonzero, with_bias=True):
    w = rng.integers(-128, 128, (n, k), dtype=np.int8)
    w_s = rng.uniform(0.001, 0.02, n) if per_channel else float(rng.uniform(0.001, 0.02))
    if wzp_nonzero:
        w_zp = rng.integers(-9, 9, n) if per_channel else int(rng.integers(1, 9))
    else:
        w_zp = 0
    bias = rng.normal(size=n).astype(F32) if with_bias else None
    return w, w_s, w_zp, bias


@pytest.mark.parametrize("target", TARGETS)
@settings(max_examples=20, deadline=None)
@given(
    lead=st.lists(st.integers(1, 9), min_size=1, max_size=2),
    k=st.integers(1, 150),
    n=st.integers(1, 70),
    per_channel=st.booleans(),
    wzp_nonzero=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**32 - 1),
)
def test_per_tensor_bit_identical_to_former_path(
    target, lead, k, n, per_channel, wzp_nonzero, threads, seed
):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(*lead, k)) * rng.uniform(0.1, 5) + rng.normal()).astype(F32)
    w, w_s, w_zp, bias = _weights(rng, n, k, per_channel, wzp_nonzero)
    packed = PackedLinearWeight(w, w_s, w_zp, bias, target=target)
    got = linear_dynamic(x, packed, num_threads=threads)
    np.testing.assert_array_equal(got, former_linear_dynamic(x, packed))


@pytest.mark.parametrize("target", TARGETS)
def test_per_tensor_bit_identical_on_encoder_shapes(target):
    rng = np.random.default_rng(3)
    for k, n in ((384, 384), (384, 1536), (1536, 384)):
        x = rng.normal(size=(2, 128, k)).astype(F32)
        w, w_s, _, bias = _weights(rng, n, k, True, False)
        packed = PackedLinearWeight(w, w_s, 0, bias, target=target)
        np.testing.assert_array_equal(linear_dynamic(x, packed), former_linear_dynamic(x, packed))


def per_row_reference(x, w, w_s, bias):
    """The per-row rule in float64/int64: (codes, scales, zero points, float64 output)."""
    x2 = x.reshape(-1, x.shape[-1])
    lo = np.minimum(x2.min(axis=1), 0).astype(np.float64)
    hi = np.maximum(x2.max(axis=1), 0).astype(np.float64)
    scale = ((hi - lo) / 255).astype(F32)
    scale[~(scale >= F32(1.1754944e-38))] = F32(0.1)
    zp = np.clip(np.rint(-lo / scale.astype(np.float64)), 0, 255).astype(np.int64)
    inv = (F32(1) / scale).astype(F32)
    # fma(x, inv, zp) rounded once: exact in float64 (a float32 product is exact there, and the
    # sum's float64 rounding cannot move it across a float32 rounding boundary at these sizes)
    t = (x2.astype(np.float64) * inv.astype(np.float64)[:, None] + zp[:, None]).astype(F32)
    q = np.clip(np.rint(t), 0, 255).astype(np.int64)
    acc = (q - zp[:, None]) @ w.astype(np.int64).T
    ws = np.broadcast_to(np.asarray(w_s, np.float64), (w.shape[0],)).astype(F32)
    b = np.zeros(w.shape[0]) if bias is None else bias.astype(np.float64)
    y = acc * ws.astype(np.float64) * scale.astype(np.float64)[:, None] + b
    return q, scale, zp, y.reshape(*x.shape[:-1], w.shape[0]), acc


@pytest.mark.parametrize("target", TARGETS)
@settings(max_examples=20, deadline=None)
@given(
    m=st.integers(1, 30),
    k=st.integers(1, 150),
    n=st.integers(1, 70),
    per_channel=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**32 - 1),
)
def test_per_row_matches_float64_reference(target, m, k, n, per_channel, threads, seed):
    from quantbridge.kernels._dynamic_act import quantize_rows

    rng = np.random.default_rng(seed)
    # rows of very different ranges (what per-token scales are for), one all-zero row
    x = (rng.normal(size=(m, k)) * rng.uniform(0.01, 20, (m, 1)) + rng.normal()).astype(F32)
    x[rng.integers(0, m)] = 0
    w, w_s, _, bias = _weights(rng, n, k, per_channel, False)
    q_ref, s_ref, zp_ref, y_ref, acc = per_row_reference(x, w, w_s, bias)
    codes = np.empty((m, k), np.uint8)
    scales, zps = np.empty(m, F32), np.empty(m, np.int32)
    assert not quantize_rows(x, codes, scales, zps)
    np.testing.assert_array_equal(codes, q_ref)
    np.testing.assert_array_equal(scales, s_ref)
    np.testing.assert_array_equal(zps, zp_ref)
    packed = PackedLinearWeight(w, w_s, 0, bias, target=target)
    got = linear_dynamic(x, packed, per_row=True, num_threads=threads)
    # two float32 roundings (acc * w_scale, then fma with the row scale and bias)
    ws = np.broadcast_to(np.asarray(w_s, np.float64), (n,))
    size = np.abs(acc * ws * s_ref.astype(np.float64)[:, None]) + np.abs(bias.astype(np.float64))
    assert np.all(np.abs(got - y_ref) <= 2.5e-7 * size + 1e-30)


def test_per_row_beats_per_tensor_on_rows_of_different_ranges():
    rng = np.random.default_rng(5)
    x = (rng.normal(size=(64, 256)) * np.geomspace(0.01, 30, 64)[:, None]).astype(F32)
    w, w_s, _, bias = _weights(rng, 96, 256, True, False)
    packed = PackedLinearWeight(w, w_s, 0, bias)
    exact = x.astype(np.float64) @ (w.astype(np.float64) * w_s[:, None]).T + bias
    err_row = np.abs(linear_dynamic(x, packed, per_row=True) - exact)[:32].mean()
    err_tensor = np.abs(linear_dynamic(x, packed) - exact)[:32].mean()
    assert err_row < err_tensor / 10


def test_per_row_refuses_asymmetric_weights_and_bad_options():
    packed = PackedLinearWeight(np.ones((3, 8), np.int8), 0.1, 2)
    x = np.ones((2, 8), F32)
    with pytest.raises(KernelError, match="symmetric weights"):
        linear_dynamic(x, packed, per_row=True)
    with pytest.raises(KernelError, match="activation"):
        linear_dynamic(x, packed, activation="swish")
    with pytest.raises(KernelError, match="per_row"):
        linear_dynamic(x, packed, per_row=1)  # type: ignore[arg-type]
    with pytest.raises(KernelError, match="NaN or infinity"):
        linear_dynamic(np.array([[1, 2, 3, np.inf, 0, 0, 0, 0]], F32), packed)
    sym = PackedLinearWeight(np.ones((3, 8), np.int8), 0.1)
    with pytest.raises(KernelError, match="NaN or infinity"):
        linear_dynamic(np.array([[1, 2, 3, np.nan, 0, 0, 0, 0]], F32), sym, per_row=True)


def gelu64(y, approximate):
    y = y.astype(np.float64)
    if approximate == "tanh":
        return 0.5 * y * (1 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y**3)))
    return 0.5 * y * (1 + np.vectorize(math.erf)(y / math.sqrt(2)))


# Fused epilogue tolerance against float64 GELU of the unfused float32 output:
# |got - gelu(y)| <= GELU_TOL * max(1, |y|) (erf: Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7,
# scaled by |y| / 2, plus float32 rounding; measured maximum here 1.3e-7)
GELU_TOL = 4e-7


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_activation_equals_unfused(target, per_row, activation, threads):
    rng = np.random.default_rng(11)
    x = (rng.normal(size=(3, 37, 200)) * 2).astype(F32)
    w, w_s, _, bias = _weights(rng, 150, 200, True, False)
    packed = PackedLinearWeight(w, w_s, 0, bias, target=target)
    y = linear_dynamic(x, packed, per_row=per_row, num_threads=threads)
    got = linear_dynamic(x, packed, per_row=per_row, activation=activation, num_threads=threads)
    if activation == "relu":
        np.testing.assert_array_equal(got, np.maximum(y, 0))
        return
    want = gelu64(y, "tanh" if activation == "gelu_tanh" else "none")
    assert np.all(np.abs(got - want) <= GELU_TOL * np.maximum(1, np.abs(y)))


@pytest.mark.parametrize("size", [1, 15, 16, 17, 40, 1000])
def test_tensor_range_vectors_and_tail(size):
    # the range pass reads 16 floats a vector, then a scalar tail: min/max as numpy's, and a
    # NaN or infinity anywhere (in a vector or in the tail) is found
    from quantbridge.kernels._dynamic_act import tensor_range

    rng = np.random.default_rng(size)
    x = (rng.normal(size=size) * 3).astype(F32)
    lo, hi, bad = tensor_range(x)
    assert (lo, hi, bad) == (x.min(), x.max(), False)
    for at in sorted({0, size // 2, size - 1}):
        for value in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[at] = value
            assert tensor_range(y)[2], (at, value)
    packed = PackedLinearWeight(rng.integers(-128, 128, (3, size), dtype=np.int8), 0.01, 0)
    y = x.copy()
    y[size - 1] = np.inf
    with pytest.raises(KernelError, match="NaN or infinity"):
        linear_dynamic(y[None], packed)
