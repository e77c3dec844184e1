"""Each lowered op, once: tensors (and packed weights) in, a kernel call, a tensor out.

The lowered modules call these in eager mode; the torch.library custom ops (``_custom_ops``,
what torch.export and torch.compile capture) call them as their real implementation. Codes
may arrive C-contiguous or channels-last; convs return channels-last codes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from quantbridge import kernels as K
from quantbridge.lowering._errors import LoweringError

QParams = tuple[float, int]  # (scale, zero point); kernels.QParams is one too


def per_channel_operand(x_shape: tuple[int, ...], s_shape: tuple[int, ...]) -> bool:
    """``s_shape`` is one value per (image, channel) of ``x_shape``: [N or 1, C, 1, ...]."""
    return (
        len(x_shape) >= 3
        and len(s_shape) == len(x_shape)
        and s_shape[0] in (1, x_shape[0])
        and s_shape[1] == x_shape[1]
        and all(d == 1 for d in s_shape[2:])
    )


def numpy_view(t: torch.Tensor) -> Any:
    """C-contiguous numpy view (a copy only when ``t`` is laid out otherwise)."""
    t = t.detach()  # float inputs may come from float ops with parameters (grad mode on)
    return (t if t.is_contiguous() else t.contiguous()).numpy()


def dense_view(t: torch.Tensor) -> Any:
    """Zero-copy numpy view of a C-contiguous or channels-last tensor, else a C-contiguous copy.

    For the kernels that take either layout (conv, elementwise): convs return channels-last
    data, so activations stay channels-last from conv to conv without transposes.
    """
    if t.requires_grad:
        t = t.detach()
    if t.is_contiguous():
        return t.numpy()
    # channels-last 4-d data: one stride check instead of building a moved view
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return t.numpy()
    if t.dim() >= 3 and t.movedim(1, -1).is_contiguous():
        return t.numpy()
    return t.contiguous().numpy()


def pair(v: Any) -> tuple[int, int]:
    """An int or a 1- or 2-sequence as a (height, width) pair."""
    if isinstance(v, int):
        return (v, v)
    return (v[0], v[1]) if len(v) > 1 else (v[0], v[0])


def linear(
    x: torch.Tensor,
    packed: K.PackedLinearWeight,
    in_qp: QParams,
    out_qp: QParams,
    relu: bool,
    lut: Any = None,
) -> torch.Tensor:
    """``lut``: an activation table fused into the epilogue (uint8[256] numpy) or None."""
    return torch.from_numpy(K.linear(numpy_view(x), packed, *in_qp, *out_qp, relu=relu, lut=lut))


def linear_dynamic(
    x: torch.Tensor, packed: K.PackedLinearWeight, activation: str = "none", per_row: bool = False
) -> torch.Tensor:
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    out = K.linear_dynamic(numpy_view(x), packed, per_row=per_row, activation=activation)
    return torch.from_numpy(out)


def layer_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: Any, bias: Any, eps: float
) -> torch.Tensor:
    r = None if residual is None else numpy_view(residual.to(torch.float32))
    return torch.from_numpy(K.layer_norm(numpy_view(x), weight, bias, eps, residual=r))


def softmax(x: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    m = None if mask is None else mask.detach().numpy()  # strided views are fine: it is copied
    return torch.from_numpy(K.softmax(numpy_view(x), scale=scale, mask=m))


def conv(
    x: torch.Tensor,
    packed: K.PackedConvWeight,
    in_qp: QParams,
    out_qp: QParams,
    relu: bool,
    lut: Any = None,
) -> torch.Tensor:
    fn = K.conv2d if packed.dims == 2 else K.conv1d
    out = fn(dense_view(x), packed, *in_qp, *out_qp, relu=relu, channels_last=True, lut=lut)
    return torch.from_numpy(out)


def conv_add(
    x: torch.Tensor,
    packed: K.PackedConvWeight,
    in_qp: QParams,
    conv_qp: QParams,
    other: torch.Tensor,
    other_qp: QParams,
    out_qp: QParams,
    relu_conv: bool,
    relu: bool,
    lut: Any = None,
) -> torch.Tensor:
    out = K.conv2d_add(
        dense_view(x), packed, in_qp, conv_qp, dense_view(other), other_qp, out_qp,
        relu_conv=relu_conv, relu=relu, lut=lut,
    )  # fmt: skip
    return torch.from_numpy(out)


def binary(
    kind: str,
    a: torch.Tensor,
    a_qp: QParams,
    b: torch.Tensor,
    b_qp: QParams,
    out_qp: QParams,
    target: str,
) -> torch.Tensor:
    """``kind``: add, add_relu, mul or mul_relu; shapes broadcast first, except a mul by one
    value per (image, channel) (squeeze-excite), which ``kernels.mul_channels`` runs without
    the broadcast (same numbers; the product does not depend on the operand order)."""
    if kind in ("mul", "mul_relu") and a.shape != b.shape:
        for x, x_qp, s, s_qp in ((a, a_qp, b, b_qp), (b, b_qp, a, a_qp)):
            if per_channel_operand(tuple(x.shape), tuple(s.shape)):
                out = K.mul_channels(
                    dense_view(x), x_qp, numpy_view(s), s_qp, out_qp, relu=kind == "mul_relu",
                    target=target,
                )  # fmt: skip
                return torch.from_numpy(out)
    if a.shape != b.shape:  # the kernels take equal shapes
        a, b = torch.broadcast_tensors(a, b)  # type: ignore[no-untyped-call]
    fn = getattr(K, kind)
    out = fn(dense_view(a), a_qp, dense_view(b), b_qp, out_qp, target=target)
    return torch.from_numpy(out)


def matmul(
    a: torch.Tensor, a_qp: QParams, b: torch.Tensor, b_qp: QParams, out_qp: QParams, target: str
) -> torch.Tensor:
    """2-D or batched; leading dims broadcast and run as one [B, M, K] x [B, K, N] call."""
    if a.dim() == b.dim() and a.dim() in (2, 3) and a.shape[:-2] == b.shape[:-2]:
        out = K.matmul(numpy_view(a), a_qp, numpy_view(b), b_qp, out_qp, target=target)
        return torch.from_numpy(out)
    if a.dim() < 2 or b.dim() < 2:
        raise LoweringError(
            f"quantized matmul: operands need at least 2 dims, got {tuple(a.shape)} and "
            f"{tuple(b.shape)}"
        )
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])  # type: ignore[no-untyped-call]
    a3 = a.expand(*lead, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*lead, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    out = K.matmul(numpy_view(a3), a_qp, numpy_view(b3), b_qp, out_qp, target=target)
    return torch.from_numpy(np.asarray(out)).reshape(*lead, a.shape[-2], b.shape[-1])


def lookup_table(x: torch.Tensor, table: Any, target: str) -> torch.Tensor:
    return torch.from_numpy(K.apply_lut(dense_view(x), table, target=target))


def requantize(x: torch.Tensor, in_qp: QParams, out_qp: QParams, target: str) -> torch.Tensor:
    return torch.from_numpy(K.requantize(dense_view(x), *in_qp, *out_qp, target=target))


def max_pool2d(
    x: torch.Tensor,
    kernel_size: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    ceil_mode: bool,
    target: str,
) -> torch.Tensor:
    out = K.max_pool2d(
        dense_view(x), pair(kernel_size), pair(stride), pair(padding), pair(dilation),
        ceil_mode, target=target,
    )  # fmt: skip
    return torch.from_numpy(out)


def avg_pool2d(
    x: torch.Tensor,
    kernel_size: Any,
    stride: Any,
    padding: Any,
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
    in_qp: QParams,
    out_qp: QParams,
    target: str,
) -> torch.Tensor:
    out = K.avg_pool2d(
        dense_view(x), pair(kernel_size), pair(stride), pair(padding), ceil_mode,
        count_include_pad, divisor_override, scale=in_qp[0], zero_point=in_qp[1],
        out_scale=out_qp[0], out_zero_point=out_qp[1], target=target,
    )  # fmt: skip
    return torch.from_numpy(out)


def adaptive_avg_pool2d(x: torch.Tensor, output_size: Any, target: str) -> torch.Tensor:
    return torch.from_numpy(K.adaptive_avg_pool2d(dense_view(x), pair(output_size), target=target))


def embedding_bag(
    packed: K.PackedEmbedding,
    indices: torch.Tensor,
    offsets: torch.Tensor | None,
    mode: str,
    per_sample_weights: torch.Tensor | None,
    include_last_offset: bool,
    target: str,
) -> torch.Tensor:
    out = K.embedding_bag(
        packed,
        numpy_view(indices),
        None if offsets is None else numpy_view(offsets),
        mode,
        None if per_sample_weights is None else numpy_view(per_sample_weights),
        include_last_offset,
        target=target,
    )
    return torch.from_numpy(out)
