"""Weight-only quantized embedding_bag: int8 or int4 rows with a float scale and bias per row.

Row packing follows torch's prepack ops (fbgemm), so packed bytes match
``torch.ops.quantized.embedding_bag_byte_prepack`` / ``embedding_bag_4bit_prepack``:

* 8-bit: ``scale = (max - min) / 255``, ``bias = min`` (float32),
  ``q = rint((w - min) * (255 / (max - min + 1e-8)))``;
* 4-bit: ``bias = fp16(min)``, ``scale = fp16((max - bias) / 15)`` (1.0 if that is 0 or its
  inverse overflows), ``q = clamp(rint((w - bias) * (1 / scale)), 0, 15)``, two codes per byte
  (even column in the low nibble). Scale and bias are kept as float32 holding fp16 values.

A row dequantizes as ``q * scale + bias``. The lookup accumulates like fbgemm's kernels
(``acc = fma(w * scale, q, acc + w * bias)`` per row, float32), which makes mode "sum"
bit-identical to ``torch.ops.quantized.embedding_bag_byte_rowwise_offsets`` /
``embedding_bag_4bit_rowwise_offsets``. torch ignores ``mode`` there (always sums); here
"mean" multiplies a bag's sum by ``float32(1 / length)`` (fbgemm's normalize-by-lengths) and
"max" takes the elementwise max of ``fma(scale, q, bias)`` over the bag. Empty bags give 0.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
import numpy.typing as npt

from quantbridge.kernels._checks import check_array, check_out
from quantbridge.kernels._errors import KernelError
from quantbridge.kernels._fma import fma32
from quantbridge.kernels._quantize import choose_kernel
from quantbridge.kernels._targets import check_target

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]
_MODES = {"sum": 0, "mean": 1, "max": 2}
_FP16_MAX = 65504.0


class PackedEmbedding(NamedTuple):
    """Quantized embedding rows: ``data`` codes, per-row float32 ``scale`` and ``bias``."""

    data: U8  # (num_embeddings, dim) for 8-bit, (num_embeddings, ceil(dim / 2)) for 4-bit
    scale: F32  # (num_embeddings,)
    bias: F32  # (num_embeddings,)
    bit_width: int  # 8 or 4
    embedding_dim: int


# --------------------------------------------------------------------------- packing


def _row_min_max(weight: object) -> tuple[F32, F32, F32]:
    w = check_array("weight", weight, np.float32, 2)
    if not np.all(np.isfinite(w)):
        raise KernelError("weight: contains NaN or infinite values; cannot choose row qparams")
    return w, w.min(axis=1), w.max(axis=1)


def pack_embedding_8bit(weight: F32) -> PackedEmbedding:
    """Quantize float32 rows (num_embeddings, dim) to uint8 codes as torch's byte prepack does."""
    w, lo, hi = _row_min_max(weight)
    with np.errstate(over="ignore", invalid="ignore"):
        rng = (hi - lo).astype(np.float32)
        scale = rng / np.float32(255.0)
        inv = np.float32(255.0) / (rng + np.float32(1e-8))
        codes = np.rint((w - lo[:, None]) * inv[:, None])
    if not (np.all(np.isfinite(rng)) and np.all(np.isfinite(codes))):
        raise KernelError("weight: a row's value range overflows float32")
    return PackedEmbedding(
        np.ascontiguousarray(np.clip(codes, 0, 255).astype(np.uint8)),
        scale.astype(np.float32),
        lo.astype(np.float32),
        8,
        int(w.shape[1]),
    )


def pack_embedding_4bit(weight: F32) -> PackedEmbedding:
    """Quantize float32 rows to 4-bit codes, two per byte, as torch's 4-bit prepack does."""
    w, lo, hi = _row_min_max(weight)
    if w.shape[1] % 2:
        raise KernelError(
            f"weight: 4-bit packing needs an even embedding dim (torch's rule), got {w.shape[1]}"
        )
    if np.any(np.abs(lo) > _FP16_MAX) or np.any(np.abs(hi) > _FP16_MAX):
        raise KernelError(
            f"weight: 4-bit rows store fp16 qparams; values must be within ±{_FP16_MAX}"
        )
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        bias = lo.astype(np.float16).astype(np.float32)
        rng = (hi - bias).astype(np.float32)
        scale = np.where(rng == 0, np.float32(1.0), rng / np.float32(15.0)).astype(np.float32)
        scale = scale.astype(np.float16).astype(np.float32)
        inv = np.float32(1.0) / scale
        bad = (scale == 0) | np.isinf(inv)
        scale[bad] = np.float32(1.0)
        inv[bad] = np.float32(1.0)
        codes = np.clip(np.rint((w - bias[:, None]) * inv[:, None]), 0, 15).astype(np.uint8)
    if np.any(np.isinf(scale)):
        raise KernelError("weight: a row's range is too large for an fp16 scale")
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return PackedEmbedding(np.ascontiguousarray(packed), scale, bias, 4, int(w.shape[1]))


