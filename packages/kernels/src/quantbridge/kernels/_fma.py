"""A fused multiply-add usable inside numba kernels: ``fma32(a, b, c) = round32(a * b + c)``.

torch's CPU kernels use FMA instructions in places that decide rounding (per-tensor quantize,
vectorised dequantize, embedding_bag accumulation); matching them bit for bit needs a true
single-rounding FMA, not ``a * b + c`` rounded twice. LLVM's ``llvm.fma`` intrinsic gives
exactly that on every CPU (an instruction where the CPU has one, a correctly rounded libm
call otherwise).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llvmlite import ir
from numba import types
from numba.core.extending import intrinsic


@intrinsic
def _fma32(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """float32 ``a * b + c`` with a single rounding (call from numba code only)."""
    if not all(isinstance(t, types.Float) for t in (a, b, c)):
        return None
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f32 = ir.FloatType()
        values = [
            context.cast(builder, value, ty, types.float32)
            for value, ty in zip(args, signature.args, strict=True)
        ]
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32] * 3))
        return builder.call(fn, values)

    return sig, codegen


if TYPE_CHECKING:

    def fma32(a: float, b: float, c: float) -> float:
        """float32 ``a * b + c`` with a single rounding (numba code only)."""

else:
    fma32 = _fma32
