"""The AVX-512 VNNI target of the GEMM micro-kernels: ``vpdpbusd`` on uint8 x int8.

B is packed int8 ``[Np/32][Kp/4][32][4]``; one step consumes 4 k values:
``acc(16 x i32) = vpdpbusd(acc, broadcast(a[k:k+4] as i32), b_panel[step][16 cols][4])``:
u8 x s8 products summed in int32 without saturation. Also the peak probe the bench uses.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from quantbridge.kernels._ir import I8, I32, I64, declare, stack_slot

# vector lanes of i32, vectors per block row, k values per step, packed B element type
LANES, VECTORS_PER_ROW, K_STEP, B_ELEMENT = 16, 2, 4, I8
_VPDPBUSD = "llvm.x86.avx512.vpdpbusd.512"


def declare_dot(module: ir.Module, acc_type: ir.VectorType, b_type: ir.VectorType) -> ir.Function:
    """``vpdpbusd``: four uint8 x int8 products summed into each int32 lane."""
    return declare(module, ir.FunctionType(acc_type, [acc_type, acc_type, acc_type]), _VPDPBUSD)


def accumulate(
    builder: ir.IRBuilder, dot: ir.Function, acc: ir.Value, a_words: ir.Value, b: ir.Value
) -> ir.Value:
    """``acc`` plus one k step: ``a_words`` holds four uint8 activations per i32 lane."""
    return builder.call(dot, [acc, a_words, builder.bitcast(b, a_words.type)])


@intrinsic
def vpdpbusd_peak_loop(typingctx: Any, iters: Any) -> Any:
    """Run ``iters`` x 16 independent register-only vpdpbusd (the int8 peak probe).

    Returns a lane sum so the work cannot be optimized away. Used by the bench to measure
    the machine's vpdpbusd throughput instead of trusting a datasheet.
    """
    sig = types.int64(types.int64)

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        vi32 = ir.VectorType(I32, 16)
        fn = declare(
            builder.module,
            ir.FunctionType(vi32, [vi32, vi32, vi32]),
            _VPDPBUSD,
        )
        a = ir.Constant(vi32, [0x01010101] * 16)
        b = ir.Constant(vi32, [0x01FF0102 + i for i in range(16)])
        slots = [stack_slot(builder, ir.Constant(vi32, [i] * 16)) for i in range(16)]
        with cgutils.for_range(builder, args[0]):
            for slot in slots:
                builder.store(builder.call(fn, [builder.load(slot), a, b]), slot)
        total = builder.load(slots[0])
        for slot in slots[1:]:
            total = builder.add(total, builder.load(slot))
        lane0 = builder.extract_element(total, ir.Constant(I32, 0))
        return builder.sext(lane0, I64)

    return sig, codegen
