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


def _pair(v: list[int]) -> tuple[int, int]:
    return (v[0], v[1]) if len(v) > 1 else (v[0], v[0])


def _numpy(t: torch.Tensor) -> Any:
    return (t if t.is_contiguous() else t.contiguous()).numpy()


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
    return _numpy(scale), _numpy(zero_point)


def _bias(b: torch.Tensor | None) -> Any:
    return None if b is None else _numpy(b.detach().to(torch.float32))


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
            _numpy(weight), *_wqp(w_scale, w_zero_point), _bias(bias), target=target
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
    out = K.linear(_numpy(x), packed, x_scale, x_zero_point, out_scale, out_zero_point, relu=relu)
    return torch.from_numpy(out)


@linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, *args: Any) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.uint8)


@torch.library.custom_op(f"{_NS}::linear_dynamic", mutates_args=())
def linear_dynamic_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    w_zero_point: torch.Tensor,
    bias: torch.Tensor | None,
    target: str,
) -> torch.Tensor:
    packed = _packed_linear(weight, w_scale, w_zero_point, bias, target)
    return torch.from_numpy(K.linear_dynamic(_numpy(x.to(torch.float32)), packed))


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
            _numpy(weight),
            *_wqp(w_scale, w_zero_point),
            _bias(bias),
            stride=tuple(stride),
            padding=tuple(padding),
            dilation=tuple(dilation),
            groups=groups,
            target=target,
        ),
    )
    fn = K.conv2d if weight.dim() == 4 else K.conv1d
    out = fn(_numpy(x), packed, x_scale, x_zero_point, out_scale, out_zero_point, relu=relu)
    return torch.from_numpy(out)


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
    fn = getattr(K, kind)
    if a.shape != b.shape:
        a, b = torch.broadcast_tensors(a, b)  # type: ignore[no-untyped-call]
    out = fn(
        _numpy(a),
        a_scale,
        a_zero_point,
        _numpy(b),
        b_scale,
        b_zero_point,
        out_scale,
        out_zero_point,
        target=target,
    )
    return torch.from_numpy(out)


@binary_op.register_fake
def _(a: torch.Tensor, a_scale: float, a_zero_point: int, b: torch.Tensor, *args: Any) -> Any:
    return torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=torch.uint8)  # type: ignore[no-untyped-call]


@torch.library.custom_op(f"{_NS}::lut", mutates_args=())
def lut_op(x: torch.Tensor, table: torch.Tensor, target: str) -> torch.Tensor:
    return torch.from_numpy(K.apply_lut(_numpy(x), _numpy(table), target=target))


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
    out = K.requantize(_numpy(x), in_scale, in_zero_point, out_scale, out_zero_point, target=target)
    return torch.from_numpy(out)


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
    out = K.max_pool2d(
        _numpy(x),
        _pair(kernel_size),
        _pair(stride),
        _pair(padding),
        _pair(dilation),
        ceil_mode,
        target=target,
    )
    return torch.from_numpy(out)


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
    out = K.avg_pool2d(
        _numpy(x),
        _pair(kernel_size),
        _pair(stride),
        _pair(padding),
        ceil_mode,
        count_include_pad,
        divisor_override,
        scale=scale,
        zero_point=zero_point,
        out_scale=out_scale,
        out_zero_point=out_zero_point,
        target=target,
    )
    return torch.from_numpy(out)


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
def adaptive_avg_pool2d_op(x: torch.Tensor, output_size: list[int], target: str) -> torch.Tensor:
    return torch.from_numpy(K.adaptive_avg_pool2d(_numpy(x), _pair(output_size), target=target))


@adaptive_avg_pool2d_op.register_fake
def _(x: torch.Tensor, output_size: list[int], target: str) -> torch.Tensor:
    return F.adaptive_avg_pool2d(x.float(), _pair(output_size)).to(torch.uint8)


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
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])  # type: ignore[no-untyped-call]
    a3 = a.expand(*lead, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*lead, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    out = K.matmul(
        _numpy(a3),
        a_scale,
        a_zero_point,
        _numpy(b3),
        b_scale,
        b_zero_point,
        out_scale,
        out_zero_point,
        target=target,
    )
    return torch.from_numpy(np.asarray(out)).reshape(*lead, a.shape[-2], b.shape[-1])


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
            _numpy(weight), _numpy(row_scale), _numpy(row_bias), 8, int(weight.shape[1])
        ),
    )
    out = K.embedding_bag(
        packed,
        _numpy(indices),
        None if offsets is None else _numpy(offsets),
        mode,
        None if per_sample_weights is None else _numpy(per_sample_weights),
        include_last_offset,
        target=target,
    )
    return torch.from_numpy(out)


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
