"""The FX matcher: assign graph nodes to complex-format patterns, torch.ao style.

Decisions follow torch.ao 2.13's prepare-time matcher: nodes are visited from the last to the
first; each unclaimed node is tried against the patterns in priority order (tuple patterns
by decreasing size, then single operators, registration order breaking ties); the first
pattern that matches claims its nodes. Inner operator nodes must have exactly one user;
arguments are matched by position and their count must equal the pattern's; ``MatchAllNode``
accepts any argument.

What differs is the cost: patterns are indexed by the operator at their anchor (last node),
so a node is only tried against the patterns that can end there. Patterns are compiled and
matched as the rewriter's are (``_compiled``), read with torch.ao's rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from torch.fx import GraphModule, Node

from quantbridge.patterns._compiled import (
    AnchorIndex,
    Binding,
    Compiled,
    Op,
    Resolver,
    compile_complex,
    complex_priority,
    torch_ao_arguments,
)
from quantbridge.patterns._errors import PatternError
from quantbridge.patterns._forms import Pattern
from quantbridge.patterns._typed import Chain, Nested, as_complex

# Nested structure of matched nodes as torch.ao records it: a list at the top, tuples for
# nested argument patterns, Nodes (or literals bound by MatchAllNode) at the leaves.
NodePattern: TypeAlias = Any
RootNodeGetter: TypeAlias = Callable[[Any], Any]
MatchMode: TypeAlias = Literal["prepare", "fuse"]


@dataclass(frozen=True, eq=False)
class Match:
    """One pattern matched in a graph.

    ``nodes`` are the nodes matched by the pattern's operators in the pre-order of the
    complex pattern (the order of :func:`pattern_operators`, anchor first); ``inputs`` are the
    values bound by ``MatchAllNode`` in the same order. ``node_pattern`` is torch.ao's
    prepare-time nested structure of the matched nodes and ``nested_node_pattern`` its
    fusion-time structure (one tuple per nested pattern); ``root`` is what the root-node
    getter returned for this match.
    """

    pattern: Pattern
    nodes: tuple[Node, ...]
    anchor: Node
    root: Any
    inputs: tuple[Any, ...]
    node_pattern: NodePattern
    nested_node_pattern: NodePattern
    priority: int = field(default=0)

    @property
    def claimed(self) -> tuple[Node, ...]:
        """Nodes this match records in a node-name map: the operators, then the nodes bound
        by MatchAllNode (including nodes inside a bound list or tuple, as torch.ao does)."""
        return self.nodes + tuple(_nodes_in(self.inputs))


def _nodes_in(value: Any) -> list[Node]:
    """Nodes in a value, looking inside (nested) lists and tuples."""
    if isinstance(value, Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for item in value for n in _nodes_in(item)]
    return []


def default_root_node_getter(node_pattern: NodePattern) -> Any:
    """torch.ao's default root node: descend into the last item until reaching a leaf."""
    current = node_pattern
    while isinstance(current, (list, tuple)):
        if not current:
            return None
        current = current[-1]
    return current


def sort_patterns(patterns: Iterable[Pattern]) -> list[Pattern]:
    """Patterns in matching priority: larger patterns first, then single operators.

    The sort is stable, so the given order breaks ties (torch.ao's rule). ``find_matches``
    and ``find_rewrite_matches`` both order their patterns this way.
    """
    return sorted(patterns, key=lambda p: complex_priority(as_complex(p)))


def _matches(resolver: Resolver, node: Node, pattern: Compiled, inner: bool) -> Binding | None:
    """torch.ao's decision for one pattern at one node (``inner``: the node is an argument
    inside an enclosing match): what the pattern bound there, or None."""
    binding = Binding(resolver, torch_ao=True)
    return binding if binding.match(node, pattern, inner) else None


def _records(pattern: Compiled, value: Any, prepare: list[Any]) -> Any:
    """torch.ao's records of the values one matched (sub)pattern bound: appends the
    prepare-time record to ``prepare`` (a single nested argument becomes a tuple, several
    arguments are spliced flat) and returns the fusion-time one (a tuple per operator with
    argument patterns)."""
    prepare.append(value)
    args = torch_ao_arguments(pattern) if isinstance(pattern, Op) else ()
    if not args:
        return value
    below: list[Any] = []
    fused: list[Any] = [value]
    for sub, arg in zip(args, value.args, strict=True):
        fused.append(_records(sub, arg, below))
    if len(below) > 1:
        if len(args) == 1:
            prepare.append(tuple(below))
        else:
            prepare.extend(below)
    else:
        prepare.append(below[0])
    return tuple(fused)


