"""The AVX2 target of the GEMM micro-kernels: ``vpmaddwd`` on activations widened to int16.

B is packed int16 ``[Np/16][Kp/2][16][2]``; one step consumes 2 k values:
``acc(8 x i32) += vpmaddwd(broadcast(a16[k:k+2] as i32), b_panel[step][8 cols][2])``, where
``a16`` is the activation zero-extended to int16 once per call (so each step is a single
broadcast load instead of a byte-pair load, widen and broadcast). Widening to 16 bits keeps
every product and pair sum exact (|255 * 128 * 2| < 2**31), which ``vpmaddubsw`` (int16
saturation at 32767) would not.
"""

from __future__ import annotations

from llvmlite import ir

from quantbridge.kernels._ir import I16, declare

# vector lanes of i32, vectors per block row, k values per step, packed B element type
LANES, VECTORS_PER_ROW, K_STEP, B_ELEMENT = 8, 2, 2, I16


def declare_dot(module: ir.Module, acc_type: ir.VectorType, b_type: ir.VectorType) -> ir.Function:
    """``vpmaddwd``: pairs of int16 products summed into int32 lanes."""
    return declare(module, ir.FunctionType(acc_type, [b_type, b_type]), "llvm.x86.avx2.pmadd.wd")


def accumulate(
    builder: ir.IRBuilder, dot: ir.Function, acc: ir.Value, a_words: ir.Value, b: ir.Value
) -> ir.Value:
    """``acc`` plus one k step: ``a_words`` holds two int16 activations per i32 lane."""
    return builder.add(acc, builder.call(dot, [builder.bitcast(a_words, b.type), b]))
