"""The lowering registry: backend name -> function that lowers a reference model.

``convert_fx(prepared, backend_config=bc)`` builds the reference model and, when a lowering
is registered under ``bc.name``, returns ``lowering(reference_model)``. Backends register in
code with :func:`register_lowering` or from an installed distribution through the entry-point
group ``quantbridge.backends`` (name = backend name, value = the lowering function), which is
read lazily on the first lookup of an unknown name (all of them, once; a plugin that fails to
load is reported by one warning and registers nothing). fx_quant never imports a backend
itself. When no lowering is registered, convert_fx returns the reference model and warns once
per process and name (:func:`warn_not_lowered`).
"""

from __future__ import annotations

import importlib.metadata
import threading
import warnings
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
_load_lock = threading.RLock()
_loading = False
# backend name -> why its plugin failed to load (kept for convert_fx's warning)
_load_failures: dict[str, str] = {}


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
    """Load every entry point, once. The loaded flag is set only after all were tried; a
    plugin that fails leaves nothing registered under its name and is reported by one warning
    (convert_fx then returns the reference model for that name and says why)."""
    global _entry_points_loaded, _loading
    with _load_lock:  # other threads wait until the load is complete
        if _entry_points_loaded or _loading:
            return  # _loading: a plugin being imported looked a name up; not there yet
        _loading = True
        try:
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                if ep.name not in _registry:  # code registrations win over installed ones
                    _load_one(ep)
        finally:
            _loading = False
            _entry_points_loaded = True


def _load_one(ep: importlib.metadata.EntryPoint) -> None:
    try:
        register_lowering(ep.name, ep.load())
    except Exception as e:  # a broken plugin must not break the others
        unregister_lowering(ep.name)  # whatever its failed import registered under the name
        dist = getattr(ep, "dist", None)
        source = f" from {dist.name} {dist.version}" if dist is not None else ""
        message = (
            f"quantbridge lowering plugin {ep.name!r} ({ep.value}{source}, entry-point group "
            f"{ENTRY_POINT_GROUP!r}) failed to load: {type(e).__name__}: {e}. convert_fx "
            f"returns the reference model for backend {ep.name!r} until the plugin is fixed "
            "or uninstalled"
        )
        _load_failures[ep.name] = message
        warnings.warn(message, RuntimeWarning, stacklevel=2)


def get_lowering(name: str) -> Lowering | None:
    """The lowering registered for backend ``name`` (entry points read once), else None.

    None also when the plugin that would provide it failed to load (warned once, at loading).
    """
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


# --- convert_fx without a lowering ------------------------------------------------------------

# torch.ao lowered these BackendConfigs to its x86/fbgemm/onednn engines; quantbridge-lowering
# registers its numba lowering under the same names.
TORCH_AO_CPU_CONFIGS = ("x86", "fbgemm", "onednn", "native")
_FAST_MODEL = (
    "for a fast CPU model, prepare and convert with quantbridge.lowering's numba backend: "
    "backend = get_backend('numba'); prepare_fx(model, backend.qconfig_mapping(), "
    "example_inputs, backend_config=backend.backend_config), then convert_fx(prepared)"
)
_NO_QUANTBRIDGE_ENGINE = {
    "qnnpack": "torch.ao ran it on its QNNPACK engine (ARM and mobile CPUs)",
    "executorch": "torch.ao left it to ExecuTorch to lower",
    "tensorrt": "torch.ao left it to TensorRT (GPUs) to lower",
}
_warned_names: set[str] = set()


def not_lowered_message(name: str) -> str:
    """Why convert_fx returned the reference model for a BackendConfig named ``name``."""
    returned = (
        "convert_fx returned the reference model (dequantize -> float op -> quantize on "
        "plain tensors: exact but slow)"
    )
    if not name:
        return (
            f"{returned}: the BackendConfig has no name, so no lowering can be looked up; "
            f"name it after a registered lowering, or {_FAST_MODEL}"
        )
    if name in _load_failures:
        return f"{returned} for backend {name!r}: {_load_failures[name]}"
    if name in TORCH_AO_CPU_CONFIGS:
        return (
            f"{returned} for backend {name!r}: no lowering is registered for it. torch.ao "
            f"lowered {name!r} to its quantized CPU engine; install quantbridge-lowering, "
            f"which lowers {name!r} to its numba kernels"
        )
    if name in _NO_QUANTBRIDGE_ENGINE:
        return (
            f"{returned} for backend {name!r}: {_NO_QUANTBRIDGE_ENGINE[name]}, and quantbridge "
            f"has no such lowering; {_FAST_MODEL}"
        )
    return (
        f"{returned} for backend {name!r}: no lowering is registered for it; register one "
        f"with quantbridge.fx_quant.register_lowering({name!r}, fn), install the plugin that "
        f"provides it, or {_FAST_MODEL}"
    )


def warn_not_lowered(name: str) -> None:
    """Warn that convert_fx returned the reference model: once per process and backend name."""
    with _lock:
        if name in _warned_names:
            return
        _warned_names.add(name)
    warnings.warn(not_lowered_message(name), UserWarning, stacklevel=3)
