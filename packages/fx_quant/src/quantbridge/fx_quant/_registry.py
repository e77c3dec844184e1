"""The backend registry: one name space of BackendConfigs, lowerings and backend objects.

Each name may have a BackendConfig factory (``get_backend_config``), a lowering
(``convert_fx`` calls it on the reference model), a backend object (anything with ``.name``,
``.backend_config`` and ``.lower``, such as quantbridge.lowering's backends) and the origin
of each. The seven torch.ao configs are built in. Installed distributions add names through
the entry-point group ``quantbridge.backends``: :meth:`BackendRegistry.load_entry_points`
loads them (a lookup of an unknown name calls it once). Each plugin loads as a transaction: if
it raises, whatever it registered is rolled back, one warning names it, and ``convert_fx``
says why that name was not lowered.
"""

from __future__ import annotations

import copy
import importlib.metadata
import re
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from torch.fx import GraphModule

from quantbridge.fx_quant._backend_configs import BUILTIN_BACKEND_CONFIGS
from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.qconfig import BackendConfig

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendEntry",
    "BackendLike",
    "BackendRegistry",
    "LoweringRegistryError",
    "backend_config_names",
    "backend_registry",
    "get_backend_config",
    "get_lowering",
    "register_backend_config",
    "register_lowering",
    "registered_lowerings",
    "unregister_lowering",
]

ENTRY_POINT_GROUP = "quantbridge.backends"

Lowering = Callable[[GraphModule], GraphModule]
BackendConfigFactory = Callable[[], BackendConfig]
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


class LoweringRegistryError(FxQuantError):
    """A backend, config or lowering could not be registered, loaded or run."""


@runtime_checkable
class BackendLike(Protocol):
    """What the registry and ``convert_fx(backend=...)`` need of a backend object."""

    @property
    def name(self) -> str: ...

    @property
    def backend_config(self) -> BackendConfig: ...

    def lower(self, reference_model: GraphModule) -> GraphModule: ...


@dataclass(frozen=True)
class BackendEntry:
    """What one name holds, and where each part came from."""

    name: str
    config: BackendConfigFactory | None = None
    lowering: Lowering | None = None
    backend: Any = None
    origin: str = ""
    config_from_backend: bool = False  # the config is the backend's: they go together


