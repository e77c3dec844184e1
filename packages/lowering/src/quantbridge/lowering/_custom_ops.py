"""The torch.library path: lowered ops as ``torch.ops.quantbridge_lowering.*`` custom ops.

Eager forward calls the numba kernels directly on numpy views (fastest, no dispatcher). While
``torch.export``/``torch.compile`` traces (``torch.compiler.is_compiling()``, which is also
true while exporting, or any input is not a plain ``torch.Tensor``: fake, functional or proxy
tensors) the lowered modules call these custom ops instead: each has a fake (meta)
implementation giving the output shape and dtype, so the graph captures one opaque node per
lowered op. Running the exported program eagerly executes the real implementation, which
calls the same kernels; packed weights are rebuilt from the int8 weight tensors there and
cached per weight tensor.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from quantbridge import kernels as K
from quantbridge.lowering import _lowered_ops as lowered

__all__ = ["is_tracing"]

_NS = "quantbridge_lowering"
_pack_cache: dict[tuple[Any, ...], Any] = {}
_pack_lock = threading.Lock()

# Lowered ops (these and the eager modules) run on torch's intra-op thread count, read at
# every kernel call; an explicit quantbridge.kernels.set_num_threads still wins.
K.set_num_threads_source(torch.get_num_threads)


def is_tracing(*tensors: torch.Tensor) -> bool:
    """True when the custom-op path must run (export/compile tracing, fake tensors)."""
    for t in tensors:
        # plain eager tensors are exactly torch.Tensor; fake/functional/proxy ones subclass it
        if type(t) is not torch.Tensor:
            return True
    return torch.compiler.is_compiling()


def _cached(key: tuple[Any, ...], build: Any) -> Any:
    with _pack_lock:
        found = _pack_cache.get(key)
        if found is None:
            if len(_pack_cache) > 256:
                _pack_cache.clear()
            found = build()
            _pack_cache[key] = found
        return found


def _wkey(kind: str, w: torch.Tensor, *rest: Any) -> tuple[Any, ...]:
    return (kind, w.data_ptr(), w._version, tuple(w.shape), *rest)


def _wqp(scale: torch.Tensor, zero_point: torch.Tensor) -> tuple[Any, Any]:
    """Per-tensor weight qparams as Python numbers, per-channel as arrays."""
    if scale.numel() == 1:
        return float(scale.reshape(-1)[0]), int(zero_point.reshape(-1)[0])
    return lowered.numpy_view(scale), lowered.numpy_view(zero_point)


def _bias(b: torch.Tensor | None) -> Any:
    return None if b is None else lowered.numpy_view(b.detach().to(torch.float32))


def _view(t: torch.Tensor | None) -> Any:
    return None if t is None else lowered.numpy_view(t)


def _qp(values: list[float], at: int = 0) -> tuple[float, int]:
    """(scale, zero point) at ``values[at : at + 2]``: schemas carry qparams as float lists."""
    return values[at], int(values[at + 1])


def _packed_linear(
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    w_zero_point: torch.Tensor,
    bias: torch.Tensor | None,
    target: str,
) -> K.PackedLinearWeight:
    """The packed linear weight (static and dynamic share it), built once per weight tensor."""
    packed: K.PackedLinearWeight = _cached(
        _wkey("linear", weight, target),
        lambda: K.PackedLinearWeight(
            lowered.numpy_view(weight), *_wqp(w_scale, w_zero_point), _bias(bias), target=target
        ),
    )
    return packed


@torch.library.custom_op(f"{_NS}::linear", mutates_args=())
def linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    w_zero_point: torch.Tensor,
    bias: torch.Tensor | None,
    x_scale: float,
    x_zero_point: int,
    out_scale: float,
    out_zero_point: int,
    relu: bool,
    target: str,
) -> torch.Tensor:
    packed = _packed_linear(weight, w_scale, w_zero_point, bias, target)
    return lowered.linear(x, packed, (x_scale, x_zero_point), (out_scale, out_zero_point), relu)


@linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, *args: Any) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.uint8)


@torch.library.custom_op(f"{_NS}::linear_float", mutates_args=())
def linear_float_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    w_zero_point: torch.Tensor,
    bias: torch.Tensor | None,
    x_scale: float,
    x_zero_point: int,
    target: str,
    activation: str,
    float_input: torch.Tensor | None,
    channels: torch.Tensor | None,
    column_weight: torch.Tensor | None,
    codes_qparams: list[float] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float result, its codes when ``codes_qparams`` is given, else an empty tensor)."""
    packed = _packed_linear(weight, w_scale, w_zero_point, bias, target)
    columns, floats = None, None
    if float_input is not None and channels is not None and column_weight is not None:
        floats = lowered.numpy_view(float_input)
        columns = _cached(
            _wkey("float_columns", column_weight, target),
            lambda: K.FloatColumns(lowered.numpy_view(channels), lowered.numpy_view(column_weight)),
        )
    c_qp = None if codes_qparams is None else _qp(codes_qparams)
    codes = None
    if c_qp is not None:
        codes = np.empty((*x.shape[:-1], weight.shape[0]), np.uint8)
    out = K.linear_float(
        lowered.numpy_view(x), packed, x_scale, x_zero_point, activation=activation,
        columns=columns, float_input=floats,
        codes=codes, codes_qparams=c_qp,
    )  # fmt: skip
    empty = torch.empty(0, dtype=torch.uint8)
    return torch.from_numpy(out), empty if codes is None else torch.from_numpy(codes)


