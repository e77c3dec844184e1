"""LLVM IR building blocks shared by the int8 micro-kernels of every SIMD target."""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

I8 = ir.IntType(8)
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
F32T = ir.FloatType()


def declare(module: ir.Module, fnty: ir.FunctionType, name: str) -> ir.Function:
    """Declare (once) an LLVM intrinsic in ``module``."""
    return cgutils.get_or_insert_function(module, fnty, name)  # type: ignore[no-untyped-call]


def stack_slot(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """An entry-block stack slot; LLVM promotes these accumulators to registers."""
    return cgutils.alloca_once_value(builder, value)  # type: ignore[no-untyped-call]


def vec_broadcast(builder: ir.IRBuilder, scalar: ir.Value, lanes: int) -> ir.Value:
    vt = ir.VectorType(scalar.type, lanes)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), scalar, ir.Constant(I32, 0))
    mask = ir.Constant(ir.VectorType(I32, lanes), [0] * lanes)
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), mask)


def load_vec(builder: ir.IRBuilder, ptr: ir.Value, vt: ir.VectorType) -> ir.Value:
    v = builder.load(builder.bitcast(ptr, vt.as_pointer()))
    v.align = 1
    return v


def store_vec(builder: ir.IRBuilder, value: ir.Value, ptr: ir.Value) -> None:
    st = builder.store(value, builder.bitcast(ptr, value.type.as_pointer()))
    st.align = 1
