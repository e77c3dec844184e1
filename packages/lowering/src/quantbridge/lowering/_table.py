"""The built-in lowering table: one :class:`LoweringRule` per kernel family, with its builder.

Rules are tried in table order at each quantize node (the first whose pattern and constraints
match wins), so nested patterns such as ``relu(add(a, b))`` come before ``relu`` alone. Module
classes in patterns also match their subclasses (``isinstance``; the pass adds the variants).
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.fx_quant.nn import qat as nnqat
from quantbridge.fx_quant.nn import reference as nnqr
from quantbridge.fx_quant.nn.intrinsic import qat as nniqat
from quantbridge.fx_quant.nn.quantizable import FloatColumns
from quantbridge.lowering import _modules as lm
from quantbridge.lowering._context import (
    DEQUANTIZE,
    QUANTIZE,
    LoweringContext,
    NotLowerableError,
    QParams,
    constant_tensor,
    lookup_table,
    quantized_input,
    static_qparams,
)
from quantbridge.lowering._float_rules import float_op_rules
from quantbridge.lowering._rnn import (
    QuantizedDynamicGRU,
    QuantizedDynamicLSTM,
    rnn_unsupported_reason,
)
from quantbridge.lowering._rules import LoweringRule, RuleMatch
from quantbridge.patterns import ArgConstraint, MatchAllNode, Nested, Pattern, RewriteMatch

__all__ = ["default_lowering_rules"]


# --- op families ---------------------------------------------------------------------------

_RELU_FNS: tuple[Any, ...] = (F.relu, torch.relu, "relu")
_ADD_FNS: tuple[Any, ...] = (operator.add, torch.add, "add", operator.iadd)
_MUL_FNS: tuple[Any, ...] = (operator.mul, torch.mul, "mul", operator.imul)
_MATMUL_FNS: tuple[Any, ...] = (torch.matmul, operator.matmul, torch.bmm, "matmul", "bmm")
_CAT_FNS: tuple[Any, ...] = (torch.cat, torch.concat)
# pure data movement on the codes: run the same op on the uint8 tensor
_SHAPE_FNS: tuple[Any, ...] = (
    torch.flatten, torch.reshape, torch.squeeze, torch.unsqueeze, torch.permute,
    torch.transpose, torch.narrow, torch.repeat_interleave, operator.getitem, torch.detach,
    F.pixel_shuffle, F.pixel_unshuffle, torch.pixel_shuffle, torch.pixel_unshuffle,
    "flatten", "reshape", "view", "squeeze", "unsqueeze", "permute", "transpose", "contiguous",
    "detach", "narrow", "repeat", "repeat_interleave", "squeeze_", "unsqueeze_", "detach_",
)  # fmt: skip
_SHAPE_MODULES: tuple[type[nn.Module], ...] = (nn.Flatten, nn.PixelShuffle, nn.PixelUnshuffle)
# identity in eval: removed, the codes flow through (requantized once if the qparams differ)
_IDENTITY_MODULES: tuple[type[nn.Module], ...] = (
    nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)  # fmt: skip
# functions of (input, p, training, ...): identity when ``training`` is False
_DROPOUT_FNS: tuple[Any, ...] = (
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
    torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,
)  # fmt: skip
# torchvision.ops.stochastic_depth(input, p, mode, training=True) (fx-wrapped there, so traced
# models call it) and functions written like it: found by name and signature
_STOCHASTIC_DEPTH = "stochastic_depth"
# elementwise functions of one quantized input: lookup tables
_LUT_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Sigmoid, nn.Tanh,
    nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Mish, nn.Softplus, nn.CELU, nn.SELU,
)  # fmt: skip
_LUT_FNS: tuple[Any, ...] = (
    F.relu, torch.relu, F.relu6, F.hardtanh, F.hardswish, F.hardsigmoid, torch.sigmoid,
    F.sigmoid, torch.tanh, F.tanh, F.leaky_relu, F.elu, F.gelu, F.silu, F.mish, torch.clamp,
    torch.clip, F.relu_, torch.relu_, F.hardtanh_, F.leaky_relu_, F.elu_,
    "relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "clamp", "clamp_", "clip",
    "hardtanh", "hardtanh_",
)  # fmt: skip
# clamps a numba BackendConfig observes together with the Linear / conv before them, each with
# the positional arguments it may take after its input (bounds, ``inplace``)
_CLAMP_EXTRA_ARGS: dict[Any, int] = {nn.ReLU6: 0, nn.Hardtanh: 0, F.relu6: 1, F.hardtanh: 3}
WEIGHTED_CLAMPS: tuple[Any, ...] = tuple(_CLAMP_EXTRA_ARGS)
_FUSED_WEIGHTED: tuple[type[nn.Module], ...] = (nni.LinearReLU, nni.ConvReLU1d, nni.ConvReLU2d)
_REF_WEIGHTED: tuple[type[nn.Module], ...] = (nnqr.Linear, nnqr.Conv1d, nnqr.Conv2d)


def _unique(ops: Sequence[Any]) -> tuple[Any, ...]:
    """Drop repeats (``F.sigmoid is torch.sigmoid``, ...), keeping the first occurrence."""
    out: list[Any] = []
    for op in ops:
        if not any(op is seen for seen in out):
            out.append(op)
    return tuple(out)


def _fn_key(node: Node) -> Any:
    return node.target if node.op in ("call_function", "call_method") else None


def _in(key: Any, ops: tuple[Any, ...]) -> bool:
    return any(key is op or (isinstance(op, str) and key == op) for op in ops)


# --- argument helpers ----------------------------------------------------------------------


def _flat_args(node: Node) -> list[Any]:
    return [*node.args, *node.kwargs.values()]


def _nodes_in(value: Any) -> list[Node]:
    if isinstance(value, Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _nodes_in(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _nodes_in(v)]
    return []


def _fn_args(node: Node, names: list[str], defaults: list[Any]) -> dict[str, Any]:
    out = dict(zip(names, defaults, strict=True))
    for name, value in zip(names, node.args, strict=False):
        out[name] = value
    for k, v in node.kwargs.items():
        if k not in out:
            raise NotLowerableError(f"unsupported keyword argument {k!r}")
        out[k] = v
    return out


def _pair(v: Any) -> tuple[Any, Any]:
    if isinstance(v, (list, tuple)):
        if len(v) == 1:
            return (v[0], v[0])
        if len(v) != 2:
            raise NotLowerableError(f"expected 1 or 2 values, got {v!r}")
        return (v[0], v[1])
    return (v, v)


def _single_input(ctx: LoweringContext, node: Node, sizes_ok: bool = False) -> tuple[Node, QParams]:
    """The one quantized input (first argument); other node arguments are refused unless
    ``sizes_ok`` (shape ops take sizes computed in the graph, e.g. ``x.shape[0]``)."""
    first = node.args[0] if node.args else node.kwargs.get("input")
    qin = ctx.quantized_input(first)
    if qin is None:
        raise NotLowerableError("input is not a static uint8 quantized value")
    for a in _flat_args(node)[1:]:
        for n in _nodes_in(a):
            if not sizes_ok or (n.op == "call_function" and n.target is DEQUANTIZE):
                raise NotLowerableError("more than one tensor input")
    return qin


def _int8_weight(mod: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    assert isinstance(mod, nnqr.ReferenceQuantizedModule)
    qw = mod.get_quantized_weight()
    if qw.dtype != torch.int8:
        raise NotLowerableError(f"weight dtype {qw.dtype} (kernels take int8 weights)")
    if qw.axis not in (None, 0):
        raise NotLowerableError(f"per-channel weight axis {qw.axis} (kernels take axis 0)")
    if qw.zero_point.dtype.is_floating_point:
        raise NotLowerableError("float weight zero points")
    zp = qw.zero_point.reshape(-1)
    if bool(((zp < -128) | (zp > 127)).any()):
        raise NotLowerableError("weight zero point outside [-128, 127]")
    return qw.values, qw.scale.reshape(-1), zp


def _no_kernel(ctx: LoweringContext, node: Node) -> str:
    """Why an op no rule lowers stays reference (also the pass's reason for unmatched ops)."""
    mod = ctx.module(node)
    if mod is not None:
        return f"no kernel for module {type(mod).__name__}"
    fn = _fn_key(node)
    if fn is None:
        return f"{node.op} nodes are not lowered"
    return f"no kernel for {getattr(fn, '__name__', fn)}"


def _literal_arg(node: Node, position: int, name: str, default: Any) -> Any:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def eval_identity(node: Node) -> str | None:
    """What ``node`` is when it returns its input unchanged (eval-mode dropout, stochastic
    depth, nn.Identity), else None. Training-mode ones and run-time flags are not."""
    owner = node.graph.owning_module
    if node.op == "call_module" and owner is not None:
        mod = owner.get_submodule(str(node.target))
        if isinstance(mod, _IDENTITY_MODULES) and not (
            mod.training and type(mod) is not nn.Identity
        ):
            return type(mod).__name__
        return None
    if node.op != "call_function":
        return None
    fn = node.target
    if any(fn is f for f in _DROPOUT_FNS):
        # F.dropout*(input, p=0.5, training=True, inplace=False); torch.dropout(input, p, train)
        name = "train" if fn in (torch.dropout, torch.alpha_dropout, torch.feature_dropout,
                                 torch.feature_alpha_dropout) else "training"  # fmt: skip
        training = _literal_arg(node, 2, name, True)
        return getattr(fn, "__name__", "dropout") if training is False else None
    if getattr(fn, "__name__", None) == _STOCHASTIC_DEPTH and callable(fn):
        training = _literal_arg(node, 3, "training", True)
        p = _literal_arg(node, 1, "p", None)
        return _STOCHASTIC_DEPTH if training is False or p == 0.0 else None
    return None


def _is_eval_identity(value: Any) -> bool:
    return isinstance(value, Node) and eval_identity(value) is not None


# --- builders ------------------------------------------------------------------------------


def _build_requantize(ctx: LoweringContext, m: RuleMatch) -> Node:
    """quantize(dequantize(x)): only the qparams change."""
    qin = ctx.quantized_input(m.node)
    assert qin is not None  # the rule's constraint
    return ctx.requantize(qin[0], qin[1], m.out_qparams)


def _fused_relu_parts(mod: nn.Module) -> tuple[nn.Module, bool]:
    """(inner weighted module, relu?) of a fused X-ReLU module, or (mod, False)."""
    if not isinstance(mod, (nni.LinearReLU, nni.ConvReLU1d, nni.ConvReLU2d)):
        return mod, False
    if not isinstance(mod[1], nn.ReLU) and mod[1] not in (F.relu, torch.relu):
        raise NotLowerableError(f"fused activation {type(mod[1]).__name__} is not relu")
    return mod[0], True


def _build_weighted(ctx: LoweringContext, m: RuleMatch) -> Node:
    new_mod, x = _weighted_module(ctx, m.node, m.out_qparams)
    new = ctx.add_module(f"{m.node.target}", new_mod, (x,))
    ctx.record(new, f"{new_mod.kernel} ({ctx.target})")
    return new


def _weighted_module(
    ctx: LoweringContext, node: Node, out_qp: QParams
) -> tuple[lm.QuantizedConv | lm.QuantizedLinear, Node]:
    """The lowered module of a reference Linear / Conv1d / Conv2d (+relu) node writing codes in
    ``out_qp``, and the node of its input codes."""
    mod = ctx.module(node)
    assert mod is not None
    inner, relu = _fused_relu_parts(mod)
    if not isinstance(inner, _REF_WEIGHTED):
        if isinstance(inner, (nn.Linear, nn.Conv1d, nn.Conv2d)) and inner is not mod:
            raise NotLowerableError("fused module holds a float (not reference) weighted module")
        raise NotLowerableError(_no_kernel(ctx, node))
    if len(node.args) != 1 or node.kwargs:
        raise NotLowerableError("weighted module called with extra arguments")
    qin = ctx.quantized_input(node.args[0])
    if qin is None:
        raise NotLowerableError("input is not a static uint8 quantized value")
    w, ws, wz = _int8_weight(inner)
    bias = inner.bias
    if isinstance(inner, nnqr.Linear):
        return lm.QuantizedLinear(w, ws, wz, bias, ctx.target, qin[1], out_qp, relu=relu), qin[0]
    assert isinstance(inner, (nnqr.Conv1d, nnqr.Conv2d))
    if inner.padding_mode != "zeros" or isinstance(inner.padding, str):
        raise NotLowerableError(
            f"conv padding={inner.padding!r}, padding_mode={inner.padding_mode!r} "
            "(kernels take explicit zero padding)"
        )
    conv = lm.QuantizedConv(
        w, ws, wz, bias, ctx.target, qin[1], out_qp,
        stride=tuple(inner.stride), padding=tuple(int(p) for p in inner.padding),
        dilation=tuple(inner.dilation), groups=inner.groups, relu=relu,
    )  # fmt: skip
    return conv, qin[0]


def _build_weighted_clamp(ctx: LoweringContext, m: RuleMatch) -> Node:
    """clamp(conv / linear) observed after the clamp (``m.nodes``: clamp, weighted): the
    weighted module writing the clamp's codes, the clamp in its epilogue. Exact: quantizing
    is monotonic, so quantize(clamp(y)) = clamp of quantize(y) to the bounds' codes."""
    clamp, node = m.nodes[0], m.nodes[1]
    if any(_nodes_in(a) for a in _flat_args(clamp)[1:]):
        raise NotLowerableError("clamp bounds computed in the graph")
    weighted, x = _weighted_module(ctx, node, m.out_qparams)
    fn, what = _elementwise_fn(ctx, clamp)
    table = lookup_table(fn, m.out_qparams, m.out_qparams)
    fused = weighted.with_activation(table, what, m.out_qparams)
    new = ctx.add_module(f"{node.target}_{what}", fused, (x,))
    ctx.record(new, f"{fused.kernel} ({ctx.target}), {what} in the epilogue")
    return new


def _binary(ctx: LoweringContext, node: Node, kind: str, out_qp: QParams, relu: bool = False
            ) -> Node:  # fmt: skip
    if node.kwargs and set(node.kwargs) - {"other", "input"}:
        raise NotLowerableError(f"{kind} with keyword arguments {sorted(node.kwargs)}")
    args = list(node.args) + [node.kwargs[k] for k in ("input", "other") if k in node.kwargs]
    if len(args) != 2:
        raise NotLowerableError(f"{kind} with {len(args)} arguments")
    qa, qb = ctx.quantized_input(args[0]), ctx.quantized_input(args[1])
    if qa is not None and qb is not None:
        mod: lm.LoweredModule
        if kind == "matmul":
            mod = lm.QuantizedMatmul(ctx.target, qa[1], qb[1], out_qp)
        else:
            full = f"{kind}_relu" if relu else kind
            mod = lm.QuantizedBinary(full, ctx.target, qa[1], qb[1], out_qp)
        new = ctx.add_module(f"{node.name}_q", mod, (qa[0], qb[0]))
        ctx.record(new, mod.kernel)
        return new
    if kind == "matmul":
        raise NotLowerableError("matmul needs two static uint8 quantized inputs")
    # one quantized input and a Python scalar: an elementwise function, as a table
    scalar_i = 1 if qa is not None else 0
    qin = qa if qa is not None else qb
    c = args[scalar_i]
    if qin is not None and isinstance(c, Node):
        raise NotLowerableError(
            f"{kind} by {c.name!r}, neither a quantized tensor nor a constant (a float value "
            "or a number known only at run time, e.g. a forward argument)"
        )
    if qin is None or not isinstance(c, (int, float)) or isinstance(c, bool):
        raise NotLowerableError(
            f"{kind} operands are not two quantized tensors or tensor and scalar"
        )
    op = operator.add if kind == "add" else operator.mul

    def fn(t: torch.Tensor) -> torch.Tensor:
        y = op(t, c)
        return torch.relu(y) if relu else y

    what = f"{kind} {c!r}" + (" + relu" if relu else "")
    return ctx.lookup_table(node, qin[0], fn, what, qin[1], out_qp)


def _build_matmul(ctx: LoweringContext, m: RuleMatch) -> Node:
    return _binary(ctx, m.node, "matmul", m.out_qparams)


def _build_add_mul(ctx: LoweringContext, m: RuleMatch) -> Node:
    kind = "add" if _in(_fn_key(m.node), _ADD_FNS) else "mul"
    return _binary(ctx, m.node, kind, m.out_qparams)


def _build_add_mul_relu(ctx: LoweringContext, m: RuleMatch) -> Node:
    """relu(add(a, b)) / relu(mul(a, b)) → add_relu / mul_relu (``m.nodes``: relu, add)."""
    inner = m.nodes[1]
    kind = "add" if _in(_fn_key(inner), _ADD_FNS) else "mul"
    return _binary(ctx, inner, kind, m.out_qparams, relu=True)


def _build_lut(ctx: LoweringContext, m: RuleMatch) -> Node:
    if ctx.module(m.node) is not None and (len(m.node.args) != 1 or m.node.kwargs):
        raise NotLowerableError("module called with extra arguments")
    x, in_qp = _single_input(ctx, m.node)
    fn, what = _elementwise_fn(ctx, m.node)
    return ctx.lookup_table(m.node, x, fn, what, in_qp, m.out_qparams)


def _elementwise_fn(ctx: LoweringContext, node: Node) -> tuple[Any, str]:
    """(float function of the first input, its name) of an elementwise module, function or
    method node, with the node's other arguments bound."""
    mod = ctx.module(node)
    if mod is not None:
        return (lambda t: mod(t)), type(mod).__name__
    target = node.target
    rest, kwargs = node.args[1:], dict(node.kwargs)
    kwargs.pop("inplace", None)
    if node.op == "call_method":
        name = str(target).rstrip("_")
        return (lambda t: getattr(t, name)(*rest, **kwargs)), name
    f: Any = target
    return (lambda t: f(t.clone(), *rest, **kwargs)), getattr(f, "__name__", str(f))


def _build_identity(ctx: LoweringContext, m: RuleMatch) -> Node:
    """Eval-mode dropout / stochastic depth / nn.Identity: its input's codes, requantized
    once if the output qparams differ (no module when they agree)."""
    chain: list[tuple[Node, str]] = []
    node: Any = m.node
    # identities not quantized in between (not in the config) chain on float values
    while isinstance(node, Node) and eval_identity(node) is not None:
        what = eval_identity(node)
        assert what is not None
        first = node.args[0] if node.args else node.kwargs.get("input")
        for a in [*node.args[1:], *node.kwargs.values()]:
            if _nodes_in(a):
                raise NotLowerableError(f"{what} with an argument computed in the graph")
        chain.append((node, what))
        if len(node.users) != 1 and node is not m.node:
            raise NotLowerableError(f"{what}: its float output has other users")
        node = first
    qin = ctx.quantized_input(node)
    if qin is None:
        raise NotLowerableError("input is not a static uint8 quantized value")
    x, in_qp = qin
    out = ctx.requantize(x, in_qp, m.out_qparams)
    for op, what in chain:
        ctx.record_removed(op, f"{what} (identity in eval): removed")
    return out


def _build_max_pool2d(ctx: LoweringContext, m: RuleMatch) -> Node:
    node = m.node
    mod = ctx.module(node)
    if isinstance(mod, nn.MaxPool2d):
        ks, stride, padding, dilation, ceil = (
            mod.kernel_size, mod.stride, mod.padding, mod.dilation, mod.ceil_mode,
        )  # fmt: skip
    else:
        a = _fn_args(node, ["input", "kernel_size", "stride", "padding", "dilation",
                            "ceil_mode", "return_indices"],
                     [None, None, None, 0, 1, False, False])  # fmt: skip
        if a["return_indices"]:
            raise NotLowerableError("max_pool2d with return_indices=True")
        ks, padding, dilation, ceil = a["kernel_size"], a["padding"], a["dilation"], a["ceil_mode"]
        stride = a["stride"] if a["stride"] not in (None, []) else ks
    x, in_qp = _single_input(ctx, node)
    pool = lm.QuantizedMaxPool2d(_pair(ks), _pair(stride if stride else ks), _pair(padding),
                                 _pair(dilation), bool(ceil), ctx.target)  # fmt: skip
    new = ctx.add_module(f"{node.name}_q", pool, (x,))
    ctx.record(new, pool.kernel)
    return ctx.requantize(new, in_qp, m.out_qparams)


def _build_avg_pool2d(ctx: LoweringContext, m: RuleMatch) -> Node:
    node = m.node
    mod = ctx.module(node)
    if isinstance(mod, nn.AvgPool2d):
        ks, stride, padding, ceil, count_pad, divisor = (
            mod.kernel_size, mod.stride, mod.padding, mod.ceil_mode, mod.count_include_pad,
            mod.divisor_override,
        )  # fmt: skip
    else:
        a = _fn_args(node, ["input", "kernel_size", "stride", "padding", "ceil_mode",
                            "count_include_pad", "divisor_override"],
                     [None, None, None, 0, False, True, None])  # fmt: skip
        ks, padding, ceil = a["kernel_size"], a["padding"], a["ceil_mode"]
        count_pad, divisor = a["count_include_pad"], a["divisor_override"]
        stride = a["stride"] if a["stride"] not in (None, []) else ks
    x, in_qp = _single_input(ctx, node)
    pool = lm.QuantizedAvgPool2d(_pair(ks), _pair(stride if stride else ks), _pair(padding),
                                 bool(ceil), bool(count_pad), divisor, ctx.target, in_qp,
                                 m.out_qparams)  # fmt: skip
    new = ctx.add_module(f"{node.name}_q", pool, (x,))
    ctx.record(new, pool.kernel)
    return new


def _build_adaptive_avg_pool2d(ctx: LoweringContext, m: RuleMatch) -> Node:
    node = m.node
    mod = ctx.module(node)
    if isinstance(mod, nn.AdaptiveAvgPool2d):
        output_size = mod.output_size
    else:
        output_size = _fn_args(node, ["input", "output_size"], [None, None])["output_size"]
    x, in_qp = _single_input(ctx, node)
    size = _pair(output_size)
    if any(s is None for s in size):
        raise NotLowerableError("adaptive pool output size with None")
    pool = lm.QuantizedAdaptiveAvgPool2d(size, ctx.target, in_qp, m.out_qparams)
    new = ctx.add_module(f"{node.name}_q", pool, (x,))
    ctx.record(new, pool.kernel)
    return new


def _build_cat(ctx: LoweringContext, m: RuleMatch) -> Node:
    node, out_qp = m.node, m.out_qparams
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise NotLowerableError("cat of a non-literal list")
    new_inputs = []
    for t in tensors:
        qin = ctx.quantized_input(t)
        if qin is None:
            raise NotLowerableError("cat input is not a static uint8 quantized value")
        new_inputs.append(ctx.requantize(qin[0], qin[1], out_qp))
    new = ctx.create_node(
        "call_function",
        node.target,
        (new_inputs, *node.args[1:]),
        {k: v for k, v in node.kwargs.items() if k != "tensors"},
    )
    ctx.record(new, "torch.cat on uint8 codes")
    return new


def _build_shape(ctx: LoweringContext, m: RuleMatch) -> Node:
    node = m.node
    x, in_qp = _single_input(ctx, node, sizes_ok=True)
    if not node.args:
        raise NotLowerableError("shape op with its input passed by keyword")
    target = node.target
    if node.op == "call_method" and target == "view":
        # lowered convs return channels-last codes, which ``view`` cannot always flatten;
        # ``reshape`` gives the same values and copies only when a view is impossible
        target = "reshape"
    new = ctx.create_node(node.op, target, (x, *node.args[1:]), dict(node.kwargs))
    what = target if isinstance(target, str) else getattr(target, "__name__", "")
    ctx.record(new, f"{what} on uint8 codes")
    return ctx.requantize(new, in_qp, m.out_qparams)


def _make_build_dynamic_linear(per_row: bool) -> Any:
    def build(ctx: LoweringContext, m: RuleMatch) -> Node:
        node = m.node
        fused = ctx.module(node)
        assert fused is not None
        mod, relu = _fused_relu_parts(fused)
        if not isinstance(mod, nnqr.Linear):
            raise NotLowerableError("fused module holds a float (not reference) Linear")
        dq = node.args[0]
        assert isinstance(dq, Node)  # the rule's constraint: dequantize(quantize(x))
        q = dq.args[0]
        assert isinstance(q, Node)
        x = q.args[0]
        assert isinstance(x, Node)
        w, ws, wz = _int8_weight(mod)
        if per_row and bool((wz != 0).any()):
            raise NotLowerableError(
                "per-token activations need symmetric weights (weight zero point 0)"
            )
        new_mod = lm.QuantizedDynamicLinear(
            w, ws, wz, mod.bias, ctx.target, None, None,
            activation="relu" if relu else "none", per_row=per_row,
        )  # fmt: skip
        new = ctx.add_module(f"{node.target}_dynamic", new_mod, (x,))
        what = f"{new_mod.kernel} ({ctx.target})"
        what += ", per-token activations" if per_row else ""
        ctx.record(new, what + (", relu fused" if relu else ""))
        return new

    return build


_build_dynamic_linear = _make_build_dynamic_linear(False)


def _build_float_linear(ctx: LoweringContext, m: RuleMatch) -> Node:
    """A static Linear (+relu) left with a float output by prepare: its consumers run in float."""
    node = m.node
    fused = ctx.module(node)
    assert fused is not None
    mod, relu = _fused_relu_parts(fused)
    if not isinstance(mod, nnqr.Linear):
        raise NotLowerableError("fused module holds a float (not reference) Linear")
    if len(node.args) != 1 or node.kwargs:
        raise NotLowerableError("Linear called with extra arguments")
    qin = ctx.quantized_input(node.args[0])
    assert qin is not None  # the rule's constraint
    w, ws, wz = _int8_weight(mod)
    new_mod = lm.QuantizedLinearFloat(
        w, ws, wz, mod.bias, ctx.target, qin[1], None, activation="relu" if relu else "none"
    )
    new = ctx.add_module(f"{node.target}", new_mod, (qin[0],))
    ctx.record(
        new, f"{new_mod.kernel} ({ctx.target}), float output" + (", relu fused" if relu else "")
    )
    return new


def _build_dynamic_rnn(ctx: LoweringContext, m: RuleMatch) -> Node:
    node = m.node
    mod = ctx.module(node)
    assert isinstance(mod, (nnqr.LSTM, nnqr.GRU))
    reason = rnn_unsupported_reason(mod)
    if reason is not None:
        raise NotLowerableError(reason)
    dq = node.args[0]
    assert isinstance(dq, Node)  # the rule's constraint: dequantize(quantize(x))
    q = dq.args[0]
    assert isinstance(q, Node)
    cls = QuantizedDynamicLSTM if isinstance(mod, nnqr.LSTM) else QuantizedDynamicGRU
    new_mod = cls(mod, ctx.target)
    new = ctx.add_module(f"{node.target}_dynamic", new_mod, (q.args[0], *node.args[1:]))
    ctx.record(new, f"{new_mod.kernel} ({ctx.target}) gate GEMMs, recurrence in float")
    return new


def _build_embedding(ctx: LoweringContext, m: RuleMatch) -> Node:
    node = m.node
    mod = ctx.module(node)
    assert isinstance(mod, (nnqr.EmbeddingBag, nnqr.Embedding))
    qw = mod.get_quantized_weight()
    if qw.dtype != torch.uint8 or qw.axis != 0 or qw.zero_point.dtype.is_floating_point is False:
        raise NotLowerableError(
            f"weight {qw.dtype} {qw.qscheme} (8-bit per-row float-qparams only)"
        )
    if mod.max_norm is not None or mod.padding_idx is not None:
        raise NotLowerableError("max_norm / padding_idx are not supported by kernels.embedding_bag")
    if isinstance(mod, nnqr.EmbeddingBag) and mod.mode not in ("sum", "mean", "max"):
        raise NotLowerableError(f"mode {mod.mode!r}")
    scale = qw.scale.to(torch.float32)
    row_bias = -qw.zero_point.to(torch.float32) * scale
    new_mod: lm.LoweredModule
    if isinstance(mod, nnqr.EmbeddingBag):
        new_mod = lm.QuantizedEmbeddingBag(
            qw.values, scale, row_bias, mod.mode, mod.include_last_offset, ctx.target
        )
    else:
        new_mod = lm.QuantizedEmbedding(qw.values, scale, row_bias, ctx.target)
    new = ctx.add_module(f"{node.target}_lowered", new_mod, node.args, dict(node.kwargs))
    ctx.record(new, f"{new_mod.kernel} ({ctx.target})")
    return new


# --- constraints of the table --------------------------------------------------------------


def _is_static_dequantize(value: Any) -> bool:
    """A static uint8 dequantize node (the input of quantize(dequantize(x)))."""
    owner = value.graph.owning_module if isinstance(value, Node) else None
    return owner is not None and quantized_input(owner, value) is not None


def _is_dynamic_quantized_input(value: Any) -> bool:
    """dequantize(quantize(x, ...)) on per-call qparams (dynamic linear's input)."""
    if not (isinstance(value, Node) and value.op == "call_function"):
        return False
    owner = value.graph.owning_module
    if value.target is not DEQUANTIZE or owner is None or static_qparams(owner, value) is not None:
        return False
    q = value.args[0]
    if not (isinstance(q, Node) and q.op == "call_function" and q.target is QUANTIZE):
        return False
    return isinstance(q.args[0], Node)


def _no_kwargs(match: RewriteMatch) -> bool:
    return not match.anchor.kwargs


def _float_result(match: RewriteMatch) -> bool:
    """No keyword arguments, and no user quantizes the result (prepare left it float)."""
    anchor = match.anchor
    return not anchor.kwargs and not any(
        u.op == "call_function" and u.target is QUANTIZE for u in anchor.users
    )


def _relu_over(binary_ops: tuple[Any, ...]) -> tuple[Pattern, ...]:
    """relu(op(...)) for every relu spelling; F.relu also with ``inplace`` positional."""
    pats: list[Pattern] = []
    for relu in (nn.ReLU, *_RELU_FNS):
        for op in binary_ops:
            pats.append(Nested(relu, op))
            if relu is F.relu:
                pats.append(Nested(relu, op, MatchAllNode))
    return tuple(pats)


def _clamp_over(weighted: tuple[type[nn.Module], ...]) -> tuple[Pattern, ...]:
    """relu6 / hardtanh (module or function, bounds and ``inplace`` positional) of each of
    ``weighted``."""
    return tuple(
        Nested(clamp, w, *[MatchAllNode] * n)
        for w in weighted
        for clamp, most in _CLAMP_EXTRA_ARGS.items()
        for n in range(most + 1)
    )


def default_lowering_rules(*, per_token_activations: bool = False) -> tuple[LoweringRule, ...]:
    """The built-in table in matching order; extend it with ``(*default_lowering_rules(), rule)``
    (a rule placed before a built-in one takes precedence on the ops they share).

    ``per_token_activations``: dynamic linears quantize each row (token) of their input with
    its own scale and zero point (``kernels.linear_dynamic(per_row=True)``) instead of one per
    tensor (torch.ao's rule).
    """
    if per_token_activations:
        return _PER_TOKEN_RULES
    return _DEFAULT_RULES


def _residual_conv(match: RewriteMatch) -> tuple[int, Any, Any, Any] | None:
    """(position of the conv among the add's operands, add, conv, other operand) when a lowered
    2-D conv feeds only a lowered add (+relu) that reads it in the conv's output qparams."""
    add_node, conv_node = match.anchor, match.nodes[1]
    gm = add_node.graph.owning_module
    assert gm is not None
    add, conv = gm.get_submodule(str(add_node.target)), gm.get_submodule(str(conv_node.target))
    if type(add) is not lm.QuantizedBinary or add.kind not in ("add", "add_relu"):
        return None
    if type(conv) is not lm.QuantizedConv or conv.weight.dim() != 4:
        return None
    position = 0 if add_node.args[0] is conv_node else 1
    other = add_node.args[1 - position]
    operands = (add.input_qparams, add.other_qparams)
    if other is conv_node or operands[position] != conv.output_qparams:
        return None
    return position, add, conv, other


def _build_conv_add(ctx: LoweringContext, m: RuleMatch) -> Node:
    found = m.recheck(_residual_conv, "not a residual conv + add")
    position, add, conv, other = found
    operands = (add.input_qparams, add.other_qparams)
    conv_node = m.nodes[1]
    fused = lm.QuantizedConvAdd(
        conv, operands[1 - position], add.output_qparams, add.kind == "add_relu"
    )
    new = ctx.add_module(
        f"{conv_node.name}_{add.kind}", fused, (conv_node.args[0], other), before=m.anchor
    )
    ctx.record(new, f"{fused.kernel} ({ctx.target}), conv + {add.kind}")
    return new


def _float_columns(match: RewriteMatch) -> tuple[Node, Node, torch.Tensor, torch.Tensor] | None:
    """(float-output linear node, float value, channels, weight) when a lowered float-output
    Linear is added to the float columns of its outlier split: ``FloatColumns(x)`` (fx
    capture) or ``linear(index_select(x, -1, channels), weight)`` (torch.export)."""
    add = match.anchor
    gm = add.graph.owning_module
    assert gm is not None
    if len(add.args) != 2 or add.kwargs:
        return None
    for position in (0, 1):
        lin, side = add.args[position], add.args[1 - position]
        if not (isinstance(lin, Node) and isinstance(side, Node) and lin.op == "call_module"):
            continue
        mod = gm.get_submodule(str(lin.target))
        if type(mod) is not lm.QuantizedLinearFloat or mod.epilogue != "none":
            continue
        if mod.side_channels is not None or len(lin.users) != 1 or len(lin.args) != 1:
            continue
        found = _side_columns(gm, side)
        if found is not None and found[2].shape[0] == mod.weight.shape[0]:
            return (lin, *found)
    return None


def _side_columns(gm: Any, side: Node) -> tuple[Node, torch.Tensor, torch.Tensor] | None:
    if side.op == "call_module":
        mod = gm.get_submodule(str(side.target))
        if isinstance(mod, FloatColumns) and len(side.args) == 1 and isinstance(side.args[0], Node):
            return side.args[0], mod.channels, mod.weight
        return None
    if side.op != "call_function" or side.target is not F.linear or side.kwargs:
        return None
    if len(side.args) not in (2, 3) or (len(side.args) == 3 and side.args[2] is not None):
        return None
    picked, weight = side.args[0], constant_tensor(gm, side.args[1])
    if not isinstance(picked, Node) or weight is None or picked.kwargs:
        return None
    if picked.target is not torch.ops.aten.index_select.default or len(picked.args) != 3:
        return None
    x, dim, channels = picked.args
    index = constant_tensor(gm, channels)
    if dim != -1 or index is None or not isinstance(x, Node):
        return None
    return x, index, weight


def _build_float_columns(ctx: LoweringContext, m: RuleMatch) -> Node:
    found = m.recheck(_float_columns, "not a float-output linear plus its float columns")
    lin, x, channels, weight = found
    mod = ctx.module(lin)
    assert isinstance(mod, lm.QuantizedLinearFloat)
    fused = copy.deepcopy(mod)
    fused.add_float_columns(channels, weight)
    new = ctx.add_module(f"{lin.name}_columns", fused, (lin.args[0], x), before=m.anchor)
    ctx.record(
        new, f"{fused.kernel} ({ctx.target}), float output + float columns {channels.tolist()}"
    )
    return new


def _activation_epilogue(match: RewriteMatch) -> tuple[Any, Any] | None:
    """(lookup-table module, weighted module) when a lowered conv / linear (or conv + add)
    without an activation feeds only a lowered lookup table reading its output codes."""
    lut_node, w_node = match.anchor, match.nodes[1]
    gm = lut_node.graph.owning_module
    assert gm is not None
    lut = gm.get_submodule(str(lut_node.target))
    wmod = gm.get_submodule(str(w_node.target))
    if type(lut) is not lm.QuantizedLookupTable or len(w_node.users) != 1:
        return None
    if not isinstance(wmod, (lm.QuantizedConv, lm.QuantizedLinear)) or type(wmod) not in (
        lm.QuantizedConv, lm.QuantizedConvAdd, lm.QuantizedLinear,
    ):  # fmt: skip
        return None
    if wmod.activation is not None or wmod.target != lut.target:
        return None
    if lut.input_qparams != wmod.output_qparams:
        return None
    return lut, wmod


def _build_activation_epilogue(ctx: LoweringContext, m: RuleMatch) -> Node:
    found = m.recheck(_activation_epilogue, "not a conv / linear whose only user is a lookup table")
    lut, wmod = found
    w_node = m.nodes[1]
    fused = wmod.with_activation(lut.table, lut.what, lut.output_qparams)
    name = re.sub(r"\W+", "_", f"{w_node.name}_{lut.what}")  # "add 3.0 + relu": identifier
    new = ctx.add_module(name, fused, w_node.args, dict(w_node.kwargs), before=m.anchor)
    ctx.record(new, f"{fused.kernel} ({ctx.target}), {lut.what} in the epilogue")
    return new


# float-model operators (before convert) whose quantized form the weighted rule lowers
_WEIGHTED_CONFIG_OPS: tuple[Any, ...] = (
    nn.Linear, nn.Conv1d, nn.Conv2d, F.linear, F.conv1d, F.conv2d,
    nnqat.Linear, nnqat.Conv1d, nnqat.Conv2d,
    nni.LinearBn1d, nni.ConvBn1d, nni.ConvBn2d, nni.ConvBnReLU1d, nni.ConvBnReLU2d,
    nniqat.LinearReLU, nniqat.LinearBn1d, nniqat.ConvReLU1d, nniqat.ConvReLU2d,
    nniqat.ConvBn1d, nniqat.ConvBn2d, nniqat.ConvBnReLU1d, nniqat.ConvBnReLU2d,
)  # fmt: skip
_FLOAT_OUTPUT_CONFIG_OPS: tuple[Any, ...] = (
    nn.Linear, F.linear, nnqat.Linear, nni.LinearBn1d, nniqat.LinearBn1d, nniqat.LinearReLU,
)  # fmt: skip
_DYNAMIC_CONFIG_OPS: tuple[Any, ...] = (
    nn.Linear, F.linear, nnqat.Linear, nni.LinearBn1d, nniqat.LinearBn1d, nniqat.LinearReLU,
    nn.ReLU, F.relu,
)  # fmt: skip

_DEFAULT_RULES: tuple[LoweringRule, ...] = (
    LoweringRule(
        "requantize",
        (MatchAllNode,),
        _build_requantize,
        constraints=(ArgConstraint(op=0, position=0, predicate=_is_static_dequantize),),
        description="quantize(dequantize(x)) between different qparams",
        kernel="kernels.requantize",
    ),
    LoweringRule(
        "linear / conv + clamp",
        _clamp_over(_REF_WEIGHTED),
        _build_weighted_clamp,
        description="Linear / Conv1d / Conv2d followed by relu6 / hardtanh, observed after "
        "the clamp",
        kernel="kernels.linear / conv1d / conv2d (the clamp narrows the output range)",
        config_ops=WEIGHTED_CLAMPS,
    ),
    LoweringRule(
        "linear / conv (+relu)",
        _FUSED_WEIGHTED + _REF_WEIGHTED,
        _build_weighted,
        description="Linear / Conv1d / Conv2d (+relu, BN folded), depthwise",
        kernel="kernels.linear / conv1d / conv2d",
        config_ops=_WEIGHTED_CONFIG_OPS,
        folds=(nn.BatchNorm1d, nn.BatchNorm2d),
    ),
    LoweringRule(
        "matmul",
        _MATMUL_FNS,
        _build_matmul,
        description="matmul of two quantized tensors",
        kernel="kernels.matmul",
    ),
    LoweringRule(
        "add / mul",
        _ADD_FNS + _MUL_FNS,
        _build_add_mul,
        description="add / mul of two quantized tensors, or of one and a scalar",
        kernel="kernels.add / mul (lookup table for a scalar)",
    ),
    LoweringRule(
        "add / mul + relu",
        _relu_over(_ADD_FNS + _MUL_FNS),
        _build_add_mul_relu,
        description="relu(add / mul) of two quantized tensors",
        kernel="kernels.add_relu / mul_relu",
    ),
    LoweringRule(
        "lookup table",
        _unique(_LUT_MODULES + _LUT_FNS),
        _build_lut,
        description="activations of one input (relu, hardswish, sigmoid, clamp, ...)",
        kernel="kernels.apply_lut",
        # method names torch.ao's configs list (torch.Tensor has no such method): kept so the
        # derived config has every entry the native one has for this family
        config_ops=("hardsigmoid", "hardsigmoid_"),
    ),
    LoweringRule(
        "max_pool2d",
        (nn.MaxPool2d, F.max_pool2d, torch.max_pool2d),
        _build_max_pool2d,
        description="MaxPool2d / max_pool2d",
        kernel="kernels.max_pool2d",
    ),
    LoweringRule(
        "avg_pool2d",
        _unique((nn.AvgPool2d, F.avg_pool2d, torch._C._nn.avg_pool2d)),
        _build_avg_pool2d,
        description="AvgPool2d / avg_pool2d",
        kernel="kernels.avg_pool2d",
    ),
    LoweringRule(
        "adaptive_avg_pool2d",
        _unique((nn.AdaptiveAvgPool2d, F.adaptive_avg_pool2d, torch._C._nn.adaptive_avg_pool2d)),
        _build_adaptive_avg_pool2d,
        description="AdaptiveAvgPool2d / adaptive_avg_pool2d",
        kernel="kernels.adaptive_avg_pool2d",
    ),
    LoweringRule(
        "cat",
        _CAT_FNS,
        _build_cat,
        description="cat",
        kernel="torch.cat on uint8 (+kernels.requantize)",
    ),
    LoweringRule(
        "identity in eval",
        (*_unique(_IDENTITY_MODULES + _DROPOUT_FNS), MatchAllNode),
        _build_identity,
        # MatchAllNode: functions known by name (torchvision's stochastic_depth)
        constraints=(ArgConstraint(op=0, position=0, predicate=_is_eval_identity),),
        description="dropout variants, stochastic_depth, Identity (eval mode): removed",
        kernel="none (kernels.requantize if the qparams differ)",
    ),
    LoweringRule(
        "shape ops",
        _unique(_SHAPE_MODULES + _SHAPE_FNS),
        _build_shape,
        description="flatten, reshape, view (as reshape), permute, getitem, ...",
        kernel="the op on uint8 (+kernels.requantize)",
    ),
    LoweringRule(
        "linear, float output",
        (Nested(nnqr.Linear, MatchAllNode), Nested(nni.LinearReLU, MatchAllNode)),
        _build_float_linear,
        kind="float_output",
        constraints=(ArgConstraint(op=0, position=0, predicate=_is_static_dequantize),),
        match_filter=_float_result,
        description="Linear (+relu) on a static uint8 input whose consumers run in float: "
        "float output, no requantization",
        kernel="kernels.linear_float",
        modes=("static_float_output",),
        config_ops=_FLOAT_OUTPUT_CONFIG_OPS,
    ),
    LoweringRule(
        "dynamic linear",
        (Nested(nnqr.Linear, MatchAllNode), Nested(nni.LinearReLU, MatchAllNode)),
        _build_dynamic_linear,
        kind="float_output",
        constraints=(ArgConstraint(op=0, position=0, predicate=_is_dynamic_quantized_input),),
        match_filter=_no_kwargs,
        description="dynamic Linear (+relu): float in and out, int8 weights",
        kernel="kernels.linear_dynamic",
        modes=("dynamic",),
        config_ops=_DYNAMIC_CONFIG_OPS,
    ),
    LoweringRule(
        "dynamic lstm / gru",
        tuple(
            Nested(rnn, *([MatchAllNode] * n_args))
            for rnn in (nnqr.LSTM, nnqr.GRU)
            for n_args in (1, 2)
        ),
        _build_dynamic_rnn,
        kind="float_output",
        constraints=(ArgConstraint(op=0, position=0, predicate=_is_dynamic_quantized_input),),
        match_filter=_no_kwargs,
        description="dynamic LSTM / GRU: int8 gate GEMMs, float recurrence",
        kernel="kernels.linear_dynamic",
        modes=("dynamic",),
        config_ops=(nn.LSTM, nn.GRU),
    ),
    LoweringRule(
        "embedding",
        (nnqr.EmbeddingBag, nnqr.Embedding),
        _build_embedding,
        kind="float_output",
        description="EmbeddingBag / Embedding (8-bit and 4-bit weight-only)",
        kernel="kernels.embedding_bag",
        modes=("weight_only",),
        config_ops=(nn.Embedding, nn.EmbeddingBag, nnqat.Embedding, nnqat.EmbeddingBag),
    ),
    LoweringRule(
        "conv + add (+relu)",
        (
            Nested(lm.QuantizedBinary, lm.QuantizedConv, MatchAllNode),
            Nested(lm.QuantizedBinary, MatchAllNode, lm.QuantizedConv),
        ),
        _build_conv_add,
        kind="fusion",
        match_filter=lambda match: _residual_conv(match) is not None,
        description="Conv2d whose only user is an add (+relu): a residual block",
        kernel="kernels.conv2d_add (the add in the conv's epilogue)",
    ),
    LoweringRule(
        "linear + float columns",
        (
            Nested(operator.add, lm.QuantizedLinearFloat, MatchAllNode),
            Nested(operator.add, MatchAllNode, lm.QuantizedLinearFloat),
        ),
        _build_float_columns,
        kind="fusion",
        match_filter=lambda match: _float_columns(match) is not None,
        description="float-output Linear plus the float columns of its outlier split",
        kernel="kernels.linear_float, then the columns added in one BLAS call",
    ),
    LoweringRule(
        "conv / linear + activation",
        (
            Nested(lm.QuantizedLookupTable, lm.QuantizedConv),
            Nested(lm.QuantizedLookupTable, lm.QuantizedConvAdd),
            Nested(lm.QuantizedLookupTable, lm.QuantizedLinear),
        ),
        _build_activation_epilogue,
        kind="fusion",
        match_filter=lambda match: _activation_epilogue(match) is not None,
        description="Conv1d / Conv2d (incl. depthwise, conv + add) / Linear whose only user is "
        "an activation (any lookup-table op: relu6, hardswish, silu, sigmoid, gelu, ...)",
        kernel="kernels.conv2d / conv1d / conv2d_add / linear with lut= (the table in the "
        "epilogue; a clamp table narrows the clamp range)",
    ),
    *float_op_rules(),
)
_PER_TOKEN_RULES: tuple[LoweringRule, ...] = tuple(
    dataclasses.replace(
        rule,
        build=_make_build_dynamic_linear(True),
        description="dynamic Linear (+relu), per-token activation scales: float in and out",
    )
    if rule.name == "dynamic linear"
    else rule
    for rule in _DEFAULT_RULES
)
