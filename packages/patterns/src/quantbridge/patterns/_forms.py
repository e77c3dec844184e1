"""Pattern forms: single operators, sequential tuples, and the reverse-nested complex form.

A *sequential* pattern lists operators in execution order, ``(nn.Conv2d, nn.BatchNorm2d,
nn.ReLU)``. The *complex* form starts from the last operator and nests its arguments:
``(nn.ReLU, (nn.BatchNorm2d, nn.Conv2d))``; an operator with several inputs lists one
sub-pattern per positional argument, and ``MatchAllNode`` stands for "any input".
"""

from __future__ import annotations

import types
from typing import Any, TypeAlias

import torch

from quantbridge.patterns._errors import PatternError


class MatchAllNode:
    """Pattern element that matches any node (used as the class itself, never instantiated)."""


# A pattern element or a (possibly nested) tuple of them; kept loose because torch ops,
# builtins, module classes and method-name strings all qualify.
Pattern: TypeAlias = Any

_CALLABLE_KINDS = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    torch._ops.OpOverload,
    torch._ops.OpOverloadPacket,
)


def is_pattern_element(element: object) -> bool:
    """True for anything that can stand for one graph node in a pattern."""
    if element is MatchAllNode:
        return True
    if isinstance(element, str):
        return bool(element)
    if isinstance(element, type):
        return issubclass(element, torch.nn.Module)
    if isinstance(element, torch.nn.Module):
        return False  # an instance; patterns name module classes
    if isinstance(element, _CALLABLE_KINDS):
        return True
    # functools.partial, boolean-dispatch wrappers and other callables that FX records as
    # call_function targets.
    return callable(element) and not isinstance(element, (tuple, type))


def describe_pattern_element(element: object) -> str:
    """Readable name of a pattern element for error messages and tables."""
    if isinstance(element, str):
        return repr(element)
    if element is MatchAllNode:
        return "MatchAllNode"
    module = getattr(element, "__module__", None)
    name = getattr(element, "__qualname__", None) or getattr(element, "__name__", None)
    if module and name:
        return f"{module}.{name}"
    return repr(element)


def _element_error(element: object, where: str) -> PatternError:
    kind = type(element).__name__
    if isinstance(element, torch.nn.Module):
        return PatternError(
            f"{where}: got an instance of {kind}; patterns name module classes, use {kind} "
            "itself (type(module))"
        )
    return PatternError(
        f"{where}: {element!r} (a {kind}) is not a pattern element; use an nn.Module subclass, "
        "a function or torch op, a method name string, or MatchAllNode"
    )


def check_sequential_pattern(pattern: Pattern, where: str = "pattern") -> None:
    """Raise PatternError unless ``pattern`` is one element or a flat tuple of elements."""
    if isinstance(pattern, tuple):
        if not pattern:
            raise PatternError(f"{where}: an empty tuple is not a pattern")
        for i, element in enumerate(pattern):
            if isinstance(element, tuple):
                raise PatternError(
                    f"{where}[{i}]: a sequential pattern holds operators, not the nested tuple "
                    f"{element!r}; nested patterns use the complex format"
                )
            if not is_pattern_element(element):
                raise _element_error(element, f"{where}[{i}]")
    elif not is_pattern_element(pattern):
        raise _element_error(pattern, where)


def check_complex_pattern(pattern: Pattern, where: str = "pattern") -> None:
    """Raise PatternError unless ``pattern`` is a valid reverse-nested complex pattern."""
    if isinstance(pattern, tuple):
        if not pattern:
            raise PatternError(f"{where}: an empty tuple is not a pattern")
        if isinstance(pattern[0], tuple):
            raise PatternError(
                f"{where}[0]: the first item of a complex pattern must be an operator, "
                f"got the tuple {pattern[0]!r}"
            )
        if not is_pattern_element(pattern[0]):
            raise _element_error(pattern[0], f"{where}[0]")
        for i, arg in enumerate(pattern[1:], start=1):
            check_complex_pattern(arg, f"{where}[{i}]")
    elif not is_pattern_element(pattern):
        raise _element_error(pattern, where)


def sequential_to_complex(pattern: Pattern) -> Pattern:
    """``(a, b, c, d)`` -> ``(d, (c, (b, a)))``; a single operator is returned unchanged.

    For 2- and 3-tuples this is torch.ao's reversed nested tuple conversion; longer tuples
    continue the same nesting.
    """
    check_sequential_pattern(pattern)
    if not isinstance(pattern, tuple):
        return pattern
    nested: Pattern = pattern[0]
    for op in pattern[1:]:
        nested = (op, nested)
    return nested


def complex_to_sequential(pattern: Pattern) -> Pattern:
    """Inverse of :func:`sequential_to_complex` for chains; a single operator is unchanged.

    Raises PatternError for complex patterns that are not a simple chain (an operator with
    several argument patterns, or MatchAllNode inside the chain).
    """
    check_complex_pattern(pattern)
    if not isinstance(pattern, tuple):
        return pattern
    chain: list[Pattern] = []
    node: Pattern = pattern
    while isinstance(node, tuple):
        if len(node) != 2:
            raise PatternError(
                f"complex pattern {pattern!r} is not a chain: {node!r} has {len(node) - 1} "
                "argument patterns, a sequential pattern needs exactly one per operator"
            )
        chain.append(node[0])
        node = node[1]
    chain.append(node)
    if any(op is MatchAllNode for op in chain):
        raise PatternError(
            f"complex pattern {pattern!r} uses MatchAllNode, which has no sequential form"
        )
    return tuple(reversed(chain))


def pattern_operators(pattern: Pattern) -> list[Pattern]:
    """Operators of a complex pattern in pre-order (root first), MatchAllNode excluded."""
    ops: list[Pattern] = []

    def walk(p: Pattern) -> None:
        if isinstance(p, tuple):
            if p[0] is not MatchAllNode:
                ops.append(p[0])
            if p[0] is getattr:
                return  # (getattr, "name"): the name is the attribute, not an operator
            for arg in p[1:]:
                walk(arg)
        elif p is not MatchAllNode:
            ops.append(p)

    walk(pattern)
    return ops
