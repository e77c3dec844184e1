"""Quantized ``a * b`` where ``b`` holds one value per (image, channel): squeeze-excite.

``a`` is [N, C, *spatial] (C-contiguous or channels-last), ``b`` is [N, C, 1, ...] (or
[1, C, 1, ...]): the channel attention ``x * sigmoid(fc(pool(x)))``. The broadcast is never
materialized: each output reads ``b``'s code for its channel. Numerics are exactly
``kernels.mul`` (``mul_relu``) on the broadcast tensor: ``p = (qa - zp_a) * (qb - zp_b)``
in int32, ``clamp(rint(float32(p) * m) + out_zp, 0, 255)`` with ``m = sa * sb * (1 / so)``
in float32 (a product of two values, so the operand order never changes a bit).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import numba
import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from quantbridge.kernels._checks import check_array
from quantbridge.kernels._elementwise import _mul_params, binary_qparams
from quantbridge.kernels._errors import KernelError
from quantbridge.kernels._float_math import RowSteps, flat_f32, flat_u8
from quantbridge.kernels._ir import arrays_data, declare, vec_broadcast
from quantbridge.kernels._layout import InputLayout, check_dense
from quantbridge.kernels._qparams import QParams, as_qparams
from quantbridge.kernels._quantize import choose_kernel
from quantbridge.kernels._targets import check_target
from quantbridge.kernels._threads import get_num_threads

U8 = npt.NDArray[np.uint8]
QP = QParams | tuple[float, int]


@intrinsic
def _scaled_rows(typingctx, a, out, f, za, m, zp, lo, rows):  # type: ignore[no-untyped-def]
    """``out[p * C + j] = _requant((a[p * C + j] - za) * f[j] * m, zp, lo)`` for ``p < rows``,
    ``j < C = len(f)``, in 16-float vectors (each row's last one masked): numba's loop over the
    same steps chose 8-float vectors. ``f`` is float32 and ``|product| <= 255 * 255``, so the
    float32 product is the exact int32 one; the steps and their order are ``_requant``'s."""
    scalars = (za, m, zp, lo)
    if not (flat_u8(a) and flat_u8(out) and flat_f32(f)):
        return None
    if not (all(t == types.float32 for t in scalars) and isinstance(rows, types.Integer)):
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        a_p, out_p, f_p = arrays_data(context, builder, sig, args, (0, 1, 2))
        c = context.make_array(sig.args[2])(context, builder, args[2]).nitems
        za_v, m_v, zp_v, lo_v = (vec_broadcast(builder, v, 16) for v in args[3:7])
        nrows = context.cast(builder, args[7], sig.args[7], types.int64)
        steps = RowSteps(builder, c)
        vt = steps.vt
        rint = declare(builder.module, ir.FunctionType(vt, [vt]), "llvm.rint.v16f32")
        top = ir.Constant(vt, [255.0] * 16)
        zero = ir.Constant(ir.IntType(64), 0)
        with cgutils.for_range(builder, nrows) as loop:
            base = builder.mul(loop.index, c)

            def body(at: ir.Value, valid: ir.Value | None) -> None:
                q = builder.uitofp(steps.load_bytes(a_p, base, at, valid), vt)
                t = builder.fmul(
                    builder.fmul(builder.fsub(q, za_v), steps.load(f_p, zero, at, valid)), m_v
                )
                r = builder.fadd(builder.call(rint, [t]), zp_v)
                r = builder.select(builder.fcmp_ordered(">", r, lo_v), r, lo_v)
                r = builder.select(builder.fcmp_ordered("<", r, top), r, top)
                codes = builder.trunc(
                    builder.fptoui(r, ir.VectorType(ir.IntType(32), 16)),
                    ir.VectorType(ir.IntType(8), 16),
                )
                steps.store_bytes(codes, out_p, base, at, valid)

            steps.each(body)
        return context.get_dummy_value()

    return types.void(a, out, f, za, m, zp, lo, rows), codegen


@numba.njit(cache=True, error_model="numpy")
def _scaled(a, out, f, za, m, zp, lo):  # type: ignore[no-untyped-def]
    # out[p, j] = requant((a[p, j] - za) * f[j]) over rows p of C-contiguous [rows, C]
    _scaled_rows(a.reshape(-1), out.reshape(-1), f, za, m, zp, lo, a.shape[0])  # type: ignore[call-arg]


@numba.njit(cache=True)
def _as_f32(za, zb, m, zp, lo):  # type: ignore[no-untyped-def]
    return np.float32(za), np.float32(zb), np.float32(m), np.float32(zp), np.float32(lo)


def _make(parallel: bool):  # type: ignore[no-untyped-def]
    loop = numba.prange if parallel else range

    # The scalars come as Python floats (numba's dispatcher types them ~5x faster than numpy
    # scalars); each holds a float32 value exactly, and is turned back into float32 here.

    def nchw(a, b, out, za, zb, m, zp, lo):  # type: ignore[no-untyped-def]
        # a, out: [N, C, S]; b: [Nb, C] with Nb in (1, N); a plane is one row of S codes
        # times its channel's factor repeated S times, so the inner loop runs along S
        za, zb, m, zp, lo = _as_f32(za, zb, m, zp, lo)
        n, c, s = a.shape
        for t in loop(n * c):
            i, j = t // c, t % c
            f = np.full(s, np.float32(b[min(i, b.shape[0] - 1), j]) - zb)
            _scaled(a[i, j].reshape(1, s), out[i, j].reshape(1, s), f, za, m, zp, lo)

    def nhwc(a, b, out, za, zb, m, zp, lo):  # type: ignore[no-untyped-def]
        # a, out: [N, S, C]; the factors of image i computed once
        za, zb, m, zp, lo = _as_f32(za, zb, m, zp, lo)
        n, s, c = a.shape
        f = np.empty((b.shape[0], c), np.float32)
        for i in range(b.shape[0]):
            for j in range(c):
                f[i, j] = np.float32(b[i, j]) - zb
        # pixels per task: one task an image on one thread (a task's call and slices cost
        # ~0.1 us, as much as 50 pixels of 288 channels)
        rows = -(-s // 64) if parallel else s
        tasks = -(-s // rows)
        for t in loop(n * tasks):
            i, k = t // tasks, t % tasks
            start, stop = k * rows, min(s, (k + 1) * rows)
            fi = f[min(i, b.shape[0] - 1)]
            _scaled(a[i, start:stop], out[i, start:stop], fi, za, m, zp, lo)

    suffix = "_par" if parallel else ""
    nchw.__name__ = nchw.__qualname__ = f"_mul_channels_nchw{suffix}"
    nhwc.__name__ = nhwc.__qualname__ = f"_mul_channels_nhwc{suffix}"
    jit = numba.njit(cache=True, parallel=parallel, nogil=True, error_model="numpy")
    return jit(nchw), jit(nhwc)


_nchw, _nhwc = _make(False)
_nchw_par, _nhwc_par = _make(True)


def per_channel_operand(a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> bool:
    """Whether ``b_shape`` is one value per (image, channel) of ``a_shape``: [N|1, C, 1, ...]."""
    return (
        len(a_shape) >= 3
        and len(b_shape) == len(a_shape)
        and b_shape[0] in (1, a_shape[0])
        and b_shape[1] == a_shape[1]
        and all(d == 1 for d in b_shape[2:])
    )


def mul_channels(
    a: U8,
    a_qparams: QP,
    b: U8,
    b_qparams: QP,
    out_qparams: QP,
    *,
    relu: bool = False,
    target: str | None = None,
) -> U8:
    """Quantized ``a * b`` for ``a`` [N, C, *spatial] and ``b`` [N, C, 1, ...] (or [1, C, 1,
    ...]): ``kernels.mul`` (``mul_relu`` with ``relu=True``) on ``b`` broadcast to ``a``'s
    shape, bit for bit, without the broadcast. ``a`` is C-contiguous or channels-last; the
    result has ``a``'s shape and layout."""
    run, qa, qb = _checked_plan(a, a_qparams, b, b_qparams, out_qparams, relu, target)
    return run(qa, qb)


class _MulPlan(NamedTuple):
    """``PreparedMulChannels``' plan: the operands' layouts and the thread count it was made
    for, whether the run takes them swapped (per-channel operand first), and the run."""

    a: InputLayout
    b: InputLayout
    threads: int
    swapped: bool
    run: Callable[..., Any]


class PreparedMulChannels:
    """``mul_channels`` with the qparams and relu fixed, for a layer called again and again
    on inputs of one shape and layout (squeeze-excite), and either operand the per-channel one.

    ``prepared(a, b)`` returns exactly ``mul_channels(a, a_qparams, b, b_qparams,
    out_qparams, relu=relu, target=target)`` when ``b`` holds one value per (image, channel)
    of ``a``, and ``mul_channels(b, b_qparams, a, a_qparams, ...)`` when ``a`` is the
    per-channel one (the same numbers: the product does not depend on the order). The first
    call checks and plans as ``mul_channels`` does; later calls whose operands keep their
    shapes, strides and dtype, at the same thread count, run that plan without the checks
    (~5 us a call, and more between a model's layers, where the checks' code is cold).
    """

    __slots__ = ("_fast", "_qparams", "relu", "target")

    def __init__(
        self,
        a_qparams: QP,
        b_qparams: QP,
        out_qparams: QP,
        *,
        relu: bool = False,
        target: str | None = None,
    ) -> None:
        check_target(target)
        qa = as_qparams("a_qparams", a_qparams)
        qb = as_qparams("b_qparams", b_qparams)
        qo = as_qparams("out_qparams", out_qparams)
        _constants(qa, qb, qo, relu)  # bad qparams are refused here, by name
        self._qparams = (qa, qb, qo)
        self.relu = relu
        self.target = target
        self._fast: _MulPlan | None = None  # the last plan, for inputs of its layouts

    def __call__(self, a: U8, b: U8) -> U8:
        fast = self._fast
        if (
            fast is not None
            and fast.a.fits(a)
            and fast.b.fits(b)
            and get_num_threads() == fast.threads
        ):
            out: U8 = fast.run(b, a) if fast.swapped else fast.run(a, b)
            return out
        return self._plan_and_run(a, b)

    def _plan_and_run(self, a: object, b: object) -> U8:
        self._fast = None
        qa_, qb_, qo = self._qparams
        swapped = (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and per_channel_operand(b.shape, a.shape)
            and not per_channel_operand(a.shape, b.shape)
        )
        x, xq, f, fq = (b, qb_, a, qa_) if swapped else (a, qa_, b, qb_)
        run, qx, qf = _checked_plan(x, xq, f, fq, qo, self.relu, self.target)
        if type(a) is np.ndarray and type(b) is np.ndarray and qx is x and qf is f:
            layouts = InputLayout.of(a), InputLayout.of(b)
            self._fast = _MulPlan(*layouts, get_num_threads(), swapped, run)
        return run(qx, qf)


def _checked_plan(
    a: object, a_qparams: QP, b: object, b_qparams: QP, out_qparams: QP, relu: bool,
    target: str | None,
) -> tuple[Callable[[U8, U8], U8], U8, U8]:  # fmt: skip
    """Every argument checked: the call to run (valid for operands of these shapes, strides
    and dtype, at this thread count) and the checked operands."""
    check_target(target)
    qa, order = check_dense("a", a, np.uint8)
    qb = check_array("b", b, np.uint8, contiguous=False)
    if not per_channel_operand(qa.shape, qb.shape):
        raise KernelError(
            f"b: shape {qb.shape} is not one value per (image, channel) of a's shape "
            f"{qa.shape}; expected ({qa.shape[0] if qa.ndim else 'N'}, C, 1, ...) with a's C "
            "and rank (use kernels.mul for equal shapes)"
        )
    consts = _constants(a_qparams, b_qparams, out_qparams, relu)
    if order != (0, *range(2, qa.ndim), 1):  # C-contiguous, or any other dense order
        kernel = choose_kernel(qa.size, "mul_channels", _nchw, _nchw_par)
        return functools.partial(_run_planes, kernel, consts), qa, qb
    kernel = choose_kernel(qa.size, "mul_channels", _nhwc, _nhwc_par)
    return functools.partial(_run_channels_last, kernel, consts), qa, qb


def _factors(b: U8) -> U8:
    return np.ascontiguousarray(b.reshape(b.shape[0], b.shape[1]))


def _run_planes(kernel: Any, consts: _Consts, a: U8, b: U8) -> U8:
    """NCHW (or any dense order, read as NCHW): one plane of ``a`` per (image, channel)."""
    n, c = a.shape[0], a.shape[1]
    src = np.ascontiguousarray(a)
    out = np.empty(a.shape, np.uint8)
    kernel(src.reshape(n, c, -1), _factors(b), out.reshape(n, c, -1), *consts)
    return out


def _run_channels_last(kernel: Any, consts: _Consts, a: U8, b: U8) -> U8:
    """Channels-last ``a``: rows of C codes, the result channels-last too."""
    n, c, nd = a.shape[0], a.shape[1], a.ndim
    nhwc = a.transpose(0, *range(2, nd), 1)  # C-contiguous [N, *spatial, C]
    out_nhwc = np.empty(nhwc.shape, np.uint8)
    kernel(nhwc.reshape(n, -1, c), _factors(b), out_nhwc.reshape(n, -1, c), *consts)
    result: U8 = out_nhwc.transpose(0, nd - 1, *range(1, nd - 1))
    return result


def _constants(a_qparams: QP, b_qparams: QP, out_qparams: QP, relu: bool) -> _Consts:
    """The kernel's scalars ``(za, zb, m, zp, lo)``; checked once per set of qparams."""
    try:
        return _cached_constants(a_qparams, b_qparams, out_qparams, relu)
    except TypeError:  # unhashable qparams (a list pair): check them on every call
        return _cached_constants.__wrapped__(a_qparams, b_qparams, out_qparams, relu)


_Consts = tuple[float, float, float, float, float]


@functools.lru_cache(maxsize=512)  # errors are not cached: bad qparams raise on every call
def _cached_constants(a_qparams: QP, b_qparams: QP, out_qparams: QP, relu: bool) -> _Consts:
    sa, za, sb, zb, so, zo = binary_qparams(a_qparams, b_qparams, out_qparams, True)
    m = float(_mul_params(sa, sb, so))  # a float32 value (numba returns it as a Python float)
    lo = zo if relu else 0  # relu clamps at the output zero point
    return float(za), float(zb), m, float(zo), float(lo)
