"""The lowering pass: reference graph (dequantize → float op → quantize) → kernel calls on uint8.

Finding and replacing are separate. The reference patterns are found with quantbridge.patterns
(``find_rewrite_matches``) from the lowering table (``_table``): each static rule's pattern is
``quantize_per_tensor(op, scale, zero_point, 0, 255, torch.uint8)`` with constant qparams
and ``op`` feeding only that quantize; float-output rules (dynamic linear, embeddings) match
the module node alone. Both sets are matched on the unchanged reference graph.

The matches are then applied in graph order, each rule's builder emitting a lowered node that
takes the *quantized* producers directly and returns uint8 with the quantize's qparams. A
lowered node replaces the quantize node, so the next op's ``dequantize`` reads the lowered
node, and when that op is lowered too the dequantize has no user left: chains of quantized ops
stay uint8, with one quantize at the model input and one dequantize at its output. Builders
read their inputs when they run, so they see the nodes lowered before them. Ops no rule lowers,
or whose builder refuses them, keep their reference form (dequantize → float op → quantize):
correct, slower, and listed in the lowering report with the reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import product

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.nn.utils.parametrize import type_before_parametrizations

from quantbridge.fx_quant import QUANTIZED_OUTPUTS_KEY
from quantbridge.fx_quant.nn import reference as nnqr
from quantbridge.fx_quant.nn.quantizable import ZeroedChannels
from quantbridge.lowering import _modules as lm
from quantbridge.lowering._array_forward import install as install_array_forward
from quantbridge.lowering._context import (
    DEQUANTIZE,
    QUANTIZE,
    LoweringContext,
    LoweringReport,
    NotLowerableError,
    QParams,
)
from quantbridge.lowering._errors import LoweringError
from quantbridge.lowering._rules import LoweringRule, RuleMatch
from quantbridge.lowering._table import (
    _no_kernel,
    _nodes_in,
    default_lowering_rules,
    eval_identity,
)
from quantbridge.patterns import (
    MatchAllNode,
    Nested,
    Pattern,
    ReplacementPattern,
    RewriteMatch,
    as_complex,
    find_rewrite_matches,
)

__all__ = ["LoweringReport", "lower_to_kernels", "lowering_report"]

_REPORT_KEY = "quantbridge_lowering"
_INDEX_FILL = torch.ops.aten.index_fill.int_Scalar


def lowering_report(model: GraphModule) -> LoweringReport:
    """The report of the pass that produced ``model``."""
    rep = model.meta.get(_REPORT_KEY) if hasattr(model, "meta") else None
    if not isinstance(rep, LoweringReport):
        raise LoweringError(
            f"lowering_report: {type(model).__name__} was not produced by a quantbridge numba "
            "backend's lower(); lower a reference model first"
        )
    return rep


# --- module subclasses ---------------------------------------------------------------------


def _module_types(gm: GraphModule) -> set[type]:
    """Classes of the modules the graph calls (the original class of parametrized ones)."""
    modules = dict(gm.named_modules(remove_duplicate=False))
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    return {type_before_parametrizations(modules[t]) for t in called if t in modules}


def _subclass_variants(pattern: Pattern, types: set[type]) -> list[Pattern]:
    """``pattern`` with module classes replaced by the graph's subclasses of them (the
    matcher compares classes exactly; the table means ``isinstance``). First: ``pattern``."""
    if isinstance(pattern, tuple):
        choices = [_subclass_variants(p, types) for p in pattern]
        return [tuple(c) for c in product(*choices)]
    if isinstance(pattern, type) and issubclass(pattern, nn.Module):
        subs = [t for t in types if t is not pattern and issubclass(t, pattern)]
        return [pattern, *sorted(subs, key=lambda t: f"{t.__module__}.{t.__qualname__}")]
    return [pattern]


# --- the pass ------------------------------------------------------------------------------


class _Pass:
    def __init__(self, ctx: LoweringContext, rules: tuple[LoweringRule, ...]) -> None:
        self.ctx = ctx
        self.rules = rules
        self.owner: dict[ReplacementPattern, LoweringRule] = {}
        self._types: set[type] = set()

    def _compile(self, kind: str) -> list[ReplacementPattern]:
        """The rules' rewrite patterns in table order, with subclass variants if any."""
        out: list[ReplacementPattern] = []
        for rule in self.rules:
            if rule.kind != kind:
                continue
            own = {as_complex(op) for op in rule.ops if op is not MatchAllNode}
            for op, compiled in zip(rule.ops, rule._compiled, strict=True):
                out.append(compiled)
                self.owner[compiled] = rule
                if not self._types or op is MatchAllNode:
                    continue
                for variant in _subclass_variants(as_complex(op), self._types)[1:]:
                    if variant in own:
                        continue
                    extra = rule.compile(Nested.from_tuple(variant))
                    out.append(extra)
                    self.owner[extra] = rule
        return out

    def _find(self, kind: str) -> dict[Node, RuleMatch]:
        """Matches of the ``kind`` rules on the graph as it is now, by anchor node."""
        patterns = self._compile(kind)
        if not patterns:
            return {}
        found = find_rewrite_matches(self.ctx.graph_module, patterns)
        return {m.anchor: self._rule_match(m) for m in found}

    def _rule_match(self, found: RewriteMatch) -> RuleMatch:
        rule = self.owner[found.rule]
        anchor = found.anchor
        if rule.kind != "static":
            return RuleMatch(rule, anchor, found.nodes, anchor, None)
        op = anchor.args[0]
        assert isinstance(op, Node)
        qparams = self.ctx.static_qparams(anchor)
        assert qparams is not None  # the static rules' constraints
        return RuleMatch(rule, op, found.nodes[1:], anchor, qparams)

    def run(self) -> None:
        gm = self.ctx.graph_module
        # graph module classes that subclass a class the table names (rarely any)
        named = {c for rule in self.rules for c in rule._module_classes}
        self._types = {t for t in _module_types(gm) if any(b in named for b in t.__mro__[1:])}
        self._bypass_zeroed_channels()
        self._merge_equal_quantizes()
        static = self._find("static")
        # an op inside a static match (a Linear before its clamp) is that match's
        claimed = {n for m in static.values() for n in m.nodes[1:]}
        floats = {n: m for n, m in self._find("float_output").items() if n not in claimed}
        for node in list(gm.graph.nodes):
            match = floats.get(node)
            if match is not None:
                self._apply(match)
            elif node.op == "call_function" and node.target is QUANTIZE:
                match = static.get(node)
                # matched on the reference graph: the op may since have been lowered as a
                # float-output op (dynamic linear) and the quantize now reads its result
                if match is not None and node.args[0] is match.node:
                    self._apply(match)
                else:
                    self._unmatched_quantize(node)
        self._cleanup()

    def _bypass_zeroed_channels(self) -> None:
        """An outlier split's zeroing (``ZeroedChannels``) before the quantize of its int8
        Linear: the channels it zeroes meet weights that are zero, so the Linear computes the
        same bytes from the unzeroed value (codes past the range saturate and are multiplied
        by zero). Without it, the quantize reads the value every other reader quantizes."""
        gm = self.ctx.graph_module
        for node in list(gm.graph.nodes):
            found = self._zeroed_channels(node)
            if found is None:
                continue
            channels = found
            if all(_zero_weight_reader(gm, q, channels) for q in node.users):
                source = node.args[0]
                assert isinstance(source, Node)  # checked by _zeroed_channels
                node.replace_all_uses_with(source)
                gm.graph.erase_node(node)
                self.ctx.record_removed(
                    node, "zeroed outlier channels (the int8 Linear's weights there are zero)"
                )

    def _zeroed_channels(self, node: Node) -> torch.Tensor | None:
        """The channels ``node`` zeroes (its input is ``node.args[0]``): a ``ZeroedChannels``
        call (fx capture), or the ``index_fill`` it is under torch.export."""
        if node.kwargs or not node.args or not isinstance(node.args[0], Node):
            return None
        mod = self.ctx.module(node)
        if isinstance(mod, ZeroedChannels):
            return mod.channels if len(node.args) == 1 else None
        if node.op != "call_function" or node.target is not _INDEX_FILL or len(node.args) != 4:
            return None
        _, dim, channels, value = node.args
        shape = node.meta.get("val", None)
        last = dim == -1 or (shape is not None and dim == len(shape.shape) - 1)
        index = self.ctx.constant(channels)
        if not last or value != 0.0 or index is None:
            return None
        return index

    def _merge_equal_quantizes(self) -> None:
        """Quantizes of one value with equal qparams (q, k and v of one LayerNorm output
        after an outlier split) become one."""
        seen: dict[tuple[Node, QParams], Node] = {}
        for node in list(self.ctx.graph.nodes):
            if node.op != "call_function" or node.target is not QUANTIZE:
                continue
            qp = self.ctx.static_qparams(node)
            src = node.args[0]
            if qp is None or not isinstance(src, Node):
                continue
            first = seen.setdefault((src, qp), node)
            if first is not node:
                node.replace_all_uses_with(first)
                self.ctx.graph.erase_node(node)

    def _fuse(self) -> None:
        """The fusion rules, on the lowered graph: each merges lowered modules into one. A
        fused module may match again (conv + add, then its activation): rounds until one
        fuses nothing (each fusion removes a node, so this ends)."""
        while self._fuse_round():
            pass

    def _fuse_round(self) -> bool:
        ctx = self.ctx
        found = self._find("fusion")
        fused = False
        for node in list(ctx.graph.nodes):
            match = found.get(node)
            if match is None:
                continue
            ctx.anchor = match.anchor
            try:
                new = match.rule.build(ctx, match)
            except NotLowerableError:
                continue  # the modules stay lowered as they are
            finally:
                ctx.anchor = None
            self._check_built(match, new)
            match.anchor.replace_all_uses_with(new)
            ctx.absorb(new, match.nodes)
            for replaced in match.nodes:
                ctx.graph.erase_node(replaced)
            fused = True
        return fused

    def _check_built(self, match: RuleMatch, new: object) -> None:
        if not isinstance(new, Node) or new is match.anchor:
            raise LoweringError(
                f"lowering rule {match.rule.name!r}: its builder returned {new!r} for node "
                f"{match.anchor.name!r}; return the new node that replaces it, or raise "
                "NotLowerableError('why') to keep the reference form"
            )

    def _apply(self, match: RuleMatch) -> None:
        ctx = self.ctx
        ctx.anchor = match.anchor
        try:
            new = match.rule.build(ctx, match)
        except NotLowerableError as why:
            ctx.keep(match.node, str(why))
            return
        finally:
            ctx.anchor = None
        self._check_built(match, new)
        match.anchor.replace_all_uses_with(new)
        # first wins: a builder may return an earlier op's node (an identity op its input)
        ctx.report.origins.setdefault(new.name, match.anchor.name)
        if match.output_qparams is not None:
            ctx.record_output(new, match.node.name, match.output_qparams)

    def _unmatched_quantize(self, q: Node) -> None:
        """A static quantize no rule lowered: report why its op stays reference."""
        if self.ctx.static_qparams(q) is None:
            return
        src = q.args[0]
        if not isinstance(src, Node) or src.op in ("placeholder", "get_attr"):
            return  # model input: stays a quantize op
        if src.op == "call_function" and src.target is DEQUANTIZE:
            return  # quantize(dequantize(x)): the requantize rule takes the static ones
        if len(src.users) != 1:
            self.ctx.keep(src, "its float output has other users")
            return
        self.ctx.keep(src, _no_kernel(self.ctx, src))

    # cleanup -----------------------------------------------------------------------------

    def _boundaries(self) -> None:
        """Remaining static uint8 quantize/dequantize ops → kernel-backed modules (the
        reference ops are exact but slow); ones on dynamic qparams stay as they are."""
        ctx = self.ctx
        for node in list(ctx.graph.nodes):
            if (
                node.op != "call_function"
                or node.target not in (QUANTIZE, DEQUANTIZE)
                or not node.users
            ):
                continue
            qp = ctx.static_qparams(node)
            if qp is None or not isinstance(node.args[0], Node):
                continue
            if node.target is QUANTIZE:
                mod: lm.LoweredModule = lm.Quantize(ctx.target, None, qp)
                base = f"{node.args[0].name}_quantize"
                source: str | None = node.args[0].name
            else:
                mod = lm.Dequantize(ctx.target, qp, None)
                base = f"{node.args[0].name}_dequantize"
                source = None
            new = ctx.add_module(base, mod, (node.args[0],), before=node)
            node.replace_all_uses_with(new)
            ctx.report.origins[new.name] = node.name
            if source is not None:
                ctx.record_output(new, source, qp)

    def _cleanup(self) -> None:
        gm, graph = self.ctx.graph_module, self.ctx.graph
        before = {n.target for n in graph.nodes if n.op == "get_attr"}
        graph.eliminate_dead_code()  # first: dequantizes read only by replaced ops go
        self._boundaries()
        graph.eliminate_dead_code()
        self._fuse()  # on the final graph: a conv's users are real users now
        self._drop_float_identities()
        graph.eliminate_dead_code()
        after = {n.target for n in graph.nodes if n.op == "get_attr"}
        for t in before - after:
            path = str(t)
            if "." not in path and hasattr(gm, path):
                delattr(gm, path)
        gm.delete_all_unused_submodules()
        graph.lint()
        gm.recompile()

    def _drop_float_identities(self) -> None:
        """Eval-mode dropout, stochastic depth and nn.Identity left on float values (a dynamic
        model's, or between float ops): the value flows through, as the rule does for codes."""
        for node in list(self.ctx.graph.nodes):
            what = eval_identity(node)
            if what is None or not node.args or not isinstance(node.args[0], Node):
                continue
            if _nodes_in([*node.args[1:], *node.kwargs.values()]):
                continue  # a run-time argument: not provably an identity
            node.replace_all_uses_with(node.args[0])
            self.ctx.record_removed(node, f"{what} (identity in eval, float): removed")


