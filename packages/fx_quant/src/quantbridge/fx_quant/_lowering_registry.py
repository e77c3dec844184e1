"""The lowering registry: backend name -> function that lowers a reference model.

``convert_fx(prepared, backend_config=bc)`` builds the reference model and, when a lowering
is registered under ``bc.name``, returns ``lowering(reference_model)``. Backends register in
code with :func:`register_lowering` or from an installed distribution through the entry-point
group ``quantbridge.backends`` (name = backend name, value = the lowering function), which is
read lazily on the first lookup of an unknown name. fx_quant never imports a backend itself.
"""

from __future__ import annotations

import importlib.metadata
import threading
from collections.abc import Callable

from torch.fx import GraphModule

from quantbridge.fx_quant._errors import FxQuantError

__all__ = [
    "ENTRY_POINT_GROUP",
    "LoweringRegistryError",
    "get_lowering",
    "register_lowering",
    "registered_lowerings",
    "unregister_lowering",
]

ENTRY_POINT_GROUP = "quantbridge.backends"

Lowering = Callable[[GraphModule], GraphModule]

_registry: dict[str, Lowering] = {}
_entry_points_loaded = False
_lock = threading.Lock()


class LoweringRegistryError(FxQuantError):
    """A lowering could not be registered, loaded or run."""


def _check_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise LoweringRegistryError(
            f"{where}: backend name must be a non-empty string, got {name!r}"
        )
    return name


def register_lowering(backend_name: str, fn: Lowering, *, replace: bool = False) -> None:
    """Register ``fn(reference_model) -> lowered_model`` for BackendConfigs named ``backend_name``.

    Registering a name twice with different functions is an error unless ``replace=True``.
    """
    name = _check_name(backend_name, "register_lowering")
    if not callable(fn):
        raise LoweringRegistryError(
            f"register_lowering({name!r}): fn must be callable, got {type(fn).__name__}"
        )
    with _lock:
        existing = _registry.get(name)
        if existing is not None and existing is not fn and not replace:
            raise LoweringRegistryError(
                f"register_lowering({name!r}): a different lowering "
                f"({getattr(existing, '__qualname__', existing)!r}) is already registered; pass "
                "replace=True to override it"
            )
        _registry[name] = fn


def unregister_lowering(backend_name: str) -> None:
    """Remove a registered lowering (no error if absent)."""
    with _lock:
        _registry.pop(backend_name, None)


def _load_entry_points() -> None:
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        found = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    for ep in found:
        if ep.name in _registry:
            continue  # code registrations win over installed defaults
        try:
            fn = ep.load()
        except Exception as e:
            raise LoweringRegistryError(
                f"entry point {ep.name!r} = {ep.value!r} in group {ENTRY_POINT_GROUP!r} failed "
                f"to load: {type(e).__name__}: {e}"
            ) from e
        register_lowering(ep.name, fn)


def get_lowering(name: str) -> Lowering | None:
    """The lowering registered for backend ``name`` (entry points consulted once), else None."""
    _check_name(name, "get_lowering")
    fn = _registry.get(name)
    if fn is None and not _entry_points_loaded:
        _load_entry_points()
        fn = _registry.get(name)
    return fn


def registered_lowerings() -> list[str]:
    """Names with a lowering (after reading the entry points)."""
    _load_entry_points()
    return sorted(_registry)
