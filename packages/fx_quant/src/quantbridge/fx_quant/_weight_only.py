"""Weight-only quantization of a model by module swap: decoder LLMs that must keep generating.

``quantize_weight_only`` walks the model's ``nn.Linear`` and ``nn.Embedding`` modules, looks
each one's qconfig up in the QConfigMapping (module name, regex, object type, global: the
same precedence as prepare), checks that the BackendConfig declares a weight-only
DTypeConfig for that module type that takes the qconfig's weight (dtype, range, group size),
and replaces it with the reference module holding the codes. Nothing is traced, so the
model's own ``forward`` and ``generate`` (its KV cache, sampling, stopping rules) run
unchanged; torch.fx and torch.export capture a graph of one call and would lose them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from quantbridge.fx_quant._channel_max import replace_submodule
from quantbridge.fx_quant._dtype_matching import (
    ObserverProbe,
    constraint_violation,
    describe_dtype_config,
    is_per_group_observer,
)
from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant.nn.reference._grouped import (
    GroupQuantizedEmbedding,
    GroupQuantizedLinear,
)
from quantbridge.qconfig import (
    GROUP_SIZES,
    BackendConfig,
    DTypeConfig,
    QConfig,
    QConfigMapping,
)

__all__ = ["quantize_weight_only", "reject_per_group"]

_SWAPPED: dict[type[nn.Module], Any] = {
    nn.Linear: GroupQuantizedLinear,
    nn.Embedding: GroupQuantizedEmbedding,
}


def quantize_weight_only(
    model: nn.Module,
    qconfig_mapping: QConfigMapping,
    *,
    backend_config: BackendConfig,
    inplace: bool = False,
) -> nn.Module:
    """``model`` (a copy unless ``inplace``) with each ``nn.Linear`` / ``nn.Embedding`` whose
    qconfig is a per-group weight-only one (``group_weight_only_qconfig``) replaced by
    ``nn.reference.GroupQuantizedLinear`` / ``GroupQuantizedEmbedding``; modules whose
    qconfig is None stay float.

    Raises FxQuantError naming the module when its qconfig is not weight-only per group, or
    when ``backend_config`` has no weight-only DTypeConfig for its type that takes the
    qconfig's weight (the message lists what the backend takes). A backend lowers the result
    (the numba backends: ``quantize_weights`` does both steps).
    """
    if not isinstance(model, nn.Module):
        raise FxQuantError(
            f"quantize_weight_only: model must be an nn.Module, got {type(model).__name__}"
        )
    if not isinstance(qconfig_mapping, QConfigMapping):
        raise FxQuantError(
            "quantize_weight_only: qconfig_mapping must be a QConfigMapping, got "
            f"{type(qconfig_mapping).__name__}"
        )
    if not isinstance(backend_config, BackendConfig):
        raise FxQuantError(
            "quantize_weight_only: backend_config must be a BackendConfig, got "
            f"{type(backend_config).__name__}"
        )
    result = model if inplace else copy.deepcopy(model)
    probe = ObserverProbe()
    plan: list[tuple[str, nn.Module, QConfig]] = []
    for name, module in result.named_modules():
        kind = type(module)
        if kind not in _SWAPPED:
            continue
        qconfig = qconfig_mapping.qconfig_for(name, kind).qconfig
        if qconfig is None:
            continue
        _check_weight_only(name, module, qconfig, backend_config, probe)
        plan.append((name, module, qconfig))
    # checked first, swapped after: a rejected module leaves the model untouched
    for name, module, qconfig in plan:
        make_observer = qconfig.weight
        assert make_observer is not None  # checked: a per-group weight observer
        swapped = _SWAPPED[type(module)].from_float(module, make_observer())
        if name:
            replace_submodule(result, name, swapped)
        else:
            result = swapped
    return result


def _check_weight_only(
    name: str,
    module: nn.Module,
    qconfig: QConfig,
    backend_config: BackendConfig,
    probe: ObserverProbe,
) -> None:
    kind = type(module)
    where = f"quantize_weight_only: {name or '<root>'} ({kind.__name__})"
    activation = probe(qconfig.activation)
    weight = probe(qconfig.weight)
    if getattr(activation, "dtype", None) != torch.float32 or not is_per_group_observer(weight):
        raise FxQuantError(
            f"{where}: its qconfig is not weight-only per group (activation "
            f"{type(activation).__name__} dtype {getattr(activation, 'dtype', None)}, weight "
            f"{type(weight).__name__}); use quantbridge.qconfig.group_weight_only_qconfig(...) "
            "for it, or set its qconfig to None to keep it float"
        )
    weight_param = module.weight
    assert isinstance(weight_param, torch.Tensor)
    features = int(weight_param.shape[-1])
    if features % weight.group_size:
        fits = [g for g in GROUP_SIZES if features % g == 0]
        raise FxQuantError(
            f"{where}: its {features} input features are not a multiple of group_size "
            f"{weight.group_size}; give it a group size that divides them "
            f"({fits or 'none of ' + str(list(GROUP_SIZES)) + ' does'}) by module name, or "
            "keep it float (qconfig None)"
        )
    offered = [dc for cfg in backend_config.configs if cfg.pattern is kind
               for dc in cfg.dtype_configs if _weight_only(dc)]  # fmt: skip
    reasons = []
    for dc in offered:
        if dc.weight_dtype != weight.dtype:
            reasons.append(f"weight dtype {weight.dtype} != {dc.weight_dtype}")
            continue
        reason = constraint_violation(qconfig, dc.weight_dtype_with_constraints, "weight", probe)
        if reason is None:
            return
        reasons.append(reason)
    takes = "; ".join(_describe(dc) for dc in offered)
    raise FxQuantError(
        f"{where}: backend {backend_config.name!r} does not take this weight "
        f"({type(weight).__name__}, {weight.dtype} [{weight.quant_min}, {weight.quant_max}], "
        f"group_size {getattr(weight, 'group_size', None)}): "
        f"{'; '.join(reasons) or 'it declares no weight-only config for ' + kind.__name__}. "
        f"It takes: {takes or 'nothing'}. Choose one of those, or set this module's qconfig to "
        "None to keep it float"
    )


def _describe(dc: DTypeConfig) -> str:
    w = dc.weight_dtype_with_constraints
    return (
        f"{describe_dtype_config(dc)} [{w.quant_min_lower_bound}, {w.quant_max_upper_bound}] "
        f"group sizes {list(w.group_sizes or ())}"
    )


def _weight_only(dc: DTypeConfig) -> bool:
    return (
        dc.input_dtype == torch.float32
        and dc.output_dtype in (None, torch.float32)
        and not dc.is_dynamic
        and dc.weight_dtype_with_constraints.group_sizes is not None
    )


def reject_per_group(mapping: QConfigMapping, where: str) -> None:
    """FxQuantError when a qconfig of ``mapping`` quantizes weights per group: that is
    weight-only quantization by module swap, not a traced flow."""
    entries: list[tuple[str, Any]] = [("global", mapping.global_qconfig)]
    for label, table in (
        ("object type", mapping.object_type_qconfigs),
        ("module name regex", mapping.module_name_regex_qconfigs),
        ("module name", mapping.module_name_qconfigs),
        ("module name, object type and order", mapping.module_name_object_type_order_qconfigs),
    ):
        entries += [(f"{label} {key!r}", qconfig) for key, qconfig in table.items()]
    for label, qconfig in entries:
        if qconfig is None or qconfig.weight is None:
            continue
        weight = qconfig.weight()
        if is_per_group_observer(weight):
            raise FxQuantError(
                f"{where}: the qconfig of {label} quantizes weights per group "
                f"({weight.qscheme.value}): that is weight-only quantization of a model that keeps "
                "its own forward, done by module swap, not by tracing. Use "
                "quantbridge.fx_quant.quantize_weight_only(model, qconfig_mapping, "
                "backend_config=...) or a numba backend's quantize_weights(model, "
                "qconfig_mapping)"
            )
