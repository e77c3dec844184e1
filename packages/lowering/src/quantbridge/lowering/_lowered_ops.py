"""Each lowered op, once: tensors (and packed weights) in, a kernel call, a tensor out.

The lowered modules call these in eager mode; the torch.library custom ops (``_custom_ops``,
what torch.export and torch.compile capture) call them as their real implementation. Codes
may arrive C-contiguous or channels-last; convs return channels-last codes.

The ops that a lowered model chains (convs, linears, elementwise, pools, quantize) also come
as ``*_arrays`` functions on numpy arrays; the tensor op is that function between
``dense_view`` (or ``numpy_view``) and ``torch.from_numpy``, so a model can pass arrays from
op to op (``_array_forward``) and get the same numbers.
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
    return dense_array((t.detach() if t.requires_grad else t).numpy())


def as_array(value: Any, how: str) -> Any:
    """A tensor's or an array's codes as a lowered module's array form takes them (its
    ``array_input``): ``"dense"`` (``dense_view``), ``"c"`` (C-contiguous), ``"float"``
    (float32, dense) or ``"strided"`` (as laid out: an array itself, a tensor's view; half
    and bfloat16 floats, which numpy lacks or reads slowly, as float32)."""
    if how == "strided":
        if isinstance(value, np.ndarray):
            return value
        t = value.detach()
        return (t.to(torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t).numpy()
    if isinstance(value, np.ndarray):
        if how == "c":
            return np.ascontiguousarray(value)
        if how == "float" and value.dtype != np.float32:
            value = value.astype(np.float32)
        return dense_array(value)
    if how == "c":
        return numpy_view(value)
    if how == "float" and value.dtype != torch.float32:
        value = value.to(torch.float32)
    return dense_view(value)


def dense_array(a: Any) -> Any:
    """``a`` itself when C-contiguous or channels-last (channels in the last memory axis),
    else a C-contiguous copy: ``dense_view`` for arrays."""
    if a.flags.c_contiguous:
        return a
    if a.ndim >= 3 and a.transpose((0, *range(2, a.ndim), 1)).flags.c_contiguous:
        return a
    return np.ascontiguousarray(a)


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
    return torch.from_numpy(linear_arrays(numpy_view(x), packed, in_qp, out_qp, relu, lut))


def linear_arrays(
    a: Any, packed: K.PackedLinearWeight, in_qp: QParams, out_qp: QParams, relu: bool, lut: Any
) -> Any:
    """``linear`` on a C-contiguous array."""
    return K.linear(a, packed, *in_qp, *out_qp, relu=relu, lut=lut)


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


def layer_norm_codes(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: Any,
    bias: Any,
    eps: float,
    x_qp: QParams | None,
    codes_qp: QParams | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer_norm`` reading uint8 codes (``x_qp``) and/or also returning its result quantized
    (``codes_qp``; else an empty uint8 tensor)."""
    r = None if residual is None else numpy_view(residual.to(torch.float32))
    xa = numpy_view(x)
    codes = np.empty(xa.shape if codes_qp is not None else (0,), np.uint8)
    out = K.layer_norm(xa, weight, bias, eps, residual=r, x_qparams=x_qp,
                       codes=codes if codes_qp is not None else None,
                       codes_qparams=codes_qp)  # fmt: skip
    return torch.from_numpy(out), torch.from_numpy(codes)


def softmax(x: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    m = None if mask is None else mask.detach().numpy()  # strided views are fine: it is copied
    return torch.from_numpy(K.softmax(numpy_view(x), scale=scale, mask=m))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qparams: tuple[QParams, QParams, QParams],
    out_qp: QParams | None,
    scale: float | None,
    mask: torch.Tensor | None,
    target: str,
    causal: bool = False,
) -> torch.Tensor:
    """``kernels.attention`` on uint8 codes [B, H, S, D] (any strides: read in place)."""
    m = None if mask is None else mask.detach().numpy()  # strided (expanded) masks: no copy
    out = K.attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), *qparams,
                      mask=m, scale=scale, causal=causal, out_qparams=out_qp,
                      target=target)  # fmt: skip
    return torch.from_numpy(out)


def conv(
    x: torch.Tensor,
    packed: K.PackedConvWeight,
    in_qp: QParams,
    out_qp: QParams,
    relu: bool,
    lut: Any = None,
) -> torch.Tensor:
    return torch.from_numpy(conv_arrays(dense_view(x), packed, in_qp, out_qp, relu, lut))


def conv_arrays(
    a: Any, packed: K.PackedConvWeight, in_qp: QParams, out_qp: QParams, relu: bool, lut: Any
) -> Any:
    """``conv`` on a dense array (``dense_array``): channels-last codes out."""
    fn = K.conv2d if packed.dims == 2 else K.conv1d
    return fn(a, packed, *in_qp, *out_qp, relu=relu, channels_last=True, lut=lut)


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
    return torch.from_numpy(conv_add_arrays(
        dense_view(x), packed, in_qp, conv_qp, dense_view(other), other_qp, out_qp, relu_conv,
        relu, lut,
    ))  # fmt: skip


