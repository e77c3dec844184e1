"""embedding_bag on 8-bit / 4-bit rows: references written here, torch's quantized ops as oracle."""

from __future__ import annotations

import numba
import numpy as np
import pytest

import quantbridge.kernels as qk
import quantbridge.kernels._quantize as _quantize_module
from quantbridge.kernels import KernelError


def _fma(a, b, c):
    # float32 a * (small integer b) is exact in float64; adding the float32 c is exact too
    # unless their exponents are far apart, where the result does not depend on it
    return (np.float64(a) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def ref_rows(packed):
    """Dequantized float32 rows ``q * scale + bias`` (one rounding)."""
    data = packed.data.astype(np.int64)
    if packed.bit_width == 4:
        codes = np.empty((data.shape[0], 2 * data.shape[1]), np.int64)
        codes[:, 0::2], codes[:, 1::2] = data & 15, data >> 4
        data = codes[:, : packed.embedding_dim]
    return (
        data * packed.scale.astype(np.float64)[:, None] + packed.bias.astype(np.float64)[:, None]
    ).astype(np.float32)


def ref_bag(packed, indices, offsets, mode, weights):
    dim = packed.embedding_dim
    bounds = [*offsets.tolist(), len(indices)]
    out = np.zeros((len(offsets), dim), np.float32)
    codes = ref_rows(packed) if mode == "max" else None
    for b in range(len(offsets)):
        rows = indices[bounds[b] : bounds[b + 1]]
        if len(rows) == 0:
            continue
        if mode == "max":
            out[b] = codes[rows].max(axis=0)
            continue
        acc = np.zeros(dim, np.float32)
        for i, row in zip(range(bounds[b], bounds[b + 1]), rows, strict=True):
            w = np.float32(1) if weights is None else weights[i]
            sc, bi = np.float32(w * packed.scale[row]), np.float32(w * packed.bias[row])
            acc = _fma(sc, ref_rows_codes(packed, row), (acc + bi).astype(np.float32))
        if mode == "mean":
            acc = (acc * (np.float32(1) / np.float32(len(rows)))).astype(np.float32)
        out[b] = acc
    return out


def ref_rows_codes(packed, row):
    if packed.bit_width == 8:
        return packed.data[row].astype(np.int64)
    byte = packed.data[row].astype(np.int64)
    codes = np.empty(2 * byte.size, np.int64)
    codes[0::2], codes[1::2] = byte & 15, byte >> 4
    return codes[: packed.embedding_dim]


def ref_pack8(w):
    lo, hi = w.min(axis=1), w.max(axis=1)
    rng = (hi - lo).astype(np.float32)
    inv = (np.float32(255) / (rng + np.float32(1e-8))).astype(np.float32)
    q = np.rint(((w - lo[:, None]).astype(np.float32) * inv[:, None]).astype(np.float32))
    return q.astype(np.uint8), (rng / np.float32(255)).astype(np.float32), lo


def _case(rng, bits):
    n, dim = int(rng.integers(1, 40)), 2 * int(rng.integers(1, 20))
    w = (rng.standard_normal((n, dim)) * rng.uniform(0.01, 10)).astype(np.float32)
    w[0] = 0.75  # a constant row
    packed = qk.pack_embedding_8bit(w) if bits == 8 else qk.pack_embedding_4bit(w)
    bags, length = int(rng.integers(1, 12)), int(rng.integers(0, 60))
    indices = rng.integers(0, n, length).astype(rng.choice([np.int32, np.int64]))
    offsets = np.sort(rng.integers(0, length + 1, bags))
    offsets[0] = 0
    return w, packed, indices, offsets.astype(rng.choice([np.int32, np.int64]))


def test_pack_8bit_matches_reference_and_reconstructs():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((30, 17)) * 3).astype(np.float32)
    packed = qk.pack_embedding_8bit(w)
    q, scale, bias = ref_pack8(w)
    np.testing.assert_array_equal(packed.data, q)
    np.testing.assert_array_equal(packed.scale, scale)
    np.testing.assert_array_equal(packed.bias, bias)
    assert packed.bit_width == 8
    assert packed.embedding_dim == 17
    np.testing.assert_allclose(ref_rows(packed), w, atol=float(scale.max()) / 2 * 1.001)