def _caller_module() -> str:
    """The first module up the stack outside the registries (who registered)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).startswith(
        ("quantbridge.fx_quant._registry", "quantbridge.lowering._backend")
    ):
        frame = frame.f_back
    return str(frame.f_globals.get("__name__", "?"))


class BackendRegistry:
    """Backends by name. Use the process-wide :data:`backend_registry`."""

    def __init__(self, builtins: dict[str, BackendConfigFactory]) -> None:
        self._entries: dict[str, BackendEntry] = {
            name: BackendEntry(name, config=factory, origin="built in (torch.ao 2.13's config)")
            for name, factory in builtins.items()
        }
        self._lock = threading.RLock()
        self._entry_points_loaded = False
        self._loading = False
        self._failures: dict[str, str] = {}

    # registering ----------------------------------------------------------------------------

    def register(
        self,
        name: str,
        *,
        config: BackendConfigFactory | None = None,
        lowering: Lowering | None = None,
        backend: Any = None,
        origin: str = "",
        replace_existing: bool = False,
    ) -> None:
        """Give ``name`` a config factory, a lowering and/or a backend object.

        A backend object brings its config (a copy per lookup) and, unless ``lowering`` is
        given, its ``lower``. Setting a part the name already has to something else is an
        error unless ``replace_existing``.
        """
        name = _check_name(name, "register")
        if backend is not None:
            if not isinstance(backend, BackendLike):
                raise LoweringRegistryError(
                    f"register({name!r}): the backend object {backend!r} needs .name, "
                    ".backend_config and .lower(reference_model)"
                )
            lowering = lowering or (backend if callable(backend) else backend.lower)
        if config is not None and (not callable(config) or isinstance(config, BackendConfig)):
            raise LoweringRegistryError(
                f"register({name!r}): config must be a function returning a new BackendConfig, "
                f"got {config!r}; pass e.g. lambda: my_backend_config()"
            )
        if lowering is not None and not callable(lowering):
            raise LoweringRegistryError(
                f"register({name!r}): the lowering must be callable, got {type(lowering).__name__}"
            )
        origin = origin or f"registered in code by {_caller_module()}"
        with self._lock:
            old = self._entries.get(name, BackendEntry(name))
            if backend is not None and config is None:
                # a name with a config of its own (x86, ...) keeps it; else the backend's
                keep = old.config is not None and not old.config_from_backend
                config = old.config if keep else (lambda: backend.backend_config)
                from_backend = not keep
            else:
                from_backend = False
            parts = {"config": config, "lowering": lowering, "backend": backend}
            for part, new in parts.items():
                current = getattr(old, part)
                if new is None or current is None or current == new or replace_existing:
                    continue
                if part == "config" and backend is not None and old.backend is backend:
                    continue
                raise LoweringRegistryError(
                    f"register({name!r}): a different {part} is already registered under "
                    f"{name!r} ({getattr(current, '__qualname__', current)!r}, {old.origin}); "
                    "pass replace=True to override it"
                )
            updates = {k: v for k, v in parts.items() if v is not None}
            new_config = config is not None and config is not old.config
            flag = from_backend if new_config else old.config_from_backend
            self._entries[name] = replace(old, **updates, origin=origin, config_from_backend=flag)
            self._failures.pop(name, None)

    def unregister(self, name: str, *parts: str) -> None:
        """Remove ``parts`` ("config", "lowering", "backend"; all if none) of ``name``."""
        with self._lock:
            old = self._entries.get(name)
            if old is None:
                return
            if not parts or set(parts) >= {"config", "lowering", "backend"}:
                del self._entries[name]
                return
            if "backend" in parts and old.config_from_backend:
                parts = (*parts, "config")
            cleared: dict[str, Any] = dict.fromkeys(parts)
            kept = replace(old, **cleared)
            if kept.config is None and kept.lowering is None and kept.backend is None:
                del self._entries[name]
            else:
                self._entries[name] = kept

    # looking up ----------------------------------------------------------------------------

    def entry(self, name: str, part: str = "") -> BackendEntry | None:
        """What ``name`` holds, else None. The entry points are loaded once first if the name
        is unknown, or lacks ``part`` ("config", "lowering" or "backend")."""
        _check_name(name, "entry")
        found = self._entries.get(name)
        lacking = found is None or (part and getattr(found, part) is None)
        if lacking and not self._entry_points_loaded:
            self.load_entry_points()
            found = self._entries.get(name)
        return found

    def backend_config(self, name: str) -> BackendConfig:
        """A new BackendConfig for ``name``."""
        if not isinstance(name, str):
            raise LoweringRegistryError(
                f"get_backend_config: the backend name must be a string, got {name!r}; "
                f"valid names are {', '.join(self.config_names())}"
            )
        entry = self.entry(name, "config") if name else None
        if entry is None or entry.config is None:
            why = f"; {self._failures[name]}" if name in self._failures else ""
            raise LoweringRegistryError(
                f"get_backend_config: unknown backend {name!r}; valid names are "
                f"{', '.join(self.config_names())} (register more with "
                f"register_backend_config(name, factory)){why}"
            )
        config = entry.config()
        if not isinstance(config, BackendConfig):
            raise LoweringRegistryError(
                f"get_backend_config({name!r}): the registered factory {entry.config!r} returned "
                f"{type(config).__name__}, not a quantbridge.qconfig.BackendConfig"
            )
        if entry.config_from_backend:  # a third-party backend may hand out its own object
            config = copy.deepcopy(config)
        return config

    def entries(self) -> dict[str, BackendEntry]:
        """Every name and what it holds, after loading the entry points."""
        self.load_entry_points()
        return dict(sorted(self._entries.items()))

    def names(self) -> list[str]:
        """Every registered name, after loading the entry points."""
        self.load_entry_points()
        return sorted(self._entries)

    def config_names(self) -> list[str]:
        """Names with a BackendConfig registered so far (entry points not loaded)."""
        return sorted(n for n, e in self._entries.items() if e.config is not None)

    def failure(self, name: str) -> str | None:
        """Why the plugin providing ``name`` failed to load, if it did."""
        return self._failures.get(name)

    # entry points --------------------------------------------------------------------------

    def load_entry_points(self) -> None:
        """Load every ``quantbridge.backends`` entry point not loaded yet, each as a
        transaction. Code registrations win over entry points of the same name."""
        with self._lock:  # other threads wait until the load is complete
            if self._entry_points_loaded or self._loading:
                return  # _loading: a plugin being imported looked a name up; not there yet
            self._loading = True
            try:
                for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                    existing = self._entries.get(ep.name)
                    if existing is None or existing.lowering is None:
                        self._load_one(ep)
            finally:
                self._loading = False
                self._entry_points_loaded = True

    def _load_one(self, ep: importlib.metadata.EntryPoint) -> None:
        dist = getattr(ep, "dist", None)
        source = f" from {dist.name} {dist.version}" if dist is not None else ""
        origin = f"entry point {ep.name} = {ep.value}{source}"
        before = dict(self._entries)
        try:
            value = ep.load()
            if isinstance(value, BackendLike):
                self.register(ep.name, backend=value, origin=origin)
            else:
                self.register(ep.name, lowering=value, origin=origin)
        except Exception as e:  # a broken plugin must not break the others
            self._entries = before  # never half-loaded: drop all it registered on import
            message = (
                f"quantbridge backend plugin {ep.name!r} ({ep.value}{source}, entry-point group "
                f"{ENTRY_POINT_GROUP!r}) failed to load: {type(e).__name__}: {e}. convert_fx "
                f"returns the reference model for backend {ep.name!r} until the plugin is fixed "
                "or uninstalled"
            )
            self._failures[ep.name] = message
            warnings.warn(message, RuntimeWarning, stacklevel=3)


def _check_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise LoweringRegistryError(
            f"{where}: {name!r} is not a valid backend name; use letters, digits, '_', '-' or "
            "'.', starting with a letter or '_' (e.g. 'my_backend')"
        )
    return name


backend_registry = BackendRegistry(BUILTIN_BACKEND_CONFIGS)
"""The process-wide registry behind every function below and ``convert_fx``."""


def get_backend_config(name: str) -> BackendConfig:
    """A new BackendConfig for the backend called ``name``: the seven torch.ao names
    (``"native"``, ``"fbgemm"``, ``"x86"``, ``"qnnpack"``, ``"onednn"``, ``"executorch"``,
    ``"tensorrt"``), installed backends such as ``"numba"``, or a registered name."""
    return backend_registry.backend_config(name)


def register_backend_config(
    name: str, factory: BackendConfigFactory, *, replace: bool = False
) -> None:
    """Make ``get_backend_config(name)`` call ``factory()`` (no arguments, a new BackendConfig)."""
    if isinstance(factory, BackendConfig):
        raise LoweringRegistryError(
            f"register_backend_config({name!r}): factory must be a function returning a "
            f"BackendConfig, got {factory!r}; pass e.g. lambda: my_backend_config()"
        )
    existing = backend_registry._entries.get(name)
    if existing is not None and existing.config is not None and not replace:
        raise LoweringRegistryError(
            f"register_backend_config: a backend config called {name!r} is already registered "
            f"under {name!r} ({existing.origin}); pass replace=True to replace it"
        )
    backend_registry.register(name, config=factory, replace_existing=replace)


def backend_config_names() -> list[str]:
    """The names :func:`get_backend_config` accepts (after loading the entry points), sorted."""
    backend_registry.load_entry_points()
    return backend_registry.config_names()


def register_lowering(backend_name: str, fn: Lowering, *, replace: bool = False) -> None:
    """Register ``fn(reference_model) -> lowered_model`` for configs named ``backend_name``."""
    if not callable(fn):
        raise LoweringRegistryError(
            f"register_lowering({backend_name!r}): fn must be callable, got {type(fn).__name__}"
        )
    backend_registry.register(backend_name, lowering=fn, replace_existing=replace)


def unregister_lowering(backend_name: str) -> None:
    """Remove a registered lowering (no error if absent)."""
    backend_registry.unregister(backend_name, "lowering", "backend")


def get_lowering(name: str) -> Lowering | None:
    """The lowering registered for backend ``name`` (entry points read once), else None."""
    entry = backend_registry.entry(name, "lowering")
    return None if entry is None else entry.lowering


def registered_lowerings() -> list[str]:
    """Names with a lowering (after reading the entry points)."""
    return [n for n, e in backend_registry.entries().items() if e.lowering is not None]


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
_lock = threading.Lock()


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
    failure = backend_registry.failure(name)
    if failure is not None:
        return f"{returned} for backend {name!r}: {failure}"
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
