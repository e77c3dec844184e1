"""QConfig: which observer (or fake quantize) constructors quantize a layer's activation and weight.

A QConfig holds *constructors*, never observer instances: the flow builds one fresh observer
per observed value. Constructors are observer classes, the factories returned by
``Observer.with_args(...)`` (objects with a ``functools.partial`` in ``.p``), or plain
``functools.partial`` objects.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias

import torch

from quantbridge.qconfig._errors import QConfigError

ObserverConstructor: TypeAlias = Callable[..., Any]


def _check_constructor(value: object, field: str) -> None:
    if value is None:  # allowed, as in torch.ao: e.g. no weight observer for weightless ops
        return
    if isinstance(value, torch.nn.Module):
        raise QConfigError(
            f"QConfig.{field}: got an observer instance ({type(value).__name__}); QConfig needs "
            "a constructor because the flow creates one observer per observed value. Pass the "
            f"class, e.g. {type(value).__name__}, or {type(value).__name__}.with_args(...) "
            "to override constructor arguments"
        )
    if not callable(value):
        raise QConfigError(
            f"QConfig.{field}: {value!r} (a {type(value).__name__}) is not an observer "
            "constructor; pass an observer or fake-quantize class, Observer.with_args(...), "
            "a functools.partial, or None"
        )


class _QConfigFields(NamedTuple):
    activation: ObserverConstructor | None
    weight: ObserverConstructor | None


class QConfig(_QConfigFields):
    """Observer constructors for a layer's activations and weight: ``QConfig(activation, weight)``.

    A named tuple like torch.ao's ``QConfig``. Either field may be None (torch.ao uses
    ``weight=None`` for weightless operators); observer instances and other non-callables are
    rejected with :class:`QConfigError` (a ``ValueError``, as torch.ao raises).
    """

    __slots__ = ()

    def __new__(
        cls, activation: ObserverConstructor | None, weight: ObserverConstructor | None
    ) -> QConfig:
        _check_constructor(activation, "activation")
        _check_constructor(weight, "weight")
        return super().__new__(cls, activation, weight)


QConfigAny: TypeAlias = QConfig | None


def as_qconfig(value: object, where: str = "qconfig") -> QConfigAny:
    """``value`` as a QConfig (or None).

    Other ``(activation, weight)`` named tuples, such as torch.ao's ``QConfig``, are converted;
    anything else raises QConfigError naming ``where``.
    """
    if value is None:
        return None
    if isinstance(value, QConfig):
        try:  # _replace() and _make() bypass __new__'s checks
            _check_constructor(value.activation, "activation")
            _check_constructor(value.weight, "weight")
        except QConfigError as e:
            raise QConfigError(f"{where}: {e}") from None
        return value
    if isinstance(value, tuple) and len(value) == 2 and hasattr(value, "activation"):
        try:
            return QConfig(value[0], value[1])
        except QConfigError as e:
            raise QConfigError(f"{where}: {e}") from None
    raise QConfigError(
        f"{where}: expected a QConfig or None, got {value!r} (a {type(value).__name__}); "
        "build one with QConfig(activation=..., weight=...)"
    )


def _partial_of(ctor: object) -> functools.partial[Any] | None:
    """The functools.partial behind a ``with_args`` factory or a plain partial, else None."""
    if isinstance(ctor, functools.partial):
        return ctor
    p = getattr(ctor, "p", None)
    return p if isinstance(p, functools.partial) else None


def constructor_equals(a: object, b: object) -> bool:
    """Whether two observer constructors build the same observers.

    ``functools.partial`` has identity equality, so factories are compared by their function,
    positional arguments and keywords (recursively, so a fake quantize built with an observer
    factory compares its observer by value) and their ``callable_args``.
    """
    pa, pb = _partial_of(a), _partial_of(b)
    if pa is None or pb is None:
        return bool(a == b)
    if pa.func != pb.func or len(pa.args) != len(pb.args):
        return False
    if not all(constructor_equals(x, y) for x, y in zip(pa.args, pb.args, strict=True)):
        return False
    ka, kb = pa.keywords, pb.keywords
    if ka.keys() != kb.keys():
        return False
    if not all(constructor_equals(ka[k], kb[k]) for k in ka):
        return False
    ca = getattr(a, "callable_args", None) or {}
    cb = getattr(b, "callable_args", None) or {}
    return bool(ca == cb)


def qconfig_equals(q1: object, q2: object) -> bool:
    """True when two qconfigs (or None) use equal activation and weight constructors.

    Like torch.ao's ``qconfig_equals``: factories compare by class and arguments, not identity.
    """
    if q1 is None or q2 is None:
        return q1 is q2
    try:
        return constructor_equals(q1.activation, q2.activation) and constructor_equals(  # type: ignore[attr-defined]
            q1.weight,  # type: ignore[attr-defined]
            q2.weight,  # type: ignore[attr-defined]
        )
    except AttributeError:
        return bool(q1 == q2)
