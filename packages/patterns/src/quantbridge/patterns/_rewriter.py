"""Subgraph rewriter for lowering passes: find a pattern, put new nodes in its place.

A pattern is either a complex-format pattern (the matcher's language; arguments bound by
``MatchAllNode`` become the match's inputs) or a Python function traced with torch.fx (its
parameters become the inputs; literals in it must be equal in the graph). Argument
constraints narrow either form, e.g. "the dtype argument of this dequantize is uint8". The
replacement is a function (traced and inlined, called with the inputs) or a callback that
builds the new nodes itself and returns the one that takes the anchor's place.

After rewriting, the replaced nodes and whatever only they used are erased, the graph is
linted and the module recompiled; new nodes inherit the replaced anchor's meta.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from torch.fx import Graph, GraphModule, Node, symbolic_trace

from quantbridge.patterns._compiled import (
    AnchorIndex,
    Binding,
    Op,
    Resolver,
    compile_complex,
    compile_traced,
    complex_priority,
    operators,
)
from quantbridge.patterns._errors import PatternError
from quantbridge.patterns._forms import Pattern
from quantbridge.patterns._typed import as_complex

_NO_VALUE: Any = object()

# meta keys that describe a node's value: only the node that takes the anchor's place gets
# them, other new nodes compute different values.
_VALUE_META = frozenset({"val", "tensor_meta", "example_value", "type"})


@dataclass(frozen=True)
class ArgConstraint:
    """A condition on one argument of one operator of a pattern.

    ``op`` indexes the pattern's operators in pre-order, anchor first (``nodes`` of a
    match). The argument is looked up by ``keyword`` in the node's kwargs first, then by
    ``position`` in its args; when absent, ``default`` is used if given, else the constraint
    fails. Give exactly one of ``equals`` (same type and equal) or ``predicate``.
    """

    position: int | None = None
    keyword: str | None = None
    equals: Any = _NO_VALUE
    predicate: Callable[[Any], bool] | None = None
    op: int = 0
    default: Any = _NO_VALUE

    def __post_init__(self) -> None:
        if self.position is None and self.keyword is None:
            raise PatternError(
                "ArgConstraint needs position= or keyword= (or both) to find the argument"
            )
        if self.position is not None and self.position < 0:
            raise PatternError(f"ArgConstraint position must be >= 0, got {self.position}")
        if (self.equals is _NO_VALUE) == (self.predicate is None):
            raise PatternError(
                "ArgConstraint takes exactly one of equals= (a value) or predicate= "
                "(a function of the argument returning bool)"
            )
        if self.op < 0:
            raise PatternError(f"ArgConstraint op must be >= 0, got {self.op}")

    def value_of(self, node: Node) -> Any:
        """The constrained argument of ``node``, or the sentinel when absent."""
        if self.keyword is not None and self.keyword in node.kwargs:
            return node.kwargs[self.keyword]
        if self.position is not None and self.position < len(node.args):
            return node.args[self.position]
        return self.default

    def holds(self, node: Node) -> bool:
        value = self.value_of(node)
        if value is _NO_VALUE:
            return False
        if self.predicate is not None:
            return bool(self.predicate(value))
        expected = self.equals
        return value is expected or (type(value) is type(expected) and bool(value == expected))


@dataclass(frozen=True, eq=False)
class RewriteMatch:
    """One occurrence of a replacement pattern: operator nodes (pre-order, anchor first),
    the anchor, and the values bound to the pattern's inputs (in input order)."""

    rule: ReplacementPattern
    nodes: tuple[Node, ...]
    anchor: Node
    inputs: tuple[Any, ...]


BuildCallback: TypeAlias = Callable[[RewriteMatch, Graph], Any]


