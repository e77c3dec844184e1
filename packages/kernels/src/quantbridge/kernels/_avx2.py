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

from quantbridge.kernels._ir import I16, I32, declare, vec_broadcast

# vector lanes of i32, vectors per block row, k values per step, packed B element type
LANES, VECTORS_PER_ROW, K_STEP, B_ELEMENT = 8, 2, 2, I16


def declare_dot(module: ir.Module, acc_type: ir.VectorType, b_type: ir.VectorType) -> ir.Function:
    """The multiply-accumulate intrinsic of this target."""
    return declare(module, ir.FunctionType(acc_type, [b_type, b_type]), "llvm.x86.avx2.pmadd.wd")


def emit_dot_step(
    builder: ir.IRBuilder,
    dot: ir.Function,
    a_ptr: ir.Value,
    b_vectors: list[ir.Value],
    slots: list[ir.Value],
    b_type: ir.VectorType,
) -> None:
    """Accumulate one k step of one row into ``slots`` (one per B vector)."""
    pair = builder.load(builder.bitcast(a_ptr, I32.as_pointer()))  # two int16 activations
    pair.align = 1
    a_broadcast = builder.bitcast(vec_broadcast(builder, pair, LANES), b_type)
    for slot, b in zip(slots, b_vectors, strict=True):
        builder.store(builder.add(builder.load(slot), builder.call(dot, [a_broadcast, b])), slot)
