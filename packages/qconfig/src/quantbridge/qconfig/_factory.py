"""Constructor factories: ``Observer.with_args(...)`` and ``Observer.with_callable_args(...)``.

A QConfig holds *factories*, not module instances: every observed node needs its own observer.
:class:`PartialWrapper` is that factory. Its contract (relied on by the JSON code):

* ``.p`` is a :class:`functools.partial` over the class (or function) that builds the module;
  ``.p.func``, ``.p.args`` and ``.p.keywords`` say what it builds and with which arguments.
* ``.callable_args`` maps keyword names to zero-argument callables, evaluated at every build
  (unless the caller passes that keyword itself).
* ``.with_args(**kw)`` and ``.with_callable_args(**kw)`` return a new factory with the extra
  arguments; the original is unchanged.

Unlike torch.ao, chaining keeps the factory flat: ``A.with_args(x=1).with_args(y=2).p`` is
``partial(A, x=1, y=2)`` rather than a partial over another wrapper. Building gives the same
module either way (later keywords win, as in torch.ao) and flat factories serialize cleanly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from quantbridge.qconfig._errors import QConfigError


class PartialWrapper:
    """A module factory: ``factory()`` builds a new instance with the stored arguments."""

    def __init__(self, p: functools.partial[Any]) -> None:
        if not isinstance(p, functools.partial):
            raise QConfigError(
                f"PartialWrapper needs a functools.partial, got {type(p).__name__}; build "
                "factories with Observer.with_args(...)"
            )
        self.p: functools.partial[Any] = p
        self.callable_args: dict[str, Callable[[], Any]] = {}

    def __call__(self, *args: Any, **keywords: Any) -> Any:
        for name, make in self.callable_args.items():
            if name not in keywords:  # an explicit keyword overrides the callable
                keywords[name] = make()
        return self.p(*args, **keywords)

    def with_args(self, **kwargs: Any) -> PartialWrapper:
        """A new factory with ``kwargs`` added (they override earlier values)."""
        result = PartialWrapper(functools.partial(self.p, **kwargs))
        result.callable_args = dict(self.callable_args)
        return result

    def with_callable_args(self, **kwargs: Callable[[], Any]) -> PartialWrapper:
        """A new factory whose ``kwargs`` are produced by calling each value at build time."""
        result = PartialWrapper(self.p)
        result.callable_args = {**self.callable_args, **kwargs}
        return result

    def __repr__(self) -> str:
        return repr(self.p) + repr(self.callable_args)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PartialWrapper):
            return NotImplemented
        return (
            self.p.func is other.p.func
            and self.p.args == other.p.args
            and self.p.keywords == other.p.keywords
            and self.callable_args == other.callable_args
        )

    def __hash__(self) -> int:
        # Keyword values may be unhashable; the names are enough to spread the buckets.
        return hash((self.p.func, len(self.p.args), frozenset(self.p.keywords)))


def with_args(cls_or_self: Callable[..., Any], **kwargs: Any) -> PartialWrapper:
    """A factory building ``cls_or_self(**kwargs)``; used as a classmethod on modules."""
    if isinstance(cls_or_self, PartialWrapper):
        return cls_or_self.with_args(**kwargs)
    return PartialWrapper(functools.partial(cls_or_self, **kwargs))


def with_callable_args(
    cls_or_self: Callable[..., Any], **kwargs: Callable[[], Any]
) -> PartialWrapper:
    """A factory whose ``kwargs`` are computed by calling each value at build time."""
    if isinstance(cls_or_self, PartialWrapper):
        return cls_or_self.with_callable_args(**kwargs)
    return PartialWrapper(functools.partial(cls_or_self)).with_callable_args(**kwargs)
