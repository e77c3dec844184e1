"""The AArch64 i8mm target of the GEMM micro-kernels: ``usdot`` on uint8 x int8.

Armv8.6's int8 matrix-multiply extension (Graviton 3 and 4, Neoverse V1/V2/N2, Apple M2 and
later) adds ``usdot``: four uint8 x int8 products summed into each int32 lane, the same step as
x86's ``vpdpbusd``, so the kernels' arithmetic and bytes are VNNI's. B is packed int8
``[Np/16][Kp/4][16][4]`` (AVX-VNNI's layout); a 128-bit NEON vector holds 4 columns, so a
panel is 4 vectors: ``acc(4 x i32) = usdot(acc, broadcast(a[k:k+4] as i32), b_panel[step][4
cols][4])``.
"""

from __future__ import annotations

from llvmlite import ir

from quantbridge.kernels._ir import I8, declare

# vector lanes of i32, vectors per block row, k values per step, packed B element type
LANES, VECTORS_PER_ROW, K_STEP, B_ELEMENT = 4, 4, 4, I8


def declare_dot(module: ir.Module, acc_type: ir.VectorType, b_type: ir.VectorType) -> ir.Function:
    """``usdot``: four uint8 x int8 products summed into each int32 lane."""
    return declare(
        module, ir.FunctionType(acc_type, [acc_type, b_type, b_type]),
        "llvm.aarch64.neon.usdot.v4i32.v16i8",
    )  # fmt: skip


def accumulate(
    builder: ir.IRBuilder, dot: ir.Function, acc: ir.Value, a_words: ir.Value, b: ir.Value
) -> ir.Value:
    """``acc`` plus one k step: ``a_words`` holds four uint8 activations per i32 lane."""
    return builder.call(dot, [acc, builder.bitcast(a_words, b.type), b])
