"""256-entry lookup tables: any elementwise function on uint8 activations, exact by construction.

A table maps every input code ``q`` to ``quantize(f(dequantize(q)))`` computed once in float32
with the same rules as ``quantize_per_tensor`` / ``dequantize_per_tensor``, so applying it gives
exactly the float reference for every input. Applying is one gather per byte.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from quantbridge.kernels._checks import check_array, check_out, check_quant_range, check_zero_point
from quantbridge.kernels._errors import KernelError
from quantbridge.kernels._float_math import flat_u8
from quantbridge.kernels._ir import I64, declare, load_vec, store_vec
from quantbridge.kernels._layout import check_dense, empty_in_order, flat
from quantbridge.kernels._quantize import (
    _dequantize_flat,
    _quantize_flat,
    choose_kernel,
    f32_scale,
)
from quantbridge.kernels._targets import check_target, cpu_features, needs_features
from quantbridge.kernels._threads import apply_num_threads, with_threads

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]
_CHUNK = 1 << 15


@numba.njit(cache=True)
def _gather_span(q, table, out, start, stop):  # type: ignore[no-untyped-def]
    for i in range(start, stop):
        out[i] = table[q[i]]


@numba.njit(cache=True)
def _gather(q, table, out):  # type: ignore[no-untyped-def]
    _gather_span(q, table, out, 0, q.size)


@numba.njit(cache=True, parallel=True)
def _gather_par(q, table, out):  # type: ignore[no-untyped-def]
    n = q.size
    for c in numba.prange((n + _CHUNK - 1) // _CHUNK):
        lo, hi = c * _CHUNK, min(c * _CHUNK + _CHUNK, n)
        _gather_span(q[lo:hi], table, out[lo:hi], 0, hi - lo)  # slices: see _elementwise


# AVX-512 VBMI (Ice Lake, Zen 4 and later): ``vpermi2b`` looks 64 codes up in a 128-byte table
# held in two registers, so a whole 256-entry table is two of them and a select: ~20x the
# byte-by-byte gather. Compiled only on CPUs that have it (LLVM cannot emit it elsewhere).
_VBMI_FEATURES = ("avx512f", "avx512bw", "avx512vbmi")
VBMI = set(_VBMI_FEATURES) <= cpu_features()
_V64 = ir.VectorType(ir.IntType(8), 64)


def _lookup_span_codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
    q, table, out, start, stop = args
    q_p = context.make_array(sig.args[0])(context, builder, q).data
    t_p = context.make_array(sig.args[1])(context, builder, table).data
    o_p = context.make_array(sig.args[2])(context, builder, out).data
    # the table's four 64-byte quarters stay in registers for the whole span
    quarters = [load_vec(builder, builder.gep(t_p, [ir.Constant(I64, 64 * k)]), _V64)
                for k in range(4)]  # fmt: skip
    perm = declare(builder.module, ir.FunctionType(_V64, [_V64, _V64, _V64]),
                   "llvm.x86.avx512.vpermi2var.qi.512")  # fmt: skip
    top_bit = ir.Constant(_V64, [128] * 64)

    def step(at: ir.Value) -> None:
        codes = load_vec(builder, builder.gep(q_p, [at]), _V64)
        low = builder.call(perm, [quarters[0], codes, quarters[1]])  # codes 0-127 (7 low bits)
        high = builder.call(perm, [quarters[2], codes, quarters[3]])  # codes 128-255
        top = builder.icmp_unsigned(">=", codes, top_bit)
        store_vec(builder, builder.select(top, high, low), builder.gep(o_p, [at]))

    # two 64-byte steps a turn (each reads its codes before writing: out may be q)
    pairs = builder.sdiv(builder.sub(stop, start), ir.Constant(I64, 128))
    with cgutils.for_range(builder, pairs) as loop:
        at = builder.add(start, builder.mul(loop.index, ir.Constant(I64, 128)))
        step(at)
        step(builder.add(at, ir.Constant(I64, 64)))
    done = builder.add(start, builder.mul(pairs, ir.Constant(I64, 128)))
    with builder.if_then(builder.icmp_signed("<", done, stop)):
        step(done)
    return context.get_dummy_value()


def _lookup_span_typing(
    typingctx: Any, q: Any, table: Any, out: Any, start: Any, stop: Any
) -> Any:  # fmt: skip
    """``out[start:stop] = table[q[start:stop]]`` (C-contiguous 1-D uint8 arrays; ``stop -
    start`` a multiple of 64; the caller keeps every byte in bounds and the table 256
    entries)."""
    if not all(map(flat_u8, (q, table, out))):
        return None
    return types.void(q, table, out, start, stop), _lookup_span_codegen


# typed Any: callers pass the five arguments, not numba's typing context
_lookup_span: Any = intrinsic(_lookup_span_typing)


def _make_gather_vbmi(parallel: bool) -> Any:
    def gather(q, table, out):  # type: ignore[no-untyped-def]
        n = q.size
        full = n - n % 64
        for c in numba.prange((full + _VBMI_CHUNK - 1) // _VBMI_CHUNK):  # plain range if serial
            _lookup_span(q, table, out, c * _VBMI_CHUNK, min(full, c * _VBMI_CHUNK + _VBMI_CHUNK))
        _gather_span(q, table, out, full, n)

    gather.__name__ = gather.__qualname__ = "gather_vbmi_parallel" if parallel else "gather_vbmi"
    return needs_features(_VBMI_FEATURES, numba.njit(cache=True, parallel=parallel)(gather))


_VBMI_CHUNK = 1 << 16  # codes per parallel task (a multiple of 64)
# codes from which two threads gain: 200 K codes 9.4 -> 6.2 us, 1.2 M 69 -> 22 us (Xeon)
VBMI_PARALLEL_MIN = 1 << 18
_gather_vbmi, _gather_vbmi_par = _make_gather_vbmi(False), _make_gather_vbmi(True)


def table_as_pass(table: U8) -> bool:
    """Whether a table fused into a kernel (``lut=``) runs faster as ``apply_table`` over the
    kernel's output than looked up in its epilogue: with VBMI, any real table."""
    return VBMI and table.size > 0


