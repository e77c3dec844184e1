"""The Backend base class and the backend registry.

A backend is a BackendConfig (what the flow may quantize and how), default qconfigs that satisfy
it, and a lowering pass that turns the reference model into something fast. A ``Backend``
instance is callable (``backend(reference_model)`` lowers), so it is directly a valid
fx_quant lowering function: registering a backend registers it in fx_quant's lowering registry
(``quantbridge.fx_quant.register_lowering``), the single registry of lowerings, and
``convert_fx(prepared, backend_config=backend.backend_config)`` then lowers with it.
Third-party distributions point an entry point of group ``quantbridge.backends`` at a Backend
instance; :func:`get_backend` finds those too.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule

from quantbridge.fx_quant import (
    convert_to_reference_fx,
    get_lowering,
    register_lowering,
    registered_lowerings,
    unregister_lowering,
)
from quantbridge.lowering._errors import LoweringError
from quantbridge.qconfig import (
    BackendConfig,
    DTypeConfig,
    QConfigMapping,
    get_default_qat_qconfig_mapping,
    get_default_qconfig_mapping,
)

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "SupportedOp",
    "available_backends",
    "get_backend",
    "register_backend",
    "unregister_backend",
]


class BackendUnavailableError(LoweringError):
    """A backend is known but cannot run here (CPU lacks its target, torch lacks its engine)."""


@dataclass(frozen=True)
class SupportedOp:
    """One row of a backend's support table: an op (pattern) and the modes it runs in.

    ``modes`` are short words: ``"static"`` (uint8 activations, int8 weights where the op has
    weights), ``"dynamic"`` (float activations quantized per call, int8 weights),
    ``"weight_only"``, ``"fp16"``, ``"fixed_qparams"``, ``"shared_qparams"``; ``kernel`` names
    what runs it (``"reference"`` means: stays dequantize → float op → quantize).
    """

    op: str
    modes: tuple[str, ...]
    kernel: str = ""


def _pattern_name(pattern: object) -> str:
    if isinstance(pattern, tuple):
        return "(" + ", ".join(_pattern_name(p) for p in pattern) + ")"
    if isinstance(pattern, type):
        return f"{pattern.__module__.split('.')[0]}.{pattern.__qualname__}".replace(
            "torch.", "nn.", 1
        )
    name = getattr(pattern, "__name__", None)
    if name is not None:
        return str(name)
    return str(pattern)


def _dtype_mode(dc: DTypeConfig) -> str:
    if dc.is_dynamic:
        return "dynamic" if dc.weight_dtype != torch.float16 else "dynamic_fp16"
    if dc.input_dtype == torch.float16:
        return "fp16"
    if dc.input_dtype in (None, torch.float32) and dc.weight_dtype is not None:
        return "weight_only"
    return "static"


class Backend:
    """A quantization backend: a BackendConfig, default qconfigs and a lowering pass.

    Subclass and override :meth:`lower` (and usually :meth:`qconfig_mapping`,
    :meth:`supported_ops`, :meth:`is_available`). The base class lowers nothing: ``lower``
    returns the reference model unchanged, which is what the ``reference`` backend does.

    ``backend_config.name`` should equal ``name`` so that
    ``convert_fx(prepared, backend_config=backend.backend_config)`` finds this backend in
    fx_quant's lowering registry.
    """

    def __init__(self, name: str, backend_config: BackendConfig, *, description: str = "") -> None:
        if not isinstance(name, str) or not name:
            raise LoweringError(f"Backend: name must be a non-empty string, got {name!r}")
        if not isinstance(backend_config, BackendConfig):
            raise LoweringError(
                f"Backend {name!r}: backend_config must be a quantbridge.qconfig.BackendConfig, "
                f"got {type(backend_config).__name__}"
            )
        self._name = name
        self._backend_config = backend_config
        self.description = description

    @property
    def name(self) -> str:
        """The registry name; also the name of :attr:`backend_config`."""
        return self._name

    @property
    def backend_config(self) -> BackendConfig:
        """What this backend can run, for ``prepare_fx``/``convert_fx``."""
        return self._backend_config

    def is_available(self) -> bool:
        """Whether this backend can run on this machine (CPU features, installed engines)."""
        return True

    def unavailable_reason(self) -> str:
        """Why :meth:`is_available` is False (empty when available)."""
        return ""

    def qconfig_mapping(self, qat: bool = False) -> QConfigMapping:
        """Default QConfigMapping whose qconfigs satisfy this backend's constraints.

        The base class returns torch.ao's x86 defaults (``reduce_range=True`` activations).
        """
        if qat:
            return get_default_qat_qconfig_mapping("x86")
        return get_default_qconfig_mapping("x86")

    def lower(self, reference_model: GraphModule) -> GraphModule:
        """Lower a reference model (output of ``convert_to_reference_fx``); base: unchanged."""
        self._check_lowerable(reference_model)
        return reference_model

    def convert(self, prepared_model: GraphModule) -> GraphModule:
        """``convert_to_reference_fx`` with this backend's config, then :meth:`lower`."""
        reference = convert_to_reference_fx(prepared_model, backend_config=self.backend_config)
        return self.lower(reference)

    def __call__(self, reference_model: GraphModule) -> GraphModule:
        return self.lower(reference_model)

    def supported_ops(self) -> list[SupportedOp]:
        """The op x mode table, read from :attr:`backend_config` unless a subclass knows more."""
        rows: dict[str, list[str]] = {}
        for cfg in self.backend_config.configs:
            op = _pattern_name(cfg.pattern if cfg.pattern is not None else cfg.complex_pattern)
            modes = rows.setdefault(op, [])
            for dc in cfg.dtype_configs:
                m = _dtype_mode(dc)
                if m not in modes:
                    modes.append(m)
        return [SupportedOp(op, tuple(modes), "") for op, modes in rows.items()]

    def support_table(self) -> str:
        """:meth:`supported_ops` as an aligned text table (op, modes, kernel)."""
        ops = self.supported_ops()
        header = ("op", "modes", "runs on")
        lines = [(o.op, ", ".join(o.modes), o.kernel) for o in ops]
        widths = [max([len(header[i])] + [len(r[i]) for r in lines]) for i in range(3)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
        out += [fmt.format(*r) for r in lines]
        return "\n".join(s.rstrip() for s in out)

    def _check_lowerable(self, reference_model: object) -> None:
        if not self.is_available():
            raise BackendUnavailableError(
                f"backend {self.name!r} cannot run on this machine: {self.unavailable_reason()}; "
                f"available backends: {available_backends()}"
            )
        if not isinstance(reference_model, GraphModule):
            raise LoweringError(
                f"backend {self.name!r}: lower() takes the GraphModule returned by "
                f"convert_to_reference_fx, got {type(reference_model).__name__}; call "
                "backend.convert(prepared_model) to convert and lower in one step"
            )

    def __repr__(self) -> str:
        state = "" if self.is_available() else f", unavailable: {self.unavailable_reason()}"
        return f"{type(self).__name__}(name={self.name!r}{state})"


_backends: dict[str, Backend] = {}
_lock = threading.Lock()


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Register ``backend`` under ``backend.name`` here and in fx_quant's lowering registry.

    Registering a different backend under a taken name is an error unless ``replace=True``.
    Returns ``backend`` so it can be used as an expression.
    """
    if not isinstance(backend, Backend):
        raise LoweringError(
            f"register_backend: expected a quantbridge.lowering.Backend instance, got "
            f"{type(backend).__name__}; plain lowering functions go to "
            "quantbridge.fx_quant.register_lowering"
        )
    with _lock:
        existing = _backends.get(backend.name)
        if existing is not None and existing is not backend and not replace:
            raise LoweringError(
                f"register_backend: a different backend {existing!r} is already registered as "
                f"{backend.name!r}; pass replace=True to override it"
            )
        _backends[backend.name] = backend
    register_lowering(backend.name, backend, replace=replace)
    return backend


def unregister_backend(name: str) -> None:
    """Remove a backend from both registries (no error if absent)."""
    with _lock:
        _backends.pop(name, None)
    unregister_lowering(name)


def _lookup(name: str) -> Backend | None:
    found = _backends.get(name)
    if found is not None:
        return found
    fn: Any = get_lowering(name)  # also loads the quantbridge.backends entry points
    if isinstance(fn, Backend):
        with _lock:
            _backends.setdefault(name, fn)
        return fn
    target = getattr(fn, "backend_name", None)  # TorchAoConfigLowering: a torch.ao config name
    if isinstance(target, str):
        raise LoweringError(
            f"get_backend({name!r}): {name!r} names a torch.ao BackendConfig "
            f"(quantbridge.fx_quant.get_backend_config({name!r})), not a backend; convert_fx "
            f"lowers models prepared with it using the {target!r} backend: "
            f"get_backend({target!r})"
        )
    if fn is not None:
        raise LoweringError(
            f"get_backend({name!r}): the lowering registered under {name!r} is "
            f"{getattr(fn, '__qualname__', fn)!r}, a plain function, not a "
            "quantbridge.lowering.Backend; it still lowers through convert_fx, but has no "
            "backend_config or qconfig_mapping to offer"
        )
    return None


def _all_backends() -> list[Backend]:
    found = dict(_backends)
    for name in registered_lowerings():  # entry points from other distributions
        if name not in found:
            fn: Any = get_lowering(name)
            if isinstance(fn, Backend):
                found[name] = fn
    return [found[n] for n in sorted(found)]


def available_backends() -> list[str]:
    """Names of the backends that can run on this machine, sorted."""
    return [b.name for b in _all_backends() if b.is_available()]


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; a clear error if unknown or unable to run here."""
    if not isinstance(name, str) or not name:
        raise LoweringError(f"get_backend: name must be a non-empty string, got {name!r}")
    backend = _lookup(name)
    if backend is None:
        raise LoweringError(
            f"get_backend: no backend named {name!r}; available backends: "
            f"{available_backends()} (third-party backends register through the "
            "'quantbridge.backends' entry point or quantbridge.lowering.register_backend)"
        )
    if not backend.is_available():
        raise BackendUnavailableError(
            f"get_backend: backend {name!r} cannot run on this machine: "
            f"{backend.unavailable_reason()}; available backends: {available_backends()}"
        )
    return backend
