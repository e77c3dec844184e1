"""Typed patterns: ``Chain`` (operators in execution order) and ``Nested`` (root first).

A bare tuple cannot say which order it is written in: ``(nn.Conv2d, nn.ReLU)`` is conv → relu
as a BackendConfig ``pattern`` but relu-feeding-conv in torch.ao's nested ("complex") form.
The APIs that take patterns therefore take one operator, a :class:`Chain` or a
:class:`Nested`, and refuse bare tuples (:func:`as_complex` says which constructor to use).
"""

from __future__ import annotations

import builtins
from typing import Any, TypeAlias

from quantbridge.patterns._errors import PatternError
from quantbridge.patterns._forms import (
    MatchAllNode,
    check_complex_pattern,
    describe_pattern_element,
    is_pattern_element,
)

__all__ = ["Chain", "Nested", "TypedPattern", "as_complex", "from_complex"]


def _element(op: object, where: str) -> object:
    if isinstance(op, tuple):
        raise PatternError(
            f"{where}: got the tuple {op!r}; inside a typed pattern write the sub-pattern as "
            "Nested(...) (or convert a torch.ao complex-format tuple with Nested.from_tuple)"
        )
    if isinstance(op, (Chain, Nested)) or not is_pattern_element(op):
        check_complex_pattern(op, where)  # raises the element error
    return op


def _name(element: object) -> str:
    if isinstance(element, Nested):
        return repr(element)
    if isinstance(element, str):
        return repr(element)
    text = describe_pattern_element(element)
    for prefix in ("torch.nn.modules.", "torch.nn.functional.", "torch.", "builtins."):
        if text.startswith(prefix):
            tail = text[len(prefix) :]
            return tail.split(".", 1)[1] if prefix == "torch.nn.modules." else tail
    return text


class Chain:
    """Operators in execution order, each feeding the next: ``Chain(nn.Conv2d, nn.ReLU)``.

    This is BackendConfig's ``pattern`` order. Every operator but the last must have its
    output used only by the next one.
    """

    __slots__ = ("_complex", "ops")
    ops: tuple[Any, ...]
    _complex: Any

    def __init__(self, *ops: object) -> None:
        if not ops:
            raise PatternError("Chain() needs at least one operator, e.g. Chain(nn.Conv2d)")
        for i, op in enumerate(ops):
            _element(op, f"Chain(...)[{i}]")
            if op is MatchAllNode:
                raise PatternError(
                    f"Chain(...)[{i}]: MatchAllNode stands for an input and has no place in a "
                    "chain; use Nested(op, ..., MatchAllNode) to leave an argument open"
                )
        object.__setattr__(self, "ops", tuple(ops))
        nested = self.to_nested()
        complex_form = nested.to_tuple() if isinstance(nested, Nested) else nested
        object.__setattr__(self, "_complex", complex_form)  # what the engines compile

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Chain is immutable")

    def to_nested(self) -> Nested | Any:
        """The same pattern root first: ``Chain(a, b, c)`` → ``Nested(c, Nested(b, a))``;
        a one-operator chain is that operator."""
        result: Any = self.ops[0]
        for op in self.ops[1:]:
            result = Nested(op, result)
        return result

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Chain) and other.ops == self.ops

    def __hash__(self) -> int:
        return hash((Chain, self.ops))

    def __repr__(self) -> str:
        return "Chain(" + ", ".join(_name(op) for op in self.ops) + ")"