def test_pack_4bit_qparams_are_fp16_and_reconstruct():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((25, 12)) * 2).astype(np.float32)
    packed = qk.pack_embedding_4bit(w)
    assert packed.data.shape == (25, 6)
    np.testing.assert_array_equal(packed.scale.astype(np.float16).astype(np.float32), packed.scale)
    np.testing.assert_array_equal(packed.bias, w.min(axis=1).astype(np.float16).astype(np.float32))
    err = np.abs(ref_rows(packed) - w).max(axis=1)
    assert (err <= packed.scale * 0.5 + 2e-3).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_matches_reference(bits, mode):
    rng = np.random.default_rng(bits * 10 + len(mode))
    for trial in range(25):
        _, packed, indices, offsets = _case(rng, bits)
        weights = None
        if mode == "sum" and trial % 2:
            weights = rng.standard_normal(len(indices)).astype(np.float32)
        got = qk.embedding_bag(packed, indices, offsets, mode, weights)
        np.testing.assert_array_equal(got, ref_bag(packed, indices, offsets, mode, weights))


def test_include_last_offset_and_2d_indices():
    rng = np.random.default_rng(2)
    _, packed, _, _ = _case(rng, 8)
    n = packed.data.shape[0]
    indices = rng.integers(0, n, 12).astype(np.int64)
    offsets = np.array([0, 3, 3, 7], np.int64)
    plain = qk.embedding_bag(packed, indices, offsets)
    with_last = qk.embedding_bag(
        packed, indices, np.array([0, 3, 3, 7, 12]), include_last_offset=True
    )
    np.testing.assert_array_equal(plain, with_last)
    assert (plain[1] == 0).all()  # empty bag
    grid = indices.reshape(4, 3)
    np.testing.assert_array_equal(
        qk.embedding_bag(packed, grid, mode="mean"),
        qk.embedding_bag(packed, indices, np.arange(0, 12, 3), mode="mean"),
    )
    empty = qk.embedding_bag(packed, np.zeros(0, np.int64), np.zeros(3, np.int64))
    np.testing.assert_array_equal(empty, np.zeros((3, packed.embedding_dim), np.float32))


def test_fused_rows_round_trip():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((9, 10)).astype(np.float32)
    for bits, pack in ((8, qk.pack_embedding_8bit), (4, qk.pack_embedding_4bit)):
        packed = pack(w)
        back = qk.from_fused_rows(qk.to_fused_rows(packed), bits)
        for a, b in zip(packed, back, strict=True):
            np.testing.assert_array_equal(a, b)


GOOD = qk.pack_embedding_8bit(np.arange(20, dtype=np.float32).reshape(4, 5))
IDX = np.array([0, 1, 3], np.int64)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"indices": np.array([0, 4], np.int64)}, "indices: 4 is out of range"),
        ({"indices": np.array([-1, 0], np.int64)}, "indices: -1 is out of range"),
        ({"indices": IDX.astype(np.int16)}, "indices: expected dtype"),
        ({"indices": IDX.astype(np.float32)}, "indices: expected dtype"),
        ({"offsets": np.array([1, 2])}, "offsets: must start at 0"),
        ({"offsets": np.array([0, 2, 1])}, "never decrease"),
        ({"offsets": np.array([0, 5])}, "stay <="),
        ({"offsets": None}, "offsets: required"),
        ({"offsets": np.array([0.0])}, "offsets: expected dtype"),
        ({"offsets": np.array([0, 2]), "include_last_offset": True}, "last offset must equal"),
        ({"offsets": np.array([0]), "include_last_offset": True}, "at least 2 offsets"),
        ({"mode": "median"}, "mode"),
        ({"per_sample_weights": np.ones(2, np.float32)}, "one weight per index"),
        ({"per_sample_weights": np.ones(3, np.float64)}, "per_sample_weights: expected dtype"),
        ({"per_sample_weights": np.ones(3, np.float32), "mode": "max"}, "only supported"),
        ({"packed": (GOOD.data, GOOD.scale, GOOD.bias, 8, 5)}, "PackedEmbedding"),
        ({"packed": GOOD._replace(embedding_dim=6)}, "bytes per row"),
        ({"packed": GOOD._replace(bit_width=2)}, "bit_width"),
        ({"packed": GOOD._replace(scale=GOOD.scale[:3])}, "one entry per row"),
        ({"packed": GOOD._replace(data=GOOD.data.astype(np.int8))}, "packed.data"),
        ({"out": np.zeros((1, 4), np.float32)}, "out: expected shape"),
        ({"target": "avx9"}, "unknown kernel target"),
    ],
)
def test_bad_input_is_refused_before_compiled_code(kwargs, message):
    args = {"packed": GOOD, "indices": IDX, "offsets": np.array([0, 2])}
    args.update(kwargs)
    packed, indices, offsets = args.pop("packed"), args.pop("indices"), args.pop("offsets")
    with pytest.raises(KernelError, match=message):
        qk.embedding_bag(packed, indices, offsets, **args)


