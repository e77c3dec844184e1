"""The float epilogue of a float-output GEMM: what follows ``fma(acc, mult, bias)``.

A float-output linear may do more to its result: scale each row by its own activation scale
(per-token dynamic quantization), add float columns (an outlier split), apply an activation,
and quantize the result for an int8 consumer. :func:`finish_rows` does all of it in one pass
over the output, four rows at a time, applying to every element:

1. with row scales, ``y = fma(y, rowscale[r], bias[j])``;
2. each float column ``s`` in order, ``y = fma(vals[r, s], weight_t[s, j], y)``: one fma chain
   per element, the same rounding on every target (four rows share each weight vector load and
   keep four chains in flight: one chain, 4 cycles a step, left 3/4 of the FMA units idle);
3. the activation (``ACT_*``), stored back into ``y``;
4. with codes, ``codes[r, j]`` as ``quantize_per_tensor`` makes them from ``y``.

Run inside the GEMM drivers, block by block while the output is in L1, the same steps were no
faster (Zen 5, a 2048 x 2304 BERT projection): short spans of 32 floats cost as much in loop
overhead as the second pass cost in memory traffic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from quantbridge.kernels._float_math import (
    ACT_GELU,
    ACT_GELU_TANH,
    ACT_NONE,
    ACT_RELU,
    FAST,
    RowSteps,
    _vgelu,
    codes_lanes,
)
from quantbridge.kernels._ir import array_data, declare, record_fields, stack_slot, vec_broadcast
from quantbridge.kernels._threads import with_threads


class FloatEpilogue(NamedTuple):
    """What :func:`finish_rows` does to a float GEMM output after ``fma(acc, mult, bias)``.

    Empty arrays switch a step off. Build it with :func:`float_epilogue`, which fixes the
    field types (numba compiles the pass once per record type).
    """

    act: int  # ACT_NONE, ACT_RELU, ACT_GELU or ACT_GELU_TANH
    rowscale: npt.NDArray[np.float32]  # [M] or empty: y = fma(y, rowscale[r], bias[j]) first
    bias: npt.NDArray[np.float32]  # [>= n], with rowscale
    vals: npt.NDArray[np.float32]  # [M * nside]: each row's inputs of the float columns
    nside: int  # float columns
    weight_t: npt.NDArray[np.float32]  # [nside * n]: each column's row of output weights
    n: int  # output columns: the row stride of weight_t and codes
    codes: npt.NDArray[np.uint8]  # [M * n] or empty: the result quantized
    inv: np.float32  # 1 / scale of codes
    zp: np.float32  # zero point of codes


_NO_F32 = np.zeros(0, np.float32)
_NO_U8 = np.zeros(0, np.uint8)


def float_epilogue(
    n: int,
    act: int = ACT_NONE,
    *,
    rowscale: npt.NDArray[np.float32] = _NO_F32,
    bias: npt.NDArray[np.float32] = _NO_F32,
    vals: npt.NDArray[np.float32] = _NO_F32,
    weight_t: npt.NDArray[np.float32] = _NO_F32,
    codes: npt.NDArray[np.uint8] = _NO_U8,
    inv: float = 1.0,
    zp: float = 0.0,
) -> FloatEpilogue:
    """A :class:`FloatEpilogue` for ``n`` output columns (arrays flat and C-contiguous, as the
    callers check them)."""
    nside = weight_t.shape[0] // n if n else 0
    return FloatEpilogue(
        int(act), rowscale, bias, vals, nside, weight_t, int(n), codes, np.float32(inv),
        np.float32(zp),
    )  # fmt: skip


def is_identity(e: FloatEpilogue) -> bool:
    """True when ``e`` leaves the output as it is."""
    return e.act == ACT_NONE and not e.rowscale.shape[0] and not e.nside and not e.codes.shape[0]


# rows whose float columns run together (8 ymm accumulators on AVX2)
_ROW_GROUP = 4


def _complete_block_codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
    fe, y, ldc, first, rows, j0, count = args
    fe_type = sig.args[0]
    rowscale_p, bias_p, vals_p, w_p, codes_p = record_fields(
        context, builder, fe_type, fe, ("rowscale", "bias", "vals", "weight_t", "codes")
    )
    act, n, nside, inv, zp = record_fields(
        context, builder, fe_type, fe, ("act", "n", "nside", "inv", "zp")
    )
    i64 = ir.IntType(64)
    zero64 = ir.Constant(i64, 0)
    y_p = array_data(context, builder, sig.args[1], y)

    def present(name: str) -> ir.Value:  # an optional array field is not empty
        i = FloatEpilogue._fields.index(name)
        arr = context.make_array(fe_type.types[i])(context, builder, builder.extract_value(fe, i))
        return builder.icmp_signed(">", builder.extract_value(arr.shape, 0), zero64)

    row = RowSteps(builder, count)
    vt, lanes = row.vt, row.vt.count
    fma = declare(builder.module, ir.FunctionType(vt, [vt, vt, vt]), f"llvm.fma.v{lanes}f32")
    w_p = builder.gep(w_p, [j0])
    bias_p = builder.gep(bias_p, [j0])
    scaled, quantize = present("rowscale"), present("codes")
    inv_v, zp_v = (vec_broadcast(builder, v, lanes) for v in (inv, zp))
    slots = [stack_slot(builder, row.zero) for _ in range(_ROW_GROUP)]

    def y_at(r: ir.Value) -> ir.Value:
        return builder.add(builder.mul(r, ldc), j0)

    def for_rows(body: Any, group: int) -> None:
        """``body(r)`` for rows ``first ..`` in groups of ``group`` (then the rest one by one)."""
        size = ir.Constant(i64, group)
        with cgutils.for_range(builder, builder.udiv(rows, size)) as loop:
            body(builder.add(first, builder.mul(loop.index, size)), group)
        done = builder.mul(builder.udiv(rows, size), size)
        with cgutils.for_range(builder, builder.sub(rows, done)) as loop:
            body(builder.add(first, builder.add(done, loop.index)), 1)

    def columns(with_scale: bool) -> Any:
        def rows_from(r0: ir.Value, group: int) -> None:
            def step(at: ir.Value, valid: ir.Value | None) -> None:
                for k in range(group):
                    r = builder.add(r0, ir.Constant(i64, k))
                    acc = row.load(y_p, y_at(r), at, valid)
                    if with_scale:
                        s = builder.load(builder.gep(rowscale_p, [r]))
                        b = row.load(bias_p, zero64, at, valid)
                        acc = builder.call(fma, [acc, vec_broadcast(builder, s, lanes), b])
                    builder.store(acc, slots[k])
                # each float column in order, one fma each: the same rounding on every target
                vals_at = builder.mul(r0, nside)
                with cgutils.for_range(builder, nside) as loop:
                    wv = row.load(w_p, builder.mul(loop.index, n), at, valid)
                    for k in range(group):
                        at_v = builder.add(
                            vals_at,
                            builder.add(builder.mul(ir.Constant(i64, k), nside), loop.index),
                        )
                        v = builder.load(builder.gep(vals_p, [at_v]))
                        acc = builder.call(fma, [vec_broadcast(builder, v, lanes), wv,
                                                 builder.load(slots[k])])  # fmt: skip
                        builder.store(acc, slots[k])
                for k in range(group):
                    r = builder.add(r0, ir.Constant(i64, k))
                    row.store(builder.load(slots[k]), y_p, y_at(r), at, valid)

            row.each(step)

        return rows_from

    def finish(mode: int, with_codes: bool) -> Any:
        def one_row(r: ir.Value, _group: int) -> None:
            yoff = y_at(r)
            coff = builder.add(builder.mul(r, n), j0)

            def step(at: ir.Value, valid: ir.Value | None) -> None:
                acc = row.load(y_p, yoff, at, valid)
                if mode == ACT_RELU:  # NaN stays NaN, as numpy's maximum
                    keep = builder.fcmp_unordered("une", acc, acc)
                    keep = builder.or_(keep, builder.fcmp_ordered(">", acc, row.zero))
                    acc = builder.select(keep, acc, row.zero)
                elif mode in (ACT_GELU, ACT_GELU_TANH):
                    acc = _vgelu(builder, acc, mode)
                if mode != ACT_NONE:
                    row.store(acc, y_p, yoff, at, valid)
                if with_codes:
                    codes = codes_lanes(builder, acc, inv_v, zp_v)
                    row.store_bytes(codes, codes_p, coff, at, valid)

            row.each(step)

        return one_row

    # two passes over the block: the columns' loop would keep the activation's constants out
    # of registers. The branches are taken once per block; each holds its own loops.
    with builder.if_else(scaled) as (then, otherwise):
        with then:
            for_rows(columns(True), _ROW_GROUP)
        with otherwise, builder.if_then(builder.icmp_signed(">", nside, zero64)):
            for_rows(columns(False), _ROW_GROUP)
    for mode in (ACT_NONE, ACT_RELU, ACT_GELU, ACT_GELU_TANH):
        is_mode = builder.icmp_signed("==", act, ir.Constant(act.type, mode))
        with builder.if_then(is_mode), builder.if_else(quantize) as (then, otherwise):
            with then:
                for_rows(finish(mode, True), 1)
            with otherwise:
                if mode != ACT_NONE:
                    for_rows(finish(mode, False), 1)
    return context.get_dummy_value()


@intrinsic
def _complete_block(
    typingctx: Any, fe: Any, y: Any, ldc: Any, first: Any, rows: Any, j0: Any, count: Any
) -> Any:
    """The epilogue ``fe`` on rows ``first .. first + rows - 1`` of flat ``y`` (row stride
    ``ldc``), columns ``j0 .. j0 + count - 1``."""
    if not isinstance(fe, types.NamedTuple) or fe.instance_class is not FloatEpilogue:
        return None
    if not (isinstance(y, types.Array) and y.ndim == 1 and y.dtype == types.float32):
        return None
    sig = types.void(fe, y, *([types.int64] * 5))
    return sig, _complete_block_codegen


if TYPE_CHECKING:

    def complete_block(
        fe: Any, y: Any, ldc: int, first: int, rows: int, j0: int, count: int
    ) -> None:
        """See ``_complete_block`` (numba code only)."""

else:
    complete_block = _complete_block


def _make_rows_pass(parallel: bool) -> Any:
    def rows_pass(fe, c, ldc, m):  # type: ignore[no-untyped-def]
        for g in prange((m + _ROW_GROUP - 1) // _ROW_GROUP):  # a plain range when not parallel
            first = g * _ROW_GROUP
            complete_block(fe, c, ldc, first, min(_ROW_GROUP, m - first), 0, fe.n)

    rows_pass.__name__ = rows_pass.__qualname__ = (
        "epilogue_rows_parallel" if parallel else "epilogue_rows_serial"
    )
    return njit(cache=True, parallel=parallel, nogil=True, fastmath=FAST)(rows_pass)


_ROWS_PASS = (_make_rows_pass(False), _make_rows_pass(True))
# a parallel region costs more than it saves below ~1M elements (~1 ms of GELU)
PARALLEL_PASS_MIN = 1 << 20


def finish_rows(
    fe: FloatEpilogue, c: npt.NDArray[np.float32], ldc: int, m: int, threads: int
) -> None:
    """The epilogue as one pass over ``m`` rows of flat ``c`` (row stride ``ldc``), in place:
    for outputs the drivers did not finish block by block."""
    if is_identity(fe):
        return
    if threads == 1 or m * fe.n < PARALLEL_PASS_MIN:
        _ROWS_PASS[0](fe, c, ldc, m)
    else:
        with_threads(_ROWS_PASS[1], threads)(fe, c, ldc, m)


@njit(cache=True)
def gather_columns(xf, k, m, channels, vals):  # type: ignore[no-untyped-def]
    """``vals[r * S + s] = xf[r * k + channels[s]]``: each row's float-column inputs."""
    nside = channels.shape[0]
    for r in range(m):
        for s in range(nside):
            vals[r * nside + s] = xf[r * k + channels[s]]


def rows_of(fe: FloatEpilogue, rows: npt.NDArray[np.int64]) -> FloatEpilogue:
    """``fe`` for the rows ``rows`` alone, numbered from 0 (codes go to a new array: copy them
    back with :func:`put_codes`)."""
    n, s = fe.n, fe.nside
    return fe._replace(
        rowscale=fe.rowscale[rows] if fe.rowscale.shape[0] else fe.rowscale,
        vals=fe.vals.reshape(-1, s)[rows].reshape(-1) if s else fe.vals,
        codes=np.empty(rows.shape[0] * n, np.uint8) if fe.codes.shape[0] else fe.codes,
    )


def put_codes(fe: FloatEpilogue, part: FloatEpilogue, rows: npt.NDArray[np.int64]) -> None:
    """Copy the codes of ``part`` (``rows_of(fe, rows)``) into ``fe``'s rows ``rows``."""
    if fe.codes.shape[0]:
        fe.codes.reshape(-1, fe.n)[rows] = part.codes.reshape(-1, fe.n)
