"""The torch.library path: lowered ops as ``torch.ops.quantbridge_lowering.*`` custom ops.

Eager forward calls each module's op object (``_lowered_ops``) on numpy views (fastest, no
dispatcher). While ``torch.export``/``torch.compile`` traces (``torch.compiler.is_compiling()``,
which is also true while exporting, or any input is not a plain ``torch.Tensor``: fake,
functional or proxy tensors) the lowered modules call these custom ops instead: each has a
fake (meta) implementation giving the output shape and dtype, so the graph captures one opaque
node per lowered op. Running the exported program eagerly executes the real implementation:
it builds the module's op object from the op's tensors and arguments (cached per weight
tensor and arguments, so the weight is packed once) and calls it.
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
_op_cache: dict[tuple[Any, ...], Any] = {}
_op_lock = threading.Lock()

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
    """The op object for ``key``, built once (``key`` names everything it is built from)."""
    with _op_lock:
        found = _op_cache.get(key)
        if found is None:
            if len(_op_cache) > 256:
                _op_cache.clear()
            found = build()
            _op_cache[key] = found
        return found


def _wkey(kind: str, w: torch.Tensor, *rest: Any) -> tuple[Any, ...]:
    return (kind, w.data_ptr(), w._version, tuple(w.shape), *rest)


def _qp(values: list[float], at: int = 0) -> tuple[float, int]:
    """(scale, zero point) at ``values[at : at + 2]``: schemas carry qparams as float lists."""
    return values[at], int(values[at + 1])


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
    in_qp, out_qp = (x_scale, x_zero_point), (out_scale, out_zero_point)
    op = _cached(
        _wkey("linear", weight, target, in_qp, out_qp, relu),
        lambda: lowered.LinearOp(
            lowered.pack_linear(weight, w_scale, w_zero_point, bias, target), in_qp, out_qp,
            relu=relu,
        ),
    )  # fmt: skip
    return torch.from_numpy(op(lowered.numpy_view(x)))


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
    c_qp = None if codes_qparams is None else _qp(codes_qparams)
    floats, columns, columns_key = None, None, None
    if float_input is not None and channels is not None and column_weight is not None:
        floats, columns = lowered.numpy_view(float_input), (channels, column_weight)
        columns_key = _wkey("columns", column_weight)

    def build() -> lowered.LinearFloatOp:
        float_columns = None
        if columns is not None:
            float_columns = K.FloatColumns(*(lowered.numpy_view(t) for t in columns))
        return lowered.LinearFloatOp(
            lowered.pack_linear(weight, w_scale, w_zero_point, bias, target),
            (x_scale, x_zero_point), activation=activation, columns=float_columns,
            codes_qparams=c_qp,
        )  # fmt: skip

    op = _cached(
        _wkey("linear_float", weight, target, x_scale, x_zero_point, activation, c_qp, columns_key),
        build,
    )
    got = op(lowered.numpy_view(x), floats)
    if c_qp is None:
        return torch.from_numpy(got), torch.empty(0, dtype=torch.uint8)
    return torch.from_numpy(got[0]), torch.from_numpy(got[1])


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
    op = _cached(
        _wkey("linear_dynamic", weight, target, activation, per_row),
        lambda: lowered.DynamicLinearOp(
            lowered.pack_linear(weight, w_scale, w_zero_point, bias, target),
            activation=activation, per_row=per_row,
        ),
    )  # fmt: skip
    return torch.from_numpy(op(lowered.numpy_view(x.to(torch.float32))))


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
    in_qp, out_qp = (x_scale, x_zero_point), (out_scale, out_zero_point)
    geometry = (tuple(stride), tuple(padding), tuple(dilation), groups)
    op = _cached(
        _wkey("conv", weight, target, geometry, in_qp, out_qp, relu),
        lambda: K.PreparedConv(
            lowered.pack_conv(weight, w_scale, w_zero_point, bias, *geometry, target), in_qp,
            out_qp, relu=relu, channels_last=True,
        ),
    )  # fmt: skip
    return torch.from_numpy(op(lowered.dense_view(x))).contiguous()  # NCHW, as the fake


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
    qparams = ((a_scale, a_zero_point), (b_scale, b_zero_point), (out_scale, out_zero_point))
    op = _cached(
        ("binary", kind, *qparams, target), lambda: lowered.BinaryOp(kind, *qparams, target)
    )
    return torch.from_numpy(op(lowered.dense_view(a), lowered.dense_view(b)))


@binary_op.register_fake
def _(a: torch.Tensor, a_scale: float, a_zero_point: int, b: torch.Tensor, *args: Any) -> Any:
    return torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=torch.uint8)  # type: ignore[no-untyped-call]


@torch.library.custom_op(f"{_NS}::lut", mutates_args=())
def lut_op(x: torch.Tensor, table: torch.Tensor, target: str) -> torch.Tensor:
    op = lowered.LookupTableOp(lowered.numpy_view(table), target)  # (a view: nothing to cache)
    return torch.from_numpy(op(lowered.dense_view(x)))


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
    in_qp, out_qp = (in_scale, in_zero_point), (out_scale, out_zero_point)
    op = _cached(
        ("requantize", in_qp, out_qp, target),
        lambda: K.PreparedRequantize(in_qp, out_qp, target=target),
    )
    return torch.from_numpy(op(lowered.dense_view(x)))


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
    op = lowered.MaxPool2dOp(kernel_size, stride, padding, dilation, ceil_mode, target)
    return torch.from_numpy(op(lowered.dense_view(x)))


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
    op = lowered.AvgPool2dOp(
        kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
        (scale, zero_point), (out_scale, out_zero_point), target,
    )  # fmt: skip
    return torch.from_numpy(op(lowered.dense_view(x)))


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
    in_qp, out_qp = (scale, zero_point), (out_scale, out_zero_point)
    op = _cached(
        ("adaptive_avg_pool2d", tuple(output_size), in_qp, out_qp, target),
        lambda: lowered.adaptive_avg_pool2d_op(output_size, in_qp, out_qp, target),
    )
    return torch.from_numpy(op(lowered.dense_view(x)))


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
    op = lowered.MatmulOp(
        (a_scale, a_zero_point), (b_scale, b_zero_point), (out_scale, out_zero_point), target
    )
    return torch.from_numpy(op(lowered.numpy_view(a), lowered.numpy_view(b)))


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
    op = _cached(
        _wkey("embedding_bag", weight, mode, include_last_offset, target),
        lambda: lowered.EmbeddingBagOp(
            lowered.pack_embedding(weight, row_scale, row_bias), mode, include_last_offset, target
        ),
    )
    return torch.from_numpy(op(*(None if t is None else lowered.numpy_view(t)
                                 for t in (indices, offsets, per_sample_weights))))  # fmt: skip


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


def _view(t: torch.Tensor | None) -> Any:
    return None if t is None else lowered.numpy_view(t)


def _float_views(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[Any, Any]:
    """(x, residual as float32) as C-contiguous arrays, as a LayerNorm takes them."""
    r = None if residual is None else lowered.numpy_view(residual.to(torch.float32))
    return lowered.numpy_view(x), r


@torch.library.custom_op(f"{_NS}::layer_norm", mutates_args=())
def layer_norm_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    out, _ = K.PreparedLayerNorm(_view(weight), _view(bias), eps)(*_float_views(x, residual))
    return torch.from_numpy(out)


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
    op = K.PreparedLayerNorm(_view(weight), _view(bias), eps, x_qparams=x_qp, codes_qparams=c_qp)
    out, codes = op(*_float_views(x, residual))
    return torch.from_numpy(out), torch.from_numpy(
        np.empty(0, np.uint8) if codes is None else codes
    )


@layer_norm_codes_op.register_fake
def _(x: torch.Tensor, residual: Any, weight: Any, bias: Any, eps: float, x_qparams: Any,
      codes_qparams: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    codes = x.new_empty(x.shape if codes_qparams is not None else (0,), dtype=torch.uint8)
    return x.new_empty(x.shape, dtype=torch.float32), codes


@torch.library.custom_op(f"{_NS}::softmax", mutates_args=())
def softmax_op(x: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    m = None if mask is None else mask.detach().numpy()  # strided views are fine: it is copied
    return torch.from_numpy(lowered.SoftmaxOp(scale)(lowered.numpy_view(x), m))


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
    op = lowered.AttentionOp(qp, out_qp, scale, causal, target)
    m = None if mask is None else mask.detach().numpy()  # strided (expanded) masks: no copy
    return torch.from_numpy(op(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), m))


@attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qparams: Any, out_qparams: Any,
      *args: Any) -> torch.Tensor:  # fmt: skip
    shape = (*q.shape[:-1], v.shape[-1])
    return q.new_empty(shape, dtype=torch.uint8 if out_qparams is not None else torch.float32)
