"""Weight-only group-quantized linear for decoder LLMs (llama.cpp's Q4_0 / Q8_0 kind).

Weights are int4 or int8 codes with one float32 scale (and, asymmetric, one zero point) per
group of ``group_size`` consecutive input features of an output feature. Activations stay
float32 outside the call; inside, each row is quantized to int8 per group and the products
are summed exactly in int32. The rule, the same bytes on every target:

1. per row ``m`` and group ``g`` of ``x``: ``sx = max|x_g| / 127`` (float32 division);
   ``qx = clamp(rint(x / sx), -127, 127)`` (``x / sx`` a float32 division, ``rint`` half to
   even); every code 0 when ``sx`` is 0 (an all-zero group, or one whose maximum divided by
   127 underflows float32);
2. per row ``m`` and output feature ``n``: ``acc = 0.0f``, then for each group ``g`` in order
   ``isum = sum_k w[n, k] * qx[m, k] - zp[n, g] * sum_k qx[m, k]`` (exact, int32) and
   ``acc = acc + float32(isum) * (sw[n, g] * sx[m, g])``, the two products and the sum each
   rounded to float32 (never fused);
3. ``out[m, n] = acc + bias[n]`` in float32 (no bias: ``acc``).

A row of ``x`` holding NaN or infinity raises ``KernelError`` naming the row, before any
output is computed, on every target.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from quantbridge.kernels._checks import check_array, f32_problem, plain_array
from quantbridge.kernels._errors import KernelError
from quantbridge.kernels._numba_compat import compiled_entry_point
from quantbridge.kernels._targets import ARM_TARGETS, resolve_target
from quantbridge.kernels._threads import apply_num_threads, with_threads
from quantbridge.kernels._wo_kernels import DRIVERS, PANEL, ROWS

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
# one thread below this many weight bytes x rows: a parallel launch costs more than it saves
_PARALLEL_MIN = 1 << 16
# activation rows per tile: a chunk of int8 rows this large stays in L2 beside the panel
_ROW_CHUNK_BYTES = 1 << 18
_ARRAY_KEYS = ("codes", "scales", "zero_points", "bits", "group_size")


def _family(target: str) -> str:
    """The kernels that serve ``target``: the Arm targets have none of their own in this
    family yet and run the portable ones."""
    return "generic" if target in ARM_TARGETS else target


def code_shift(target: str, bits: int, symmetric: bool) -> int:
    """What the packed layout of ``target`` adds to every code (and to the zero points).

    4-bit codes are stored as unsigned nibbles (symmetric ``code + 8``: llama.cpp's Q4_0);
    8-bit codes as unsigned bytes for the ``vpdpbusd`` targets and generic (symmetric
    ``code + 128``), as signed bytes for ``avx2``'s sign trick (asymmetric ``code - 128``).
    """
    if bits == 4:
        return 8 if symmetric else 0
    if target == "avx2":
        return 0 if symmetric else -128
    return 128 if symmetric else 0


def _pack_panels(stored: npt.NDArray[np.int16], nr: int, bits: int) -> npt.NDArray[np.uint8]:
    """Stored codes [Np, K] as the panel layout: 8-bit ``[Np/nr][K/4][nr][4]``; 4-bit
    ``[Np/nr][K/8][nr][4]``, byte ``(t, j, b)`` holding k = 8t + b in its low nibble and
    k = 8t + 4 + b in its high one."""
    npad, k = stored.shape
    panels = npad // nr
    raw = (stored & 0xFF).astype(np.uint8)
    if bits == 8:
        out = raw.reshape(panels, nr, k // 4, 4).transpose(0, 2, 1, 3)
    else:
        split = raw.reshape(panels, nr, k // 8, 2, 4).transpose(0, 2, 3, 1, 4)
        out = split[:, :, 0] | (split[:, :, 1] << 4)
    return np.ascontiguousarray(out).reshape(-1)


def _unpack_panels(
    codes: npt.NDArray[np.uint8], nr: int, bits: int, k: int, signed: bool
) -> npt.NDArray[np.int16]:
    """The inverse of ``_pack_panels``: stored codes [Np, K] as int16."""
    panels = codes.size * 8 // (bits * nr * k)
    if bits == 8:
        raw = codes.reshape(panels, k // 4, nr, 4).transpose(0, 2, 1, 3).reshape(-1, k)
        stored: npt.NDArray[np.int16] = (raw.view(np.int8) if signed else raw).astype(np.int16)
        return stored
    b = codes.reshape(panels, k // 8, nr, 4)
    both = np.stack([b & 15, b >> 4], axis=2)  # [P][K/8][2][nr][4]
    stored = both.transpose(0, 3, 1, 2, 4).reshape(-1, k).astype(np.int16)
    return stored


def _by_panel(values: npt.NDArray[Any], nr: int, fill: Any) -> npt.NDArray[Any]:
    """Per (output feature, group) values [N, G] as ``[Np/nr][G][nr]``, padding ``fill``."""
    n, ng = values.shape
    npad = -(-n // nr) * nr
    padded = np.full((npad, ng), fill, values.dtype)
    padded[:n] = values
    return np.ascontiguousarray(padded.reshape(npad // nr, nr, ng).transpose(0, 2, 1)).reshape(-1)


def _from_panels(values: npt.NDArray[Any], nr: int, n: int, ng: int) -> npt.NDArray[Any]:
    """The inverse of ``_by_panel``: [N, G]."""
    per_feature: npt.NDArray[Any] = values.reshape(-1, ng, nr).transpose(0, 2, 1)
    return per_feature.reshape(-1, ng)[:n]


def _frozen(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    array.flags.writeable = False
    return array


# the zero points a symmetric weight hands the drivers (never read)
_NO_ZPS = _frozen(np.zeros(0, np.uint8))


class PackedGroupWeight:
    """An immutable int4 / int8 weight [N, K] with one float32 scale (and, asymmetric, one
    zero point) per group of ``group_size`` input features, packed for one kernel target.

    Made by ``pack_group_weight`` or ``PackedGroupWeight.from_arrays``; run by
    ``linear_weight_only``. Pickles through ``to_arrays`` (unpickling packs again, for the
    target it was packed for, which this CPU must run).
    """

    __slots__ = (
        "_bits", "_codes", "_group_size", "_k", "_n", "_npanels", "_nr", "_scales", "_shift",
        "_target", "_zero_bias", "_zps", "_zps_arg",
    )  # fmt: skip
    _bits: int
    _codes: npt.NDArray[np.uint8]
    _group_size: int
    _k: int
    _n: int
    _npanels: int  # panels of _nr output features
    _nr: int
    _scales: npt.NDArray[np.float32]
    _shift: int  # added to every stored code (code_shift)
    _target: str
    _zero_bias: npt.NDArray[np.float32]  # the padded bias of a call without one
    _zps: npt.NDArray[np.uint8] | None
    _zps_arg: npt.NDArray[np.uint8]  # what the drivers get: _zps, or an empty array

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise KernelError(
            "PackedGroupWeight: not built directly; use pack_group_weight(codes, scales, "
            "zero_points, bits=..., group_size=...) or PackedGroupWeight.from_arrays(arrays)"
        )

    @classmethod
    def _create(
        cls,
        codes: npt.NDArray[np.uint8],
        scales: npt.NDArray[np.float32],
        zps: npt.NDArray[np.uint8] | None,
        *,
        bits: int,
        group_size: int,
        n: int,
        k: int,
        target: str,
    ) -> PackedGroupWeight:
        self = object.__new__(cls)
        nr = PANEL[_family(target)]
        npanels = -(-n // nr)
        fields = {
            "_bits": bits,
            "_codes": _frozen(codes),
            "_group_size": group_size,
            "_k": k,
            "_n": n,
            "_npanels": npanels,
            "_nr": nr,
            "_scales": _frozen(scales),
            "_shift": code_shift(target, bits, zps is None),
            "_target": target,
            "_zero_bias": _frozen(np.zeros(npanels * nr, np.float32)),
            "_zps": None if zps is None else _frozen(zps),
            "_zps_arg": _NO_ZPS if zps is None else zps,
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        return self

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("PackedGroupWeight is immutable; pack a new one")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("PackedGroupWeight is immutable; pack a new one")

    def __reduce__(self) -> tuple[Any, tuple[dict[str, npt.NDArray[Any]], str]]:
        return _from_pickle, (self.to_arrays(), self._target)

    def __copy__(self) -> PackedGroupWeight:
        return self  # immutable: a copy would be the same in every way

    def __deepcopy__(self, memo: dict[int, object]) -> PackedGroupWeight:
        return self

    def __repr__(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        return (
            f"PackedGroupWeight(out_features={self._n}, in_features={self._k}, "
            f"bits={self._bits}, group_size={self._group_size}, {kind}, "
            f"target={self._target!r})"
        )

    @property
    def bits(self) -> int:
        """4 or 8."""
        return self._bits

    @property
    def group_size(self) -> int:
        """Input features per scale: 32, 64 or 128."""
        return self._group_size

    @property
    def symmetric(self) -> bool:
        """True when there are no zero points (signed codes)."""
        return self._zps is None

    @property
    def in_features(self) -> int:
        """K."""
        return self._k

    @property
    def out_features(self) -> int:
        """N."""
        return self._n

    @property
    def target(self) -> str:
        """The kernel target the layout is packed for."""
        return self._target

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight: codes, scales and zero points (padding included)."""
        zps = 0 if self._zps is None else self._zps.nbytes
        return int(self._codes.nbytes + self._scales.nbytes + zps)

    def _codes_nk(self) -> npt.NDArray[np.int16]:
        signed = self._target == "avx2" and self._bits == 8
        stored = _unpack_panels(self._codes, self._nr, self._bits, self._k, signed)
        codes: npt.NDArray[np.int16] = (stored[: self._n] - self._shift).astype(np.int16)
        return codes

    def _scales_ng(self) -> npt.NDArray[np.float32]:
        return _from_panels(self._scales, self._nr, self._n, self._k // self._group_size)

    def _zps_ng(self) -> npt.NDArray[np.uint8] | None:
        if self._zps is None:
            return None
        return _from_panels(self._zps, self._nr, self._n, self._k // self._group_size)

    # --- conversions

    def dequantize(self) -> npt.NDArray[np.float32]:
        """float32 [N, K]: ``float32(code - zp) * scale`` per group (zp 0 when symmetric)."""
        ng = self._k // self._group_size
        codes = self._codes_nk().reshape(self._n, ng, self._group_size)
        zps = self._zps_ng()
        if zps is not None:
            codes = codes - zps.astype(np.int16)[:, :, None]
        out = codes.astype(np.float32) * self._scales_ng()[:, :, None]
        return out.reshape(self._n, self._k)

    def to_arrays(self) -> dict[str, npt.NDArray[Any]]:
        """The weight as plain arrays, independent of the target (for state dicts):

        - ``codes``: uint8 ``[N, K * bits / 8]``, row-major; 8-bit: one code a byte (int8
          codes as their two's complement byte); 4-bit: byte ``j`` holds code ``2j`` in its
          low nibble and ``2j + 1`` in its high one (symmetric codes as 4-bit two's
          complement);
        - ``scales``: float32 ``[N, K / group_size]``;
        - ``zero_points``: uint8 ``[N, K / group_size]``, asymmetric weights only;
        - ``bits``, ``group_size``: int64 scalars (0-d arrays).
        """
        codes = self._codes_nk()
        row: npt.NDArray[np.uint8]
        if self._bits == 8:
            row = codes.astype(np.int8 if self.symmetric else np.uint8).view(np.uint8)
        else:
            nibbles = (codes & 15).astype(np.uint8)
            row = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).astype(np.uint8)
        arrays: dict[str, npt.NDArray[Any]] = {
            "codes": np.ascontiguousarray(row),
            "scales": np.ascontiguousarray(self._scales_ng()),
            "bits": np.array(self._bits, np.int64),
            "group_size": np.array(self._group_size, np.int64),
        }
        zps = self._zps_ng()
        if zps is not None:
            arrays["zero_points"] = np.ascontiguousarray(zps)
        return arrays

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any], target: str | None = None) -> PackedGroupWeight:
        """Pack again what ``to_arrays`` gave, for ``target``; every array is checked as
        ``pack_group_weight`` checks its arguments."""
        if not isinstance(arrays, Mapping):
            raise KernelError(
                f"arrays: expected a mapping of names to arrays (what to_arrays returns), "
                f"got {type(arrays).__name__}"
            )
        unknown = sorted(str(key) for key in arrays if key not in _ARRAY_KEYS)
        if unknown:
            raise KernelError(
                f"arrays: unknown keys {unknown}; expected {list(_ARRAY_KEYS)} "
                "(zero_points only for asymmetric weights)"
            )
        missing = [key for key in _ARRAY_KEYS if key != "zero_points" and key not in arrays]
        if missing:
            raise KernelError(
                f"arrays: missing {missing}; pass the whole dict PackedGroupWeight.to_arrays "
                "returned"
            )
        bits = _scalar_int("arrays['bits']", arrays["bits"])
        group_size = _scalar_int("arrays['group_size']", arrays["group_size"])
        if bits not in BITS:
            raise KernelError(f"arrays['bits']: expected 4 or 8, got {bits}")
        zero_points = arrays.get("zero_points")
        packed = check_array("arrays['codes']", arrays["codes"], np.uint8, 2, contiguous=False)
        if bits == 8:
            codes: npt.NDArray[Any] = packed if zero_points is not None else packed.view(np.int8)
        else:
            nibbles = np.empty((packed.shape[0], 2 * packed.shape[1]), np.uint8)
            nibbles[:, 0::2] = packed & 15
            nibbles[:, 1::2] = packed >> 4
            if zero_points is None:  # 4-bit two's complement
                codes = ((nibbles.astype(np.int8) ^ 8) - 8).astype(np.int8)
            else:
                codes = nibbles
        return pack_group_weight(
            codes, arrays["scales"], zero_points, bits=bits, group_size=group_size, target=target
        )


