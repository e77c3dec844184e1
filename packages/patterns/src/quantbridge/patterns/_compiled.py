"""Compiled patterns: the one form ``find_matches`` and the rewriter look for in a graph.

A pattern compiles to four kinds of parts: ``Op`` (a node calling one operator, with optional
patterns for its arguments), ``Input`` (any value: a ``MatchAllNode`` or a traced function's
parameter), ``Literal`` and ``Seq`` (a constant argument, a tuple or list of arguments).
:func:`compile_complex` compiles the complex format, :func:`compile_traced` a function traced
with torch.fx. :class:`Binding` matches a compiled pattern at a node, :class:`AnchorIndex`
picks the patterns worth trying there and :func:`complex_priority` orders them.
"""

from __future__ import annotations

import builtins
from typing import Any, Generic, TypeAlias, TypeVar

import torch
from torch.fx import GraphModule, Node
from torch.nn.utils.parametrize import type_before_parametrizations

from quantbridge.patterns._errors import PatternError
from quantbridge.patterns._forms import MatchAllNode, Pattern

# What an operator calls, which decides what its identity is compared with.
MODULE = 0  # call_module: the module's class
FUNCTION = 1  # call_function: id() of the target, as torch.ao compares targets with ``is``
METHOD = 2  # call_method: the method name

_GETATTR = id(builtins.getattr)

Key: TypeAlias = "tuple[int, object]"


class Op:
    """A node calling one operator; ``args`` / ``kwargs`` None means any arguments."""

    __slots__ = ("args", "ident", "kind", "kwargs")

    def __init__(
        self,
        kind: int,
        ident: object,
        args: tuple[Compiled, ...] | None,
        kwargs: dict[str, Compiled] | None = None,
    ) -> None:
        self.kind = kind
        self.ident = ident
        self.args = args
        self.kwargs = kwargs

    @property
    def key(self) -> Key:
        return (self.kind, self.ident)


class Input:
    """Any value; the same input met twice must be the same value. Index -1 binds nothing
    (the object of a ``(getattr, name)`` pattern)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class Literal:
    """A constant argument: equal and of the same type."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class Seq:
    """A tuple or list argument, item by item."""

    __slots__ = ("items", "kind")

    def __init__(self, kind: type, items: tuple[Compiled, ...]) -> None:
        self.kind = kind
        self.items = items


Compiled: TypeAlias = "Op | Input | Literal | Seq"


def _operator_key(op: Pattern) -> Key:
    # Module classes are callable too, so they are recognised first.
    if isinstance(op, type) and issubclass(op, torch.nn.Module):
        return (MODULE, op)
    if callable(op):
        return (FUNCTION, id(op))
    if isinstance(op, str):
        return (METHOD, op)
    raise PatternError(f"unsupported pattern element {op!r}")  # pragma: no cover


def compile_complex(pattern: Pattern) -> tuple[Compiled, int]:
    """A complex-format pattern compiled, and how many inputs it has.

    Each ``MatchAllNode`` is a new input, numbered in pre-order; ``(getattr, name)`` is
    getattr of any object with that name. A lone ``MatchAllNode`` compiles to an input,
    which ``find_matches`` tries at every node and the rewriter refuses.
    """
    inputs = 0

    def walk(p: Pattern) -> Compiled:
        nonlocal inputs
        op = p[0] if isinstance(p, tuple) else p
        if op is MatchAllNode:
            if isinstance(p, tuple):
                raise PatternError(f"{p!r}: MatchAllNode cannot take argument patterns")
            inputs += 1
            return Input(inputs - 1)
        kind, ident = _operator_key(op)
        if not isinstance(p, tuple):
            return Op(kind, ident, None)
        if op is builtins.getattr:
            return Op(kind, ident, (Input(-1), Literal(p[1])))
        return Op(kind, ident, tuple(walk(arg) for arg in p[1:]))

    root = walk(pattern)
    return root, inputs


