"""float32 layer_norm (+residual), softmax (+scale, mask) and gelu against float64 references
and, where torch is installed, against torch's CPU ops, within documented tolerances."""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest

from quantbridge.kernels import KernelError, PreparedLayerNorm, gelu, layer_norm, softmax
from quantbridge.kernels._float_math import exp32

F32 = np.float32
# documented tolerances (docs/guide/numerics.md, "Float kernels")
LN_ATOL = 2e-5  # |y| of a normalized row is O(1); float32 two-pass statistics
SOFTMAX_ATOL = 2e-7  # probabilities: exp32 within 2 ulp, float32 sum and reciprocal
SOFTMAX_RTOL = 2e-6
GELU_TOL = 4e-7  # times max(1, |x|)


@numba.njit
def _exp_all(v):  # type: ignore[no-untyped-def]
    out = np.empty_like(v)
    for i in range(v.shape[0]):
        out[i] = exp32(v[i])
    return out


def test_exp32_within_two_ulp():
    v = np.concatenate([np.linspace(-87, 88, 400_001), [-0.0, 0.0, 1e-8, -1e-8]]).astype(F32)
    got = _exp_all(v).astype(np.float64)
    want = np.exp(v.astype(np.float64))
    ulp = np.spacing(want.astype(F32)).astype(np.float64)
    assert np.max(np.abs(got - want) / ulp) <= 2.0
    assert np.all(_exp_all(np.array([-87.5, -100, -np.inf], F32)) == 0)


def _ln64(h, w, b, eps):
    h = h.astype(np.float64)
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    return (h - mean) / np.sqrt(var + eps) * w + b


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(7, 384), (2, 128, 384), (3, 5, 33), (1,)])
def test_layer_norm_with_residual(shape, threads):
    rng = np.random.default_rng(len(shape))
    x = (rng.normal(size=shape) * 3 + 1).astype(F32)
    r = rng.normal(size=shape).astype(F32)
    n = shape[-1]
    w, b = rng.normal(size=n).astype(F32), rng.normal(size=n).astype(F32)
    got = layer_norm(x, w, b, 1e-12, residual=r, num_threads=threads)
    assert np.max(np.abs(got - _ln64(x + r, w, b, 1e-12))) <= LN_ATOL * max(1, np.abs(w).max())
    plain = layer_norm(x, None, None, 1e-5)
    assert np.max(np.abs(plain - _ln64(x, 1, 0, 1e-5))) <= LN_ATOL
    # in place into the residual or x: each row is read before it is written, same bytes
    want = layer_norm(x, w, b, residual=r)
    got_inplace = layer_norm(x, w, b, residual=r.copy(), out=x.copy())
    np.testing.assert_array_equal(got_inplace, want)
    got_inplace = layer_norm(x, w, b, residual=r, out=r)
    assert got_inplace is r
    np.testing.assert_array_equal(got_inplace, want)


def test_layer_norm_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x, r = (rng.normal(size=(16, 128, 384)).astype(F32) for _ in range(2))
    w, b = rng.normal(size=384).astype(F32), rng.normal(size=384).astype(F32)
    want = torch.nn.functional.layer_norm(
        torch.from_numpy(x + r), (384,), torch.from_numpy(w), torch.from_numpy(b), 1e-12
    ).numpy()
    assert np.max(np.abs(layer_norm(x, w, b, 1e-12, residual=r) - want)) <= LN_ATOL * 4


def _softmax64(x, scale, mask):
    v = x.astype(np.float64) * np.float64(F32(scale))
    if mask is not None:
        v = v + mask
    v = v - v.max(-1, keepdims=True)
    e = np.exp(v)
    return e / e.sum(-1, keepdims=True)


MASKS = {
    "none": None,
    "bert": (2, 1, 1, 50),  # padding mask over heads and queries
    "per_query": (2, 1, 9, 50),
    "full": (2, 3, 9, 50),
    "2d": (9, 50),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mask_kind", list(MASKS))
def test_softmax_scale_and_broadcast_mask(mask_kind, threads):
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(2, 3, 9, 50)) * 5).astype(F32)
    shape = MASKS[mask_kind]
    mask = None
    if shape is not None:
        mask = np.where(rng.random(shape) < 0.3, np.finfo(F32).min, 0).astype(F32)
        mask[..., 0] = 0  # every row keeps one position
    got = softmax(x, scale=0.125, mask=mask, num_threads=threads)
    want = _softmax64(x, 0.125, mask)
    np.testing.assert_allclose(got, want, rtol=SOFTMAX_RTOL, atol=SOFTMAX_ATOL)
    if mask is not None:
        assert np.all(got[np.broadcast_to(mask, x.shape) < -1e30] == 0)


