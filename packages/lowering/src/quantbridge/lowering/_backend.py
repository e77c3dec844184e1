"""The Backend base class, and backends by name in fx_quant's one backend registry.

A backend is a BackendConfig (what the flow may quantize), default qconfigs that satisfy it,
and a lowering pass. ``register_backend`` puts it in ``quantbridge.fx_quant.backend_registry``
(config, lowering and object under one name); entry points of group ``quantbridge.backends``
that name a Backend instance are found the same way.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch.fx import GraphModule

from quantbridge.fx_quant import (
    LoweringRegistryError,
    backend_registry,
    convert_to_reference_fx,
)
from quantbridge.lowering._errors import LoweringError
from quantbridge.lowering._rules import dtype_mode
from quantbridge.qconfig import (
    BackendConfig,
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


class Backend:
    """A quantization backend: a BackendConfig, default qconfigs and a lowering pass.

    Subclass and override :meth:`lower` (and usually :meth:`qconfig_mapping`,
    :meth:`supported_ops`, :meth:`is_available`). The base class lowers nothing: ``lower``
    returns the reference model unchanged, which is what the ``reference`` backend does.

    ``backend_config.name`` should equal ``name`` so that
    ``convert_fx(prepared, backend_config=backend.backend_config)`` finds this backend in
    fx_quant's backend registry.
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
        """What this backend can run, for ``prepare_fx``/``convert_fx``: a new copy each time,
        so editing it never changes the backend."""
        return copy.deepcopy(self._backend_config)

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
        reference = convert_to_reference_fx(prepared_model, backend_config=self._backend_config)
        return self.lower(reference)

    def __call__(self, reference_model: GraphModule) -> GraphModule:
        return self.lower(reference_model)

    def supported_ops(self) -> list[SupportedOp]:
        """The op x mode table, read from :attr:`backend_config` unless a subclass knows more."""
        rows: dict[str, list[str]] = {}
        for cfg in self._backend_config.configs:
            op = _pattern_name(cfg.pattern if cfg.pattern is not None else cfg.complex_pattern)
            modes = rows.setdefault(op, [])
            for dc in cfg.dtype_configs:
                m = dtype_mode(dc)
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


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Register ``backend`` under ``backend.name`` in the backend registry (its config, its
    lowering and the object). A different backend under a taken name is an error unless
    ``replace=True``. Returns ``backend`` so it can be used as an expression."""
    if not isinstance(backend, Backend):
        raise LoweringError(
            f"register_backend: expected a quantbridge.lowering.Backend instance, got "
            f"{type(backend).__name__}; plain lowering functions go to "
            "quantbridge.fx_quant.register_lowering"
        )
    try:
        backend_registry.register(backend.name, backend=backend, replace_existing=replace)
    except LoweringRegistryError as e:
        raise LoweringError(f"register_backend: {e}") from e
    return backend


def unregister_backend(name: str) -> None:
    """Remove a backend (no error if absent); a built-in torch.ao config keeps its name."""
    backend_registry.unregister(name, "lowering", "backend")


def _lookup(name: str) -> Backend | None:
    entry = backend_registry.entry(name, "backend")  # may load the entry points
    if entry is None:
        return None
    if isinstance(entry.backend, Backend):
        return entry.backend
    if entry.lowering is not None:
        raise LoweringError(
            f"get_backend({name!r}): the lowering registered under {name!r} is "
            f"{getattr(entry.lowering, '__qualname__', entry.lowering)!r}, a plain function, "
            "not a quantbridge.lowering.Backend; it still lowers through convert_fx, but has "
            "no backend_config or qconfig_mapping to offer"
        )
    if entry.config is not None:
        raise LoweringError(
            f"get_backend({name!r}): {name!r} names a BackendConfig "
            f"(quantbridge.fx_quant.get_backend_config({name!r}), {entry.origin}) with no "
            "lowering: quantbridge has no kernels for it and convert_fx returns the reference "
            "model. For a fast CPU model use get_backend('numba')"
        )
    return None


def _all_backends() -> list[Backend]:
    found = []
    for name in backend_registry.names():
        entry = backend_registry.entry(name)
        if entry is not None and isinstance(entry.backend, Backend):
            found.append(entry.backend)
    return found


def available_backends() -> list[str]:
    """Names of the backends that can run on this machine, sorted (the torch.ao names that
    lower with another backend, ``get_backend("x86")`` etc., are left out)."""
    return [
        b.name
        for b in _all_backends()
        if b.is_available() and getattr(b, "lowers_with", None) is None
    ]


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