def compile_traced(gm: GraphModule) -> tuple[Op, int]:
    """The operation a traced function returns, compiled with everything it reads, and how
    many inputs (parameters) it has. Literals and keyword arguments must be equal in the
    graph; an operation used twice in the function must be one node there."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    outputs = [n for n in gm.graph.nodes if n.op == "output"]
    result = outputs[0].args[0]
    if not isinstance(result, Node) or result.op not in (
        "call_function",
        "call_method",
        "call_module",
    ):
        raise PatternError(
            "pattern_fn must return the result of one operation (a single output node); got "
            f"{result!r}"
        )
    modules = dict(gm.named_modules(remove_duplicate=False))
    memo: dict[Node, Op] = {}

    def arg(value: Any) -> Compiled:
        if isinstance(value, Node):
            if value.op == "placeholder":
                return Input(placeholders[value])
            if value.op in ("call_function", "call_method", "call_module"):
                return op(value)
            raise PatternError(
                f"pattern_fn: node {value.format_node()} ({value.op}) is not supported in a "
                "pattern; pass tensors and constants as function parameters"
            )
        if isinstance(value, (tuple, list)):
            return Seq(type(value), tuple(arg(v) for v in value))
        return Literal(value)

    def op(node: Node) -> Op:
        found = memo.get(node)
        if found is not None:
            return found
        ident: object
        if node.op == "call_module":
            kind, ident = MODULE, type(modules[str(node.target)])
        elif node.op == "call_method":
            kind, ident = METHOD, node.target
        else:
            kind, ident = FUNCTION, id(node.target)
        compiled = Op(kind, ident, None)
        memo[node] = compiled
        compiled.args = tuple(arg(a) for a in node.args)
        compiled.kwargs = {k: arg(v) for k, v in node.kwargs.items()}
        return compiled

    return op(result), len(placeholders)


def operators(root: Compiled) -> list[Op]:
    """The distinct operators of a compiled pattern in pre-order, anchor first."""
    seen: list[Op] = []

    def walk(p: Compiled) -> None:
        if isinstance(p, Op):
            if any(p is s for s in seen):
                return
            seen.append(p)
            for sub in p.args or ():
                walk(sub)
            for sub in (p.kwargs or {}).values():
                walk(sub)
        elif isinstance(p, Seq):
            for sub in p.items:
                walk(sub)

    walk(root)
    return seen


def _attribute_name(p: Op) -> Literal | None:
    """The name of a ``(getattr, name)`` pattern."""
    if p.args and p.kind == FUNCTION and p.ident == _GETATTR:
        name = p.args[1]
        return name if isinstance(name, Literal) else None
    return None


def torch_ao_arguments(p: Op) -> tuple[Compiled, ...]:
    """The argument patterns torch.ao matches: none for an operator given alone or as
    ``(op,)`` (it takes any arguments) and none for ``(getattr, name)``, whose name torch.ao
    reads as part of the operator."""
    if p.args is None or _attribute_name(p) is not None:
        return ()
    return p.args


def _pattern_size(pattern: Pattern) -> int:
    if isinstance(pattern, tuple):
        return sum(_pattern_size(item) for item in pattern)
    return 1


def complex_priority(complex_form: Pattern) -> int:
    """Sort key of the one priority rule of matcher and rewriter, on a complex-format
    pattern: larger patterns first (``-size``, where ``MatchAllNode`` counts), single
    operators last."""
    return -_pattern_size(complex_form) if isinstance(complex_form, tuple) else 1


class Resolver:
    """What a graph's nodes call: the key of a node, as ``Op.key`` names an operator."""

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

    def key(self, node: Node) -> Key | None:
        op = node.op
        if op == "call_function":
            return (FUNCTION, id(node.target))
        if op == "call_method":
            return (METHOD, node.target)
        if op == "call_module":
            return (MODULE, self.module_type(node))
        return None


