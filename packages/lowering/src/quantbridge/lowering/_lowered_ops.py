"""Each lowered op once: the object a lowered module calls, which calls one kernel.

A lowered module builds its op object in ``_sync`` (at lowering, after ``load_state_dict``,
after unpickling, when a setting changes) from its buffers and settings: the packed weight,
qparams as Python numbers, flags, tables. Its ``forward_arrays``, its eager ``forward``
(``forward_arrays`` between array views and ``torch.from_numpy``) and the torch.library
custom op torch.export captures (``_custom_ops``: the same object, built from the op's
tensors and cached) all call that object, so each op's logic is written here once.

Where the kernels package has a prepared call (``kernels.PreparedConv``, ``PreparedConvAdd``,
``PreparedLayerNorm``, ``PreparedAdaptiveAvgPool2d``, ``PreparedQuantize`` /
``PreparedDequantize`` / ``PreparedRequantize``), that is the op object. The classes here are
the op objects of the other kernels, whose functions take their prepared state (packed
weights, Python numbers) as arguments: each holds those arguments and makes the call.

Op objects take numpy arrays (the helpers below make them from tensors): codes C-contiguous
or channels-last (``dense_view``) where the kernel takes either, else C-contiguous
(``numpy_view``); convs return channels-last codes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


# --- packed weights, from the tensors a module holds and its custom op receives ---


def _weight_args(
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[Any, Any, Any, Any]:
    """(int8 weight, its qparams: Python numbers per tensor, arrays per channel, float bias)."""
    if scale.numel() == 1:
        ws, wz = float(scale.reshape(-1)[0]), int(zero_point.reshape(-1)[0])
    else:
        ws, wz = numpy_view(scale), numpy_view(zero_point)
    b = None if bias is None else numpy_view(bias.to(torch.float32))
    return numpy_view(weight), ws, wz, b


def pack_linear(
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    bias: torch.Tensor | None,
    target: str,
) -> K.PackedLinearWeight:
    """The packed weight of a linear (static, float-output and dynamic share it)."""
    return K.PackedLinearWeight(*_weight_args(weight, scale, zero_point, bias), target=target)


def pack_conv(
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: int,
    target: str,
) -> K.PackedConvWeight:
    return K.PackedConvWeight(
        *_weight_args(weight, scale, zero_point, bias), stride=tuple(stride),
        padding=tuple(padding), dilation=tuple(dilation), groups=groups, target=target,
    )  # fmt: skip


def pack_embedding(
    codes: torch.Tensor, row_scale: torch.Tensor, row_bias: torch.Tensor
) -> K.PackedEmbedding:
    """8-bit rows, a float32 scale and bias per row."""
    return K.PackedEmbedding(
        numpy_view(codes), numpy_view(row_scale), numpy_view(row_bias), 8, int(codes.shape[1])
    )


# --- the op objects of kernels without a prepared call: each a record of its kernels
# call's prepared arguments (slots: a call reads them as fast as locals' neighbours) ---


@dataclass(slots=True)
class LinearOp:
    """``kernels.linear``: uint8 ``[..., K]`` (C-contiguous) → uint8 ``[..., N]``, relu and
    an activation table (``lut``, uint8[256]) fused into the epilogue if given."""

    packed: K.PackedLinearWeight
    in_qparams: QParams
    out_qparams: QParams
    relu: bool = False
    lut: Any = None

    def __call__(self, a: Any) -> Any:
        return K.linear(
            a, self.packed, *self.in_qparams, *self.out_qparams, relu=self.relu, lut=self.lut
        )


@dataclass(slots=True)
class LinearFloatOp:
    """``kernels.linear_float``: uint8 ``[..., K]`` → float32 ``[..., N]``, ``activation`` in
    the float epilogue. With ``columns`` (an outlier split's ``kernels.FloatColumns``) a call
    given the float input also adds its columns' products; with ``codes_qparams`` it returns
    ``(float result, its codes)``."""

    packed: K.PackedLinearWeight
    in_qparams: QParams
    activation: str = "none"
    columns: K.FloatColumns | None = None
    codes_qparams: QParams | None = None

    def __call__(self, a: Any, floats: Any = None) -> Any:
        columns = self.columns if floats is not None else None
        codes = None
        if self.codes_qparams is not None:
            codes = np.empty((*a.shape[:-1], self.packed.n), np.uint8)
        out = K.linear_float(
            a, self.packed, *self.in_qparams, activation=self.activation, columns=columns,
            float_input=None if columns is None else floats, codes=codes,
            codes_qparams=self.codes_qparams,
        )  # fmt: skip
        return out if codes is None else (out, codes)


@dataclass(slots=True)
class DynamicLinearOp:
    """``kernels.linear_dynamic``: float32 ``[..., K]`` (C-contiguous) → float32, the input
    quantized per call (per row with ``per_row``), ``activation`` in the float epilogue."""

    packed: K.PackedLinearWeight
    activation: str = "none"
    per_row: bool = False

    def __call__(self, a: Any) -> Any:
        return K.linear_dynamic(a, self.packed, per_row=self.per_row, activation=self.activation)


@dataclass(slots=True)
class WeightOnlyLinearOp:
    """``kernels.linear_weight_only``: float32 ``[..., K]`` → float32 ``[..., N]``."""

    packed: K.PackedGroupWeight
    bias: Any

    def __call__(self, a: Any) -> Any:
        return K.linear_weight_only(a, self.packed, self.bias)


@dataclass(slots=True)
class BinaryOp:
    """``kernels.add`` / ``add_relu`` / ``mul`` / ``mul_relu`` (``kind``) on two dense uint8
    arrays. Shapes broadcast first, except a mul by one value per (image, channel)
    (squeeze-excite), which a ``kernels.PreparedMulChannels`` runs without the broadcast (same
    numbers: the product does not depend on the operand order)."""

    kind: str
    a_qparams: QParams
    b_qparams: QParams
    out_qparams: QParams
    target: str
    _fn: Any = field(init=False, repr=False)
    # made at the first squeeze-excite call (its checks are mul_channels'), with the operand
    # shapes it was last called with
    _mul_channels: Any = field(init=False, repr=False, default=None)
    _channel_shapes: Any = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        self._fn = getattr(K, self.kind)

    def __call__(self, a: Any, b: Any) -> Any:
        if a.shape != b.shape:
            if (a.shape, b.shape) == self._channel_shapes or self._per_channel(a.shape, b.shape):
                return self._mul_channels(a, b)
            a, b = (dense_array(v) for v in np.broadcast_arrays(a, b))  # kernels: equal shapes
        return self._fn(a, self.a_qparams, b, self.b_qparams, self.out_qparams, target=self.target)

    def _per_channel(self, a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> bool:
        """A squeeze-excite mul (then ``_mul_channels`` is made, for these shapes)."""
        if self.kind not in ("mul", "mul_relu") or not (
            per_channel_operand(a_shape, b_shape) or per_channel_operand(b_shape, a_shape)
        ):
            return False
        if self._mul_channels is None:
            self._mul_channels = K.PreparedMulChannels(
                self.a_qparams, self.b_qparams, self.out_qparams, relu=self.kind == "mul_relu",
                target=self.target,
            )  # fmt: skip
        self._channel_shapes = (a_shape, b_shape)
        return True


@dataclass(slots=True)
class MatmulOp:
    """``kernels.matmul``: uint8 ``a @ b``, C-contiguous; 2-D or batched, leading dims
    broadcast and run as one [B, M, K] x [B, K, N] call."""

    a_qparams: QParams
    b_qparams: QParams
    out_qparams: QParams
    target: str

    def __call__(self, a: Any, b: Any) -> Any:
        qp = (self.a_qparams, self.b_qparams, self.out_qparams)
        if a.ndim == b.ndim and a.ndim in (2, 3) and a.shape[:-2] == b.shape[:-2]:
            return K.matmul(a, qp[0], b, qp[1], qp[2], target=self.target)
        if a.ndim < 2 or b.ndim < 2:
            raise LoweringError(
                f"quantized matmul: operands need at least 2 dims, got {tuple(a.shape)} and "
                f"{tuple(b.shape)}"
            )
        lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a3, b3 = (
            np.ascontiguousarray(
                np.broadcast_to(x, (*lead, *x.shape[-2:])).reshape(-1, *x.shape[-2:])
            )
            for x in (a, b)
        )
        out = K.matmul(a3, qp[0], b3, qp[1], qp[2], target=self.target)
        return out.reshape(*lead, a.shape[-2], b.shape[-1])


@dataclass(slots=True)
class LookupTableOp:
    """``kernels.apply_lut``: a 256-entry table on dense uint8 codes."""

    table: Any
    target: str

    def __call__(self, a: Any) -> Any:
        return K.apply_lut(a, self.table, target=self.target)


@dataclass(slots=True)
class MaxPool2dOp:
    """``kernels.max_pool2d`` on dense uint8 NCHW codes (qparams unchanged); sizes are ints
    or 1- or 2-sequences, kept as pairs."""

    kernel_size: Any
    stride: Any
    padding: Any
    dilation: Any
    ceil_mode: bool
    target: str

    def __post_init__(self) -> None:
        self.kernel_size, self.stride = pair(self.kernel_size), pair(self.stride)
        self.padding, self.dilation = pair(self.padding), pair(self.dilation)

    def __call__(self, a: Any) -> Any:
        return K.max_pool2d(
            a, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode,
            target=self.target,
        )  # fmt: skip


@dataclass(slots=True)
class AvgPool2dOp:
    """``kernels.avg_pool2d`` on dense uint8 NCHW codes (torch's quantized numerics); sizes
    as ``MaxPool2dOp``'s."""

    kernel_size: Any
    stride: Any
    padding: Any
    ceil_mode: bool
    count_include_pad: bool
    divisor_override: int | None
    in_qparams: QParams
    out_qparams: QParams
    target: str

    def __post_init__(self) -> None:
        self.kernel_size, self.stride = pair(self.kernel_size), pair(self.stride)
        self.padding = pair(self.padding)

    def __call__(self, a: Any) -> Any:
        (scale, zero_point), (out_scale, out_zero_point) = self.in_qparams, self.out_qparams
        return K.avg_pool2d(
            a, self.kernel_size, self.stride, self.padding, self.ceil_mode,
            self.count_include_pad, self.divisor_override, scale=scale, zero_point=zero_point,
            out_scale=out_scale, out_zero_point=out_zero_point, target=self.target,
        )  # fmt: skip


def adaptive_avg_pool2d_op(
    output_size: Any, in_qparams: QParams, out_qparams: QParams, target: str
) -> K.PreparedAdaptiveAvgPool2d:
    """The op object of one adaptive pool (a kernels prepared call): the input's qparams kept
    when they are the output's."""
    return K.PreparedAdaptiveAvgPool2d(
        pair(output_size), scale=in_qparams[0], zero_point=in_qparams[1],
        out_scale=out_qparams[0], out_zero_point=out_qparams[1], target=target,
    )  # fmt: skip


@dataclass(slots=True)
class SoftmaxOp:
    """``kernels.softmax`` of ``x * scale (+ mask)`` over the last dimension, float32."""

    scale: float

    def __call__(self, x: Any, mask: Any = None) -> Any:
        return K.softmax(x, scale=self.scale, mask=mask)


@dataclass(slots=True)
class AttentionOp:
    """``kernels.attention`` on uint8 codes q, k, v [B, H, S, D] (any strides: read in
    place), to uint8 codes (``out_qparams``) or float32 (None)."""

    qparams: tuple[QParams, QParams, QParams]
    out_qparams: QParams | None
    scale: float | None
    causal: bool
    target: str

    def __call__(self, q: Any, k: Any, v: Any, mask: Any = None) -> Any:
        return K.attention(
            q, k, v, *self.qparams, mask=mask, scale=self.scale, causal=self.causal,
            out_qparams=self.out_qparams, target=self.target,
        )  # fmt: skip


@dataclass(slots=True)
class EmbeddingBagOp:
    """``kernels.embedding_bag``: float32 bags of 8-bit rows."""

    packed: K.PackedEmbedding
    mode: str
    include_last_offset: bool
    target: str

    def __call__(self, indices: Any, offsets: Any = None, per_sample_weights: Any = None) -> Any:
        return K.embedding_bag(
            self.packed, indices, offsets, self.mode, per_sample_weights,
            self.include_last_offset, target=self.target,
        )  # fmt: skip
