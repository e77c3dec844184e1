"""The AArch64 dot-product target of the GEMM micro-kernels: ``sdot`` on int8 x int8.

Armv8.2's dot-product extension (Graviton 2, Neoverse N1, Apple M1) has ``sdot`` (int8 x
int8) and ``udot`` (uint8 x uint8), no mixed-sign form. Activation codes ``a`` are uint8, so
each step flips their top bit, ``a ^ 0x80 = a - 128`` as int8, and runs ``sdot``: the sum is
``sum(a * w) - 128 * sum(w)``. The second term is a constant of each column, which the
column corrections add back (``ACTIVATION_OFFSET``), so the int32 results are exactly
VNNI's. Layout and blocking are ``_arm_i8mm``'s.
"""

from __future__ import annotations

from llvmlite import ir

from quantbridge.kernels._ir import I8, I32, declare

# vector lanes of i32, vectors per block row, k values per step, packed B element type
LANES, VECTORS_PER_ROW, K_STEP, B_ELEMENT = 4, 4, 4, I8
# what the kernels subtract from each activation code: the column corrections add
# ACTIVATION_OFFSET * sum(w) back
ACTIVATION_OFFSET = 128
_FLIP = ir.Constant(ir.VectorType(I32, LANES), [-0x7F7F7F80] * LANES)  # 0x80808080


def declare_dot(module: ir.Module, acc_type: ir.VectorType, b_type: ir.VectorType) -> ir.Function:
    """``sdot``: four int8 x int8 products summed into each int32 lane."""
    return declare(
        module, ir.FunctionType(acc_type, [acc_type, b_type, b_type]),
        "llvm.aarch64.neon.sdot.v4i32.v16i8",
    )  # fmt: skip


def accumulate(
    builder: ir.IRBuilder, dot: ir.Function, acc: ir.Value, a_words: ir.Value, b: ir.Value
) -> ir.Value:
    """``acc`` plus one k step of ``a - 128``: ``a_words`` holds four uint8 activations per
    i32 lane."""
    flipped = builder.xor(a_words, _FLIP)
    return builder.call(dot, [acc, builder.bitcast(flipped, b.type), b])