def table_kernel(size: int, threads: int | None = None) -> Any:
    """The gather ``apply_table`` runs on ``size`` codes: ``kernel(q, table, out)`` on flat
    views. ``threads``: the calling kernel's thread count (default: the package setting)."""
    if VBMI:
        if threads is None:
            threads = apply_num_threads(None, "apply_lut")
        if threads > 1 and size >= VBMI_PARALLEL_MIN:
            return with_threads(_gather_vbmi_par, threads)
        return _gather_vbmi
    return choose_kernel(size, "apply_lut", _gather, _gather_par, stream=True)


def apply_table(q: U8, table: U8, out: U8, threads: int | None = None) -> None:
    """Unchecked gather ``out = table[q]`` on validated flat (1-D) uint8 views and a
    C-contiguous table (``out`` may be ``q``: each 64-byte step reads its codes before
    writing). ``threads``: the calling kernel's thread count (default: the package setting)."""
    table_kernel(q.size, threads)(q.reshape(-1), table, out.reshape(-1))


# Float32 definitions of the named functions (each maps a float32 array to a float32 array).
def _sigmoid(x: F32) -> F32:
    return np.asarray(np.float32(1.0) / (np.float32(1.0) + np.exp(-x)), np.float32)


def _hardsigmoid(x: F32) -> F32:
    return np.asarray(np.clip(x + np.float32(3.0), 0, 6) / np.float32(6.0), np.float32)


def _hardswish(x: F32) -> F32:
    return np.asarray(x * np.clip(x + np.float32(3.0), 0, 6) / np.float32(6.0), np.float32)


def _silu(x: F32) -> F32:
    return np.asarray(x / (np.float32(1.0) + np.exp(-x)), np.float32)


def _elu(x: F32) -> F32:
    return np.asarray(np.where(x > 0, x, np.expm1(np.minimum(x, np.float32(0.0)))), np.float32)


