"""Fusion rules for what stays float around a transformer's GEMMs (``kind="fusion"``: they run on
the lowered graph, after every op that could be quantized was; ops kept in reference form
around a missing quantized kernel are left as they are):

- GELU right after a dynamic linear (its only user) goes into the linear's float epilogue;
- ``LayerNorm(a + b)`` becomes ``kernels.layer_norm`` with the residual add fused, a LayerNorm
  alone ``kernels.layer_norm``;
- ``softmax(x * c + mask)`` / ``softmax(x / c + mask)`` (and without the mask or the scale)
  over the last dimension becomes ``kernels.softmax``;
- a LayerNorm whose input is dequantized codes reads the codes, and one whose result is also
  quantized returns the codes too (``kernels.layer_norm``'s ``x_qparams`` / ``codes``): the
  same bytes without the dequantize and quantize passes;
- ``scaled_dot_product_attention`` of three dequantized code tensors (the reference form the
  quantized projections leave), with its output quantize when it has one, becomes
  ``kernels.attention``: the codes are read in place and no dequantize pass runs.

Patterns name the operators as the float model calls them (modules, ``torch.nn.functional``,
``torch`` functions, methods), at each positional arity. A match is taken only when every
intermediate node has no other user and the arguments are what the kernels compute (last
dimension, float32 dtype, scalar scale); otherwise the next smaller pattern, or torch, runs it.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

from quantbridge.fx_quant.nn.quantizable import AttentionCore
from quantbridge.lowering import _modules as lm
from quantbridge.lowering._context import DEQUANTIZE, LoweringContext, NotLowerableError
from quantbridge.lowering._rules import LoweringRule, RuleMatch
from quantbridge.patterns import MatchAllNode, Nested, Pattern, RewriteMatch

__all__ = ["float_op_rules"]

_ADD: tuple[Any, ...] = (operator.add, torch.add)
_SCALE: tuple[Any, ...] = (operator.mul, torch.mul, operator.truediv, torch.div)
_GELU_FN: tuple[Any, ...] = (F.gelu,)
_SOFTMAX_FN: tuple[tuple[Any, range], ...] = (
    (F.softmax, range(1, 4)),
    (torch.softmax, range(2, 4)),
    ("softmax", range(2, 4)),
)
_LAYER_NORM_FN = (F.layer_norm, range(2, 6))


def _with_arity(op: Any, first: Pattern, arities: Sequence[int]) -> list[Pattern]:
    return [Nested(op, first, *([MatchAllNode] * (n - 1))) for n in arities]


def _gm(node: Node) -> torch.fx.GraphModule:
    gm = node.graph.owning_module
    assert gm is not None
    return gm


def _module(node: Node) -> nn.Module | None:
    return _gm(node).get_submodule(str(node.target)) if node.op == "call_module" else None


def _fn_in(node: Node, ops: tuple[Any, ...]) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    return any(node.target is op or (isinstance(op, str) and node.target == op) for op in ops)


def _sole_user(node: Node) -> bool:
    return len(node.users) == 1


def _arg(node: Node, index: int, name: str, default: Any) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _tensor_pair(add: Node) -> tuple[Node, Node] | None:
    """``(a, b)`` of ``a + b`` on two graph values (no ``alpha``), else None."""
    if not _fn_in(add, _ADD) or add.kwargs or len(add.args) != 2:
        return None
    a, b = add.args
    if not (isinstance(a, Node) and isinstance(b, Node)):
        return None
    return a, b


# --- GELU into the dynamic linear's epilogue ----------------------------------------------


def _gelu_approximate(node: Node) -> str | None:
    mod = _module(node)
    if isinstance(mod, nn.GELU):
        return str(mod.approximate) if len(node.args) == 1 and not node.kwargs else None
    if _fn_in(node, _GELU_FN):
        extra = set(node.kwargs) - {"approximate"}
        value = _arg(node, 1, "approximate", "none")
        return value if not extra and value in ("none", "tanh") else None
    return None


def _linear_gelu(
    match: RewriteMatch,
) -> tuple[lm.QuantizedDynamicLinear | lm.QuantizedLinearFloat, str] | None:
    act, lin_node = match.anchor, match.nodes[1]
    lin = _module(lin_node)
    if type(lin) not in (lm.QuantizedDynamicLinear, lm.QuantizedLinearFloat):
        return None
    assert isinstance(lin, (lm.QuantizedDynamicLinear, lm.QuantizedLinearFloat))
    if lin.epilogue != "none":
        return None
    if not _sole_user(lin_node):
        return None
    approximate = _gelu_approximate(act)
    return None if approximate is None else (lin, approximate)


def _refuse_kept(ctx: LoweringContext, m: RuleMatch) -> None:
    """Ops kept in reference form (dequantize → float op → quantize) stay exactly that: the
    report names them and the reference model is what they compute. An op on float values
    whose output is also quantized (a LayerNorm feeding both the residual stream and the
    next linear) is not in that form: it is a float op, and the float kernels take it."""
    for n in m.nodes:
        if ctx.is_kept(n) and any(_dequantized(a) for a in n.all_input_nodes):
            raise NotLowerableError("kept in reference form")


def _dequantized(node: Node) -> bool:
    """``node`` dequantizes codes (the reference op, or the module it is lowered to)."""
    if node.op == "call_function":
        return node.target is DEQUANTIZE
    return isinstance(_module(node), lm.Dequantize)


def _build_linear_gelu(ctx: LoweringContext, m: RuleMatch) -> Node:
    found = m.recheck(_linear_gelu, "not a dynamic linear followed by GELU")
    lin, approximate = found
    lin_node = m.nodes[1]
    activation = "gelu" if approximate == "none" else "gelu_tanh"
    fused: lm.QuantizedDynamicLinear | lm.QuantizedLinearFloat
    if isinstance(lin, lm.QuantizedLinearFloat):
        fused = copy.deepcopy(lin)
        fused.epilogue = activation
    else:
        fused = lm.QuantizedDynamicLinear(
            lin.weight, lin.weight_scale, lin.weight_zero_point, lin.bias, lin.target, None,
            None, activation=activation, per_row=lin.per_row,
        )  # fmt: skip
    new = ctx.add_module(f"{lin_node.name}_gelu", fused, lin_node.args, before=m.anchor)
    ctx.record(new, f"{fused.kernel} ({ctx.target}), GELU ({approximate}) fused")
    return new


# --- LayerNorm (+ residual add) ------------------------------------------------------------


@dataclass
class _LayerNormParts:
    x: Node
    residual: Node | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float


def _constant(node: Any) -> tuple[bool, torch.Tensor | None]:
    """``(True, value)`` for None or a get_attr tensor, ``(False, None)`` for anything else."""
    if node is None:
        return True, None
    if isinstance(node, Node) and node.op == "get_attr":
        value: Any = _gm(node)
        for part in str(node.target).split("."):
            value = getattr(value, part)
        if isinstance(value, torch.Tensor):
            return True, value
    return False, None


def _layer_norm_parts(match: RewriteMatch) -> _LayerNormParts | None:
    node = match.anchor
    mod = _module(node)
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    if isinstance(mod, nn.LayerNorm):
        if len(node.args) != 1 or node.kwargs or len(mod.normalized_shape) != 1:
            return None
        weight, bias, eps = mod.weight, mod.bias, float(mod.eps)
    elif _fn_in(node, (F.layer_norm,)):
        if set(node.kwargs) - {"weight", "bias", "eps"}:
            return None
        shape = _arg(node, 1, "normalized_shape", None)
        if not (isinstance(shape, (list, tuple)) and len(shape) == 1 and isinstance(shape[0], int)):
            return None
        w_ok, weight = _constant(_arg(node, 2, "weight", None))
        b_ok, bias = _constant(_arg(node, 3, "bias", None))
        eps_v = _arg(node, 4, "eps", 1e-5)
        if not (w_ok and b_ok) or not isinstance(eps_v, (int, float)):
            return None
        eps = float(eps_v)
        if weight is not None and weight.shape != (shape[0],):
            return None
        if bias is not None and bias.shape != (shape[0],):
            return None
    else:
        return None
    first = node.args[0]
    if not isinstance(first, Node):
        return None
    if len(match.nodes) > 1:  # the residual add is part of the match
        pair = _tensor_pair(first)
        if pair is None or not _sole_user(first):
            return None
        return _LayerNormParts(pair[0], pair[1], weight, bias, eps)
    return _LayerNormParts(first, None, weight, bias, eps)


def _build_layer_norm(ctx: LoweringContext, m: RuleMatch) -> Node:
    _refuse_kept(ctx, m)
    parts = m.recheck(_layer_norm_parts, "not a LayerNorm over the last dimension")
    mod = lm.FloatLayerNorm(
        parts.weight, parts.bias, parts.eps, parts.residual is not None, ctx.target
    )
    args = (parts.x,) if parts.residual is None else (parts.x, parts.residual)
    new = ctx.add_module(f"{m.anchor.name}_float", mod, args, before=m.anchor)
    ctx.record(new, mod.kernel + (" (residual add fused)" if parts.residual is not None else ""))
    return new


# --- softmax (scale, mask) ----------------------------------------------------------------


@dataclass
class _SoftmaxParts:
    x: Node
    scale: float
    divide: bool
    mask: Node | None


def _softmax_dim_ok(node: Node) -> bool:
    mod = _module(node)
    if isinstance(mod, nn.Softmax):
        return mod.dim == -1 and len(node.args) == 1 and not node.kwargs
    if set(node.kwargs) - {"dim", "dtype", "_stacklevel"}:
        return False
    dim = _arg(node, 1, "dim", None)
    dtype = _arg(node, 2, "dtype", None)
    return dim == -1 and dtype in (None, torch.float32)


def _scale_of(node: Node) -> tuple[Node, float, bool] | None:
    """``(x, c, divide)`` of ``x * c`` / ``x / c`` with a Python number ``c``."""
    if not _fn_in(node, _SCALE) or node.kwargs or len(node.args) != 2:
        return None
    x, c = node.args
    if not isinstance(x, Node) or isinstance(c, bool) or not isinstance(c, (int, float)):
        return None
    divide = node.target in (operator.truediv, torch.div)
    if float(c) == 0.0 and divide:
        return None
    return x, float(c), divide


def _softmax_parts(match: RewriteMatch) -> _SoftmaxParts | None:
    node = match.anchor
    if not _softmax_dim_ok(node):
        return None
    first = node.args[0]
    if not isinstance(first, Node):
        return None
    inner = match.nodes[1:]
    if not inner:
        return _SoftmaxParts(first, 1.0, False, None)
    if any(not _sole_user(n) for n in inner):
        return None
    if len(inner) == 2:  # (x op c) + mask
        pair = _tensor_pair(first)
        scaled = _scale_of(inner[1])
        if pair is None or scaled is None or pair[0] is not inner[1]:
            return None
        return _SoftmaxParts(scaled[0], scaled[1], scaled[2], pair[1])
    pair = _tensor_pair(first)
    if pair is not None:
        return _SoftmaxParts(pair[0], 1.0, False, pair[1])
    scaled = _scale_of(first)
    if scaled is None:
        return None
    return _SoftmaxParts(scaled[0], scaled[1], scaled[2], None)


def _build_softmax(ctx: LoweringContext, m: RuleMatch) -> Node:
    _refuse_kept(ctx, m)
    parts = m.recheck(_softmax_parts, "not a softmax over the last dimension")
    mod = lm.FloatSoftmax(parts.scale, parts.divide, parts.mask is not None, ctx.target)
    args = (parts.x,) if parts.mask is None else (parts.x, parts.mask)
    new = ctx.add_module(f"{m.anchor.name}_float", mod, args, before=m.anchor)
    fused = [w for w, on in (("scale", parts.scale != 1.0), ("mask", parts.mask)) if on]
    ctx.record(new, mod.kernel + (f" ({' and '.join(fused)} fused)" if fused else ""))
    return new


# --- LayerNorm reading or writing codes ----------------------------------------------------


def _ln_reads_codes(match: RewriteMatch) -> tuple[lm.FloatLayerNorm, Node, lm.Dequantize] | None:
    ln = _module(match.anchor)
    if not isinstance(ln, lm.FloatLayerNorm) or ln._x_qp is not None or not match.anchor.args:
        return None
    x = match.anchor.args[0]
    dq = _module(x) if isinstance(x, Node) else None
    if not isinstance(dq, lm.Dequantize) or not isinstance(x.args[0], Node):  # type: ignore[union-attr]
        return None
    return ln, x, dq  # type: ignore[return-value]


def _build_ln_reads_codes(ctx: LoweringContext, m: RuleMatch) -> Node:
    found = m.recheck(_ln_reads_codes, "not a LayerNorm of dequantized codes")
    ln, x, dq = found
    mod = lm.FloatLayerNorm(
        ln.weight, ln.bias, ln.eps, ln.residual, ctx.target, dq.input_qparams, ln._codes_qp
    )
    new = ctx.add_module(f"{m.anchor.name}_codes", mod, (x.args[0], *m.anchor.args[1:]))
    ctx.record(new, f"{mod.kernel} ({mod._details()})")
    return new


def _quantized_result(match: RewriteMatch, kind: type[Any]) -> tuple[Any, Node, Any] | None:
    """(quantize, producer node, producer) when ``match`` is a quantize of the result of a
    ``kind`` module that does not return codes yet. The pattern is the quantize alone: the
    producer may have other (float) users, which a nested pattern does not allow."""
    quantize = _module(match.anchor)
    node = match.anchor.args[0] if match.anchor.args else None
    if not (isinstance(node, Node) and isinstance(quantize, lm.Quantize)):
        return None
    producer: Any = _module(node)
    if type(producer) is not kind or producer._codes_qp is not None:
        return None
    return quantize, node, producer


def _ln_quantize(match: RewriteMatch) -> tuple[lm.Quantize, Node, lm.FloatLayerNorm] | None:
    return _quantized_result(match, lm.FloatLayerNorm)


def _linear_quantize(
    match: RewriteMatch,
) -> tuple[lm.Quantize, Node, lm.QuantizedLinearFloat] | None:
    return _quantized_result(match, lm.QuantizedLinearFloat)


def _with_codes(ctx: LoweringContext, node: Node, mod: lm.LoweredModule) -> Node:
    """Put ``mod``, which returns ``(float result, codes)``, where ``node`` was: the float
    users read the first, and the codes node (returned) replaces the fused quantize."""
    after = node.next  # the producer's float users may come before the quantize
    new = ctx.add_module(f"{node.name}_codes", mod, node.args, before=after)
    with ctx.graph.inserting_before(after):
        result = ctx.graph.call_function(operator.getitem, (new, 0))
        codes = ctx.graph.call_function(operator.getitem, (new, 1))
    node.replace_all_uses_with(result)
    ctx.graph.erase_node(node)
    ctx.absorb(new, (node,))  # the report names the new module where it named the old
    ctx.record(new, f"{mod.kernel} ({mod._details()})")
    return codes


def _build_ln_quantize(ctx: LoweringContext, m: RuleMatch) -> Node:
    found = m.recheck(_ln_quantize, "not a quantized LayerNorm result")
    quantize, ln_node, ln = found
    mod = lm.FloatLayerNorm(
        ln.weight, ln.bias, ln.eps, ln.residual, ctx.target, ln._x_qp, quantize.output_qparams
    )
    return _with_codes(ctx, ln_node, mod)


def _build_linear_quantize(ctx: LoweringContext, m: RuleMatch) -> Node:
    found = m.recheck(_linear_quantize, "not a quantized float-output Linear result")
    quantize, lin_node, lin = found
    mod = lm.QuantizedLinearFloat(
        lin.weight, lin.weight_scale, lin.weight_zero_point, lin.bias, ctx.target,
        lin.input_qparams, quantize.output_qparams, activation=lin.epilogue,
    )  # fmt: skip
    if lin.side_channels is not None and lin.side_weight is not None:
        mod.add_float_columns(lin.side_channels, lin.side_weight)
    return _with_codes(ctx, lin_node, mod)


# --- scaled dot-product attention on codes ---------------------------------------------------

_SDPA_FN: tuple[Any, ...] = (
    F.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
)
# positional parameters after q, k, v, and the value each must have for the kernel (the mask
# and the scale are taken as they are)
_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_REQUIRED = {"dropout_p": 0.0, "enable_gqa": False}


@dataclass
class _AttentionParts:
    sdpa: Node
    codes: tuple[Node, Node, Node]
    qparams: tuple[tuple[float, int], tuple[float, int], tuple[float, int]]
    mask: Node | None
    scale: float | None
    out_qparams: tuple[float, int] | None
    causal: bool


_QP = tuple[float, int]


def _dequantized_codes(
    values: Sequence[Any],
) -> tuple[tuple[Node, Node, Node], tuple[_QP, _QP, _QP]] | None:
    """(codes, their qparams) of q, k, v when each is a ``Dequantize`` of codes."""
    codes, qparams = [], []
    for x in values:
        dq = _module(x) if isinstance(x, Node) else None
        if not isinstance(dq, lm.Dequantize) or not isinstance(x.args[0], Node):
            return None
        codes.append(x.args[0])
        qparams.append(dq.input_qparams)
    return (codes[0], codes[1], codes[2]), (qparams[0], qparams[1], qparams[2])


def _attention_parts(match: RewriteMatch) -> _AttentionParts | None:
    anchor = _module(match.anchor)
    quantize = anchor if isinstance(anchor, lm.Quantize) else None
    sdpa = match.nodes[1] if quantize is not None else match.anchor
    if not _fn_in(sdpa, _SDPA_FN) or len(sdpa.args) < 3:
        return None
    if quantize is not None and not _sole_user(sdpa):
        return None
    named = dict(zip(_SDPA_ARGS, sdpa.args[3:], strict=False))
    if set(named) & set(sdpa.kwargs) or set(sdpa.kwargs) - set(_SDPA_ARGS):
        return None
    named.update(sdpa.kwargs)
    if any(named.get(key, want) != want for key, want in _SDPA_REQUIRED.items()):
        return None
    mask, scale, causal = named.get("attn_mask"), named.get("scale"), named.get("is_causal", False)
    if not (mask is None or isinstance(mask, Node)) or causal not in (False, True):
        return None
    if causal and mask is not None:  # torch's rule for both together is not the kernel's
        return None
    if not (scale is None or (isinstance(scale, (int, float)) and not isinstance(scale, bool))):
        return None
    found = _dequantized_codes(sdpa.args[:3])
    if found is None:
        return None
    out_qp = None if quantize is None else quantize.output_qparams
    return _AttentionParts(
        sdpa, *found, mask, None if scale is None else float(scale), out_qp, bool(causal)
    )


def _build_attention(ctx: LoweringContext, m: RuleMatch) -> Node:
    parts = m.recheck(_attention_parts, "not an attention over dequantized codes")
    mod = lm.QuantizedAttention(
        parts.qparams, parts.out_qparams, parts.scale, parts.mask is not None, ctx.target,
        parts.causal,
    )  # fmt: skip
    args = (*parts.codes, parts.mask) if parts.mask is not None else parts.codes
    new = ctx.add_module(f"{parts.sdpa.name}_codes", mod, args, before=m.anchor)
    out = "uint8" if parts.out_qparams is not None else "float32"
    ctx.record(new, f"{mod.kernel} (dequantize of q, k, v fused, {out} output)")
    return new


# --- nn.MultiheadAttention's attention (fx_quant's AttentionCore) on codes ---------------------

# AttentionCore's positional parameters after q, k, v, and the value each must have for the
# kernel: no bias_k / bias_v, masks, attention weights or causal hint
_CORE_ARGS = (
    ("bias_k", None), ("bias_v", None), ("attn_mask", None), ("key_padding_mask", None),
    ("need_weights", False), ("average_attn_weights", None), ("is_causal", False),
)  # fmt: skip


def _core_attention_parts(match: RewriteMatch) -> tuple[_AttentionParts, int] | None:
    """The attention of ``quantize(AttentionCore(...)[0])`` over dequantized q, k, v of
    nn.MultiheadAttention (batch first, nothing but q, k and v), and its head count."""
    quantize, item, core_node = _module(match.anchor), match.nodes[1], match.nodes[2]
    core = _module(core_node)
    if not (isinstance(quantize, lm.Quantize) and isinstance(core, AttentionCore)):
        return None
    if len(item.args) != 2 or item.args[1] != 0 or item.kwargs:
        return None
    if not core.batch_first or core.add_zero_attn or len(core_node.args) < 3:
        return None
    given = dict(zip((name for name, _ in _CORE_ARGS), core_node.args[3:], strict=False))
    if set(given) & set(core_node.kwargs) or set(core_node.kwargs) - {n for n, _ in _CORE_ARGS}:
        return None
    given.update(core_node.kwargs)
    if any(want is not None and given.get(name, want) != want for name, want in _CORE_ARGS):
        return None
    if any(given.get(name) is not None for name in ("bias_k", "bias_v", "attn_mask",
                                                    "key_padding_mask")):  # fmt: skip
        return None
    if "need_weights" not in given:  # AttentionCore's default returns the weights too
        return None
    found = _dequantized_codes(core_node.args[:3])
    if found is None:
        return None
    return _AttentionParts(
        core_node, *found, None, None, quantize.output_qparams, False
    ), core.num_heads


def _build_core_attention(ctx: LoweringContext, m: RuleMatch) -> Node:
    parts, heads = m.recheck(_core_attention_parts, "not a plain attention over dequantized codes")
    mod = lm.QuantizedAttention(
        parts.qparams, parts.out_qparams, None, False, ctx.target, heads=heads
    )
    new = ctx.add_module(f"{parts.sdpa.name}_codes", mod, parts.codes, before=m.anchor)
    ctx.record(new, f"{mod.kernel} (nn.MultiheadAttention's attention on codes, {heads} heads)")
    return new


# --- patterns ----------------------------------------------------------------------------


def _softmax_patterns() -> tuple[Pattern, ...]:
    scaled = [Nested(op, MatchAllNode, MatchAllNode) for op in _SCALE]
    firsts: list[Pattern] = [
        *(Nested(add, s, MatchAllNode) for add in _ADD for s in scaled),
        *(Nested(add, MatchAllNode, MatchAllNode) for add in _ADD),
        *scaled,
    ]
    pats: list[Pattern] = []
    for first in firsts:
        pats.append(Nested(nn.Softmax, first))
        for op, arities in _SOFTMAX_FN:
            pats.extend(_with_arity(op, first, arities))
    pats += [nn.Softmax, *(op for op, _ in _SOFTMAX_FN)]
    return tuple(pats)


def _layer_norm_patterns() -> tuple[Pattern, ...]:
    op, arities = _LAYER_NORM_FN
    pats: list[Pattern] = []
    for add in _ADD:
        pats.append(Nested(nn.LayerNorm, add))
        pats.extend(_with_arity(op, add, arities))
    return (*pats, nn.LayerNorm, op)


def _linear_gelu_patterns() -> tuple[Pattern, ...]:
    return tuple(
        p
        for lin in (lm.QuantizedDynamicLinear, lm.QuantizedLinearFloat)
        for p in (Nested(nn.GELU, lin), Nested(F.gelu, lin), Nested(F.gelu, lin, MatchAllNode))
    )


def _core_attention_patterns() -> tuple[Pattern, ...]:
    return (Nested(lm.Quantize, Nested(operator.getitem, AttentionCore, MatchAllNode)),)


def _ln_codes_patterns() -> tuple[Pattern, ...]:
    return (lm.FloatLayerNorm,)


def _attention_patterns() -> tuple[Pattern, ...]:
    pats: list[Pattern] = []
    for op in _SDPA_FN:
        inner = _with_arity(op, MatchAllNode, range(3, 9))
        pats += [Nested(lm.Quantize, p) for p in inner]
        pats += inner
    return tuple(pats)


def _fusion(
    name: str, patterns: Any, build: Any, parts: Any, description: str, kernel: str
) -> LoweringRule:
    """A fusion row of this table: it matches where ``parts(match)`` finds its nodes."""

    def check(match: RewriteMatch) -> bool:
        return parts(match) is not None

    return LoweringRule(name, patterns, build, kind="fusion", match_filter=check,
                        description=description, kernel=kernel, modes=())  # fmt: skip


def float_op_rules() -> tuple[LoweringRule, ...]:
    """The fusion rules for float LayerNorm, softmax, GELU and attention (module docstring)."""
    return (
        _fusion(
            "dynamic linear + GELU", _linear_gelu_patterns(), _build_linear_gelu, _linear_gelu,
            "GELU after a dynamic or float-output Linear: in its float epilogue",
            "kernels.linear_dynamic / linear_float(activation='gelu' / 'gelu_tanh')",
        ),
        _fusion(
            "float layer_norm (+ residual add)", _layer_norm_patterns(), _build_layer_norm,
            _layer_norm_parts,
            "float LayerNorm over the last dimension, the residual add before it fused",
            "kernels.layer_norm",
        ),
        _fusion(
            "float softmax (+ scale, mask)", _softmax_patterns(), _build_softmax, _softmax_parts,
            "float softmax over the last dimension, x * c (or x / c) + mask fused",
            "kernels.softmax",
        ),
        _fusion(
            "attention on codes", _attention_patterns(), _build_attention, _attention_parts,
            "scaled_dot_product_attention of dequantized q, k, v (+ quantize)",
            "kernels.attention",
        ),
        _fusion(
            "multi-head attention on codes", _core_attention_patterns(), _build_core_attention,
            _core_attention_parts,
            "nn.MultiheadAttention's attention (batch first, no masks) of dequantized q, k, v, "
            "quantized",
            "kernels.attention",
        ),
        _fusion(
            "layer_norm reads codes", _ln_codes_patterns(), _build_ln_reads_codes,
            _ln_reads_codes, "float LayerNorm of dequantized codes: the dequantize fused",
            "kernels.layer_norm(x_qparams=)",
        ),
        _fusion(
            "layer_norm + quantize", (lm.Quantize,), _build_ln_quantize, _ln_quantize,
            "float LayerNorm whose result is also quantized: the quantize fused",
            "kernels.layer_norm(codes=)",
        ),
        _fusion(
            "float linear + quantize", (lm.Quantize,), _build_linear_quantize, _linear_quantize,
            "float-output Linear whose result is also quantized: the quantize fused",
            "kernels.linear_float(codes=)",
        ),
    )  # fmt: skip
