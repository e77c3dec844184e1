"""Quantized linear (static, +relu) and dynamic linear on prepacked int8 weights.

``linear``: uint8 activations [..., K] (per-tensor scale/zero point) times int8 weights
[N, K] (per-tensor or per-channel scales, any zero points), int32 accumulation, float bias
added before requantization (the rule in ``_requant.py``), uint8 output [..., N].

``linear_dynamic``: float32 in and out. The activation is quantized per call with torch's
dynamic rule (uint8, reduce_range=False, range [min(x, 0), max(x, 0)]), then the int32
accumulator becomes ``fma(float(acc), float32(act_scale * w_scale[j]), bias[j])`` in float32.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from quantbridge.kernels._block_kernels import activation_offset
from quantbridge.kernels._checks import (
    F32_MAX,
    F32_TINY,
    check_accumulation_fits_int32,
    check_array,
    check_derived,
    check_scale,
    check_zero_point,
    f32_problem,
)
from quantbridge.kernels._dynamic_act import (
    dynamic_qparams,
    quantize_rows,
    quantize_rows_fixed,
    tensor_range,
)
from quantbridge.kernels._epilogue_lut import NO_LUT, epilogue_lut
from quantbridge.kernels._errors import KernelError
from quantbridge.kernels._float_epilogue import FloatEpilogue, float_epilogue, gather_columns
from quantbridge.kernels._float_math import ACT_NONE, ACTIVATIONS
from quantbridge.kernels._gemm import quantize_u8_fma
from quantbridge.kernels._gemm_run import NO_ADD, NO_RESIDUAL, SERIAL_BELOW, run_gemm, serial_driver
from quantbridge.kernels._lut import apply_table, table_as_pass
from quantbridge.kernels._numba_compat import compiled_entry_point
from quantbridge.kernels._pack import (
    K_ALIGN,
    PAIR_SAFE,
    kernel_family,
    layout,
    pack_b,
    pair_limit,
    round_up,
    weight_scales,
    weight_zero_points,
)
from quantbridge.kernels._pair_guard import PairGuard, split_steps, unsafe_rows
from quantbridge.kernels._requant import multipliers, scaled_bias
from quantbridge.kernels._targets import check_unpickled_target, resolve_target
from quantbridge.kernels._threads import apply_num_threads, max_threads

_CACHE_LIMIT = 64
# One thread walks the weight panels over a block of activation rows, block after block. The
# whole activation matrix is one block while it stays in L2 beside the weights; past that
# (a BERT FFN's 2048 x 1536 codes, 3 MB) every panel would stream it from L3 again, so blocks
# of SERIAL_BLOCK_BYTES are used: 2048 x 1536 x 384 at one thread, 168-row blocks against
# one block, 1.15x faster (medians of 30 interleaved calls with the caches flushed between)
SERIAL_WHOLE_BYTES = 1 << 20
SERIAL_BLOCK_BYTES = 1 << 18


def serial_block_rows(m: int, row_bytes: int) -> int:
    """Rows per block of the one-thread GEMM over ``m`` rows of ``row_bytes`` activations."""
    if m * row_bytes <= SERIAL_WHOLE_BYTES:
        return m
    return max(8, SERIAL_BLOCK_BYTES // row_bytes // 8 * 8)


# dynamic scale products (activation scale x each weight scale) inside these bounds are
# normal float32 numbers with room to spare: no element-wise check (``dynamic_epilogue``)
PRODUCT_FLOOR = 2.0 * F32_TINY
PRODUCT_CEILING = 0.5 * F32_MAX


@numba.njit(cache=True, nogil=True)
def column_corrections(zp, colsum, wzp, k_true, offset, out):  # type: ignore[no-untyped-def]
    """``out[j] = (offset - zp) * colsum[j] + k_true * zp * wzp[j]``, wrapped to int32: the
    activation zero point's share of each output column (``PackedLinearWeight.colcorr``), and
    what kernels that subtract ``offset`` from the codes (``activation_offset``) take away."""
    for j in range(out.shape[0]):
        out[j] = np.int32((offset - zp) * colsum[j] + k_true * zp * np.int64(wzp[j]))


class PackedLinearWeight:
    """An int8 weight [N, K] packed once for one target, with its scales and zero points.

    Args:
        weight: int8 array [N, K] (out_features x in_features, torch's layout).
        scale: float (per-tensor) or float array [N] (per-channel, axis 0).
        zero_point: int or int array [N], each in [-128, 127].
        bias: optional float32 array [N], in output float units.
        target: kernel target (see ``resolve_target``); None picks the default.
    """

    def __init__(
        self,
        weight: npt.NDArray[np.int8],
        scale: float | npt.ArrayLike,
        zero_point: int | npt.ArrayLike = 0,
        bias: npt.NDArray[np.float32] | None = None,
        target: str | None = None,
        *,
        _kernel: str | None = None,  # conv: one family for all of its groups
    ) -> None:
        w = check_array("weight", weight, np.int8, 2, contiguous=False)
        self.target = resolve_target(target)
        # the packed layout and micro-kernels (``kernel_family``): on avx2 chosen by the weights
        self.kernel = kernel_family(self.target, w) if _kernel is None else _kernel
        self.n, self.k = int(w.shape[0]), int(w.shape[1])
        nr, kstep, _ = layout(self.kernel)
        self.n_padded = round_up(self.n, nr)
        self.k_padded = round_up(self.k, K_ALIGN)
        self.scales, self.per_channel = weight_scales(scale, self.n, "weight scale")
        self.zero_points = weight_zero_points(zero_point, self.n, self.n_padded, "weight")
        self.has_weight_zp = bool(np.any(self.zero_points != 0))
        if bias is not None:
            bias = check_array("bias", bias, np.float32, 1, contiguous=False)
            if bias.shape[0] != self.n:
                raise KernelError(f"bias: expected shape ({self.n},), got {bias.shape}")
            if not np.all(np.isfinite(bias)):
                raise KernelError("bias: must be finite")
            bias = np.ascontiguousarray(bias)
        self.bias = bias
        wide = w.astype(np.int64) - self.zero_points[: self.n, None]
        b_max = int(np.abs(wide).max())
        check_accumulation_fits_int32("weight", self.k, 255, max(b_max, 1))
        self.weight = np.ascontiguousarray(w)
        self.packed = pack_b(self.weight, self.kernel)
        colsum = np.zeros(self.n_padded, np.int64)
        colsum[: self.n] = w.astype(np.int64).sum(axis=1)
        self.colsum = colsum
        # activation offsets per k step; padded steps read offset 0 against zero weights
        nk = self.k_padded // kstep
        steps = np.arange(nk, dtype=np.int64) * kstep
        self.koffs = np.where(steps < self.k, steps, 0).astype(np.int64)
        self.lda = round_up(self.k, 4)
        # real reduction length for the zero-point correction (conv pads channels with zeros)
        self.k_true = self.k
        # index of this weight's first output channel in the caller's numbering (conv groups)
        self.channel_offset = 0
        self.nk = int(self.koffs.shape[0])
        self.npanels = self.n_padded // nr
        # AVX2's byte kernels on weights past 7 bits: rows holding a pair of activation codes
        # past this limit are recomputed on the int16 kernels (``_pair_guard``)
        self.pair_limit = pair_limit(w) if self.kernel == "avx2_byte" else PAIR_SAFE
        self.guarded = self.pair_limit < PAIR_SAFE
        self._exact: npt.NDArray[np.int16] | None = None
        self._exact_koffs = self.koffs  # the int16 kernels' k steps, set with ``_exact``
        # the byte kernels read uint8 activations directly; AVX2's int16 ones want them widened
        byte_kernel = self.kernel not in ("avx2", "generic")
        self.act_offset = activation_offset(self.kernel)
        self.serial_u8 = serial_driver(self.kernel, "u8") if byte_kernel else None
        self._fast: dict[tuple[float, float, int], Any] = {}
        self._entry: dict[bool, Any] = {}
        self._colcorr: dict[int, npt.NDArray[np.int32]] = {}
        self._colcorr_f: dict[str, npt.NDArray[np.float32]] = {}
        self._requant: dict[tuple[float, float | None, bool], Any] = {}
        self._rows: dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]] = {}
        # (min, max) weight scale: bounds every dynamic scale product (``dynamic_epilogue``)
        self._scale_span = (float(self.scales.min()), float(self.scales.max()))

    def exact_packed(self) -> npt.NDArray[np.int16]:
        """This weight in the int16 ``avx2`` layout (exact for any activations), packed on
        first use: the guarded byte kernels' rows past the pair limit, and dynamic linears."""
        if self._exact is None:
            self._exact_koffs = split_steps(self.koffs)
            self._exact = pack_b(self.weight, "avx2")  # type: ignore[assignment]
        assert self._exact is not None
        return self._exact

    def guard(self, npix: int, pixel_bytes: int, aligned: bool, to_rows: Any) -> PairGuard | None:
        """The ``PairGuard`` of a call on this weight (None when every pair is exact)."""
        if not self.guarded:
            return None
        return PairGuard(self.pair_limit, npix, pixel_bytes, aligned, to_rows, self.exact_packed)

    @property
    def zero_colcorr(self) -> npt.NDArray[np.int32]:
        """The column corrections of activation zero point 0 (per-row activation zero points
        go through the kernels' weight-zero-point term instead, see ``linear_dynamic``): all
        zero, but on kernels that offset the codes (``activation_offset``)."""
        return self.colcorr(0)

    @property
    def colsum32(self) -> npt.NDArray[np.int32]:
        """``colsum`` as int32 (|colsum| <= 128 K, which the int32 check bounds)."""
        got = self._colcorr.get(-2)
        if got is None:
            got = self.colsum.astype(np.int32)
            self._colcorr[-2] = got
        return got

    @property
    def bias_padded(self) -> npt.NDArray[np.float32]:
        """The float32 bias padded to ``n_padded`` (zeros without a bias)."""
        got = self._colcorr_f.get("bias")
        if got is None:
            got = np.zeros(self.n_padded, np.float32)
            if self.bias is not None:
                got[: self.n] = self.bias
            self._colcorr_f["bias"] = got
        return got

    def epilogue_unit(self) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """``(zeros, w_scale)``: the f32 epilogue giving ``float32(acc * w_scale[j])``."""
        got = self._colcorr_f.get("unit")
        if got is None:
            m = np.zeros(self.n_padded, np.float32)
            m[: self.n] = self.scales
            got = np.zeros(self.n_padded, np.float32)
            self._colcorr_f["unit"] = got
            self._colcorr_f["unit_mult"] = m
        return got, self._colcorr_f["unit_mult"]

    def rows(self, m: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
        """``(row offsets, zero row sums)`` for ``m`` rows, cached (read-only arrays)."""
        got = self._rows.get(m)
        if got is None:
            offs = np.arange(m, dtype=np.int64) * self.lda
            zeros = np.zeros(m, np.int32)
            offs.flags.writeable = False
            zeros.flags.writeable = False
            got = (offs, zeros)
            if len(self._rows) < _CACHE_LIMIT:
                self._rows[m] = got
        return got

    def colcorr(self, act_zero_point: int) -> npt.NDArray[np.int32]:
        """``-a_zp * colsum[j] + K * a_zp * w_zp[j]`` as wrapped int32, cached per a_zp."""
        got = self._colcorr.get(act_zero_point)
        if got is None:
            got = np.empty(self.n_padded, np.int32)
            column_corrections(
                act_zero_point, self.colsum, self.zero_points, self.k_true, self.act_offset, got
            )
            if len(self._colcorr) < _CACHE_LIMIT:
                self._colcorr[act_zero_point] = got
        return got

    def epilogue(
        self, act_scale: float, out_scale: float | None
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """``(biasq, mult)`` for the u8 rule (out_scale given) or float output (None)."""
        if type(act_scale) is not float or (out_scale is not None and type(out_scale) is not float):
            act_scale = check_scale("x_scale", act_scale)  # non-floats: validate, then key
            if out_scale is not None:
                out_scale = check_scale("out_scale", out_scale)
        key = (act_scale, out_scale, True)
        got = self._requant.get(key)
        if got is None:
            act_scale = check_scale("x_scale", act_scale)
            if out_scale is not None:
                out_scale = check_scale("out_scale", out_scale)
            with np.errstate(all="ignore"):  # out-of-range results are refused just below
                atws, mult = multipliers(act_scale, self.scales, out_scale)
                if out_scale is not None:
                    bq = scaled_bias(self.bias, atws, self.per_channel, self.n_padded)
            self._check_derived(act_scale, atws, mult, None if out_scale is None else bq)
            m = np.zeros(self.n_padded, np.float32)
            m[: self.n] = mult
            if out_scale is None:
                bq = np.zeros(self.n_padded, np.float32)
                if self.bias is not None:
                    bq[: self.n] = self.bias
            got = (bq, m)
            if len(self._requant) < _CACHE_LIMIT:
                self._requant[key] = got
        return got

    def dynamic_epilogue(
        self, act_scale: float
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """``epilogue(act_scale, None)`` without its cache: a dynamic scale changes every call,
        so the cache would only miss (the same float32 products, the same checks)."""
        scales = self.epilogue_unit()[1]  # the weight scales, zero-padded to n_padded
        low, high = self._scale_span
        if act_scale * low > PRODUCT_FLOOR and act_scale * high < PRODUCT_CEILING:
            # every product is comfortably normal: no element-wise check, nothing to silence
            return self.bias_padded, scales * np.float32(act_scale)
        with np.errstate(over="ignore", under="ignore"):  # refused just below
            mult = scales * np.float32(act_scale)
        self._check_derived(act_scale, mult, mult, None)
        return self.bias_padded, mult

    def _check_derived(
        self,
        act_scale: float,
        atws: npt.NDArray[np.float32],
        mult: npt.NDArray[np.float32],
        biasq: npt.NDArray[np.float32] | None,
    ) -> None:
        """Refuse scale products the requantization rule cannot use (see ``_checks.py``)."""
        count = self.n if self.per_channel else 1
        off = self.channel_offset if self.per_channel else None
        if biasq is None:  # dynamic: the activation scale comes from x's range
            check_derived(f"x's dynamic scale ({act_scale:.7g}) * weight scale", atws[:count],
                          channel_offset=off)  # fmt: skip
            return
        check_derived("x_scale * weight scale", atws[:count], channel_offset=off)
        check_derived("x_scale * weight scale / out_scale", mult[:count], channel_offset=off)
        if self.bias is not None and not np.all(np.isfinite(biasq[: self.n])):
            j = int(np.flatnonzero(~np.isfinite(biasq[: self.n]))[0])
            raise KernelError(
                f"bias / (x_scale * weight scale) for output channel {j + self.channel_offset} "
                "overflows float32 "
                f"(bias {float(self.bias[j])!r}); the scales are far too small for this bias"
            )

    def __setstate__(self, state: dict[str, Any]) -> None:
        check_unpickled_target("PackedLinearWeight", state["target"])
        self.__dict__.update(state)

    def __repr__(self) -> str:
        kind = "per-channel" if self.per_channel else "per-tensor"
        byte = ""
        if self.kernel == "avx2_byte":
            byte = ", 8-bit weights, guarded byte kernels" if self.guarded else ", 7-bit weights"
        return f"PackedLinearWeight(N={self.n}, K={self.k}, {kind}{byte}, target={self.target!r})"


def _activation_rows(
    x: npt.NDArray[np.uint8], packed: PackedLinearWeight, name: str
) -> tuple[npt.NDArray[np.uint8], int, tuple[int, ...]]:
    if x.shape[-1] != packed.k:
        raise KernelError(
            f"{name}: last dimension {x.shape[-1]} does not match the weight's K={packed.k} "
            f"(x has shape {x.shape}, weight is [{packed.n}, {packed.k}])"
        )
    lead = x.shape[:-1]
    m = x.size // packed.k
    if packed.lda == packed.k:
        return x.reshape(-1), m, lead
    # 4-byte loads need rows padded to a multiple of 4 bytes
    padded = np.zeros((m, packed.lda), np.uint8)
    padded[:, : packed.k] = x.reshape(m, packed.k)
    return padded.reshape(-1), m, lead


def _rows_and_sums(
    a_flat: npt.NDArray[np.uint8], m: int, packed: PackedLinearWeight
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
    offs, zeros = packed.rows(m)
    if not packed.has_weight_zp:
        return offs, zeros
    sums = a_flat.reshape(m, packed.lda).sum(axis=1, dtype=np.int64).astype(np.int32)
    return offs, sums


def _any_unsafe_row(x: npt.NDArray[np.uint8], packed: PackedLinearWeight) -> bool:
    m = x.shape[0]
    guard = packed.guard(m, packed.lda, True, None)
    assert guard is not None
    return unsafe_rows(x.reshape(-1), guard, m) is not None


def _fast_zp(value: object, name: str) -> int:
    if type(value) is int and 0 <= value <= 255:
        return value
    return check_zero_point(name, value, 0, 255)  # type: ignore[arg-type]


def _is_plain(x: object, dtype: type[np.generic]) -> bool:
    """Fast accept for the common case; anything else goes through check_array."""
    return (
        type(x) is np.ndarray
        and x.dtype == dtype
        and x.ndim >= 1
        and x.size > 0
        and x.flags.c_contiguous
        and x.flags.aligned
    )


def linear(
    x: npt.NDArray[np.uint8],
    packed: PackedLinearWeight,
    x_scale: float,
    x_zero_point: int,
    out_scale: float,
    out_zero_point: int,
    *,
    relu: bool = False,
    num_threads: int | None = None,
    lut: npt.NDArray[np.uint8] | None = None,
) -> npt.NDArray[np.uint8]:
    """Quantized ``x @ W.T + bias`` requantized to uint8 [..., N] (relu fused if asked).

    ``lut``: a uint8[256] table (``build_lut``) applied to the output codes in the epilogue,
    after relu: exactly ``apply_lut(linear(...), lut)`` without a second pass.
    """
    if type(packed) is not PackedLinearWeight:
        raise KernelError(f"packed: expected a PackedLinearWeight, got {type(packed).__name__}")
    # uint8 data is always aligned, so contiguity, rank and size are all the fast path checks
    flags = x.flags if type(x) is np.ndarray else None
    if not (flags is not None and x.dtype == np.uint8 and x.ndim and x.size and flags.c_contiguous):
        x = check_array("x", x, np.uint8, None)  # a subclass (np.memmap) becomes a plain view
        if not x.ndim:
            raise KernelError(f"x: expected at least 1 dimension [..., K], got shape {x.shape}")
        flags = x.flags
    # epilogue() and colcorr() validate float scales on their first use (cache miss); anything
    # else first becomes a float here (None would mean "float output" to epilogue())
    if type(x_scale) is not float:
        x_scale = check_scale("x_scale", x_scale)
    if type(out_scale) is not float:
        out_scale = check_scale("out_scale", out_scale)
    a_zp = x_zero_point
    if not (type(a_zp) is int and 0 <= a_zp <= 255):
        a_zp = check_zero_point("x_zero_point", x_zero_point, 0, 255)
    o_zp = out_zero_point
    if not (type(o_zp) is int and 0 <= o_zp <= 255):
        o_zp = check_zero_point("out_zero_point", out_zero_point, 0, 255)
    qmin, qmax, table = epilogue_lut(lut, o_zp if relu else 0)
    if (num_threads == 1 and type(num_threads) is int) or (
        # small products run on one thread whatever the setting (a parallel launch costs more)
        x.size // packed.k * packed.n_padded * packed.nk < SERIAL_BELOW[packed.kernel]
        and (num_threads is None or (type(num_threads) is int and 1 < num_threads <= max_threads()))
    ):
        threads = 1
    else:
        threads = apply_num_threads(num_threads, "linear")
    fast = packed.serial_u8
    # leading dimensions of a C-contiguous x ([B, S, K], a transformer's activations) are rows
    rows2d = x if x.ndim <= 2 else x.reshape(-1, x.shape[-1])
    if (
        fast is not None
        and threads == 1
        and rows2d.ndim == 2
        and rows2d.shape[1] == packed.k == packed.lda
        # guarded weights: only when no row holds a pair past the limit
        and not (packed.guarded and _any_unsafe_row(rows2d, packed))
    ):
        row_dims = x.shape[:-1]
        x = rows2d
        key = (x_scale, out_scale, a_zp)
        floats = type(x_scale) is float and type(out_scale) is float
        params = packed._fast.get(key) if floats else None
        if params is None:
            params = (*packed.epilogue(x_scale, out_scale), packed.colcorr(a_zp))
            if floats and len(packed._fast) < _CACHE_LIMIT:
                packed._fast[key] = params
        biasq, mult, colcorr = params
        # the common small-batch case, without the general path's bookkeeping (M = 1 is
        # dominated by per-call overhead: every microsecond here is ~10 % of the call)
        m = x.shape[0]
        rows = packed._rows.get(m)
        rowoffs, rowsum = rows if rows is not None else packed.rows(m)
        if packed.has_weight_zp:
            rowsum = x.sum(axis=1, dtype=np.int64).astype(np.int32)
        res = np.empty((m, packed.n_padded), np.uint8)
        # with VBMI a real table runs as one pass over the codes, ~10x cheaper than the
        # epilogue's lane-by-lane lookup (as run_gemm does it)
        table_pass = table_as_pass(table)
        args = (
            x.reshape(-1),
            rowoffs,
            m,
            packed.koffs,
            packed.nk,
            packed.packed,
            packed.npanels,
            res.reshape(-1),
            packed.n_padded,
            colcorr,
            packed.zero_points,
            rowsum,
            biasq,
            mult,
            o_zp,
            qmin,
            qmax,
            serial_block_rows(m, packed.lda),
            NO_RESIDUAL,
            NO_ADD,
            NO_LUT if table_pass else table,
        )
        # the compiled entry point skips numba's per-call type dispatch (~0.4 us); it is
        # looked up by the exact argument types once, through the dispatcher
        writeable = flags.writeable
        entry = packed._entry.get(writeable)
        if entry is None:
            fast(*args)
            entry = compiled_entry_point(fast, args)
            if entry is not None:
                packed._entry[writeable] = entry
        else:
            entry(*args)
        if table_pass:
            flat = res.reshape(-1)
            apply_table(flat, table, flat, 1)
        cut = res if packed.n_padded == packed.n else np.ascontiguousarray(res[:, : packed.n])
        return cut if len(row_dims) == 1 else cut.reshape(*row_dims, packed.n)
    biasq, mult = packed.epilogue(x_scale, out_scale)
    a, m, lead = _activation_rows(x, packed, "x")
    rowoffs, rowsum = _rows_and_sums(a, m, packed)
    out = run_gemm(
        packed.kernel,
        a,
        rowoffs,
        packed.koffs,
        packed.packed,
        packed.n,
        packed.colcorr(a_zp),
        packed.zero_points,
        rowsum,
        biasq,
        mult,
        o_zp,
        qmin,
        False,
        threads,
        lut=table,
        qmax=qmax,
        guard=packed.guard(m, packed.lda, True, None),
    )
    if len(lead) == 1:
        return out  # type: ignore[return-value]
    return out.reshape((*lead, packed.n))  # type: ignore[return-value]


class FloatColumns:
    """Input channels a Linear computes in float beside its int8 product (an outlier split,
    as in LLM.int8()): :func:`linear_float` adds ``x[..., channels] @ weight.T``, from the
    float ``x`` the codes came from, to its result before the activation.

    Args:
        channels: integer array [S]: the input channels (each in ``[0, K)`` of the Linear).
        weight: float32 [N, S]: those channels' columns of the float weight (torch's layout).
    """

    def __init__(self, channels: npt.ArrayLike, weight: npt.NDArray[np.float32]) -> None:
        ch = np.asarray(channels)
        if ch.ndim != 1 or ch.size == 0 or ch.dtype.kind not in "iu":
            raise KernelError(
                f"channels: expected a non-empty 1-D integer array, got {ch.dtype} of shape "
                f"{ch.shape}"
            )
        if int(ch.min()) < 0:
            raise KernelError(f"channels: input channels are >= 0, got {int(ch.min())}")
        w = check_array("weight", weight, np.float32, 2, contiguous=False)
        if w.shape[1] != ch.shape[0]:
            raise KernelError(
                f"weight: expected [N, {ch.shape[0]}] (one column per channel), got {w.shape}"
            )
        if not np.all(np.isfinite(w)):
            raise KernelError("weight: the float columns must be finite")
        self.channels = np.ascontiguousarray(ch, dtype=np.int64)
        self.k_needed = int(ch.max()) + 1  # a Linear with at least this many input channels
        self.n = int(w.shape[0])
        # [S, N]: each channel's row of output contributions, read along the output row
        self.weight_t = np.ascontiguousarray(w.T)

    def __repr__(self) -> str:
        return f"FloatColumns(channels={self.channels.tolist()}, N={self.n})"


def linear_float(
    x: npt.NDArray[np.uint8],
    packed: PackedLinearWeight,
    x_scale: float,
    x_zero_point: int,
    *,
    activation: str = "none",
    columns: FloatColumns | None = None,
    float_input: npt.NDArray[np.float32] | None = None,
    codes: npt.NDArray[np.uint8] | None = None,
    codes_qparams: tuple[float, int] | None = None,
    num_threads: int | None = None,
) -> npt.NDArray[np.float32]:
    """Float ``act(x @ W.T + bias)`` [..., N] from uint8 codes ``x`` on static qparams.

    The integer accumulator becomes ``fma(float(acc), float32(x_scale * w_scale[j]), bias[j])``
    in float32, with no output quantization: for a layer whose consumer runs in float (a
    transformer's residual add), where requantizing and dequantizing would only lose precision.
    ``activation`` as in :func:`linear_dynamic`.

    ``columns`` (:class:`FloatColumns`) with ``float_input`` (float32, ``x``'s shape: the
    values ``x``'s codes came from): ``float_input[..., channels] @ weight.T`` is added before
    the activation. ``codes`` (uint8 [..., N], C-contiguous) with ``codes_qparams``
    ``(scale, zero_point)``: the result is also quantized into ``codes`` as
    ``quantize_per_tensor`` does, in the same pass.
    """
    if type(packed) is not PackedLinearWeight:
        raise KernelError(f"packed: expected a PackedLinearWeight, got {type(packed).__name__}")
    act = ACTIVATIONS.get(activation) if isinstance(activation, str) else None
    if act is None:
        raise KernelError(f"activation: expected one of {_ACTIVATIONS}, got {activation!r}")
    x = check_array("x", x, np.uint8, None)
    if not x.ndim:
        raise KernelError(f"x: expected at least 1 dimension [..., K], got shape {x.shape}")
    a_zp = check_zero_point("x_zero_point", x_zero_point, 0, 255)
    biasq, mult = packed.epilogue(check_scale("x_scale", x_scale), None)
    threads = apply_num_threads(num_threads, "linear_float")
    a, m, lead = _activation_rows(x, packed, "x")
    epilogue = _float_epilogue(packed, act, x.shape, columns, float_input, codes, codes_qparams)
    rowoffs, rowsum = _rows_and_sums(a, m, packed)
    out = run_gemm(packed.kernel, a, rowoffs, packed.koffs, packed.packed, packed.n,
                   packed.colcorr(a_zp), packed.zero_points, rowsum, biasq, mult, 0, 0, True,
                   threads, epilogue=epilogue,
                   guard=packed.guard(m, packed.lda, True, None))  # fmt: skip
    return out.reshape((*lead, packed.n))  # type: ignore[return-value]


def _float_epilogue(
    packed: PackedLinearWeight,
    act: int,
    shape: tuple[int, ...],
    columns: FloatColumns | None,
    float_input: npt.NDArray[np.float32] | None,
    codes: npt.NDArray[np.uint8] | None,
    codes_qparams: tuple[float, int] | None,
) -> FloatEpilogue | None:
    """``linear_float``'s work after ``fma(acc, mult, bias)``: the float columns, ``act``
    and the codes (None when there is none)."""
    if (columns is None) != (float_input is None):
        raise KernelError(
            "columns, float_input: give both (the float columns and the float values x's codes "
            "came from) or neither"
        )
    if (codes is None) != (codes_qparams is None):
        raise KernelError("codes, codes_qparams: give both (the array and its qparams) or neither")
    n = packed.n
    fields: dict[str, Any] = {}
    if columns is not None:
        if type(columns) is not FloatColumns:
            raise KernelError(f"columns: expected FloatColumns, got {type(columns).__name__}")
        if columns.n != packed.n or columns.k_needed > packed.k:
            raise KernelError(
                f"columns: {columns!r} does not fit the weight [{packed.n}, {packed.k}] "
                f"(needs N={packed.n} and channels below {packed.k})"
            )
        xf = check_array("float_input", float_input, np.float32, None)
        if xf.shape != shape:
            raise KernelError(f"float_input: expected x's shape {shape}, got {xf.shape}")
        m = xf.size // packed.k
        vals = np.empty(m * columns.channels.shape[0], np.float32)
        gather_columns(xf.reshape(-1), packed.k, m, columns.channels, vals)
        fields.update(vals=vals, weight_t=columns.weight_t.reshape(-1))
    if codes is not None and codes_qparams is not None:
        want = (*shape[:-1], packed.n)
        if type(codes) is not np.ndarray or codes.dtype != np.uint8 or codes.shape != want:
            got = codes.shape if isinstance(codes, np.ndarray) else type(codes).__name__
            raise KernelError(f"codes: expected a uint8 array of shape {want}, got {got}")
        if not (codes.flags.c_contiguous and codes.flags.writeable):
            raise KernelError("codes: must be C-contiguous and writeable (the pass fills it)")
        scale = check_scale("codes_qparams scale", codes_qparams[0])
        zp = check_zero_point("codes_qparams zero point", codes_qparams[1], 0, 255)
        # quantize_per_tensor's float32 1 / scale
        fields.update(codes=codes.reshape(-1), inv=np.float32(1.0) / np.float32(scale), zp=zp)
    if act == ACT_NONE and not fields:
        return None  # nothing after the GEMM's own epilogue (no record built per call)
    return float_epilogue(n, act, **fields)


def qparams_from_range(lo: float, hi: float) -> tuple[float, int]:
    """torch's dynamic activation qparams for the range [lo, hi] (uint8, widened to 0)."""
    scale, zp = dynamic_qparams(float(lo), float(hi))
    return float(scale), int(zp)


def choose_dynamic_qparams(x: npt.NDArray[np.float32]) -> tuple[float, int]:
    """torch's dynamic activation qparams: uint8 [0, 255], range widened to include 0."""
    return qparams_from_range(float(x.min()), float(x.max()))


def quantize_activation(
    x: npt.NDArray[np.float32], scale: float, zero_point: int
) -> npt.NDArray[np.uint8]:
    """uint8 ``clamp(rint(fma(x, float32(1/scale), zp)))``: fbgemm's activation quantizer."""
    inv = np.float32(np.float32(1.0) / np.float32(scale))
    out = np.empty(x.shape, np.uint8)
    quantize_u8_fma(x.reshape(-1), inv, zero_point, out.reshape(-1))
    return out


_ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh")


def linear_dynamic(
    x: npt.NDArray[np.float32],
    packed: PackedLinearWeight,
    *,
    per_row: bool = False,
    activation: str = "none",
    num_threads: int | None = None,
) -> npt.NDArray[np.float32]:
    """Float ``act(x @ W.T + bias)`` with per-call uint8 quantization of ``x``.

    ``per_row=False``: one scale and zero point for all of ``x`` (torch's dynamic rule,
    bit-identical to torch.ao's dynamic linear); ``True``: one per row of ``x`` (per token;
    symmetric weights only; the rule is in the module docstring of ``_dynamic_act``).
    ``activation``: ``"none"``, ``"relu"``, ``"gelu"`` (erf) or ``"gelu_tanh"``, applied in
    float32 to each output block while it is in cache.
    """
    if not isinstance(packed, PackedLinearWeight):
        raise KernelError(f"packed: expected a PackedLinearWeight, got {type(packed).__name__}")
    act = ACTIVATIONS.get(activation) if isinstance(activation, str) else None
    if act is None:
        raise KernelError(f"activation: expected one of {_ACTIVATIONS}, got {activation!r}")
    if type(per_row) is not bool:
        raise KernelError(f"per_row: expected True or False, got {per_row!r}")
    if per_row and packed.has_weight_zp:
        raise KernelError(
            "per_row=True needs symmetric weights (every weight zero point 0); this weight has "
            "non-zero zero points: quantize it with a symmetric qscheme or use per_row=False"
        )
    xf = check_array("x", x, np.float32, None)
    if xf.ndim < 1:
        raise KernelError("x: expected at least 1 dimension [..., K]")
    if xf.shape[-1] != packed.k:
        raise KernelError(
            f"x: last dimension {xf.shape[-1]} does not match the weight's K={packed.k} "
            f"(x has shape {xf.shape}, weight is [{packed.n}, {packed.k}])"
        )
    threads = apply_num_threads(num_threads, "linear_dynamic")
    lead = xf.shape[:-1]
    m = xf.size // packed.k
    x2 = xf.reshape(m, packed.k)
    # quantized rows go straight into the layout the kernels read: int16 for AVX2, rows
    # padded to whole 4-byte loads
    # weights past 7 bits run the int16 kernels: dynamic codes span [0, 255], where the
    # byte kernels' pairs would saturate on most rows
    kernel, bp, koffs = packed.kernel, packed.packed, packed.koffs
    if packed.guarded:
        kernel, bp, koffs = "avx2", packed.exact_packed(), packed._exact_koffs
    a: npt.NDArray[Any] = np.empty((m, packed.lda), np.int16 if kernel == "avx2" else np.uint8)
    rowoffs, _ = packed.rows(m)
    epilogue: FloatEpilogue | None
    if per_row:
        scales = np.empty(m, np.float32)
        zps = np.empty(m, np.int32)
        if quantize_rows(x2, a, scales, zps):
            raise KernelError(_NON_FINITE)
        rowsum = zps  # - colsum[j] * zp[i] through the kernels' weight-zero-point term
        colcorr = packed.zero_colcorr
        wzp = packed.colsum32
        biasq, mult = packed.epilogue_unit()
        epilogue = float_epilogue(packed.n, act, rowscale=scales, bias=packed.bias_padded)
    else:
        lo, hi, bad = tensor_range(xf.reshape(-1))
        if bad:
            raise KernelError(_NON_FINITE)
        a_s, a_zp = qparams_from_range(float(lo), float(hi))
        problem = None if a_s >= F32_TINY else f32_problem(a_s)
        if problem is not None:  # only for inputs whose whole range is below ~1e-36
            raise KernelError(
                f"x: its dynamic activation scale {a_s!r} (from x's range) {problem}; "
                "scale the input up before the layer"
            )
        inv = np.float32(np.float32(1.0) / np.float32(a_s))
        rowsum = np.empty(m, np.int32)
        quantize_rows_fixed(x2, inv, a_zp, a, rowsum, packed.has_weight_zp)
        colcorr = packed.colcorr(a_zp)
        wzp = packed.zero_points
        biasq, mult = packed.dynamic_epilogue(a_s)
        epilogue = float_epilogue(packed.n, act) if act != ACT_NONE else None
    out = run_gemm(kernel, a.reshape(-1), rowoffs, koffs, bp, packed.n,
                   colcorr, wzp, rowsum, biasq, mult, 0, 0, True, threads,
                   epilogue=epilogue)  # fmt: skip
    return out.reshape((*lead, packed.n))


_NON_FINITE = "x: contains NaN or infinity; dynamic quantization needs finite input"