def _normalize_patterns(
    patterns: Iterable[Pattern] | Mapping[Pattern, Any],
) -> list[tuple[Pattern, Pattern]]:
    """(pattern as given, its complex form) for each distinct pattern, in the given order."""
    if isinstance(patterns, (str, type, Chain, Nested)) or not isinstance(patterns, Iterable):
        raise PatternError(
            f"patterns must be an ordered collection of patterns (a list, tuple or dict keyed "
            f"by pattern), got {type(patterns).__name__} {patterns!r}; wrap a single pattern "
            "in a list"
        )
    if isinstance(patterns, tuple) and patterns and not isinstance(patterns[0], tuple):
        # (nn.Conv2d, nn.ReLU) reads as one pattern: ask for a list to be sure it is not
        raise PatternError(
            f"patterns {patterns!r} is a tuple of operators, which reads as one pattern; pass "
            "a list of patterns, e.g. [Chain(nn.Conv2d, nn.ReLU)] or [op1, op2]"
        )
    result: list[tuple[Pattern, Pattern]] = []
    seen: set[Pattern] = set()
    for i, pattern in enumerate(patterns):
        complex_form = as_complex(pattern, where=f"patterns[{i}]")
        try:
            hash(pattern)
        except TypeError:
            raise PatternError(
                f"patterns[{i}]: {pattern!r} is not hashable; pattern operators must be "
                "hashable (module classes, functions, torch ops, strings)"
            ) from None
        if pattern in seen:
            continue  # the first registration of a pattern wins, as with dict keys
        seen.add(pattern)
        result.append((pattern, complex_form))
    return result


def find_matches(
    graph_module: GraphModule,
    patterns: Iterable[Pattern] | Mapping[Pattern, Any],
    *,
    root_node_getters: Mapping[Pattern, RootNodeGetter] | None = None,
    is_ignored: Callable[[Node], bool] | None = None,
    mode: MatchMode = "prepare",
    presorted: bool = False,
) -> list[Match]:
    """Find non-overlapping matches of complex-format ``patterns`` in ``graph_module``.

    Args:
        graph_module: the traced model; ``call_module`` nodes resolve to the type of their
            module (the original type for parametrized modules).
        patterns: complex-format patterns (see :func:`sequential_to_complex`) in registration
            order; a mapping contributes its keys.
        root_node_getters: per-pattern function from ``Match.nested_node_pattern`` to the
            root node (BackendConfig's ``_root_node_getter`` functions fit); patterns without
            one use :func:`default_root_node_getter`.
        is_ignored: nodes for which this returns True are never matched by an operator
            (they may still be a ``MatchAllNode`` input); e.g. standalone or custom modules.
        mode: "prepare" follows torch.ao's prepare-time matcher, where a node bound by
            ``MatchAllNode`` is claimed by the match and is not matched again; "fuse" follows
            its fusion matcher, where such inputs stay free.
        presorted: the patterns are already in priority order; skip :func:`sort_patterns`.

    Returns:
        Matches in discovery order (anchors from the last node of the graph to the first).
        Rebuilding torch.ao's node-name map: for each match in order, map the name of every
        node in ``match.claimed`` to it (in "prepare" mode a later match can re-claim a
        ``MatchAllNode`` input, as torch.ao does).
    """
    if not isinstance(graph_module, GraphModule):
        raise PatternError(
            f"find_matches needs a torch.fx.GraphModule, got {type(graph_module).__name__}; "
            "trace the model first, e.g. torch.fx.symbolic_trace(model)"
        )
    if mode not in ("prepare", "fuse"):
        raise PatternError(f"mode must be 'prepare' or 'fuse', got {mode!r}")
    ordered = _normalize_patterns(patterns)
    if not presorted:
        ordered = sorted(ordered, key=lambda entry: complex_priority(entry[1]))
    getters = dict(root_node_getters or {})

    resolver = Resolver(graph_module)
    index: AnchorIndex[tuple[int, Pattern, Compiled, int]] = AnchorIndex(resolver)
    for priority, (pattern, complex_form) in enumerate(ordered):
        compiled, num_inputs = compile_complex(complex_form)
        index.add(priority, compiled, (priority, pattern, compiled, num_inputs))

    claimed: set[Node] = set()
    claim_inputs = mode == "prepare"
    matches: list[Match] = []
    for node in reversed(graph_module.graph.nodes):
        if node in claimed:
            continue
        if is_ignored is not None and is_ignored(node):
            continue
        for priority, pattern, compiled, num_inputs in index.candidates(node):
            binding = _matches(resolver, node, compiled, inner=False)
            if binding is None:
                continue
            nodes = binding.order
            if is_ignored is not None and any(is_ignored(n) for n in nodes[1:]):
                continue
            inputs = [binding.inputs[i] for i in range(num_inputs)]
            prepare: list[Any] = []
            nested = _records(compiled, node, prepare)
            fused = list(nested) if isinstance(nested, tuple) else [nested]  # a list on top
            # Getters get the fusion-style structure in both modes: BackendConfig root node
            # getters are written for it (torch.ao's prepare passes its flattened
            # structure instead, on which e.g. onednn's conv-bn-add getters fail).
            getter = getters.get(pattern, default_root_node_getter)
            matches.append(
                Match(
                    pattern=pattern,
                    nodes=tuple(nodes),
                    anchor=node,
                    root=getter(fused),
                    inputs=tuple(inputs),
                    node_pattern=prepare,
                    nested_node_pattern=fused,
                    priority=priority,
                )
            )
            claimed.update(nodes)
            if claim_inputs and inputs:
                claimed.update(_nodes_in(inputs))
            break
    return matches