@dataclass(frozen=True, eq=False)
class ReplacementPattern:
    """What to find and what to put in its place.

    Give exactly one of ``pattern`` (complex format) or ``pattern_fn`` (a function or
    GraphModule traced with torch.fx), and exactly one of ``replacement`` (a function or
    GraphModule called with the match's inputs, inlined) or ``build`` (called as
    ``build(match, graph)`` with insertion set before the anchor; returns the node that takes
    the anchor's place). ``constraints`` and ``match_filter`` narrow the matches.
    """

    pattern: Pattern = None
    pattern_fn: Callable[..., Any] | None = None
    replacement: Callable[..., Any] | None = None
    build: BuildCallback | None = None
    constraints: Sequence[ArgConstraint] = ()
    match_filter: Callable[[RewriteMatch], bool] | None = None
    name: str = ""
    _compiled: Op = field(init=False, repr=False, compare=False)
    _num_inputs: int = field(init=False, repr=False, compare=False)
    _num_ops: int = field(init=False, repr=False, compare=False)
    _priority: int = field(init=False, repr=False, compare=False)
    _replacement_graph: Graph | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        label = self.name or "ReplacementPattern"
        if (self.pattern is None) == (self.pattern_fn is None):
            raise PatternError(
                f"{label}: give exactly one of pattern= (complex format, e.g. "
                "(torch.add, nn.Conv2d, MatchAllNode)) or pattern_fn= (a function to trace)"
            )
        if (self.replacement is None) == (self.build is None):
            raise PatternError(
                f"{label}: give exactly one of replacement= (a function to trace and inline) "
                "or build= (a callback building the new nodes)"
            )
        if self.pattern is not None:
            pattern = as_complex(self.pattern, where=f"{label}.pattern")
            compiled, num_inputs = compile_complex(pattern)
            if not isinstance(compiled, Op):
                raise PatternError(
                    "a rewrite pattern cannot be MatchAllNode alone: it would match all"
                )
            priority = complex_priority(pattern)
        else:
            assert self.pattern_fn is not None
            compiled, num_inputs = compile_traced(_trace(self.pattern_fn, label, "pattern_fn"))
        num_ops = len(operators(compiled))
        if self.pattern is None:  # the size rule of complex patterns: operators and inputs
            priority = 1 if num_ops == 1 and num_inputs == 0 else -(num_ops + num_inputs)
        for i, constraint in enumerate(self.constraints):
            if not isinstance(constraint, ArgConstraint):
                raise PatternError(
                    f"{label}.constraints[{i}]: expected an ArgConstraint, got "
                    f"{type(constraint).__name__}"
                )
            if constraint.op >= num_ops:
                raise PatternError(
                    f"{label}.constraints[{i}]: op={constraint.op} but the pattern has "
                    f"{num_ops} operator(s) (indexed from 0, anchor first)"
                )
        replacement_graph = None
        if self.replacement is not None:
            traced = _trace(self.replacement, label, "replacement")
            placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
            if len(placeholders) != num_inputs:
                raise PatternError(
                    f"{label}: the replacement takes {len(placeholders)} input(s) but the "
                    f"pattern binds {num_inputs}; they are passed in order"
                )
            for node in traced.graph.nodes:
                if node.op in ("get_attr", "call_module"):
                    raise PatternError(
                        f"{label}: the replacement uses {node.op} {node.target!r}; a "
                        "replacement function may only call functions and methods, use "
                        "build= to add modules or constants"
                    )
            replacement_graph = traced.graph
        object.__setattr__(self, "_compiled", compiled)
        object.__setattr__(self, "_num_inputs", num_inputs)
        object.__setattr__(self, "_num_ops", num_ops)
        object.__setattr__(self, "_priority", priority)
        object.__setattr__(self, "_replacement_graph", replacement_graph)


def _trace(fn: Callable[..., Any], label: str, what: str) -> GraphModule:
    if isinstance(fn, GraphModule):
        return fn
    if not callable(fn):
        raise PatternError(f"{label}.{what}: expected a function or GraphModule, got {fn!r}")
    try:
        return symbolic_trace(fn)
    except Exception as exc:  # tracing errors come in many types
        raise PatternError(
            f"{label}.{what}: torch.fx could not trace {fn!r}: {exc}; write it with "
            "traceable operations only (no data-dependent control flow)"
        ) from exc


def _try(rule: ReplacementPattern, node: Node, resolver: Resolver) -> RewriteMatch | None:
    binding = Binding(resolver, torch_ao=False)
    if not binding.match(node, rule._compiled):
        return None
    nodes = tuple(binding.order)
    # Inner nodes may only feed the pattern itself, or replacing the anchor would leave
    # other users without their inputs.
    inside = set(nodes)
    for inner in nodes[1:]:
        if any(user not in inside for user in inner.users):
            return None
    for constraint in rule.constraints:
        if not constraint.holds(nodes[constraint.op]):
            return None
    inputs = tuple(binding.inputs.get(i) for i in range(rule._num_inputs))
    found = RewriteMatch(rule=rule, nodes=nodes, anchor=node, inputs=inputs)
    if rule.match_filter is not None and not rule.match_filter(found):
        return None
    return found