def _zero_weight_reader(gm: GraphModule, quantize: Node, channels: torch.Tensor) -> bool:
    """``quantize`` feeds only dequantizes read only by reference Linears whose weight
    columns ``channels`` are all zero."""
    if quantize.op != "call_function" or quantize.target is not QUANTIZE or not quantize.users:
        return False
    for dq in quantize.users:
        if dq.op != "call_function" or dq.target is not DEQUANTIZE or not dq.users:
            return False
        for user in dq.users:
            mod = gm.get_submodule(str(user.target)) if user.op == "call_module" else None
            if not isinstance(mod, nnqr.Linear) or user.args[:1] != (dq,):
                return False
            weight = mod.get_weight()
            if bool(weight[:, channels].any()):
                return False
    return True


def _check_rules(rules: Iterable[LoweringRule]) -> tuple[LoweringRule, ...]:
    if isinstance(rules, LoweringRule):
        raise LoweringError(
            "lower_to_kernels: rules= takes a sequence of LoweringRule, got one rule; "
            "pass (*default_lowering_rules(), rule)"
        )
    table = tuple(rules)
    for i, rule in enumerate(table):
        if not isinstance(rule, LoweringRule):
            raise LoweringError(
                f"lower_to_kernels: rules[{i}] is {type(rule).__name__} {rule!r}, not a "
                "LoweringRule"
            )
    return table


