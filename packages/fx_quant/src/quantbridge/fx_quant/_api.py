"""The public entry points, with torch.ao 2.13's signatures (``quantize_fx``)."""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn
from torch.fx import GraphModule

from quantbridge.fx_quant._convert import convert_reference, observed_state
from quantbridge.fx_quant._custom_config import (
    ConvertCustomConfig,
    FuseCustomConfig,
    PrepareCustomConfig,
)
from quantbridge.fx_quant._dtype_matching import DTypeMismatch
from quantbridge.fx_quant._equalize import insert_equalization_observers
from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._export_capture import is_exported_module
from quantbridge.fx_quant._prepare import (
    check_capture,
    fuse_model,
    prepare,
    resolve_backend_config,
)
from quantbridge.fx_quant._registry import (
    BackendLike,
    LoweringRegistryError,
    backend_registry,
    warn_not_lowered,
)
from quantbridge.fx_quant._state import OBSERVED_KEY, ObservedState
from quantbridge.fx_quant._torch_ao_names import port_backend_config
from quantbridge.qconfig import BackendConfig, QConfigMapping

__all__ = ["convert_fx", "convert_to_reference_fx", "fuse_fx", "prepare_fx", "prepare_qat_fx"]


def fuse_fx(
    model: nn.Module,
    fuse_custom_config: FuseCustomConfig | dict[str, Any] | None = None,
    backend_config: BackendConfig | dict[str, Any] | None = None,
) -> GraphModule:
    """Fuse modules (conv-bn, conv-bn-relu, linear-relu, ...) as ``backend_config`` says.

    ``model`` is traced with the quantization tracer if it is not a GraphModule yet; modules
    should be in eval mode (batch norm is folded). Returns a GraphModule.
    """
    return fuse_model(model, False, fuse_custom_config, _backend_config(backend_config))


def prepare_fx(
    model: nn.Module,
    qconfig_mapping: QConfigMapping | dict[str, Any],
    example_inputs: tuple[Any, ...],
    prepare_custom_config: PrepareCustomConfig | dict[str, Any] | None = None,
    _equalization_config: QConfigMapping | dict[str, Any] | None = None,
    backend_config: BackendConfig | dict[str, Any] | None = None,
    *,
    strict: bool = False,
    capture: str = "fx",
) -> GraphModule:
    """Prepare ``model`` (eval mode) for post-training quantization: trace, fuse, insert observers.

    Run calibration data through the result, then call :func:`convert_to_reference_fx` or
    :func:`convert_fx`. ``strict=True`` raises :class:`StrictPrepareError` when a node with a
    qconfig would stay float (torch.ao skips it silently); :func:`explain` shows every decision.

    ``capture="export"`` captures the model with ``torch.export`` instead of
    ``torch.fx.symbolic_trace`` (for models fx cannot trace), with every input dimension
    dynamic where the model allows. The module of ``torch.export.export(...).module()`` is
    accepted as ``model`` directly; the mode it was exported in must be eval.
    """
    check_capture(capture, model)
    if model.training and not is_exported_module(model):
        raise FxQuantError(
            "prepare_fx is for post-training quantization and needs the model in eval mode; "
            "call model.eval() first, or use prepare_qat_fx for quantization-aware training"
        )
    prepared = prepare(
        model,
        qconfig_mapping,
        False,
        example_inputs,
        prepare_custom_config,
        _backend_config(backend_config),
        strict=strict,
        capture=capture,
    )
    if _equalization_config is not None:
        insert_equalization_observers(prepared, _equalization_config)
    _warn_ignored_qconfigs(prepared, "prepare_fx")
    return prepared


def prepare_qat_fx(
    model: nn.Module,
    qconfig_mapping: QConfigMapping | dict[str, Any],
    example_inputs: tuple[Any, ...],
    prepare_custom_config: PrepareCustomConfig | dict[str, Any] | None = None,
    backend_config: BackendConfig | dict[str, Any] | None = None,
    *,
    strict: bool = False,
    capture: str = "fx",
) -> GraphModule:
    """Prepare ``model`` (train mode) for quantization-aware training.

    Fuses for QAT (batch norm stays live), swaps float and fused modules for their
    quantbridge QAT versions and inserts fake quantizes. ``capture`` as in
    :func:`prepare_fx`; an exported module must have been exported in train mode.
    """
    check_capture(capture, model)
    if not model.training and not is_exported_module(model):
        raise FxQuantError(
            "prepare_qat_fx needs the model in training mode; call model.train() first, or "
            "use prepare_fx for post-training quantization"
        )
    prepared = prepare(
        model,
        qconfig_mapping,
        True,
        example_inputs,
        prepare_custom_config,
        _backend_config(backend_config),
        strict=strict,
        capture=capture,
    )
    _warn_ignored_qconfigs(prepared, "prepare_qat_fx")
    return prepared


def convert_to_reference_fx(
    graph_module: GraphModule,
    convert_custom_config: ConvertCustomConfig | dict[str, Any] | None = None,
    _remove_qconfig: bool = True,
    qconfig_mapping: QConfigMapping | dict[str, Any] | None = None,
    backend_config: BackendConfig | dict[str, Any] | None = None,
) -> GraphModule:
    """The reference quantized model: ``dequantize -> float op -> quantize`` with
    ``torch.ops.quantbridge`` ops on plain tensors and reference quantized modules.

    ``graph_module`` (the prepared, calibrated model) is converted in place, as in torch.ao.
    ``backend_config`` defaults to the one given to prepare.
    """
    return convert_reference(
        graph_module,
        convert_custom_config,
        _remove_qconfig,
        qconfig_mapping,
        None if backend_config is None else _backend_config(backend_config),
    )


