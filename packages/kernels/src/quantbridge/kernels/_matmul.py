"""Quantized matmul of two activations (attention-style), batched: [B, M, K] x [B, K, N].

``a`` is uint8; ``b`` is uint8 or int8, each with a per-tensor scale and zero point. A uint8
``b`` is shifted to int8 (``b - 128``, zero point ``b_zp - 128``) so the int8-weight kernels
apply unchanged; each batch's ``b`` is packed per call (it is an activation, not a weight).
The result is requantized to uint8 with the rule in ``_requant.py`` (no bias):
``clamp(rint(float32(acc) * mult) + out_zp)``, ``mult = float32(a_s * b_s) / float32(out_s)``.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from quantbridge.kernels._checks import (
    check_accumulation_fits_int32,
    check_array,
    check_derived,
    check_scale,
    check_zero_point,
)
from quantbridge.kernels._errors import KernelError
from quantbridge.kernels._linear import PackedLinearWeight, _fast_zp, linear
from quantbridge.kernels._qparams import QParams, as_qparams
from quantbridge.kernels._targets import resolve_target


def matmul(
    a: npt.NDArray[np.uint8],
    a_qparams: QParams | tuple[float, int],
    b: npt.NDArray[np.uint8] | npt.NDArray[np.int8],
    b_qparams: QParams | tuple[float, int],
    out_qparams: QParams | tuple[float, int],
    *,
    target: str | None = None,
    num_threads: int | None = None,
) -> npt.NDArray[np.uint8]:
    """uint8 ``a @ b`` for [M, K] x [K, N] or batched [B, M, K] x [B, K, N]."""
    a_scale, a_zero_point = as_qparams("a_qparams", a_qparams)
    b_scale, b_zero_point = as_qparams("b_qparams", b_qparams)
    out_scale, out_zero_point = as_qparams("out_qparams", out_qparams)
    aa = check_array("a", a, np.uint8, (2, 3))
    bb = check_array("b", b, (np.uint8, np.int8), (2, 3))
    if aa.ndim != bb.ndim:
        raise KernelError(f"a and b must both be 2-D or both 3-D, got {aa.shape} and {bb.shape}")
    if aa.shape[-1] != bb.shape[-2]:
        raise KernelError(
            f"matmul: a's K={aa.shape[-1]} does not match b's K={bb.shape[-2]} "
            f"(a {aa.shape}, b {bb.shape})"
        )
    if aa.ndim == 3 and aa.shape[0] != bb.shape[0]:
        raise KernelError(f"matmul: batch sizes differ: a {aa.shape}, b {bb.shape}")
    tgt = resolve_target(target)
    unsigned = bb.dtype == np.uint8
    if unsigned:
        b_zp = _fast_zp(b_zero_point, "b_qparams.zero_point")
    else:
        b_zp = check_zero_point("b_qparams.zero_point", b_zero_point, -128, 127)
    k = int(aa.shape[-1])
    check_accumulation_fits_int32("b", k, 255, 255)
    # checked here under matmul's names (linear below would call them x_scale / weight scale)
    sa = check_scale("a_qparams.scale", a_scale)
    sb = check_scale("b_qparams.scale", b_scale)
    so = check_scale("out_qparams.scale", out_scale)
    with np.errstate(all="ignore"):  # out-of-range products are refused just below
        ab = np.float32(sa) * np.float32(sb)
        mult = ab / np.float32(so)
    check_derived("a_scale * b_scale", ab)
    check_derived("a_scale * b_scale / out_scale", mult)
    check_zero_point("a_qparams.zero_point", a_zero_point, 0, 255)
    check_zero_point("out_qparams.zero_point", out_zero_point, 0, 255)
    a3 = aa if aa.ndim == 3 else aa[None]
    b3 = bb if bb.ndim == 3 else bb[None]
    outs = []
    for i in range(a3.shape[0]):
        bt = b3[i].T
        if unsigned:
            w = (bt.astype(np.int16) - 128).astype(np.int8)
            zp = b_zp - 128
        else:
            w, zp = bt, b_zp
        packed = PackedLinearWeight(np.ascontiguousarray(w), b_scale, zp, None, target=tgt)
        outs.append(
            linear(
                a3[i],
                packed,
                a_scale,
                a_zero_point,
                out_scale,
                out_zero_point,
                num_threads=num_threads,
            )
        )
    res = np.stack(outs)
    return res if aa.ndim == 3 else res[0]