def lower_to_kernels(
    reference_model: GraphModule, target: str, rules: Iterable[LoweringRule] | None = None
) -> GraphModule:
    """Lower ``reference_model`` in place for kernel ``target``; returns it (report in meta).

    ``rules``: the lowering table, in matching order; default :func:`default_lowering_rules`.
    """
    if not isinstance(reference_model, GraphModule):
        raise LoweringError(
            f"lower: expected the GraphModule returned by convert_to_reference_fx, got "
            f"{type(reference_model).__name__}"
        )
    table = default_lowering_rules() if rules is None else _check_rules(rules)
    ctx = LoweringContext(reference_model, target)
    lowering = _Pass(ctx, table)
    lowering.run()
    reference_model.meta[_REPORT_KEY] = ctx.finish_report()
    reference_model.meta[QUANTIZED_OUTPUTS_KEY] = ctx.outputs
    return use_array_forward(reference_model)


def use_array_forward(model: GraphModule) -> GraphModule:
    """Run ``model`` (a lowered model) passing numpy arrays between its kernel modules.

    Same outputs as its generated forward, without a tensor made and unwrapped at every
    lowered module (~10-40 us each at batch 1). ``lower_to_kernels`` does this already, and
    ``copy.deepcopy`` keeps it; a lowered model loaded from a pickle needs this again. The
    generated forward still runs while the model is traced (torch.export, torch.compile,
    torch.jit.trace), when a module has forward hooks, and with keyword arguments. A model
    with no kernel module is returned unchanged. Returns ``model``.
    """
    if not isinstance(model, GraphModule):
        raise LoweringError(
            f"use_array_forward: expected a lowered GraphModule, got {type(model).__name__}"
        )
    if any(isinstance(m, lm.LoweredModule) and m.array_input for m in model.modules()):
        install_array_forward(model)
    return model
