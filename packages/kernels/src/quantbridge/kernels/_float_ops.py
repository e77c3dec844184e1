"""float32 kernels for the ops around a transformer's GEMMs: LayerNorm (+ residual), softmax
(+ scale and additive mask), GELU. Row-wise over the last dimension, vectorized float32 loops
(``_float_math``), parallel over rows when threads allow and the work is large.

Numerics (float32 throughout; reductions are vectorized, so summation order differs from a
sequential sum, and from torch's):

- ``layer_norm(x, weight, bias, eps, residual=r)``: ``h = x + r``; ``mean = sum(h) / n``;
  ``var = sum((h - mean)^2) / n`` (two passes over the row in cache, biased as torch's);
  ``y = (h - mean) * (1 / sqrt(var + eps)) * weight + bias``. Each step rounds as written
  (no FMA contraction); sums run in 16 float lanes, then by pairwise halves.
- ``softmax(x, scale, mask)``: ``v = x * scale + mask`` (mask broadcast over the leading
  dimensions, e.g. [B, 1, 1, S] over [B, H, S, S]); ``y = exp32(v - max(v)) / sum(...)``.
  A row whose values are all ``-inf`` gives NaN, as torch's softmax does.
- ``gelu(x, approximate)``: ``"none"`` is erf-GELU, ``"tanh"`` the tanh form (see
  ``_float_math``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from numba import njit, prange

from quantbridge.kernels._checks import check_array, check_out, check_scale, check_zero_point
from quantbridge.kernels._errors import KernelError
from quantbridge.kernels._float_math import (
    ACT_GELU,
    ACT_GELU_TANH,
    FAST,
    gelu_erf,
    gelu_tanh,
    gelu_vectors,
    layer_norm_row,
    softmax_row,
)
from quantbridge.kernels._qparams import QParams, as_qparams
from quantbridge.kernels._threads import apply_num_threads, with_threads

F32A = npt.NDArray[np.float32]
# rows x columns below which one thread runs. On a 2-core Xeon (one process, interleaved, 300
# calls) two threads gain from ~12 K elements: at 16 K gelu 1.09x, softmax 1.22x; layer_norm
# (uint8 in, residual, codes out) 1.03x at 12 K, 1.29x at 24 K, 1.22x at 48 K (a BERT
# LayerNorm at batch 1, which 1 << 16 left on one thread); below 8 K they lose (0.85-0.90x)
PARALLEL_MIN_FLOAT_WORK = 1 << 14
GELU_MODES = {"none": 0, "tanh": 1}


def _make_layer_norm(parallel: bool) -> Any:
    def layer_norm_rows(x, r, has_r, w, b, eps, out, n, xs, xz, codes, inv, zp):  # type: ignore[no-untyped-def]  # fmt: skip
        # flat C-contiguous rows of n. x: float32, or uint8 codes dequantized as
        # dequantize_per_tensor does (xs * (x - xz)); codes (unless empty): the result also
        # quantized as quantize_per_tensor does. Every row runs the one vector row kernel
        # (layer_norm_row), so the summation order is the same whatever x's type
        rows = out.shape[0] // n
        quantize = codes.shape[0] > 0
        for i in prange(rows):  # a plain range when parallel=False
            o = i * n
            if has_r:
                if quantize:
                    layer_norm_row(3, x, o, xs, xz, r, o, w, b, out, o, n, eps, codes, o, inv, zp)
                else:
                    layer_norm_row(1, x, o, xs, xz, r, o, w, b, out, o, n, eps, codes, o, inv, zp)
            elif quantize:
                layer_norm_row(2, x, o, xs, xz, r, o, w, b, out, o, n, eps, codes, o, inv, zp)
            else:
                layer_norm_row(0, x, o, xs, xz, r, o, w, b, out, o, n, eps, codes, o, inv, zp)

    name = "layer_norm_parallel" if parallel else "layer_norm_serial"
    layer_norm_rows.__name__ = layer_norm_rows.__qualname__ = name
    # no fastmath: the row kernel's IR rounds every step as written (no FMA contraction, no
    # reassociation), so the dequantize's multiply and the residual add round separately, as a
    # dequantize followed by this kernel does
    return njit(cache=True, parallel=parallel, nogil=True, error_model="numpy")(layer_norm_rows)


def _make_softmax(parallel: bool) -> Any:
    def softmax_rows(x, scale, mask, d1, d2, mb, mh, mq, out):  # type: ignore[no-untyped-def]
        # x, out: [rows, n] with rows = d0 * d1 * d2; mask: [mb * mh * mq, n], row picked by
        # broadcasting (a size-1 mask dimension repeats)
        rows, n = x.shape
        xf, mf, of = x.reshape(-1), mask.reshape(-1), out.reshape(-1)
        scale32 = np.float32(scale)
        for i in prange(rows):  # a plain range when parallel=False
            q = i % d2
            h = (i // d2) % d1
            bb = i // (d1 * d2)
            mrow = ((bb if mb > 1 else 0) * mh + (h if mh > 1 else 0)) * mq + (q if mq > 1 else 0)
            # the mask holds one zero row when there is none: adding it changes nothing
            softmax_row(xf, i * n, mf, mrow * n, of, i * n, n, scale32)

    softmax_rows.__name__ = softmax_rows.__qualname__ = (
        "softmax_parallel" if parallel else "softmax_serial"
    )
    return njit(cache=True, parallel=parallel, nogil=True, fastmath=FAST, error_model="numpy")(
        softmax_rows
    )


def _make_gelu(parallel: bool) -> Any:
    def gelu_flat(x, mode, out):  # type: ignore[no-untyped-def]
        n = x.shape[0]
        chunk = 4096
        for c in prange((n + chunk - 1) // chunk):  # a plain range when parallel=False
            lo = c * chunk
            hi = min(n, lo + chunk)
            if mode == 0:
                for k in range(lo + gelu_vectors(ACT_GELU, x, lo, out, lo, hi - lo), hi):
                    out[k] = gelu_erf(x[k])
            else:
                for k in range(lo + gelu_vectors(ACT_GELU_TANH, x, lo, out, lo, hi - lo), hi):
                    out[k] = gelu_tanh(x[k])

    gelu_flat.__name__ = gelu_flat.__qualname__ = "gelu_parallel" if parallel else "gelu_serial"
    return njit(cache=True, parallel=parallel, nogil=True, fastmath=FAST, error_model="numpy")(
        gelu_flat
    )


_LAYER_NORM = (_make_layer_norm(False), _make_layer_norm(True))
_SOFTMAX = (_make_softmax(False), _make_softmax(True))
_GELU = (_make_gelu(False), _make_gelu(True))


def _pick(pair: tuple[Any, Any], work: int, num_threads: int | None, where: str) -> Any:
    threads = apply_num_threads(num_threads, where)
    if threads == 1 or work < PARALLEL_MIN_FLOAT_WORK:
        return pair[0]
    return with_threads(pair[1], threads)


def _float_input(name: str, x: object) -> F32A:
    xf = check_array(name, x, np.float32, None)
    if xf.ndim < 1:
        raise KernelError(f"{name}: expected at least 1 dimension, got a scalar")
    return xf


def _vector(name: str, v: object, n: int, fill: float) -> F32A:
    if v is None:
        return np.full(n, fill, np.float32)
    vv = check_array(name, v, np.float32, 1)
    if vv.shape[0] != n:
        raise KernelError(f"{name}: expected shape ({n},) (the last dimension), got {vv.shape}")
    return vv


def _out(out: object, x: F32A, inputs: tuple[F32A, ...]) -> F32A:
    """A new output, or the caller's ``out=`` (which may be one of ``inputs`` itself)."""
    if out is None:
        return np.empty(x.shape, np.float32)
    return check_out(out, x.shape, np.float32, *inputs)