def to_fused_rows(packed: PackedEmbedding) -> U8:
    """torch's fused row layout: codes, then scale and bias (float32 for 8-bit, fp16 for 4-bit)."""
    data, scale, bias, bits, _ = _check_packed(packed)
    qtype = np.float32 if bits == 8 else np.float16
    tail = np.stack([scale.astype(qtype), bias.astype(qtype)], axis=1)
    return np.ascontiguousarray(np.concatenate([data, tail.view(np.uint8)], axis=1))


def from_fused_rows(fused: U8, bit_width: int) -> PackedEmbedding:
    """Split torch's fused rows (from embedding_bag_byte_prepack / _4bit_prepack)."""
    rows = check_array("fused", fused, np.uint8, 2)
    if not _is_int(bit_width) or int(bit_width) not in (8, 4):
        raise KernelError(f"bit_width: expected 8 or 4, got {bit_width!r}")
    qtype = np.float32 if bit_width == 8 else np.float16
    tail = 2 * np.dtype(qtype).itemsize
    cols = rows.shape[1] - tail
    if cols < 1:
        raise KernelError(f"fused: rows of {rows.shape[1]} bytes hold no codes")
    params = np.ascontiguousarray(rows[:, cols:]).view(qtype).astype(np.float32)
    dim = cols if bit_width == 8 else 2 * cols
    return PackedEmbedding(
        np.ascontiguousarray(rows[:, :cols]),
        np.ascontiguousarray(params[:, 0]),
        np.ascontiguousarray(params[:, 1]),
        bit_width,
        dim,
    )


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_packed(packed: object) -> tuple[U8, F32, F32, int, int]:
    if not isinstance(packed, PackedEmbedding):
        raise KernelError(
            f"packed: expected a PackedEmbedding (see pack_embedding_8bit/_4bit), "
            f"got {type(packed).__name__}"
        )
    data = check_array("packed.data", packed.data, np.uint8, 2)
    rows = data.shape[0]
    scale = check_array("packed.scale", packed.scale, np.float32, 1)
    bias = check_array("packed.bias", packed.bias, np.float32, 1)
    if scale.shape[0] != rows or bias.shape[0] != rows:
        raise KernelError(
            f"packed: scale/bias need one entry per row ({rows}), "
            f"got {scale.shape[0]} and {bias.shape[0]}"
        )
    bits, dim = packed.bit_width, packed.embedding_dim
    if not (_is_int(bits) and int(bits) in (8, 4) and _is_int(dim)):
        raise KernelError(
            f"packed: bit_width must be 8 or 4 and embedding_dim an int, got {bits!r}, {dim!r}"
        )
    want = dim if bits == 8 else (dim + 1) // 2
    if dim < 1 or data.shape[1] != want:
        raise KernelError(
            f"packed: embedding_dim {dim} at {bits} bits needs {want} bytes per row, "
            f"data has {data.shape[1]}"
        )
    return data, scale, bias, int(bits), int(dim)


def _check_row_qparams(scale: F32, bias: F32, idx: npt.NDArray[np.integer]) -> None:
    """The looked-up rows' scales and biases must be finite (only those: ~2 us per call)."""
    s, b = scale[idx], bias[idx]
    if np.isfinite(s).all() and np.isfinite(b).all():
        return
    row = int(idx[np.flatnonzero(~(np.isfinite(s) & np.isfinite(b)))[0]])
    raise KernelError(
        f"packed.scale/packed.bias: row {row} has scale {float(scale[row])!r} and bias "
        f"{float(bias[row])!r}; rows need a finite scale and bias "
        "(repack the weight with pack_embedding_8bit/_4bit)"
    )


# --------------------------------------------------------------------------- lookup


@numba.njit(cache=True)
def _code(data, row, j, bits):  # type: ignore[no-untyped-def]
    if bits == 8:
        return np.float32(data[row, j])
    byte = data[row, j >> 1]
    return np.float32((byte >> ((j & 1) * 4)) & 15)


@numba.njit(cache=True)
def _bag(data, scale, bias, bits, dim, indices, weights, has_w, mode, start, stop, out, b):  # type: ignore[no-untyped-def]
    for j in range(dim):
        out[b, j] = np.float32(0.0)
    if stop <= start:
        return
    if mode == 2:
        for i in range(start, stop):
            row = indices[i]
            sc, bi = scale[row], bias[row]
            for j in range(dim):
                v = fma32(sc, _code(data, row, j, bits), bi)
                if i == start or v > out[b, j]:
                    out[b, j] = v
        return
    for i in range(start, stop):
        row = indices[i]
        w = weights[i] if has_w else np.float32(1.0)
        sc = w * scale[row]
        bi = w * bias[row]
        for j in range(dim):
            out[b, j] = fma32(sc, _code(data, row, j, bits), out[b, j] + bi)
    if mode == 1:
        r = np.float32(1.0) / np.float32(stop - start)
        for j in range(dim):
            out[b, j] = out[b, j] * r