@linear_float_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*x.shape[:-1], weight.shape[0])
    codes = x.new_empty(shape if args[-1] is not None else (0,), dtype=torch.uint8)
    return x.new_empty(shape, dtype=torch.float32), codes


@torch.library.custom_op(f"{_NS}::linear_dynamic", mutates_args=())
def linear_dynamic_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    w_zero_point: torch.Tensor,
    bias: torch.Tensor | None,
    target: str,
    activation: str = "none",
    per_row: bool = False,
) -> torch.Tensor:
    packed = _packed_linear(weight, w_scale, w_zero_point, bias, target)
    return lowered.linear_dynamic(x, packed, activation, per_row)


@linear_dynamic_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, *args: Any) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


@torch.library.custom_op(f"{_NS}::conv", mutates_args=())
def conv_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    w_zero_point: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
    x_scale: float,
    x_zero_point: int,
    out_scale: float,
    out_zero_point: int,
    relu: bool,
    target: str,
) -> torch.Tensor:
    packed = _cached(
        _wkey("conv", weight, target, tuple(stride), tuple(padding), tuple(dilation), groups),
        lambda: K.PackedConvWeight(
            lowered.numpy_view(weight),
            *_wqp(w_scale, w_zero_point),
            _bias(bias),
            stride=tuple(stride),
            padding=tuple(padding),
            dilation=tuple(dilation),
            groups=groups,
            target=target,
        ),
    )
    in_qp, out_qp = (x_scale, x_zero_point), (out_scale, out_zero_point)
    return lowered.conv(x, packed, in_qp, out_qp, relu).contiguous()  # NCHW, as the fake


@conv_op.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    w_zero_point: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
    *args: Any,
) -> torch.Tensor:
    conv = F.conv2d if weight.dim() == 4 else F.conv1d
    y = conv(x.float(), weight.float(), None, stride, padding, dilation, groups)
    return y.to(torch.uint8)


@torch.library.custom_op(f"{_NS}::binary", mutates_args=())
def binary_op(
    a: torch.Tensor,
    a_scale: float,
    a_zero_point: int,
    b: torch.Tensor,
    b_scale: float,
    b_zero_point: int,
    out_scale: float,
    out_zero_point: int,
    kind: str,
    target: str,
) -> torch.Tensor:
    return lowered.binary(
        kind, a, (a_scale, a_zero_point), b, (b_scale, b_zero_point),
        (out_scale, out_zero_point), target,
    )  # fmt: skip


@binary_op.register_fake
def _(a: torch.Tensor, a_scale: float, a_zero_point: int, b: torch.Tensor, *args: Any) -> Any:
    return torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=torch.uint8)  # type: ignore[no-untyped-call]


@torch.library.custom_op(f"{_NS}::lut", mutates_args=())
def lut_op(x: torch.Tensor, table: torch.Tensor, target: str) -> torch.Tensor:
    return lowered.lookup_table(x, lowered.numpy_view(table), target)


@lut_op.register_fake
def _(x: torch.Tensor, table: torch.Tensor, target: str) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.uint8)


@torch.library.custom_op(f"{_NS}::requantize", mutates_args=())
def requantize_op(
    x: torch.Tensor,
    in_scale: float,
    in_zero_point: int,
    out_scale: float,
    out_zero_point: int,
    target: str,
) -> torch.Tensor:
    return lowered.requantize(x, (in_scale, in_zero_point), (out_scale, out_zero_point), target)


@requantize_op.register_fake
def _(x: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.uint8)


@torch.library.custom_op(f"{_NS}::max_pool2d", mutates_args=())
def max_pool2d_op(
    x: torch.Tensor,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    ceil_mode: bool,
    target: str,
) -> torch.Tensor:
    return lowered.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode, target)


@max_pool2d_op.register_fake
def _(
    x: torch.Tensor,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    ceil_mode: bool,
    target: str,
) -> torch.Tensor:
    y = F.max_pool2d(x.float(), kernel_size, stride, padding, dilation, ceil_mode)
    return y.to(torch.uint8)


@torch.library.custom_op(f"{_NS}::avg_pool2d", mutates_args=())
def avg_pool2d_op(
    x: torch.Tensor,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
    scale: float,
    zero_point: int,
    out_scale: float,
    out_zero_point: int,
    target: str,
) -> torch.Tensor:
    return lowered.avg_pool2d(
        x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
        (scale, zero_point), (out_scale, out_zero_point), target,
    )  # fmt: skip