def _ln_constants(
    eps: float,
    x_qparams: QParams | tuple[float, int] | None,
    codes_qparams: QParams | tuple[float, int] | None,
) -> tuple[Any, Any, int, Any, Any]:
    """The checked float32 ``eps``, dequantize scale and zero point of ``x`` (1, 0 for float
    input) and ``1 / scale`` and zero point of the codes (1, 0 without them)."""
    e = float(eps)
    if not (e >= 0.0 and np.isfinite(e)):
        raise KernelError(f"eps: expected a finite number >= 0, got {eps!r}")
    xs, xz = np.float32(1.0), 0
    if x_qparams is not None:
        s, z = as_qparams("x_qparams", x_qparams)
        xs, xz = (
            np.float32(check_scale("x_qparams.scale", s)),
            check_zero_point("x_qparams.zero_point", z, 0, 255),
        )
    inv, zp = np.float32(1.0), np.float32(0.0)
    if codes_qparams is not None:
        s, z = as_qparams("codes_qparams", codes_qparams)
        inv = np.float32(1.0) / np.float32(check_scale("codes_qparams.scale", s))
        zp = np.float32(check_zero_point("codes_qparams.zero_point", z, 0, 255))
    return np.float32(e), xs, xz, inv, zp


def layer_norm(
    x: F32A | npt.NDArray[np.uint8],
    weight: F32A | None = None,
    bias: F32A | None = None,
    eps: float = 1e-5,
    *,
    residual: F32A | None = None,
    x_qparams: QParams | tuple[float, int] | None = None,
    codes: npt.NDArray[np.uint8] | None = None,
    codes_qparams: QParams | tuple[float, int] | None = None,
    out: F32A | None = None,
    num_threads: int | None = None,
) -> F32A:
    """float32 ``LayerNorm(x + residual)`` over the last dimension (``residual`` optional).

    ``weight``/``bias``: float32 [n] or None (ones / zeros). ``out`` may be ``x`` or
    ``residual`` (in place). With ``x_qparams``, ``x`` is uint8 codes, dequantized as
    ``dequantize_per_tensor`` does. With ``codes`` (uint8, x's shape) and ``codes_qparams``,
    the result is also quantized into ``codes`` as ``quantize_per_tensor`` does: the same
    bytes as those two kernels around this one, without their passes.
    """
    if (codes is None) != (codes_qparams is None):
        raise KernelError("codes, codes_qparams: give both (the array and its qparams) or neither")
    e, xs, xz, inv, zp = _ln_constants(eps, x_qparams, codes_qparams)
    dq = x_qparams is not None
    if dq:
        xf: Any = check_array("x", x, np.uint8, None)
        if xf.ndim < 1:
            raise KernelError("x: expected at least 1 dimension, got a scalar")
    else:
        xf = _float_input("x", x)
    n = int(xf.shape[-1])
    if residual is not None:
        r = check_array("residual", residual, np.float32, None)
        if r.shape != xf.shape:
            raise KernelError(
                f"residual: expected the shape of x {xf.shape}, got {r.shape} (no broadcasting)"
            )
    else:
        r = np.empty(n, np.float32) if dq else xf
    w = _vector("weight", weight, n, 1.0)
    b = _vector("bias", bias, n, 0.0)
    o = _out(out, xf, (r,) if dq else (xf, r))
    if codes is not None:
        c2 = check_out(codes, xf.shape, np.uint8, *((xf,) if dq else ()), name="codes").reshape(-1)
    else:
        c2 = np.empty(0, np.uint8)
    fn = _pick(_LAYER_NORM, xf.size, num_threads, "layer_norm")
    fn(xf.reshape(-1), r.reshape(-1), residual is not None, w, b, e, o.reshape(-1), n, xs, xz, c2,
       inv, zp)  # fmt: skip
    return o