def _from_pickle(arrays: dict[str, npt.NDArray[Any]], target: str) -> PackedGroupWeight:
    return PackedGroupWeight.from_arrays(arrays, target)


def _scalar_int(name: str, value: object) -> int:
    if isinstance(value, np.ndarray):
        if value.size != 1 or value.dtype.kind not in "iu":
            raise KernelError(
                f"{name}: expected one integer (a 0-d int64 array), got dtype {value.dtype} "
                f"shape {value.shape}"
            )
        return int(value.reshape(-1)[0])
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    raise KernelError(f"{name}: expected one integer (a 0-d int64 array), got {value!r}")


def _first_bad(mask: npt.NDArray[np.bool_]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def _check_option(name: str, value: object, allowed: tuple[int, ...]) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value not in allowed:
        raise KernelError(f"{name}: expected one of {list(allowed)}, got {value!r}")
    return int(value)


def pack_group_weight(
    codes: npt.NDArray[Any],
    scales: npt.NDArray[np.float32],
    zero_points: npt.NDArray[Any] | None = None,
    *,
    bits: int,
    group_size: int,
    target: str | None = None,
) -> PackedGroupWeight:
    """Pack group-quantized weight codes for ``linear_weight_only``.

    Args:
        codes: ``[N, K]`` (out_features x in_features). Symmetric (``zero_points`` None): int8
            in [-8, 7] for ``bits=4``, [-128, 127] for ``bits=8`` (-128 included: every target
            computes it exactly). Asymmetric: uint8 in [0, 15] / [0, 255].
        scales: float32 ``[N, K // group_size]``, each a normal float32 number > 0 (finite,
            not subnormal).
        zero_points: None (symmetric), or integers ``[N, K // group_size]`` in the codes'
            range.
        bits: 4 or 8.
        group_size: 32, 64 or 128 input features per scale; K must be a multiple of it.
        target: kernel target (``resolve_target``); None picks the default.

    Every violation raises ``KernelError`` naming the argument, what was expected and how to
    fix it.
    """
    bits = _check_option("bits", bits, BITS)
    group_size = _check_option("group_size", group_size, GROUP_SIZES)
    target = resolve_target(target)
    symmetric = zero_points is None
    want = np.int8 if symmetric else np.uint8
    arr = plain_array("codes", codes)
    if arr.dtype != want:
        fix = (
            "pass int8 codes, or zero_points with uint8 codes for asymmetric weights"
            if symmetric
            else "pass uint8 codes (asymmetric codes are unsigned), or zero_points=None for "
            "symmetric int8 codes"
        )
        kind = "symmetric (zero_points is None)" if symmetric else "asymmetric (zero_points given)"
        raise KernelError(f"codes: expected dtype {np.dtype(want)} for {kind} codes, got "
                          f"{arr.dtype}; {fix}")  # fmt: skip
    arr = check_array("codes", arr, want, 2, contiguous=False)
    n, k = arr.shape
    if k % group_size:
        raise KernelError(
            f"codes: in_features K={k} is not a multiple of group_size={group_size}; pad each "
            f"row with zero codes (and x with zeros) to a multiple of {group_size}, or choose a "
            f"group size that divides K"
        )
    ng = k // group_size
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if symmetric else (0, (1 << bits) - 1)
    if bits == 4:
        outside = (arr < lo) | (arr > hi)
        if outside.any():
            at = _first_bad(outside)
            kind = "symmetric" if symmetric else "asymmetric"
            raise KernelError(
                f"codes{list(at)}: {int(arr[at])} is outside [{lo}, {hi}], the range of "
                f"{kind} 4-bit codes; clip the codes to it or pack with bits=8"
            )
    sc = check_array("scales", scales, np.float32, 2, contiguous=False)
    if sc.shape != (n, ng):
        raise KernelError(
            f"scales: expected shape (N, K // group_size) = ({n}, {ng}), got {sc.shape}"
        )
    with np.errstate(invalid="ignore"):
        bad = ~((sc >= np.finfo(np.float32).tiny) & (sc <= np.finfo(np.float32).max))
    if bad.any():
        at = _first_bad(bad)
        raise KernelError(
            f"scales{list(at)}: {float(sc[at])!r} {f32_problem(float(sc[at]))}; every scale "
            "must be a finite, normal float32 number > 0 (kernels compute in float32); check "
            "the quantizer that produced it"
        )
    zps: npt.NDArray[np.uint8] | None = None
    if zero_points is not None:
        z = plain_array("zero_points", zero_points)
        if z.dtype.kind not in "iu":
            raise KernelError(
                f"zero_points: expected an integer array, got dtype {z.dtype}; pass "
                "np.asarray(zero_points, np.uint8)"
            )
        if z.shape != (n, ng):
            raise KernelError(
                f"zero_points: expected shape (N, K // group_size) = ({n}, {ng}), got {z.shape}"
            )
        outside = (z < lo) | (z > hi)
        if outside.any():
            at = _first_bad(outside)
            raise KernelError(
                f"zero_points{list(at)}: {int(z[at])} is outside [{lo}, {hi}], the range of "
                f"{bits}-bit asymmetric codes; clip the zero points to it"
            )
        zps = z.astype(np.uint8)
    nr = PANEL[_family(target)]
    shift = code_shift(target, bits, symmetric)
    npad = -(-n // nr) * nr
    stored = np.full((npad, k), shift, np.int16)
    stored[:n] = arr
    stored[:n] += np.int16(shift)
    return PackedGroupWeight._create(
        _pack_panels(stored, nr, bits),
        _by_panel(sc.astype(np.float32), nr, np.float32(0.0)),
        None if zps is None else _by_panel(zps, nr, np.uint8(0)),
        bits=bits,
        group_size=group_size,
        n=n,
        k=k,
        target=target,
    )


def linear_weight_only(
    x: npt.NDArray[np.float32],
    packed: PackedGroupWeight,
    bias: npt.NDArray[np.float32] | None = None,
    *,
    num_threads: int | None = None,
) -> npt.NDArray[np.float32]:
    """float32 ``x @ W.T + bias`` for a group-quantized weight, ``x`` ``[..., K]`` (any
    strides) to ``[..., N]``.

    ``x`` is quantized per call, row by row, to int8 per group of ``packed.group_size``, and
    every target computes exactly the rule of this module's docstring (the same bytes): per
    group ``sx = max|x_g| / 127``, ``qx = clamp(rint(x / sx), -127, 127)`` (float32
    division; all 0 when ``sx`` is 0); per output ``acc = acc + float32(isum) * (sw * sx)``
    over the groups in order, with ``isum = sum (w - zp) * qx`` exact in int32 and every
    float32 operation rounded on its own (no FMA); then ``+ bias[n]``. A row holding NaN or
    infinity raises ``KernelError`` naming it. ``num_threads``: as for the other kernels
    (default: ``set_num_threads``' setting); M = 1 runs parallel over output features.
    """
    if not isinstance(packed, PackedGroupWeight):
        raise KernelError(
            f"packed: expected a PackedGroupWeight (pack_group_weight), got {type(packed).__name__}"
        )
    xf = check_array("x", x, np.float32, None, contiguous=False)
    k, n = packed._k, packed._n
    if xf.ndim < 1 or xf.shape[-1] != k:
        raise KernelError(f"x: expected shape [..., K] with K = in_features = {k}, got {xf.shape}")
    lead = xf.shape[:-1]
    m = xf.size // k
    x2 = np.ascontiguousarray(xf.reshape(m, k))
    npanels = packed._npanels
    if bias is None:
        bias_p = packed._zero_bias
    else:
        b = check_array("bias", bias, np.float32, 1, contiguous=False)
        if b.shape != (n,):
            raise KernelError(f"bias: expected shape (N,) = ({n},), got {b.shape}")
        bias_p = np.zeros(npanels * packed._nr, np.float32)
        bias_p[:n] = b
        bias_p.flags.writeable = False  # one array type for the drivers
    threads = apply_num_threads(num_threads, "linear_weight_only")
    target, bits = _family(packed._target), packed._bits
    rows = ROWS.get(target, 1)
    mchunk = min(m, max(rows, _ROW_CHUNK_BYTES // k // rows * rows))
    tiles = npanels * -(-m // mchunk)
    parallel = threads > 1 and tiles > 1 and packed.nbytes * m >= _PARALLEL_MIN
    out = np.empty((m, n), np.float32)
    args = (
        x2, packed._group_size, packed._codes, packed._scales,
        packed._zps_arg, int(packed._zps is not None), packed._shift, bias_p, out, npanels,
        mchunk, bits,
    )  # fmt: skip
    key = (target, 0 if target == "generic" else bits, parallel)
    entry_key = (*key, x2.flags.writeable)
    entry = _ENTRIES.get(entry_key)
    kernel = DRIVERS[key] if entry is None else entry
    run = with_threads(kernel, threads) if parallel else kernel
    bad = run(*args)
    if entry is None:  # later calls skip numba's type dispatch
        entry = compiled_entry_point(DRIVERS[key], args)
        if entry is not None:
            _ENTRIES[entry_key] = entry
    if bad is not None and bad >= 0:  # None: a dry run recorded the call (targets/dry_run.py)
        where = ""
        if len(lead) > 1:
            where = f" (index {tuple(int(i) for i in np.unravel_index(int(bad), lead))})"
        raise KernelError(
            f"x: row {int(bad)}{where} contains NaN or infinity; linear_weight_only quantizes "
            "each row per group and needs finite input"
        )
    return out.reshape((*lead, n))


# (target, bits, parallel, x writeable) -> the compiled entry of that driver for the argument
# types linear_weight_only passes (every other argument's type is fixed)
_ENTRIES: dict[tuple[str, int, bool, bool], Any] = {}
_NO_ZPS = _frozen(np.zeros(0, np.uint8))