def test_packing_refuses_bad_weights():
    with pytest.raises(KernelError, match="NaN or infinite"):
        qk.pack_embedding_8bit(np.array([[1.0, np.nan]], np.float32))
    with pytest.raises(KernelError, match="even embedding dim"):
        qk.pack_embedding_4bit(np.zeros((2, 3), np.float32))
    with pytest.raises(KernelError, match="fp16"):
        qk.pack_embedding_4bit(np.array([[0.0, 1e6]], np.float32))
    with pytest.raises(KernelError, match="weight: expected dtype float32"):
        qk.pack_embedding_8bit(np.zeros((2, 3)))


@pytest.mark.parametrize("target", qk.available_targets())
@pytest.mark.parametrize("threads", [1, 2])
def test_large_lookup_threads_and_targets(threads, target, monkeypatch):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((500, 64)).astype(np.float32)
    packed = qk.pack_embedding_4bit(w) if threads == 1 else qk.pack_embedding_8bit(w)
    indices = rng.integers(0, 500, 4000).astype(np.int64)
    offsets = np.arange(0, 4000, 40)
    weights = rng.standard_normal(4000).astype(np.float32)
    _force_threaded_path(monkeypatch, threads)
    qk.set_num_threads(threads)
    try:
        got = qk.embedding_bag(packed, indices, offsets, per_sample_weights=weights, target=target)
    finally:
        qk.set_num_threads(None)
    # numba's own per-thread count (set above to differ from the call's) is left as it was
    assert numba.get_num_threads() == (numba.config.NUMBA_NUM_THREADS if threads == 1 else 1)
    np.testing.assert_array_equal(got, ref_bag(packed, indices, offsets, "sum", weights))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("bits", [8, 4])
def test_byte_identical_to_torch(bits):
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.ao.quantization")
    ops = torch.ops.quantized
    prepack = ops.embedding_bag_byte_prepack if bits == 8 else ops.embedding_bag_4bit_prepack
    lookup = (
        ops.embedding_bag_byte_rowwise_offsets
        if bits == 8
        else ops.embedding_bag_4bit_rowwise_offsets
    )
    rng = np.random.default_rng(5)
    for trial in range(40):
        w, packed, indices, offsets = _case(rng, bits)
        if trial % 5 == 0:  # wide rows exercise fbgemm's other code paths
            w = rng.standard_normal((20, 2 * int(rng.integers(40, 200)))).astype(np.float32)
            packed = qk.pack_embedding_8bit(w) if bits == 8 else qk.pack_embedding_4bit(w)
            indices = rng.integers(0, 20, len(indices)).astype(indices.dtype)
        fused = prepack(torch.from_numpy(w)).numpy()
        np.testing.assert_array_equal(qk.to_fused_rows(packed), fused)
        weights = rng.standard_normal(len(indices)).astype(np.float32) if trial % 2 else None
        last = bool(trial % 3 == 0)
        offs = np.append(offsets, len(indices)).astype(offsets.dtype) if last else offsets
        want = lookup(
            torch.from_numpy(fused), torch.from_numpy(indices), torch.from_numpy(offs),
            False, 0, False, None if weights is None else torch.from_numpy(weights), None, last,
        ).numpy()  # fmt: skip
        got = qk.embedding_bag(packed, indices, offs, "sum", weights, last)
        np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
        from_torch = qk.from_fused_rows(fused, bits)
        np.testing.assert_array_equal(
            qk.embedding_bag(from_torch, indices, offs, "sum", weights, last), got
        )


def _force_threaded_path(monkeypatch, threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("numba runs with fewer threads on this machine")
    # the size threshold is tuned for speed; lower it so these inputs take the threaded path
    monkeypatch.setattr(_quantize_module, "PARALLEL_MIN_WORK", 1)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS if threads == 1 else 1)
