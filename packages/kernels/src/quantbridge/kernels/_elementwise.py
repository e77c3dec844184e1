"""Quantized add / mul (optionally fused with relu) on uint8 arrays with different qparams.

Numerics reproduce torch's quantized CPU kernels (``torch.ops.quantized.add`` / ``add_relu`` /
``mul`` / ``mul_relu``, the vectorised path that handles all but a short tail):

* add: ``da = fma(scale_a, qa, scale_a * -zp_a)`` (likewise ``db``), ``c = da + db`` in float32,
  ``c = max(c, 0)`` for add_relu, then ``clamp(rint(c * (1.0f / out_scale)) + out_zp, 0, 255)``;
* mul: ``m = scale_a * scale_b * (1.0f / out_scale)`` in float32, ``p = (qa - zp_a) * (qb - zp_b)``
  in int32, ``clamp(rint(float32(p) * m) + out_zp, 0, 255)``; mul_relu then takes
  ``max(q, out_zp)``.

Inputs must have the same shape (torch's quantized add/mul allocate the output with the first
input's shape; we do not broadcast). One numba implementation serves every target.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import numpy.typing as npt

from quantbridge.kernels._checks import check_array, check_derived, check_out, check_zero_point
from quantbridge.kernels._errors import KernelError
from quantbridge.kernels._fma import fma32
from quantbridge.kernels._layout import check_dense, empty_in_order, flat, in_order
from quantbridge.kernels._qparams import QParams, as_qparams
from quantbridge.kernels._quantize import choose_kernel, f32_scale
from quantbridge.kernels._targets import check_target

U8 = npt.NDArray[np.uint8]
_CHUNK = 1 << 14


@numba.njit(cache=True)
def _requant(t, zp, lo):  # type: ignore[no-untyped-def]
    # round half to even, add the zero point, saturate to [lo, 255] (torch's vector path;
    # lo > 0 is a fused relu). Branch-free, so the loops that call it vectorize.
    return np.uint8(min(max(np.rint(t) + zp, lo), np.float32(255.0)))


@numba.njit(cache=True, error_model="numpy")
def _add_span(a, b, out, sa, pa, sb, pb, inv, zp, relu, start, stop):  # type: ignore[no-untyped-def]
    floor = np.float32(0.0) if relu else np.float32(-np.inf)
    zero = np.float32(0.0)
    for i in range(start, stop):
        c = max(fma32(sa, np.float32(a[i]), pa) + fma32(sb, np.float32(b[i]), pb), floor)
        out[i] = _requant(c * inv, zp, zero)


@numba.njit(cache=True)
def _add_params(a_scale, a_zp, b_scale, b_zp, out_scale, out_zp):  # type: ignore[no-untyped-def]
    sa = np.float32(a_scale)
    sb = np.float32(b_scale)
    inv = np.float32(1.0) / np.float32(out_scale)
    pa = sa * np.float32(-a_zp)
    pb = sb * np.float32(-b_zp)
    return sa, pa, sb, pb, inv, np.float32(out_zp)


@numba.njit(cache=True)
def _add(a, b, out, a_scale, a_zp, b_scale, b_zp, out_scale, out_zp, relu):  # type: ignore[no-untyped-def]
    sa, pa, sb, pb, inv, zp = _add_params(a_scale, a_zp, b_scale, b_zp, out_scale, out_zp)
    _add_span(a, b, out, sa, pa, sb, pb, inv, zp, relu, 0, a.size)


@numba.njit(cache=True, parallel=True)
def _add_par(a, b, out, a_scale, a_zp, b_scale, b_zp, out_scale, out_zp, relu):  # type: ignore[no-untyped-def]
    sa, pa, sb, pb, inv, zp = _add_params(a_scale, a_zp, b_scale, b_zp, out_scale, out_zp)
    n = a.size
    for c in numba.prange((n + _CHUNK - 1) // _CHUNK):
        lo, hi = c * _CHUNK, min(c * _CHUNK + _CHUNK, n)
        # the chunk as slices: with the whole arrays and offsets the span ran ~8x slower
        _add_span(a[lo:hi], b[lo:hi], out[lo:hi], sa, pa, sb, pb, inv, zp, relu, 0, hi - lo)


@numba.njit(cache=True, error_model="numpy")
def _mul_span(a, b, out, za, zb, m, zp, relu, start, stop):  # type: ignore[no-untyped-def]
    # za, zb as float32: |(qa - za) * (qb - zb)| <= 255 * 255, exact in float32 as in int32
    lo = zp if relu else np.float32(0.0)  # mul_relu: max(q, out_zp)
    for i in range(start, stop):
        p = (np.float32(a[i]) - za) * (np.float32(b[i]) - zb)
        out[i] = _requant(p * m, zp, lo)


@numba.njit(cache=True)
def _mul_params(a_scale, b_scale, out_scale):  # type: ignore[no-untyped-def]
    inv = np.float32(1.0) / np.float32(out_scale)
    return np.float32(a_scale) * np.float32(b_scale) * inv


@numba.njit(cache=True)
def _mul(a, b, out, a_scale, a_zp, b_scale, b_zp, out_scale, out_zp, relu):  # type: ignore[no-untyped-def]
    m = _mul_params(a_scale, b_scale, out_scale)
    za, zb = np.float32(a_zp), np.float32(b_zp)
    _mul_span(a, b, out, za, zb, m, np.float32(out_zp), relu, 0, a.size)


@numba.njit(cache=True, parallel=True)
def _mul_par(a, b, out, a_scale, a_zp, b_scale, b_zp, out_scale, out_zp, relu):  # type: ignore[no-untyped-def]
    m = _mul_params(a_scale, b_scale, out_scale)
    za, zb = np.float32(a_zp), np.float32(b_zp)
    zp = np.float32(out_zp)
    n = a.size
    for c in numba.prange((n + _CHUNK - 1) // _CHUNK):
        lo, hi = c * _CHUNK, min(c * _CHUNK + _CHUNK, n)
        _mul_span(a[lo:hi], b[lo:hi], out[lo:hi], za, zb, m, zp, relu, 0, hi - lo)


@functools.lru_cache(maxsize=256)  # scales repeat call after call; errors are not cached
def _check_mul_scales(sa: float, sb: float, so: float) -> None:
    """The multiplier, formed in float32 as ``_mul_params`` does, must be a normal number."""
    with np.errstate(all="ignore"):  # out-of-range products are refused just below
        ab = np.float32(sa) * np.float32(sb)
        mult = ab * (np.float32(1.0) / np.float32(so))
    check_derived("a_scale * b_scale", ab)
    check_derived("a_scale * b_scale / out_scale", mult)


def binary_qparams(
    a_qparams: QParams | tuple[float, int],
    b_qparams: QParams | tuple[float, int],
    out_qparams: QParams | tuple[float, int],
    is_mul: bool,
) -> tuple[float, int, float, int, float, int]:
    """(sa, za, sb, zb, so, zo) of a two-input uint8 op, each checked and named in errors;
    for a mul also the product scales the kernel forms."""
    a_scale, a_zero_point = as_qparams("a_qparams", a_qparams)
    b_scale, b_zero_point = as_qparams("b_qparams", b_qparams)
    out_scale, out_zero_point = as_qparams("out_qparams", out_qparams)
    sa = f32_scale("a_qparams.scale", a_scale)
    sb = f32_scale("b_qparams.scale", b_scale)
    so = f32_scale("out_qparams.scale", out_scale, inverted=True)
    if is_mul:
        _check_mul_scales(sa, sb, so)
    za = check_zero_point("a_qparams.zero_point", a_zero_point, 0, 255)
    zb = check_zero_point("b_qparams.zero_point", b_zero_point, 0, 255)
    zo = check_zero_point("out_qparams.zero_point", out_zero_point, 0, 255)
    return sa, za, sb, zb, so, zo


def _binary(
    kind: str,
    a: object,
    a_qparams: QParams | tuple[float, int],
    b: object,
    b_qparams: QParams | tuple[float, int],
    out_qparams: QParams | tuple[float, int],
    relu: bool,
    out: U8 | None,
    target: str | None,
) -> U8:
    check_target(target)
    qa, order = check_dense("a", a, np.uint8)
    qb = check_array("b", b, np.uint8, contiguous=False)
    if qa.shape != qb.shape:
        raise KernelError(
            f"b: shape {qb.shape} differs from a's shape {qa.shape}; quantized {kind} needs "
            f"equal shapes (no broadcasting, like torch.ops.quantized.{kind})"
        )
    sa, za, sb, zb, so, zo = binary_qparams(a_qparams, b_qparams, out_qparams, kind == "mul")
    qb = in_order(qb, order)  # b in a's layout (a copy only when the layouts differ)
    if out is None:
        out = empty_in_order(qa, np.uint8)
    else:
        check_out(out, qa.shape, np.uint8, qa, qb, order=order)
    kernels = (_add, _add_par) if kind == "add" else (_mul, _mul_par)
    kernel = choose_kernel(qa.size, kind, *kernels, stream=True)
    kernel(flat(qa, order), flat(qb, order), flat(out, order), sa, za, sb, zb, so, zo, relu)
    return out


QP = QParams | tuple[float, int]


def add(
    a: U8, a_qparams: QP, b: U8, b_qparams: QP, out_qparams: QP, *,
    out: U8 | None = None, target: str | None = None,
) -> U8:  # fmt: skip
    """Quantized ``a + b`` (torch.ops.quantized.add numerics); ``out`` may be ``a`` or ``b``."""
    return _binary("add", a, a_qparams, b, b_qparams, out_qparams, False, out, target)


def add_relu(
    a: U8, a_qparams: QP, b: U8, b_qparams: QP, out_qparams: QP, *,
    out: U8 | None = None, target: str | None = None,
) -> U8:  # fmt: skip
    """Quantized ``relu(a + b)`` (torch.ops.quantized.add_relu numerics)."""
    return _binary("add", a, a_qparams, b, b_qparams, out_qparams, True, out, target)


def mul(
    a: U8, a_qparams: QP, b: U8, b_qparams: QP, out_qparams: QP, *,
    out: U8 | None = None, target: str | None = None,
) -> U8:  # fmt: skip
    """Quantized ``a * b`` (torch.ops.quantized.mul numerics); ``out`` may be ``a`` or ``b``."""
    return _binary("mul", a, a_qparams, b, b_qparams, out_qparams, False, out, target)


def mul_relu(
    a: U8, a_qparams: QP, b: U8, b_qparams: QP, out_qparams: QP, *,
    out: U8 | None = None, target: str | None = None,
) -> U8:  # fmt: skip
    """Quantized ``relu(a * b)`` (torch.ops.quantized.mul_relu numerics)."""
    return _binary("mul", a, a_qparams, b, b_qparams, out_qparams, True, out, target)