def convert_fx(
    graph_module: GraphModule,
    convert_custom_config: ConvertCustomConfig | dict[str, Any] | None = None,
    _remove_qconfig: bool = True,
    qconfig_mapping: QConfigMapping | dict[str, Any] | None = None,
    backend_config: BackendConfig | dict[str, Any] | None = None,
    keep_original_weights: bool = False,
    *,
    backend: BackendLike | str | None = None,
) -> GraphModule:
    """The reference model, lowered by the lowering registered for ``backend_config.name``.

    ``backend`` (a backend object such as ``quantbridge.lowering.get_backend("numba")``, or a
    registered name) converts with its BackendConfig and lowers with it. Without a lowering
    the reference model is returned, with a warning (once per process and name) saying why
    and how to get a fast model. ``backend_config`` defaults to the one given to prepare.
    """
    state = observed_state(graph_module, "convert_fx")
    if backend is not None:
        return _convert_with_backend(
            graph_module, backend, backend_config, convert_custom_config, _remove_qconfig,
            qconfig_mapping,
        )  # fmt: skip
    bc = state.backend_config if backend_config is None else _backend_config(backend_config)
    reference = convert_reference(
        graph_module,
        convert_custom_config,
        _remove_qconfig,
        qconfig_mapping,
        bc,
        where="convert_fx",
    )
    entry = backend_registry.entry(bc.name, "lowering") if bc.name else None
    lowering = None if entry is None else entry.lowering
    if lowering is None:
        warn_not_lowered(bc.name)
        return reference
    return _checked_lowered(bc.name, lowering(reference))


def _convert_with_backend(
    graph_module: GraphModule,
    backend: BackendLike | str,
    backend_config: BackendConfig | dict[str, Any] | None,
    convert_custom_config: ConvertCustomConfig | dict[str, Any] | None,
    remove_qconfig: bool,
    qconfig_mapping: QConfigMapping | dict[str, Any] | None,
) -> GraphModule:
    if isinstance(backend, str):
        entry = backend_registry.entry(backend, "backend")
        if entry is None or entry.backend is None:
            known = [n for n, e in backend_registry.entries().items() if e.backend is not None]
            raise LoweringRegistryError(
                f"convert_fx(backend={backend!r}): no backend object is registered under that "
                f"name; registered backends: {known}"
            )
        backend = entry.backend
    if not isinstance(backend, BackendLike):
        raise LoweringRegistryError(
            f"convert_fx(backend=...): expected a backend object (.name, .backend_config, "
            f".lower) or a registered name, got {type(backend).__name__}"
        )
    bc = backend.backend_config
    if backend_config is not None:
        given = _backend_config(backend_config)
        if given.name != bc.name:
            raise LoweringRegistryError(
                f"convert_fx: backend={backend.name!r} converts with its own BackendConfig "
                f"({bc.name!r}), but backend_config={given.name!r} was given too; drop one of "
                "them"
            )
    reference = convert_reference(
        graph_module, convert_custom_config, remove_qconfig, qconfig_mapping, bc,
        where="convert_fx",
    )  # fmt: skip
    return _checked_lowered(backend.name, backend.lower(reference))


def _checked_lowered(name: str, lowered: object) -> GraphModule:
    if not isinstance(lowered, nn.Module):
        raise LoweringRegistryError(
            f"the lowering registered for backend {name!r} returned "
            f"{type(lowered).__name__}, not a module"
        )
    return lowered  # type: ignore[return-value]


def _backend_config(backend_config: BackendConfig | dict[str, Any] | None) -> BackendConfig:
    """The config to use (native by default), with torch.ao.nn classes replaced by
    quantbridge's equivalents (or refused with the class to use)."""
    return port_backend_config(resolve_backend_config(backend_config))


# shown per node in the warning; explain() has all of them
_LISTED = 5


def _warn_ignored_qconfigs(prepared: GraphModule, where: str) -> None:
    """One warning when the backend's constraints made prepare ignore some qconfigs.

    torch.ao warned, per DTypeConfig check, when a qconfig broke a constraint of a DTypeConfig
    with its own dtype (quant range, eps below scale_min, fixed qparams) and the node stayed
    float; a dtype no DTypeConfig has is skipped silently there, and here too (a default
    mapping puts static qconfigs on embeddings, for example).
    """
    state = prepared.meta.get(OBSERVED_KEY)
    if not isinstance(state, ObservedState):
        return
    ignored: list[str] = []
    for d in state.decisions:
        if d.qconfig is None or d.status != "float" or d.chosen is not None:
            continue
        broken = [r for _, r in d.candidates if r is not None and not isinstance(r, DTypeMismatch)]
        if broken:
            ignored.append(f"{d.node} ({broken[0]})")
    if not ignored:
        return
    shown = "; ".join(ignored[:_LISTED])
    more = f"; and {len(ignored) - _LISTED} more" if len(ignored) > _LISTED else ""
    warnings.warn(
        f"{where}: backend {state.backend_config.name!r} ignored the qconfig of "
        f"{len(ignored)} node(s), which stay float because the qconfig breaks the backend's "
        f"constraints: {shown}{more}. quantbridge.fx_quant.explain(prepared) shows every "
        "decision; strict=True raises instead",
        UserWarning,
        stacklevel=3,
    )
