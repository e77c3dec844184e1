"""The AVX2 byte target of the GEMM micro-kernels: ``vpmaddubsw`` on uint8 x int8.

B is packed int8 ``[Np/16][Kp/4][16][4]``; one step consumes 4 k values:
``acc(8 x i32) += vpmaddwd(vpmaddubsw(broadcast(a[k:k+4] as i32), b_panel[step][8 cols][4]),
ones)``. ``vpmaddubsw`` adds two u8 x s8 products into a saturating int16, so this target is
exact only when no such pair can pass 32767: with every weight in [-64, 64] it cannot
(``2 * 255 * 64 = 32640``). ``_pack.kernel_family`` picks this family for such weights at
pack time; every other weight runs the int16 ``avx2`` kernels. It reads half the bytes of
``avx2`` per product and needs no widened copy of the activations.
"""

from __future__ import annotations

from llvmlite import ir

from quantbridge.kernels._ir import I8, I16, declare

# vector lanes of i32, vectors per block row, k values per step, packed B element type
LANES, VECTORS_PER_ROW, K_STEP, B_ELEMENT = 8, 2, 4, I8

_PAIRS = ir.VectorType(I16, 16)
_ONES = ir.Constant(_PAIRS, [1] * 16)


def declare_dot(module: ir.Module, acc_type: ir.VectorType, b_type: ir.VectorType) -> ir.Function:
    """``vpmaddubsw``: pairs of uint8 x int8 products summed into int16 lanes."""
    return declare(module, ir.FunctionType(_PAIRS, [b_type, b_type]), "llvm.x86.avx2.pmadd.ub.sw")


def accumulate(
    builder: ir.IRBuilder, dot: ir.Function, acc: ir.Value, a_words: ir.Value, b: ir.Value
) -> ir.Value:
    """``acc`` plus one k step: ``a_words`` holds four uint8 activations per i32 lane."""
    widen = declare(
        builder.module, ir.FunctionType(acc.type, [_PAIRS, _PAIRS]), "llvm.x86.avx2.pmadd.wd"
    )
    pairs = builder.call(dot, [builder.bitcast(a_words, b.type), b])
    return builder.add(acc, builder.call(widen, [pairs, _ONES]))