@avg_pool2d_op.register_fake
def _(
    x: torch.Tensor,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
    *args: Any,
) -> torch.Tensor:
    y = F.avg_pool2d(x.float(), kernel_size, stride, padding, ceil_mode, count_include_pad)
    return y.to(torch.uint8)


@torch.library.custom_op(f"{_NS}::adaptive_avg_pool2d", mutates_args=())
def adaptive_avg_pool2d_op(
    x: torch.Tensor,
    output_size: list[int],
    scale: float,
    zero_point: int,
    out_scale: float,
    out_zero_point: int,
    target: str,
) -> torch.Tensor:
    return lowered.adaptive_avg_pool2d(
        x, output_size, (scale, zero_point), (out_scale, out_zero_point), target
    )


@adaptive_avg_pool2d_op.register_fake
def _(x: torch.Tensor, output_size: list[int], *args: Any) -> torch.Tensor:
    return F.adaptive_avg_pool2d(x.float(), lowered.pair(output_size)).to(torch.uint8)


@torch.library.custom_op(f"{_NS}::matmul", mutates_args=())
def matmul_op(
    a: torch.Tensor,
    a_scale: float,
    a_zero_point: int,
    b: torch.Tensor,
    b_scale: float,
    b_zero_point: int,
    out_scale: float,
    out_zero_point: int,
    target: str,
) -> torch.Tensor:
    return lowered.matmul(
        a, (a_scale, a_zero_point), b, (b_scale, b_zero_point), (out_scale, out_zero_point), target
    )


@matmul_op.register_fake
def _(a: torch.Tensor, a_scale: float, a_zero_point: int, b: torch.Tensor, *args: Any) -> Any:
    return torch.matmul(a.float(), b.float()).to(torch.uint8)


@torch.library.custom_op(f"{_NS}::embedding_bag", mutates_args=())
def embedding_bag_op(
    weight: torch.Tensor,
    row_scale: torch.Tensor,
    row_bias: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor | None,
    per_sample_weights: torch.Tensor | None,
    mode: str,
    include_last_offset: bool,
    target: str,
) -> torch.Tensor:
    packed = _cached(
        _wkey("embedding", weight),
        lambda: K.PackedEmbedding(
            lowered.numpy_view(weight),
            lowered.numpy_view(row_scale),
            lowered.numpy_view(row_bias),
            8,
            int(weight.shape[1]),
        ),
    )
    return lowered.embedding_bag(
        packed, indices, offsets, mode, per_sample_weights, include_last_offset, target
    )


@embedding_bag_op.register_fake
def _(
    weight: torch.Tensor,
    row_scale: torch.Tensor,
    row_bias: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor | None,
    per_sample_weights: torch.Tensor | None,
    mode: str,
    include_last_offset: bool,
    target: str,
) -> torch.Tensor:
    if offsets is None:
        bags = indices.shape[0]
    else:
        bags = offsets.shape[0] - (1 if include_last_offset else 0)
    return weight.new_empty((bags, weight.shape[1]), dtype=torch.float32)


@torch.library.custom_op(f"{_NS}::layer_norm", mutates_args=())
def layer_norm_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    return lowered.layer_norm(x, residual, _view(weight), _view(bias), eps)


@layer_norm_op.register_fake
def _(x: torch.Tensor, *args: Any) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op(f"{_NS}::layer_norm_codes", mutates_args=())
def layer_norm_codes_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    x_qparams: list[float] | None,
    codes_qparams: list[float] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    x_qp = None if x_qparams is None else _qp(x_qparams)
    c_qp = None if codes_qparams is None else _qp(codes_qparams)
    return lowered.layer_norm_codes(x, residual, _view(weight), _view(bias), eps, x_qp, c_qp)


@layer_norm_codes_op.register_fake
def _(x: torch.Tensor, residual: Any, weight: Any, bias: Any, eps: float, x_qparams: Any,
      codes_qparams: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    codes = x.new_empty(x.shape if codes_qparams is not None else (0,), dtype=torch.uint8)
    return x.new_empty(x.shape, dtype=torch.float32), codes


@torch.library.custom_op(f"{_NS}::softmax", mutates_args=())
def softmax_op(x: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    return lowered.softmax(x, scale, mask)


@softmax_op.register_fake
def _(x: torch.Tensor, *args: Any) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op(f"{_NS}::attention", mutates_args=())
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qparams: list[float],
    out_qparams: list[float] | None,
    scale: float | None,
    mask: torch.Tensor | None,
    target: str,
    causal: bool,
) -> torch.Tensor:
    qp = (_qp(qparams), _qp(qparams, 2), _qp(qparams, 4))
    out_qp = None if out_qparams is None else _qp(out_qparams)
    return lowered.attention(q, k, v, qp, out_qp, scale, mask, target, causal)


@attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qparams: Any, out_qparams: Any,
      *args: Any) -> torch.Tensor:  # fmt: skip
    shape = (*q.shape[:-1], v.shape[-1])
    return q.new_empty(shape, dtype=torch.uint8 if out_qparams is not None else torch.float32)