def conv_add_arrays(
    a: Any,
    packed: K.PackedConvWeight,
    in_qp: QParams,
    conv_qp: QParams,
    other: Any,
    other_qp: QParams,
    out_qp: QParams,
    relu_conv: bool,
    relu: bool,
    lut: Any,
) -> Any:
    """``conv_add`` on dense arrays."""
    return K.conv2d_add(
        a, packed, in_qp, conv_qp, other, other_qp, out_qp, relu_conv=relu_conv, relu=relu,
        lut=lut,
    )  # fmt: skip


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
    return torch.from_numpy(
        binary_arrays(kind, dense_view(a), a_qp, dense_view(b), b_qp, out_qp, target)
    )


def binary_arrays(
    kind: str, a: Any, a_qp: QParams, b: Any, b_qp: QParams, out_qp: QParams, target: str
) -> Any:
    """``binary`` on dense arrays."""
    if kind in ("mul", "mul_relu") and a.shape != b.shape:
        for x, x_qp, s, s_qp in ((a, a_qp, b, b_qp), (b, b_qp, a, a_qp)):
            if per_channel_operand(x.shape, s.shape):
                return K.mul_channels(
                    x, x_qp, np.ascontiguousarray(s), s_qp, out_qp, relu=kind == "mul_relu",
                    target=target,
                )  # fmt: skip
    if a.shape != b.shape:  # the kernels take equal shapes
        a, b = (dense_array(v) for v in np.broadcast_arrays(a, b))
    return getattr(K, kind)(a, a_qp, b, b_qp, out_qp, target=target)


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
    return torch.from_numpy(lookup_table_arrays(dense_view(x), table, target))


def lookup_table_arrays(a: Any, table: Any, target: str) -> Any:
    return K.apply_lut(a, table, target=target)


def requantize(x: torch.Tensor, in_qp: QParams, out_qp: QParams, target: str) -> torch.Tensor:
    return torch.from_numpy(requantize_arrays(dense_view(x), in_qp, out_qp, target))


def requantize_arrays(a: Any, in_qp: QParams, out_qp: QParams, target: str) -> Any:
    return K.requantize(a, *in_qp, *out_qp, target=target)


def max_pool2d(
    x: torch.Tensor,
    kernel_size: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    ceil_mode: bool,
    target: str,
) -> torch.Tensor:
    return torch.from_numpy(max_pool2d_arrays(
        dense_view(x), kernel_size, stride, padding, dilation, ceil_mode, target
    ))  # fmt: skip


def max_pool2d_arrays(
    a: Any, kernel_size: Any, stride: Any, padding: Any, dilation: Any, ceil_mode: bool,
    target: str,
) -> Any:  # fmt: skip
    return K.max_pool2d(
        a, pair(kernel_size), pair(stride), pair(padding), pair(dilation), ceil_mode,
        target=target,
    )  # fmt: skip


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
    return torch.from_numpy(avg_pool2d_arrays(
        dense_view(x), kernel_size, stride, padding, ceil_mode, count_include_pad,
        divisor_override, in_qp, out_qp, target,
    ))  # fmt: skip


def avg_pool2d_arrays(
    a: Any,
    kernel_size: Any,
    stride: Any,
    padding: Any,
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
    in_qp: QParams,
    out_qp: QParams,
    target: str,
) -> Any:
    return K.avg_pool2d(
        a, pair(kernel_size), pair(stride), pair(padding), ceil_mode, count_include_pad,
        divisor_override, scale=in_qp[0], zero_point=in_qp[1], out_scale=out_qp[0],
        out_zero_point=out_qp[1], target=target,
    )  # fmt: skip


def adaptive_avg_pool2d(
    x: torch.Tensor, output_size: Any, in_qp: QParams, out_qp: QParams, target: str
) -> torch.Tensor:
    return torch.from_numpy(
        adaptive_avg_pool2d_arrays(dense_view(x), output_size, in_qp, out_qp, target)
    )


def adaptive_avg_pool2d_arrays(
    a: Any, output_size: Any, in_qp: QParams, out_qp: QParams, target: str
) -> Any:
    return prepared_adaptive_avg_pool2d(pair(output_size), in_qp, out_qp, target)(a)


def prepared_adaptive_avg_pool2d(
    output_size: tuple[int, int], in_qp: QParams, out_qp: QParams, target: str
) -> Any:
    """The kernel for one pool: the input's qparams kept when ``in_qp == out_qp``."""
    return K.PreparedAdaptiveAvgPool2d(
        output_size, scale=in_qp[0], zero_point=in_qp[1], out_scale=out_qp[0],
        out_zero_point=out_qp[1], target=target,
    )  # fmt: skip


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
