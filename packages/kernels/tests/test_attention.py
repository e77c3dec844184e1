"""``kernels.attention``: against a float64 reference of the dequantized computation, against
torch's scaled_dot_product_attention, and its edge cases and errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quantbridge.kernels import (
    KernelError,
    attention,
    available_targets,
    quantize_per_tensor,
)

QP = [(0.03, 128), (0.025, 120), (0.02, 131)]
OUT = (0.01, 127)


def _heads(rng: np.random.Generator, b: int, s: int, h: int, d: int) -> np.ndarray:
    """Codes [B, H, S, D] as the per-head view of a [B, S, H * D] projection output."""
    flat = rng.integers(0, 256, (b, s, h * d), dtype=np.uint8)
    return flat.reshape(b, s, h, d).transpose(0, 2, 1, 3)


def _reference(q, k, v, mask, scale):  # type: ignore[no-untyped-def]
    """float64 softmax(q k^T * scale + mask) v of the dequantized codes; a fully hidden row
    gives zeros."""
    qf, kf, vf = (s * (x.astype(np.float64) - z) for x, (s, z) in zip((q, k, v), QP, strict=True))
    logits = qf @ kf.swapaxes(-1, -2) * scale
    if mask is not None:
        add = np.where(mask, 0.0, -np.inf) if mask.dtype == np.bool_ else mask.astype(np.float64)
        logits = logits + add
    top = logits.max(axis=-1, keepdims=True)
    hidden = np.isneginf(top)
    e = np.exp(logits - np.where(hidden, 0.0, top))
    p = e / np.where(hidden, 1.0, e.sum(axis=-1, keepdims=True))
    return np.where(hidden, 0.0, p @ vf)


def _mask(kind: str, rng: np.random.Generator, b: int, h: int, sq: int, sk: int):  # type: ignore[no-untyped-def]
    if kind == "none":
        return None
    lengths = rng.integers(1, sk + 1, b)
    keep = np.arange(sk)[None, :] < lengths[:, None]
    if kind == "bool_padding":  # [B, 1, 1, Sk]
        return keep[:, None, None, :]
    if kind == "bool_expanded":  # [B, 1, Sq, Sk] with a stride-0 query dimension
        return np.broadcast_to(keep[:, None, None, :], (b, 1, sq, sk))
    if kind == "float_min":  # Hugging Face's additive mask
        return ((1.0 - keep) * np.finfo(np.float32).min)[:, None, None, :].astype(np.float32)
    if kind == "float_full":  # a different bias per head and query
        return rng.normal(0, 2, (b, h, sq, sk)).astype(np.float32)
    raise AssertionError(kind)


@pytest.mark.parametrize(
    ("b", "h", "sq", "sk", "d", "dv"),
    [
        (1, 2, 8, 32, 16, 32),
        (2, 3, 5, 37, 24, 40),
        (1, 1, 17, 9, 64, 8),
        (2, 2, 33, 65, 32, 32),
        (1, 2, 7, 11, 6, 5),  # a head size that is not a multiple of 4: the float q . k
    ],
)
@pytest.mark.parametrize(
    "kind", ["none", "bool_padding", "bool_expanded", "float_min", "float_full"]
)
def test_against_float64_reference(
    b: int, h: int, sq: int, sk: int, d: int, dv: int, kind: str
) -> None:
    rng = np.random.default_rng(b * 1000 + sq * 10 + sk)
    q = _heads(rng, b, sq, h, d)
    k, v = _heads(rng, b, sk, h, d), _heads(rng, b, sk, h, dv)
    mask = _mask(kind, rng, b, h, sq, sk)
    scale = 1.0 / math.sqrt(d)
    want = _reference(q, k, v, mask, scale)
    got = attention(q, k, v, *QP, mask=mask)
    assert got.shape == (b, h, sq, dv)
    assert got.dtype == np.float32
    assert got.transpose(0, 2, 1, 3).flags.c_contiguous  # heads merge back without a copy
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    codes = attention(q, k, v, *QP, mask=mask, out_qparams=OUT)
    assert codes.dtype == np.uint8
    exact = quantize_per_tensor(want.astype(np.float32), *OUT)
    # float32 against float64: a value within 1e-5 of a rounding boundary may land either side
    assert np.abs(codes.astype(int) - exact.astype(int)).max() <= 1
    assert (codes != exact).mean() < 0.01


@pytest.mark.parametrize("target", available_targets())
def test_every_target_computes_the_same_logits(target: str) -> None:
    # q . k is exact on both paths (vpdpbusd with corrections, or float32 sums of integers),
    # so the results are the same bytes; q's rows strided (a transposed view) and contiguous
    rng = np.random.default_rng(4)
    q, k, v = (_heads(rng, 2, 40, 3, 32) for _ in range(3))
    mask = _mask("float_min", rng, 2, 3, 40, 40)
    want = attention(q, k, v, *QP, mask=mask, out_qparams=OUT, target="generic")
    got = attention(q, k, v, *QP, mask=mask, out_qparams=OUT, target=target)
    np.testing.assert_array_equal(got, want)
    contiguous = attention(np.ascontiguousarray(q), k, v, *QP, mask=mask, out_qparams=OUT,
                           target=target)  # fmt: skip
    np.testing.assert_array_equal(contiguous, want)
    reversed_rows = q[:, :, ::-1]  # negative strides: copied first
    flipped = attention(reversed_rows, k, v, *QP, mask=mask, target=target)
    np.testing.assert_array_equal(
        flipped, attention(np.ascontiguousarray(reversed_rows), k, v, *QP, mask=mask,
                           target="generic"),
    )  # fmt: skip


def test_scale_and_one_thread_equals_two() -> None:
    rng = np.random.default_rng(5)
    q, k, v = (_heads(rng, 2, 64, 6, 32) for _ in range(3))
    mask = _mask("bool_padding", rng, 2, 6, 64, 64)
    want = _reference(q, k, v, mask, 0.07)
    one = attention(q, k, v, *QP, mask=mask, scale=0.07, out_qparams=OUT, num_threads=1)
    two = attention(q, k, v, *QP, mask=mask, scale=0.07, out_qparams=OUT, num_threads=2)
    np.testing.assert_array_equal(one, two)  # heads are independent: same bytes
    exact = quantize_per_tensor(want.astype(np.float32), *OUT)
    assert np.abs(one.astype(int) - exact.astype(int)).max() <= 1


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_hidden_rows_give_zeros(kind: str) -> None:
    rng = np.random.default_rng(1)
    q, k, v = (_heads(rng, 1, 6, 2, 8) for _ in range(3))
    keep = np.ones((1, 1, 6, 6), bool)
    keep[..., 2, :] = False  # query 2 sees no key
    mask = keep if kind == "bool" else np.where(keep, 0.0, -np.inf).astype(np.float32)
    got = attention(q, k, v, *QP, mask=mask)
    assert np.all(got[:, :, 2] == 0.0)
    assert np.all(np.isfinite(got))
    codes = attention(q, k, v, *QP, mask=mask, out_qparams=OUT)
    assert np.all(codes[:, :, 2] == OUT[1])  # zero is the zero point


def test_against_torch_sdpa() -> None:
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(2)
    q, k, v = (_heads(rng, 2, 128, 12, 32) for _ in range(3))
    keep = _mask("bool_padding", rng, 2, 12, 128, 128)
    deq = [
        (torch.from_numpy(np.ascontiguousarray(x)).float() - z) * np.float32(s)
        for x, (s, z) in zip((q, k, v), QP, strict=True)
    ]
    ref = F.scaled_dot_product_attention(*deq, attn_mask=torch.from_numpy(keep))
    want = torch.quantize_per_tensor(ref, OUT[0], OUT[1], torch.quint8).int_repr().numpy()
    got = attention(q, k, v, *QP, mask=keep, out_qparams=OUT)
    diff = np.abs(got.astype(int) - want.astype(int))
    assert diff.max() <= 1
    assert (diff > 0).mean() < 1e-3
    np.testing.assert_allclose(attention(q, k, v, *QP, mask=keep), ref.numpy(), atol=2e-5)


def test_errors_name_the_argument() -> None:
    rng = np.random.default_rng(3)
    q, k, v = (_heads(rng, 1, 4, 2, 8) for _ in range(3))
    with pytest.raises(KernelError, match="q: expected"):
        attention(q.astype(np.int8), k, v, *QP)
    with pytest.raises(KernelError, match=r"batch and head"):
        attention(q, k[:, :1], v, *QP)
    with pytest.raises(KernelError, match=r"k \[B, H, Sk, 8\]"):
        attention(q, _heads(rng, 1, 4, 2, 4), v, *QP)
    with pytest.raises(KernelError, match="does not broadcast"):
        attention(q, k, v, *QP, mask=np.ones((1, 1, 3, 4), bool))
    with pytest.raises(KernelError, match="mask"):
        attention(q, k, v, *QP, mask=np.ones((1, 1, 4, 4), np.int32))
    with pytest.raises(KernelError, match=r"k_qparams\.scale"):
        attention(q, k, v, QP[0], (float("nan"), 0), QP[2])
    with pytest.raises(KernelError, match=r"out_qparams\.zero_point"):
        attention(q, k, v, *QP, out_qparams=(0.1, 300))
    with pytest.raises(KernelError, match="scale"):
        attention(q, k, v, *QP, scale=float("inf"))
    big = _heads(rng, 1, 2, 1, 512)
    with pytest.raises(KernelError, match="exact limit"):
        attention(big, big, big, *QP)


def test_causal_is_the_lower_triangle() -> None:
    rng = np.random.default_rng(8)
    q = _heads(rng, 2, 6, 2, 16)
    k, v = _heads(rng, 2, 9, 2, 16), _heads(rng, 2, 9, 2, 16)
    keep = np.tri(6, 9, dtype=bool)[None, None]  # query i sees keys 0..i, as torch's is_causal
    want = _reference(q, k, v, keep, 0.25)
    got = attention(q, k, v, *QP, scale=0.25, causal=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(got, attention(q, k, v, *QP, scale=0.25, mask=keep))
    with pytest.raises(KernelError, match="mask and causal"):
        attention(q, k, v, *QP, mask=keep, causal=True)


@pytest.mark.parametrize("target", available_targets())
@pytest.mark.parametrize("kind", ["padding", "causal"])
def test_keys_past_the_last_visible_one_are_skipped_without_changing_a_bit(
    kind: str, target: str
) -> None:
    # The kernel leaves out the keys past each block's last visible key (-inf or False in the
    # mask). The same mask with those keys at -1e30 instead (finite: nothing is skipped, and
    # their exp is 0 all the same) must give exactly the same codes and floats.
    rng = np.random.default_rng(12)
    b, h, sq, sk, d = 3, 2, 40, 130, 16  # several 32-key blocks, a partial last one
    q, k, v = _heads(rng, b, sq, h, d), _heads(rng, b, sk, h, d), _heads(rng, b, sk, h, d)
    if kind == "padding":
        lengths = np.array([1, 33, 97])  # inside the first block, just past one, mid-block
        keep = (np.arange(sk)[None, :] < lengths[:, None])[:, None, None, :]
    else:
        keep = np.tri(sq, sk, k=5, dtype=bool)[None, None]
    hidden_inf = np.where(keep, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
    hidden_finite = np.where(keep, np.float32(0.0), np.float32(-1e30)).astype(np.float32)
    for out in (OUT, None):
        want = attention(q, k, v, *QP, mask=hidden_finite, out_qparams=out, target=target)
        for mask in (keep, hidden_inf):
            got = attention(q, k, v, *QP, mask=mask, out_qparams=out, target=target)
            np.testing.assert_array_equal(got, want)