class PreparedLayerNorm:
    """``layer_norm`` with the weight, bias, eps and qparams fixed: for a layer called again and
    again.

    ``prepared(x, residual=None)`` returns ``(out, codes)``: exactly ``layer_norm(x, weight,
    bias, eps, residual=residual, x_qparams=x_qparams, codes=codes,
    codes_qparams=codes_qparams)`` into new arrays, ``codes`` None without ``codes_qparams``.
    Everything but the inputs is checked here, once. A call whose ``x`` is a C-contiguous
    ndarray of the expected dtype (uint8 with ``x_qparams``, else float32) and last dimension,
    with a ``residual`` of x's shape (float32, C-contiguous) or none, runs the kernel without
    further checks; any other call goes through ``layer_norm`` and its errors. The weight and
    bias arrays are read at each call (not copied).
    """

    __slots__ = ("_b", "_eps", "_inv", "_n", "_threads", "_w", "_xdtype", "_xs", "_xz", "_zp",
                 "bias", "codes_qparams", "eps", "weight", "x_qparams")  # fmt: skip

    def __init__(
        self,
        weight: F32A | None,
        bias: F32A | None,
        eps: float = 1e-5,
        *,
        x_qparams: QParams | tuple[float, int] | None = None,
        codes_qparams: QParams | tuple[float, int] | None = None,
        num_threads: int | None = None,
    ) -> None:
        self._eps, self._xs, self._xz, self._inv, self._zp = _ln_constants(
            eps, x_qparams, codes_qparams
        )
        vectors = [None if v is None else check_array(name, v, np.float32, 1)
                   for name, v in (("weight", weight), ("bias", bias))]  # fmt: skip
        sizes = {int(v.shape[0]) for v in vectors if v is not None}
        if len(sizes) > 1:
            raise KernelError(f"weight, bias: expected one length, got {sorted(sizes)}")
        if num_threads is not None:
            apply_num_threads(num_threads, "PreparedLayerNorm")  # refused here, not at the call
        self.weight, self.bias, self.eps = weight, bias, float(eps)
        self.x_qparams, self.codes_qparams = x_qparams, codes_qparams
        self._threads = num_threads
        self._xdtype = _F32 if x_qparams is None else _U8
        # the last dimension: the vectors' length, or the first call's
        self._n: int | None = None
        self._w: Any = None
        self._b: Any = None
        if sizes:
            self._set_size(sizes.pop())

    def _set_size(self, n: int) -> None:
        """The last dimension is ``n``: the kernel's weight and bias (ones / zeros if none)."""
        self._n = n
        self._w = np.ones(n, np.float32) if self.weight is None else self.weight
        self._b = np.zeros(n, np.float32) if self.bias is None else self.bias

    def __call__(
        self, x: F32A | npt.NDArray[np.uint8], residual: F32A | None = None
    ) -> tuple[F32A, npt.NDArray[np.uint8] | None]:
        n = self._n
        if not (
            type(x) is np.ndarray
            and x.dtype is self._xdtype
            and x.ndim >= 1
            and x.shape[-1] == n
            and x.size > 0
            and x.flags.c_contiguous
            and x.flags.aligned
            and (
                residual is None
                or (
                    type(residual) is np.ndarray
                    and residual.dtype is _F32
                    and residual.shape == x.shape
                    and residual.flags.c_contiguous
                    and residual.flags.aligned
                )
            )
        ):
            return self._checked(x, residual)
        assert n is not None  # x.shape[-1] == n
        quantize = self.codes_qparams is not None
        out = np.empty(x.shape, np.float32)
        codes = np.empty(x.shape if quantize else 0, np.uint8)
        r: Any = residual
        if r is None:  # not read without a residual: any float32 array does
            r = x if self._xdtype is _F32 else out
        fn = _pick(_LAYER_NORM, x.size, self._threads, "PreparedLayerNorm")
        fn(x.reshape(-1), r.reshape(-1), residual is not None, self._w, self._b, self._eps,
           out.reshape(-1), n, self._xs, self._xz, codes.reshape(-1), self._inv,
           self._zp)  # fmt: skip
        return out, (codes if quantize else None)

    def _checked(self, x: Any, residual: F32A | None) -> tuple[F32A, npt.NDArray[np.uint8] | None]:
        """The call through ``layer_norm`` (every argument checked, its errors: x is checked
        before the codes array made here from its shape)."""
        codes = None
        if self.codes_qparams is not None:
            codes = np.empty(tuple(getattr(x, "shape", ())), np.uint8)
        out = layer_norm(x, self.weight, self.bias, self.eps, residual=residual,
                         x_qparams=self.x_qparams, codes=codes, codes_qparams=self.codes_qparams,
                         num_threads=self._threads)  # fmt: skip
        if self._n is None:
            self._set_size(int(out.shape[-1]))  # later calls of this size take the fast path
        return out, codes