def test_softmax_minus_inf_mask_and_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    x = (rng.normal(size=(16, 12, 128, 128)) * 3).astype(F32)
    mask = np.zeros((16, 1, 1, 128), F32)
    mask[:, :, :, 100:] = -np.inf
    want = torch.softmax(torch.from_numpy(x) * 0.125 + torch.from_numpy(mask), -1).numpy()
    got = softmax(x, scale=0.125, mask=mask)
    np.testing.assert_allclose(got, want, rtol=SOFTMAX_RTOL, atol=SOFTMAX_ATOL)
    assert np.all(got[..., 100:] == 0)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_against_float64_and_torch(approximate):
    x = np.concatenate([np.linspace(-30, 30, 300_001), [0.0, -0.0, 1e-30, -1e-30]]).astype(F32)
    got = gelu(x, approximate)
    x64 = x.astype(np.float64)
    if approximate == "tanh":
        want = 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64**3)))
    else:
        want = 0.5 * x64 * (1 + np.vectorize(math.erf)(x64 / math.sqrt(2)))
    assert np.all(np.abs(got - want) <= GELU_TOL * np.maximum(1, np.abs(x64)))
    torch = pytest.importorskip("torch")
    ref = torch.nn.functional.gelu(torch.from_numpy(x), approximate=approximate).numpy()
    # torch's own erf differs by CPU (its AVX-512 build is off by 3.1e-7 |x| at x = 2.93),
    # so ours and torch's may each sit within GELU_TOL of the exact value on opposite sides
    assert np.all(np.abs(got - ref) <= 2 * GELU_TOL * np.maximum(1, np.abs(x64)))


def test_bad_input():
    x = np.zeros((2, 4), F32)
    with pytest.raises(KernelError, match="residual"):
        layer_norm(x, residual=np.zeros((2, 5), F32))
    with pytest.raises(KernelError, match="weight"):
        layer_norm(x, np.ones(3, F32))
    with pytest.raises(KernelError, match="dtype"):
        layer_norm(x.astype(np.float64))
    with pytest.raises(KernelError, match="eps"):
        layer_norm(x, eps=float("nan"))
    with pytest.raises(KernelError, match="mask"):
        softmax(x, mask=np.zeros((3, 4), F32))
    with pytest.raises(KernelError, match="mask"):
        softmax(x, mask=np.zeros((2, 5), F32))
    with pytest.raises(KernelError, match="at most 4"):
        softmax(np.zeros((1, 1, 1, 1, 2), F32))
    with pytest.raises(KernelError, match="approximate"):
        gelu(x, "fast")
    with pytest.raises(KernelError, match="out"):
        gelu(x, out=np.zeros((2, 5), F32))


def test_parallel_rows_agree_with_one_thread():
    # above PARALLEL_MIN_FLOAT_WORK elements the prange versions run (2 threads)
    rng = np.random.default_rng(9)
    x = rng.normal(size=(2048, 640)).astype(F32)
    r = rng.normal(size=(2048, 640)).astype(F32)
    w, b = rng.normal(size=640).astype(F32), rng.normal(size=640).astype(F32)
    one = layer_norm(x, w, b, residual=r, num_threads=1)
    two = layer_norm(x, w, b, residual=r, num_threads=2)
    np.testing.assert_allclose(two, one, rtol=0, atol=LN_ATOL)
    s = x.reshape(4, 4, 128, 640)
    m = np.where(rng.random((4, 1, 1, 640)) < 0.2, -np.inf, 0).astype(F32)
    np.testing.assert_allclose(
        softmax(s, scale=0.5, mask=m, num_threads=2),
        softmax(s, scale=0.5, mask=m, num_threads=1),
        rtol=SOFTMAX_RTOL,
        atol=SOFTMAX_ATOL,
    )
    np.testing.assert_array_equal(gelu(x, num_threads=2), gelu(x, num_threads=1))