def find_rewrite_matches(
    graph_module: GraphModule, rules: ReplacementPattern | Sequence[ReplacementPattern]
) -> list[RewriteMatch]:
    """Non-overlapping occurrences of ``rules``, last anchor first.

    At each node the rules are tried in the matcher's priority order (:func:`sort_patterns`:
    larger patterns first, then the given order), so a list picks the same winner here as in
    ``find_matches``.
    """
    if not isinstance(graph_module, GraphModule):
        raise PatternError(
            f"expected a torch.fx.GraphModule, got {type(graph_module).__name__}; trace the "
            "model first, e.g. torch.fx.symbolic_trace(model)"
        )
    rule_list = [rules] if isinstance(rules, ReplacementPattern) else list(rules)
    for i, rule in enumerate(rule_list):
        if not isinstance(rule, ReplacementPattern):
            raise PatternError(
                f"rules[{i}]: expected a ReplacementPattern, got {type(rule).__name__}"
            )
    resolver = Resolver(graph_module)
    index: AnchorIndex[ReplacementPattern] = AnchorIndex(resolver)
    for position, rule in enumerate(sorted(rule_list, key=lambda r: r._priority)):
        index.add(position, rule._compiled, rule)
    claimed: set[Node] = set()
    found: list[RewriteMatch] = []
    for node in reversed(graph_module.graph.nodes):
        if node in claimed:
            continue
        for rule in index.candidates(node):
            match = _try(rule, node, resolver)
            if match is None or any(n in claimed for n in match.nodes):
                continue
            found.append(match)
            claimed.update(match.nodes)
            break
    return found


def _inline(graph: Graph, replacement: Graph, inputs: tuple[Any, ...]) -> Any:
    env: dict[Node, Any] = {}
    placeholders = iter(inputs)
    result: Any = None
    for node in replacement.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders)
        elif node.op == "output":
            result = torch.fx.node.map_arg(node.args[0], lambda n: env[n])
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    return result


def _inherit_meta(result: Node, anchor: Node, original: set[Node]) -> None:
    """Give the nodes a replacement created the anchor's meta (value meta: result only)."""
    shared = {k: v for k, v in anchor.meta.items() if k not in _VALUE_META}
    stack = [result]
    seen: set[Node] = set()
    while stack:
        node = stack.pop()
        if node in seen or node in original:
            continue
        seen.add(node)
        source = anchor.meta if node is result else shared
        for key, value in source.items():
            node.meta.setdefault(key, value)
        stack.extend(node.all_input_nodes)


def _erase_matched(graph: Graph, matched: Sequence[Node], erased: set[Node]) -> None:
    """Erase the replaced nodes; all their users were inside the match."""
    pending = list(matched)
    progress = True
    while pending and progress:
        progress = False
        for node in list(pending):
            if not node.users:
                graph.erase_node(node)
                erased.add(node)
                pending.remove(node)
                progress = True


def _erase_unused(graph: Graph, candidates: Sequence[Any], erased: set[Node]) -> None:
    """Erase what only replaced patterns used (constants, scale/zero-point getters, ...)."""
    stack = [v for v in candidates if isinstance(v, Node)]
    while stack:
        node = stack.pop()
        if node in erased or node.users or node.op in ("placeholder", "output"):
            continue
        if node.is_impure():
            continue
        parents = node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
        stack.extend(parents)


def replace_pattern(
    graph_module: GraphModule, rules: ReplacementPattern | Sequence[ReplacementPattern]
) -> list[RewriteMatch]:
    """Rewrite every non-overlapping occurrence of ``rules`` in place; returns the matches.

    Rules are tried in the order given at each node, nodes from the last to the first. The
    graph is linted and ``graph_module`` recompiled afterwards.
    """
    matches = find_rewrite_matches(graph_module, rules)
    graph = graph_module.graph
    original = set(graph.nodes)
    erased: set[Node] = set()
    freed: list[Any] = []
    for match in matches:
        rule = match.rule
        anchor = match.anchor
        with graph.inserting_before(anchor):
            if rule.build is not None:
                result = rule.build(match, graph)
            else:
                assert rule._replacement_graph is not None
                result = _inline(graph, rule._replacement_graph, match.inputs)
        if not isinstance(result, Node):
            raise PatternError(
                f"{rule.name or 'ReplacementPattern'}: the replacement for "
                f"{anchor.format_node()} produced {result!r}, not a graph node; return the "
                "node that takes the anchor's place"
            )
        if result in match.nodes and result is not anchor:
            raise PatternError(
                f"{rule.name or 'ReplacementPattern'}: the replacement returned the matched "
                f"node {result.name!r}, which is about to be erased"
            )
        if result is anchor:
            continue  # the callback decided to keep the anchor: nothing to replace
        _inherit_meta(result, anchor, original)
        anchor.replace_all_uses_with(result)
        _erase_matched(graph, match.nodes, erased)
        freed.extend(match.inputs)
    # Only now: an input of one match may be the anchor of another, still to be replaced.
    _erase_unused(graph, freed, erased)
    graph.lint()
    graph_module.recompile()
    return matches
