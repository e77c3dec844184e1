"""The AVX-VNNI target of the GEMM micro-kernels: VEX ``vpdpbusd`` on ymm, uint8 x int8.

For CPUs with AVX-VNNI and without AVX-512 (Intel Alder Lake and later client cores, Sierra
Forest): AVX2's 8-lane blocks and packed-B layout (int8 ``[Np/16][Kp/4][16][4]``, the
``avx2_byte`` one), with one step ``acc(8 x i32) = vpdpbusd(acc, broadcast(a[k:k+4] as i32),
b_panel[step][8 cols][4])``: four u8 x s8 products summed in int32 without saturation, so
every activation code is exact and no pair guard is needed. LLVM selects the VEX encoding
for this intrinsic when the CPU has AVX-VNNI and not AVX-512 VL.
"""

from __future__ import annotations

from llvmlite import ir

from quantbridge.kernels._ir import I8, declare

# vector lanes of i32, vectors per block row, k values per step, packed B element type
LANES, VECTORS_PER_ROW, K_STEP, B_ELEMENT = 8, 2, 4, I8


def declare_dot(module: ir.Module, acc_type: ir.VectorType, b_type: ir.VectorType) -> ir.Function:
    """``vpdpbusd`` on ymm: four uint8 x int8 products summed into each int32 lane."""
    return declare(
        module, ir.FunctionType(acc_type, [acc_type, acc_type, acc_type]),
        "llvm.x86.avx512.vpdpbusd.256",
    )  # fmt: skip


def accumulate(
    builder: ir.IRBuilder, dot: ir.Function, acc: ir.Value, a_words: ir.Value, b: ir.Value
) -> ir.Value:
    """``acc`` plus one k step: ``a_words`` holds four uint8 activations per i32 lane."""
    return builder.call(dot, [acc, a_words, builder.bitcast(b, a_words.type)])