def _gelu_tanh(x: F32) -> F32:
    c = np.float32(0.7978845608028654)  # sqrt(2 / pi)
    inner = c * (x + np.float32(0.044715) * x * x * x)
    return np.asarray(np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner)), np.float32)


LUT_FUNCTIONS: dict[str, Callable[[F32], F32]] = {
    "sigmoid": _sigmoid,
    "tanh": np.tanh,
    "hardsigmoid": _hardsigmoid,
    "hardswish": _hardswish,
    "silu": _silu,
    "elu": _elu,
    "gelu_tanh": _gelu_tanh,
    "exp": np.exp,
}


def _build(
    fn: Callable[[F32], object],
    in_scale: float,
    in_zero_point: int,
    out_scale: float,
    out_zero_point: int,
    lo: int,
    hi: int,
) -> U8:
    codes = np.arange(256, dtype=np.uint8)
    real = np.empty(256, np.float32)
    _dequantize_flat(codes, real, in_scale, in_zero_point)
    real.flags.writeable = False  # a user function must not change the inputs it is given
    with np.errstate(all="ignore"):
        result = fn(real)
    if not isinstance(result, np.ndarray) or result.shape != (256,):
        raise KernelError(
            "fn: must map a float32 array of shape (256,) to an array of the same shape, "
            f"got {type(result).__name__} {getattr(result, 'shape', '')}"
        )
    if result.dtype.kind not in "fiu":
        raise KernelError(f"fn: returned {result.dtype} values; expected real numbers")
    values = np.ascontiguousarray(result, dtype=np.float32)
    table = np.empty(256, np.uint8)
    _quantize_flat(values, table, out_scale, out_zero_point, lo, hi)
    table.flags.writeable = False
    return table


@functools.lru_cache(maxsize=256)
def _named_table(
    name: str, in_scale: float, in_zp: int, out_scale: float, out_zp: int, lo: int, hi: int
) -> U8:
    return _build(LUT_FUNCTIONS[name], in_scale, in_zp, out_scale, out_zp, lo, hi)


def build_lut(
    fn: str | Callable[[F32], object],
    in_scale: float,
    in_zero_point: int,
    out_scale: float,
    out_zero_point: int,
    quant_min: int = 0,
    quant_max: int = 255,
) -> U8:
    """The read-only uint8[256] table ``quantize(fn(dequantize(q)))`` for every code ``q``.

    ``fn`` is a name from ``LUT_FUNCTIONS`` (tables for names are cached) or a callable taking
    a float32 array of the 256 dequantized inputs and returning 256 values (cast to float32).
    """
    s_in = f32_scale("in_scale", in_scale)
    s_out = f32_scale("out_scale", out_scale, inverted=True)
    zp_in = check_zero_point("in_zero_point", in_zero_point, 0, 255)
    lo, hi = check_quant_range(np.uint8, quant_min, quant_max)
    zp_out = check_zero_point("out_zero_point", out_zero_point, lo, hi)
    if isinstance(fn, str):
        if fn not in LUT_FUNCTIONS:
            raise KernelError(f"fn: unknown function {fn!r}; choose one of {sorted(LUT_FUNCTIONS)}")
        return _named_table(fn, s_in, zp_in, s_out, zp_out, lo, hi)
    if not callable(fn):
        raise KernelError(f"fn: expected a function name or a callable, got {fn!r}")
    return _build(fn, s_in, zp_in, s_out, zp_out, lo, hi)


def apply_lut(q: U8, table: U8, *, out: U8 | None = None, target: str | None = None) -> U8:
    """``table[q]`` elementwise for uint8 ``q`` and a uint8[256] ``table`` (see build_lut)."""
    check_target(target)
    q, order = check_dense("q", q, np.uint8)
    table = check_array("table", table, np.uint8, 1)
    if table.shape[0] != 256:
        raise KernelError(f"table: expected 256 entries, got {table.shape[0]}")
    if out is None:
        out = empty_in_order(q, np.uint8)
    else:
        check_out(out, q.shape, np.uint8, q, table, order=order)
    apply_table(flat(q, order), table, flat(out, order))
    return out