@numba.njit(cache=True)
def _lookup(data, scale, bias, bits, dim, indices, offsets, n_idx, weights, has_w, mode, out):  # type: ignore[no-untyped-def]
    bags = out.shape[0]
    for b in range(bags):
        stop = offsets[b + 1] if b + 1 < offsets.size else n_idx
        _bag(data, scale, bias, bits, dim, indices, weights, has_w, mode, offsets[b], stop, out, b)


@numba.njit(cache=True, parallel=True)
def _lookup_par(data, scale, bias, bits, dim, indices, offsets, n_idx, weights, has_w, mode, out):  # type: ignore[no-untyped-def]
    bags = out.shape[0]
    for b in numba.prange(bags):
        stop = offsets[b + 1] if b + 1 < offsets.size else n_idx
        _bag(data, scale, bias, bits, dim, indices, weights, has_w, mode, offsets[b], stop, out, b)


_NO_WEIGHTS = np.zeros(1, np.float32)


def embedding_bag(
    packed: PackedEmbedding,
    indices: npt.NDArray[np.integer],
    offsets: npt.NDArray[np.integer] | None = None,
    mode: str = "sum",
    per_sample_weights: F32 | None = None,
    include_last_offset: bool = False,
    *,
    out: F32 | None = None,
    target: str | None = None,
) -> F32:
    """Sum / mean / max of quantized rows per bag, as float32 (num_bags, embedding_dim).

    ``indices`` is 1-D with ``offsets`` (bag starts; with ``include_last_offset`` the last entry
    is ``len(indices)``), or 2-D (bags of equal length) with ``offsets=None``. Every index and
    offset is checked before the compiled loop reads memory.
    """
    check_target(target)
    data, scale, bias, bits, dim = _check_packed(packed)
    if not isinstance(mode, str) or mode not in _MODES:
        raise KernelError(f"mode: expected one of {sorted(_MODES)}, got {mode!r}")
    if not isinstance(include_last_offset, (bool, np.bool_)):
        raise KernelError(f"include_last_offset: expected a bool, got {include_last_offset!r}")
    idx = check_array("indices", indices, (np.int32, np.int64), (1, 2), allow_empty=True)
    if idx.ndim == 2:
        if offsets is not None:
            raise KernelError("offsets: must be None when indices is 2-D (one bag per row)")
        if idx.shape[0] == 0:
            raise KernelError("indices: 2-D indices need at least one bag (row)")
        length = idx.shape[1]
        offs = np.arange(0, idx.size, max(length, 1), dtype=np.int64)[: idx.shape[0]]
        if length == 0:
            offs = np.zeros(idx.shape[0], np.int64)
        idx = idx.reshape(-1)
        last = False
    else:
        if offsets is None:
            raise KernelError("offsets: required with 1-D indices")
        offs = check_array("offsets", offsets, (np.int32, np.int64), 1)
        last = bool(include_last_offset)
    n_idx = idx.shape[0]
    bags = offs.shape[0] - 1 if last else offs.shape[0]
    if bags < 1:
        raise KernelError("offsets: include_last_offset needs at least 2 offsets (one bag)")
    if offs[0] != 0 or np.any(offs[1:] < offs[:-1]) or offs[-1] > n_idx:
        raise KernelError(
            f"offsets: must start at 0, never decrease and stay <= len(indices) ({n_idx}), "
            f"got first={int(offs[0])}, last={int(offs[-1])}"
        )
    if last and offs[-1] != n_idx:
        raise KernelError(
            f"offsets: with include_last_offset the last offset must equal len(indices) "
            f"({n_idx}), got {int(offs[-1])}"
        )
    if n_idx and (idx.min() < 0 or idx.max() >= data.shape[0]):
        bad = int(idx.min()) if idx.min() < 0 else int(idx.max())
        raise KernelError(f"indices: {bad} is out of range for {data.shape[0]} embedding rows")
    _check_row_qparams(scale, bias, idx)
    if per_sample_weights is not None:
        if mode != "sum":
            raise KernelError("per_sample_weights: only supported with mode='sum' (as in torch)")
        weights = check_array(
            "per_sample_weights", per_sample_weights, np.float32, 1, allow_empty=True
        )
        if weights.shape[0] != n_idx:
            raise KernelError(
                f"per_sample_weights: needs one weight per index ({n_idx}), got {weights.shape[0]}"
            )
        has_w = True
    else:
        weights, has_w = _NO_WEIGHTS, False
    if out is None:
        out = np.empty((bags, dim), np.float32)
    else:
        check_out(out, (bags, dim), np.float32)
        for name, arr in (("packed", data), ("indices", idx), ("per_sample_weights", weights)):
            if np.may_share_memory(out, arr):
                raise KernelError(f"out: must not overlap {name}")
    if not n_idx:
        idx = np.zeros(1, idx.dtype)  # give the compiled loop a non-empty array to type on
    kernel = choose_kernel(n_idx * dim if bags > 1 else 0, "embedding_bag", _lookup, _lookup_par)
    offsets_used = offs[:bags] if last else offs
    kernel(data, scale, bias, bits, dim, idx, offsets_used, n_idx, weights, has_w,
           _MODES[mode], out)  # fmt: skip
    return out