class Nested:
    """An operator and one sub-pattern per positional argument, root (last node) first.

    ``Nested(nn.ReLU, Nested(operator.add, nn.Conv2d, MatchAllNode))`` is relu(add(conv(...),
    anything)). Arguments are operators, ``MatchAllNode`` (any value) or ``Nested``. This is
    torch.ao's "complex format"; :meth:`from_tuple` converts one of its tuples.
    """

    __slots__ = ("_complex", "args", "op")
    op: Any
    args: tuple[Any, ...]
    _complex: tuple[Any, ...]

    def __init__(self, op: object, *args: object) -> None:
        _element(op, "Nested(op, ...)")
        if op is MatchAllNode and args:
            raise PatternError(
                "Nested(MatchAllNode, ...): MatchAllNode stands for one input and takes no "
                "argument patterns; put it in an argument position, e.g. "
                "Nested(torch.add, nn.Conv2d, MatchAllNode)"
            )
        if op is builtins.getattr and (len(args) != 1 or not isinstance(args[0], str)):
            raise PatternError(
                f"Nested(getattr, ...): a getattr pattern is Nested(getattr, 'attribute_name'), "
                f"got {len(args)} argument(s)"
            )
        for i, arg in enumerate(args):
            if not isinstance(arg, Nested):
                _element(arg, f"Nested(...).args[{i}]")
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "args", tuple(args))
        complex_form = (op, *(a._complex if isinstance(a, Nested) else a for a in self.args))
        object.__setattr__(self, "_complex", complex_form)  # what the engines compile

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Nested is immutable")

    @classmethod
    def from_tuple(cls, pattern: object) -> Nested | Any:
        """A torch.ao complex-format tuple (``(nn.ReLU, (nn.BatchNorm2d, nn.Conv2d))``) as a
        typed pattern; a single operator is returned as it is."""
        check_complex_pattern(pattern, "Nested.from_tuple(pattern)")
        return from_complex(pattern)

    def to_tuple(self) -> tuple[Any, ...]:
        """torch.ao's complex-format tuple of this pattern."""
        return self._complex

    def to_chain(self) -> Chain:
        """The same pattern in execution order; PatternError unless it is a simple chain."""
        ops: list[Any] = []
        node: Any = self
        while isinstance(node, Nested):
            if len(node.args) != 1:
                raise PatternError(
                    f"{self!r} is not a chain: {node.op!r} takes {len(node.args)} argument "
                    "patterns, a chain has exactly one per operator"
                )
            ops.append(node.op)
            node = node.args[0]
        ops.append(node)
        if any(op is MatchAllNode for op in ops):
            raise PatternError(f"{self!r} uses MatchAllNode, which has no place in a Chain")
        return Chain(*reversed(ops))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Nested) and other.op == self.op and other.args == self.args

    def __hash__(self) -> int:
        return hash((Nested, self.op, self.args))

    def __repr__(self) -> str:
        return "Nested(" + ", ".join(_name(p) for p in (self.op, *self.args)) + ")"


TypedPattern: TypeAlias = "Chain | Nested | Any"
"""One operator, a :class:`Chain` or a :class:`Nested`."""


def from_complex(pattern: Any) -> Nested | Any:
    """A complex-format tuple as a typed pattern (no checks; see :meth:`Nested.from_tuple`)."""
    if not isinstance(pattern, tuple):
        return pattern
    if pattern[0] is builtins.getattr:
        return Nested(*pattern)
    return Nested(pattern[0], *(from_complex(p) for p in pattern[1:]))


def as_complex(pattern: object, where: str = "pattern") -> Any:
    """The complex-format form the matcher compiles: a tuple for ``Chain``/``Nested``, the
    operator itself for one operator. A bare tuple is refused with a PatternError naming the
    constructor to use."""
    if isinstance(pattern, Nested):
        return pattern._complex
    if isinstance(pattern, Chain):
        return pattern._complex
    if isinstance(pattern, tuple):
        raise PatternError(
            f"{where}: the bare tuple {pattern!r} is ambiguous; write Chain(...) for "
            "operators in execution order (Chain(nn.Conv2d, nn.ReLU): conv, then relu) or "
            "Nested(...) for root-first nested form (Nested(nn.ReLU, nn.Conv2d): the same "
            "pattern); Nested.from_tuple converts a torch.ao complex-format tuple"
        )
    check_complex_pattern(pattern, where)
    return pattern