@pytest.mark.parametrize("n", [96, 37])  # whole 16-float vectors; a masked last one
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_layer_norm_on_codes_is_the_dequantize_and_quantize_around_it(residual, threads, n):
    from quantbridge.kernels import dequantize_per_tensor, quantize_per_tensor

    rng = np.random.default_rng(11)
    shape = (3, 700, n)  # 78-200 K elements: the parallel kernel at two threads
    x = rng.integers(0, 256, shape, dtype=np.uint8)
    r = rng.normal(size=shape).astype(F32) if residual else None
    w, b = rng.normal(size=n).astype(F32), rng.normal(size=n).astype(F32)
    b[:3] = (1e4, -1e4, np.inf)  # codes clamped at both ends, and from an infinite output
    x_qp, c_qp = (0.043, 131), (0.021, 117)
    plain = layer_norm(dequantize_per_tensor(x, *x_qp), w, b, 1e-12, residual=r,
                       num_threads=threads)  # fmt: skip
    codes = np.empty(shape, np.uint8)
    got = layer_norm(x, w, b, 1e-12, residual=r, x_qparams=x_qp, codes=codes,
                     codes_qparams=c_qp, num_threads=threads)  # fmt: skip
    np.testing.assert_array_equal(got, plain)
    np.testing.assert_array_equal(codes, quantize_per_tensor(plain, *c_qp))
    # each half alone
    np.testing.assert_array_equal(
        layer_norm(x, w, b, 1e-12, residual=r, x_qparams=x_qp, num_threads=threads), plain
    )
    xf = dequantize_per_tensor(x, *x_qp)
    only_codes = np.empty(shape, np.uint8)
    layer_norm(xf, w, b, 1e-12, residual=r, codes=only_codes, codes_qparams=c_qp)
    np.testing.assert_array_equal(only_codes, codes)


def test_layer_norm_codes_errors():
    x = np.zeros((2, 8), np.uint8)
    with pytest.raises(KernelError, match="give both"):
        layer_norm(x.astype(F32), codes=np.empty((2, 8), np.uint8))
    with pytest.raises(KernelError, match=r"x_qparams\.scale"):
        layer_norm(x, x_qparams=(0.0, 3))
    with pytest.raises(KernelError, match="x: expected"):
        layer_norm(x.astype(F32), x_qparams=(0.1, 3))  # codes must be uint8
    with pytest.raises(KernelError, match="codes"):
        layer_norm(x, x_qparams=(0.1, 3), codes=np.empty((2, 9), np.uint8), codes_qparams=(1, 0))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("codes_in", "codes_out", "residual"), [
    (False, False, False), (False, False, True), (True, False, True), (False, True, True),
    (True, True, True), (True, True, False),
])  # fmt: skip
def test_prepared_layer_norm_is_layer_norm(codes_in, codes_out, residual, threads):
    rng = np.random.default_rng(5)
    shape = (2, 300, 200)  # 120 K elements: the parallel kernel at two threads
    x = rng.integers(0, 256, shape, dtype=np.uint8) if codes_in else rng.normal(size=shape)
    x = x if codes_in else x.astype(F32)
    r = rng.normal(size=shape).astype(F32) if residual else None
    w, b = rng.normal(size=200).astype(F32), rng.normal(size=200).astype(F32)
    x_qp = (0.043, 131) if codes_in else None
    c_qp = (0.021, 117) if codes_out else None
    prepared = PreparedLayerNorm(w, b, 1e-12, x_qparams=x_qp, codes_qparams=c_qp,
                                 num_threads=threads)  # fmt: skip
    want_codes = np.empty(shape, np.uint8) if codes_out else None
    want = layer_norm(x, w, b, 1e-12, residual=r, x_qparams=x_qp, codes=want_codes,
                      codes_qparams=c_qp, num_threads=threads)  # fmt: skip
    for _ in range(2):  # the first call and a later one
        out, codes = prepared(x, r)
        np.testing.assert_array_equal(out, want)
        if codes_out:
            np.testing.assert_array_equal(codes, want_codes)
        else:
            assert codes is None
    assert out is not x  # new arrays
    assert out is not r


def test_prepared_layer_norm_without_weights_and_errors():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(4, 33)).astype(F32)
    prepared = PreparedLayerNorm(None, None, 1e-5)
    for _ in range(2):  # the size is learned at the first call
        np.testing.assert_array_equal(prepared(x)[0], layer_norm(x, None, None, 1e-5))
    with pytest.raises(KernelError, match="x: expected dtype float32"):
        prepared(x.astype(np.float64))
    with pytest.raises(KernelError, match="residual: expected the shape"):
        prepared(x, np.zeros((4, 32), F32))
    with pytest.raises(KernelError, match="x: expected a C-contiguous"):
        prepared(np.asfortranarray(np.ones((3, 33), F32)))
    with pytest.raises(KernelError, match="weight: expected shape"):
        PreparedLayerNorm(np.ones(8, F32), None)(x)
    with pytest.raises(KernelError, match="weight, bias: expected one length"):
        PreparedLayerNorm(np.ones(8, F32), np.ones(9, F32))
    with pytest.raises(KernelError, match="eps"):
        PreparedLayerNorm(None, None, float("nan"))
    with pytest.raises(KernelError, match=r"codes_qparams\.scale"):
        PreparedLayerNorm(None, None, codes_qparams=(0.0, 3))