_F32 = np.dtype(np.float32)  # numpy's built-in dtypes are singletons: identity tests
_U8 = np.dtype(np.uint8)


def softmax(
    x: F32A,
    *,
    scale: float = 1.0,
    mask: F32A | None = None,
    out: F32A | None = None,
    num_threads: int | None = None,
) -> F32A:
    """float32 ``softmax(x * scale + mask)`` over the last dimension.

    ``mask`` (float32) broadcasts against ``x`` with numpy's rules but must have ``x``'s last
    dimension and at most 4 dimensions in all (e.g. [B, 1, 1, S] over [B, H, S, S]).
    """
    xf = _float_input("x", x)
    if xf.ndim > 4:
        raise KernelError(f"x: expected at most 4 dimensions, got shape {xf.shape}")
    sc = float(scale)
    if not np.isfinite(sc):
        raise KernelError(f"scale: expected a finite number, got {scale!r}")
    n = int(xf.shape[-1])
    shape4 = (1,) * (4 - xf.ndim) + tuple(int(d) for d in xf.shape)
    if mask is None:
        m2 = np.zeros((1, n), np.float32)
        mb = mh = mq = 1
    else:
        m = check_array("mask", mask, np.float32, None, contiguous=False)
        if m.ndim > 4 or m.ndim < 1 or m.shape[-1] != n:
            raise KernelError(
                f"mask: expected 1 to 4 dimensions ending in x's last dimension {n}, got shape "
                f"{m.shape} (x {xf.shape})"
            )
        m4 = m.reshape((1,) * (4 - m.ndim) + m.shape)
        dims = [int(m4.shape[axis]) for axis in range(3)]
        for axis in range(3):
            if dims[axis] not in (1, shape4[axis]):
                raise KernelError(
                    f"mask: shape {m.shape} does not broadcast to x's {xf.shape} (dimension "
                    f"{axis - 4 + m.ndim} has {dims[axis]}, x has {shape4[axis]})"
                )
        mb, mh, mq = dims
        m2 = np.ascontiguousarray(m4).reshape(-1, n)
    o = _out(out, xf, (xf,))
    fn = _pick(_SOFTMAX, xf.size, num_threads, "softmax")
    fn(xf.reshape(-1, n), np.float32(sc), m2, shape4[1], shape4[2], mb, mh, mq, o.reshape(-1, n))
    return o


def gelu(
    x: F32A,
    approximate: str = "none",
    *,
    out: F32A | None = None,
    num_threads: int | None = None,
) -> F32A:
    """float32 GELU, ``approximate`` ``"none"`` (erf) or ``"tanh"``, as torch's names."""
    xf = _float_input("x", x)
    mode = GELU_MODES.get(approximate) if isinstance(approximate, str) else None
    if mode is None:
        raise KernelError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")
    o = _out(out, xf, (xf,))
    fn = _pick(_GELU, xf.size, num_threads, "gelu")
    fn(xf.reshape(-1), mode, o.reshape(-1))
    return o