class Binding:
    """One attempt to match a compiled pattern at a node: the node each operator bound
    (``order``, pre-order) and the value each input bound.

    The matcher and the rewriter read a complex pattern differently. With ``torch_ao``
    (find_matches, torch.ao's decisions): every operator node but the anchor has exactly one
    user, an operator without argument patterns (:func:`torch_ao_arguments`) takes any
    arguments, and getattr's name is compared with ``==``. Without it (the rewriter):
    arguments are exactly as the pattern gives them, literals equal and of the same type,
    and the users of inner nodes are the caller's decision.
    """

    __slots__ = ("inputs", "operators", "order", "resolver", "torch_ao")

    def __init__(self, resolver: Resolver, *, torch_ao: bool) -> None:
        self.resolver = resolver
        self.torch_ao = torch_ao
        self.inputs: dict[int, Any] = {}
        self.operators: dict[int, Node] = {}  # id(Op) -> node
        self.order: list[Node] = []

    def match(self, value: Any, p: Compiled, inner: bool = False) -> bool:
        """Does ``value`` fit ``p``? ``inner``: value is an argument of a matched operator."""
        if isinstance(p, Op):
            return self._match_op(value, p, inner)
        if isinstance(p, Input):
            if p.index < 0:
                return True
            if p.index in self.inputs:
                bound = self.inputs[p.index]
                return bound is value or (
                    not isinstance(bound, Node)
                    and not isinstance(value, Node)
                    and type(bound) is type(value)
                    and bool(bound == value)
                )
            self.inputs[p.index] = value
            return True
        if isinstance(p, Literal):
            if isinstance(value, Node):
                return False
            expected = p.value
            return value is expected or (type(value) is type(expected) and bool(value == expected))
        return (
            isinstance(value, (tuple, list))
            and type(value) is p.kind
            and len(value) == len(p.items)
            and all(self.match(v, s, inner=True) for v, s in zip(value, p.items, strict=True))
        )

    def _match_op(self, value: Any, p: Op, inner: bool) -> bool:
        if not isinstance(value, Node):
            return False
        previous = self.operators.get(id(p))
        if previous is not None:  # an operation a traced pattern uses twice
            return previous is value
        if inner and self.torch_ao and len(value.users) > 1:
            return False
        if not self._fits(value, p):
            return False
        self.operators[id(p)] = value
        self.order.append(value)
        return self._arguments_fit(value, p)

    def _arguments_fit(self, node: Node, p: Op) -> bool:
        args = p.args
        if self.torch_ao:
            name = _attribute_name(p)
            if name is not None:
                return len(node.args) > 1 and bool(node.args[1] == name.value)
            args = torch_ao_arguments(p) or None  # no argument patterns: any arguments
        if args is not None:
            if len(args) != len(node.args):
                return False
            for sub, arg in zip(args, node.args, strict=True):
                if not self.match(arg, sub, inner=True):
                    return False
        if p.kwargs is not None:
            if set(p.kwargs) != set(node.kwargs):
                return False
            for key, sub in p.kwargs.items():
                if not self.match(node.kwargs[key], sub, inner=True):
                    return False
        return True

    def _fits(self, node: Node, p: Op) -> bool:
        """Does ``node`` itself (not its arguments) call ``p``'s operator?"""
        if p.kind == FUNCTION:
            return node.op == "call_function" and id(node.target) == p.ident
        if p.kind == METHOD:
            return node.op == "call_method" and node.target == p.ident
        return node.op == "call_module" and self.resolver.module_type(node) is p.ident


_T = TypeVar("_T")


class AnchorIndex(Generic[_T]):
    """Patterns by the operator at their anchor, and by the operator their first argument
    must be (when the pattern names one): a node is only tried against the patterns that
    can match it, in priority order. Matcher and rewriter share it."""

    def __init__(self, resolver: Resolver) -> None:
        self._resolver = resolver
        self._by_anchor: dict[Key, list[tuple[int, Key | None, _T]]] = {}
        self._wildcard: list[tuple[int, Key | None, _T]] = []  # anchors matching any node
        self._needs_first: set[Key] = set()  # anchors with a first-argument condition
        self._merged: dict[tuple[Key | None, Key | None], list[_T]] = {}

    def add(self, priority: int, pattern: Compiled, item: _T) -> None:
        """Index ``item`` under its compiled ``pattern``; an anchor that is an input
        (``MatchAllNode``) is tried at every node."""
        if isinstance(pattern, Op):
            first = pattern.args[0] if pattern.args else None
            first_key = first.key if isinstance(first, Op) else None
            self._by_anchor.setdefault(pattern.key, []).append((priority, first_key, item))
            if first_key is not None:
                self._needs_first.add(pattern.key)
        else:
            self._wildcard.append((priority, None, item))
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
