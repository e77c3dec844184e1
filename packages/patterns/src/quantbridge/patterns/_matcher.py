"""The FX matcher: assign graph nodes to complex-format patterns, torch.ao style.

Decisions follow torch.ao 2.13's prepare-time matcher: nodes are visited from the last to the
first; each unclaimed node is tried against the patterns in priority order (tuple patterns
by decreasing size, then single operators, registration order breaking ties); the first
pattern that matches claims its nodes. Inner operator nodes must have exactly one user;
arguments are matched by position and their count must equal the pattern's; ``MatchAllNode``
accepts any argument.

What differs is the cost: patterns are indexed by the operator at their anchor (last node),
so a node is only tried against the patterns that can end there.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeAlias, TypeVar

import torch
from torch.fx import GraphModule, Node
from torch.nn.utils.parametrize import type_before_parametrizations

from quantbridge.patterns._errors import PatternError
from quantbridge.patterns._forms import MatchAllNode, Pattern
from quantbridge.patterns._typed import Chain, Nested, as_complex

# Nested structure of matched nodes as torch.ao records it: a list at the top, tuples for
# nested argument patterns, Nodes (or literals bound by MatchAllNode) at the leaves.
NodePattern: TypeAlias = Any
RootNodeGetter: TypeAlias = Callable[[Any], Any]
MatchMode: TypeAlias = Literal["prepare", "fuse"]


# Anchor kinds of the index.
_MODULE = 0
_FUNCTION = 1
_METHOD = 2
_ANY = 3


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


class _Compiled:
    """A pattern compiled for matching: what one node must be and what its arguments must be."""

    __slots__ = ("args", "attr", "ident", "is_getattr", "kind", "size")

    def __init__(
        self,
        kind: int,
        ident: object,
        args: tuple[_Compiled, ...] | None,
        is_getattr: bool = False,
        attr: object = None,
    ) -> None:
        self.kind = kind
        self.ident = ident
        self.args = args
        self.is_getattr = is_getattr
        self.attr = attr


def _element_key(element: Pattern) -> tuple[int, object]:
    if element is MatchAllNode:
        return (_ANY, None)
    if isinstance(element, type) and issubclass(element, torch.nn.Module):
        return (_MODULE, element)
    if callable(element):
        # Identity, as torch.ao compares call_function targets with ``is``.
        return (_FUNCTION, id(element))
    if isinstance(element, str):
        return (_METHOD, element)
    raise PatternError(f"unsupported pattern element {element!r}")  # pragma: no cover


def _compile(pattern: Pattern) -> _Compiled:
    if not isinstance(pattern, tuple):
        kind, ident = _element_key(pattern)
        return _Compiled(kind, ident, None)
    op, *rest = pattern
    kind, ident = _element_key(op)
    if kind == _ANY:
        raise PatternError(
            f"pattern {pattern!r}: MatchAllNode stands for one input and cannot take argument "
            "patterns; put it in an argument position, e.g. (torch.add, nn.Conv2d, MatchAllNode)"
        )
    if op is builtins.getattr:
        if len(pattern) != 2:
            raise PatternError(
                f"pattern {pattern!r}: a getattr pattern is (getattr, attribute_name), "
                f"got {len(pattern) - 1} items after getattr"
            )
        return _Compiled(kind, ident, None, is_getattr=True, attr=pattern[1])
    return _Compiled(kind, ident, tuple(_compile(arg) for arg in rest))


def _pattern_size(pattern: Pattern) -> int:
    if isinstance(pattern, tuple):
        return sum(_pattern_size(item) for item in pattern)
    return 1


def complex_priority(complex_form: Pattern) -> int:
    """Sort key of the one priority rule of matcher and rewriter, on a complex-format
    pattern: larger patterns first (``-size``, where ``MatchAllNode`` counts), single
    operators last."""
    return -_pattern_size(complex_form) if isinstance(complex_form, tuple) else 1


def sort_patterns(patterns: Iterable[Pattern]) -> list[Pattern]:
    """Patterns in matching priority: larger patterns first, then single operators.

    The sort is stable, so the given order breaks ties (torch.ao's rule). ``find_matches``
    and ``find_rewrite_matches`` both order their patterns this way.
    """
    return sorted(patterns, key=lambda p: complex_priority(as_complex(p)))


class _Resolver:
    """Maps a node to the anchor key the pattern index is keyed by."""

    def __init__(self, graph_module: GraphModule) -> None:
        self.modules = dict(graph_module.named_modules(remove_duplicate=False))
        self.module_types: dict[str, type] = {}

    def module_type(self, node: Node) -> type:
        target = node.target
        assert isinstance(target, str)
        cached = self.module_types.get(target)
        if cached is None:
            module = self.modules.get(target)
            if module is None:
                raise PatternError(
                    f"node {node.name!r} calls module {target!r}, which the GraphModule does "
                    "not have; the graph and its owning module are out of sync (recompile or "
                    "rebuild the GraphModule)"
                )
            # Only parametrized modules need the slower lookup of their original class.
            if "parametrizations" in module._modules:
                cached = type_before_parametrizations(module)
            else:
                cached = type(module)
            self.module_types[target] = cached
        return cached

    def key(self, node: Node) -> tuple[int, object] | None:
        op = node.op
        if op == "call_function":
            return (_FUNCTION, id(node.target))
        if op == "call_method":
            return (_METHOD, node.target)
        if op == "call_module":
            return (_MODULE, self.module_type(node))
        return None


_Key: TypeAlias = "tuple[int, object]"
_T = TypeVar("_T")


class AnchorIndex(Generic[_T]):
    """Patterns by the operator at their anchor, and by the operator their first argument
    must be (when the pattern names one): a node is only tried against the patterns that
    can match it, in priority order. Matcher and rewriter share it."""

    def __init__(self, resolver: _Resolver) -> None:
        self._resolver = resolver
        self._by_anchor: dict[_Key, list[tuple[int, _Key | None, _T]]] = {}
        self._wildcard: list[tuple[int, _Key | None, _T]] = []  # anchors matching any node
        self._needs_first: set[_Key] = set()  # anchors with a first-argument condition
        self._merged: dict[tuple[_Key | None, _Key | None], list[_T]] = {}

    def add(self, priority: int, anchor: _Key | None, first: _Key | None, item: _T) -> None:
        """``anchor`` None: the pattern's anchor is MatchAllNode (matches any node)."""
        entry = (priority, first, item)
        if anchor is None:
            if first is not None:
                raise PatternError("a MatchAllNode anchor takes no argument patterns")
            self._wildcard.append(entry)
        else:
            self._by_anchor.setdefault(anchor, []).append(entry)
            if first is not None:
                self._needs_first.add(anchor)
        self._merged.clear()

    def candidates(self, node: Node) -> list[_T]:
        key = self._resolver.key(node)
        first_key = None
        if key in self._needs_first:
            first = node.args[0] if node.args else None
            first_key = self._resolver.key(first) if isinstance(first, Node) else None
        found = self._merged.get((key, first_key))
        if found is None:
            own = self._by_anchor.get(key, []) if key is not None else []
            entries = sorted(own + self._wildcard, key=lambda e: e[0])
            found = [item for _, want, item in entries if want is None or want == first_key]
            self._merged[(key, first_key)] = found
        return found


def _node_fits(resolver: _Resolver, node: Node, c: _Compiled) -> bool:
    """Does ``node`` itself (not its arguments) fit the pattern operator ``c``?"""
    kind = c.kind
    if kind == _FUNCTION:
        if node.op != "call_function" or id(node.target) != c.ident:
            return False
        if c.is_getattr:
            return len(node.args) > 1 and bool(node.args[1] == c.attr)
        return True
    if kind == _MODULE:
        return node.op == "call_module" and resolver.module_type(node) is c.ident
    return node.op == "call_method" and node.target == c.ident


def _matches(resolver: _Resolver, value: object, c: _Compiled, inner: bool) -> bool:
    if c.kind == _ANY:
        return True
    if not isinstance(value, Node):
        return False
    if inner and len(value.users) > 1:
        return False
    if not _node_fits(resolver, value, c):
        return False
    args = c.args
    if not args:
        return True
    node_args = value.args
    if len(args) != len(node_args):
        return False
    # A plain loop: measurably cheaper than all() over a generator on this hot path.
    for sub, arg in zip(args, node_args, strict=True):  # noqa: SIM110
        if not _matches(resolver, arg, sub, True):
            return False
    return True


def _collect(
    c: _Compiled,
    value: Any,
    nodes: list[Node],
    inputs: list[Any],
    prepare_structure: list[Any],
) -> Any:
    """Gather the matched values of one (sub)pattern; returns its fusion-style structure.

    ``prepare_structure`` receives the prepare-style record (torch.ao's nesting rule: a
    single nested argument becomes a tuple, several arguments are spliced flat).
    """
    if c.kind == _ANY:
        inputs.append(value)
        prepare_structure.append(value)
        return value
    nodes.append(value)
    prepare_structure.append(value)
    if not c.args:
        return value
    below: list[Any] = []
    fused: list[Any] = [value]
    for sub, arg in zip(c.args, value.args, strict=True):
        fused.append(_collect(sub, arg, nodes, inputs, below))
    if len(below) > 1:
        if len(c.args) == 1:
            prepare_structure.append(tuple(below))
        else:
            prepare_structure.extend(below)
    else:
        prepare_structure.append(below[0])
    return tuple(fused)


def _record(
    c: _Compiled, anchor: Node, pattern: Pattern
) -> tuple[list[Node], list[Any], list[Any], list[Any]]:
    nodes: list[Node] = []
    inputs: list[Any] = []
    prepare: list[Any] = []
    fused = _collect(c, anchor, nodes, inputs, prepare)
    fused_top = list(fused) if isinstance(fused, tuple) else [fused]
    return nodes, inputs, prepare, fused_top


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

    resolver = _Resolver(graph_module)
    index: AnchorIndex[tuple[int, Pattern, _Compiled]] = AnchorIndex(resolver)
    for priority, (pattern, complex_form) in enumerate(ordered):
        compiled = _compile(complex_form)
        anchor = None if compiled.kind == _ANY else (compiled.kind, compiled.ident)
        first = compiled.args[0] if compiled.args else None
        first_key = None if first is None or first.kind == _ANY else (first.kind, first.ident)
        index.add(priority, anchor, first_key, (priority, pattern, compiled))

    claimed: set[Node] = set()
    claim_inputs = mode == "prepare"
    matches: list[Match] = []
    for node in reversed(graph_module.graph.nodes):
        if node in claimed:
            continue
        if is_ignored is not None and is_ignored(node):
            continue
        for priority, pattern, compiled in index.candidates(node):
            if not _matches(resolver, node, compiled, False):
                continue
            nodes, inputs, prepare, fused = _record(compiled, node, pattern)
            if is_ignored is not None and any(is_ignored(n) for n in nodes[1:]):
                continue
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
