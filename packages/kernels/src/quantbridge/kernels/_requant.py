"""THE requantization rule: int32 accumulator -> uint8, as torch's x86 (fbgemm) engine does it.

Every kernel that turns an int32 accumulator into a uint8 output uses this rule, so linear,
conv, matmul and the elementwise kernels agree bit for bit. All arithmetic is IEEE float32
with round-to-nearest-even, in this exact order (changing the order changes low bits)::

    atws   = float32(act_scale) * float32(w_scale[j])          # float32 product
    mult   = atws / float32(out_scale)                          # float32 quotient
    bias_q = bias[j] * (1 / atws)   (per-tensor weights)        # fbgemm's reciprocal form
           = bias[j] / atws[j]      (per-channel weights)       # fbgemm's division form
    x      = (float32(acc) + bias_q) * mult                     # two float32 ops, no FMA
    q      = clamp(rint(x) + out_zero_point, lo, 255)           # rint: ties to even
    lo     = out_zero_point if relu is fused else 0

``acc`` is the exact integer sum of (a - a_zp) * (w - w_zp[j]) (wrapping int32 arithmetic is
exact because inputs are checked so the true sum fits). ``bias_q`` and ``mult`` depend only on
the scales, so wrappers compute them once per call here and kernels apply them per element.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

F32 = np.float32


def multipliers(
    act_scale: float, w_scales: npt.NDArray[np.float32], out_scale: float | None
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """``(atws, mult)``: float32 act*weight scales and their ratio to the output scale."""
    atws = (F32(act_scale) * w_scales.astype(F32)).astype(F32)
    if out_scale is None:
        return atws, atws
    mult = (atws / F32(out_scale)).astype(F32)
    return atws, mult


def scaled_bias(
    bias: npt.NDArray[np.float32] | None,
    atws: npt.NDArray[np.float32],
    per_channel: bool,
    n_padded: int,
) -> npt.NDArray[np.float32]:
    """The bias in accumulator units (``bias_q`` above), zero-padded to ``n_padded``."""
    out = np.zeros(n_padded, F32)
    if bias is None:
        return out
    n = bias.shape[0]
    if per_channel:
        out[:n] = bias.astype(F32) / atws[:n]
    else:
        rcp = F32(F32(1.0) / atws[0])
        out[:n] = bias.astype(F32) * rcp
    return out


def requantize_reference(
    acc: npt.NDArray[np.int64],
    bias_q: npt.NDArray[np.float32],
    mult: npt.NDArray[np.float32],
    out_zero_point: int,
    relu: bool = False,
) -> npt.NDArray[np.uint8]:
    """The rule applied with numpy to ``acc[..., j]`` (exact int sums); for small inputs."""
    x = (acc.astype(np.int32).astype(F32) + bias_q) * mult
    q = np.rint(x.astype(F32)).astype(np.float64) + out_zero_point
    lo = out_zero_point if relu else 0
    return np.clip(q, lo, 255).astype(np.uint8)
