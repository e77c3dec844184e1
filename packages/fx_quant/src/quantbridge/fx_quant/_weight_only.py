"""Weight-only quantization of a model by module swap: decoder LLMs that must keep generating.

``quantize_weight_only`` walks the model's ``nn.Linear`` and ``nn.Embedding`` modules, looks
each one's qconfig up in the QConfigMapping (module name, regex, object type, global: the
same precedence as prepare), checks that the BackendConfig declares a weight-only
DTypeConfig for that module type that takes the qconfig's weight (dtype, range, group size),
and replaces it with the reference module holding the codes. Nothing is traced, so the
model's own ``forward`` and ``generate`` (its KV cache, sampling, stopping rules) run
unchanged; torch.fx and torch.export capture a graph of one call and would lose them.

A data-aware weight observer (``PerGroupGPTQObserver``, ``group_weight_only_qconfig(...,
method="gptq")``) makes its Linears' codes come from GPTQ (``_gptq.py``): one calibration pass
of the float model records each such Linear's input Hessian, then each is quantized.
"""

from __future__ import annotations

import copy
import itertools
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from quantbridge.fx_quant._calibrate import calibrate
from quantbridge.fx_quant._channel_max import replace_submodule
from quantbridge.fx_quant._dtype_matching import (
    ObserverProbe,
    constraint_violation,
    describe_dtype_config,
    is_per_group_observer,
)
from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._gptq import HessianRecorder, gptq_linear
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
    calibration_data: Iterable[Any] | None = None,
    input_fn: Callable[[Any], Any] | None = None,
    max_batches: int | None = None,
) -> nn.Module:
    """``model`` (a copy unless ``inplace``) with each ``nn.Linear`` / ``nn.Embedding`` whose
    qconfig is a per-group weight-only one (``group_weight_only_qconfig``) replaced by
    ``nn.reference.GroupQuantizedLinear`` / ``GroupQuantizedEmbedding``; modules whose
    qconfig is None stay float.

    GPTQ: the Linears whose weight observer is data-aware (``group_weight_only_qconfig(...,
    method="gptq")``) get their codes from GPTQ. ``calibration_data`` is then required: one
    pass of the float model over it (batches, ``input_fn`` and ``max_batches`` as in
    :func:`calibrate`) records each such Linear's inputs as ``H = sum x x^T`` (float32, one
    ``[in_features, in_features]`` matrix per Linear, held until the Linear is quantized; at
    most ``HESSIAN_BUDGET_BYTES``, 1 GiB, per pass: a model whose Hessians need more takes
    several passes, and an iterator given as ``calibration_data`` is read into a list), and
    each Linear is then quantized column by column, its rounding errors spread over the
    columns not yet quantized. Embeddings with a data-aware observer get min/max codes: a
    lookup returns the weights themselves, so there is no error for GPTQ to compensate and
    its result would be round-to-nearest. Without data-aware observers ``calibration_data``
    is not used.

    Raises FxQuantError naming the module when its qconfig is not weight-only per group, or
    when ``backend_config`` has no weight-only DTypeConfig for its type that takes the
    qconfig's weight (the message lists what the backend takes), or when it needs
    calibration data and none was given, or saw none. Everything is checked, and GPTQ run,
    before any module is swapped: an error leaves the model untouched. A backend lowers the
    result (the numba backends: ``quantize_weights`` does both steps).
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
    plan: list[_Planned] = []
    object_types = qconfig_mapping.object_type_qconfigs
    for name, module in result.named_modules():
        weighted = _swappable(module)
        if weighted is None:
            continue
        # a transposed Linear takes nn.Linear's qconfig unless the mapping names its type
        kind = type(module) if type(module) in object_types else type(weighted)
        qconfig = qconfig_mapping.qconfig_for(name, kind).qconfig
        if qconfig is None:
            continue
        entry = _Planned(name, module, weighted, qconfig)
        _check_weight_only(entry, backend_config, probe)
        plan.append(entry)
    gptq = [
        entry
        for entry in plan
        if type(entry.weighted) is nn.Linear
        and getattr(probe(entry.qconfig.weight), "data_aware", False)
    ]
    # GPTQ's modules first, then every swap: a rejected module leaves the model untouched.
    # Hessians are recorded for as many Linears per calibration pass as fit the budget.
    done: dict[str, nn.Module] = {}
    passes = _hessian_passes(gptq)
    if len(passes) > 1 and isinstance(calibration_data, Iterator):
        calibration_data = list(itertools.islice(calibration_data, max_batches))
    for linears in passes:
        hessians = _record_hessians(result, linears, calibration_data, input_fn, max_batches)
        for entry in linears:
            assert isinstance(entry.weighted, nn.Linear)
            assert entry.qconfig.weight is not None
            recorder = hessians.pop(entry.name)
            done[entry.name] = gptq_linear(
                entry.weighted, entry.qconfig.weight(), recorder, _where(entry)
            )
            del recorder
    for entry in plan:
        swapped = done.pop(entry.name, None)
        if swapped is None:
            make_observer = entry.qconfig.weight
            assert make_observer is not None  # checked: a per-group weight observer
            swapped = _SWAPPED[type(entry.weighted)].from_float(entry.weighted, make_observer())
        if entry.name:
            replace_submodule(result, entry.name, swapped)
        else:
            result = swapped
    return result


class _Planned(NamedTuple):
    """A module to quantize: as it is in the model (hooks go there), the ``nn.Linear`` /
    ``nn.Embedding`` it is quantized as (itself, or a transposed Linear's equivalent) and
    its qconfig."""

    name: str
    module: nn.Module
    weighted: nn.Module
    qconfig: QConfig


def _swappable(module: nn.Module) -> nn.Module | None:
    """The ``nn.Linear`` / ``nn.Embedding`` ``module`` is quantized as: itself; for Hugging
    Face's ``Conv1D`` (GPT-2's Linear, ``x @ weight + bias`` with ``weight [in, out]``) an
    ``nn.Linear`` holding the transposed weight; None for anything else."""
    if type(module) in _SWAPPED:
        return module
    utils = sys.modules.get("transformers.pytorch_utils")  # imported if the model holds one
    conv1d = getattr(utils, "Conv1D", None)
    if conv1d is None or type(module) is not conv1d:
        return None
    weight, bias = module.weight, getattr(module, "bias", None)
    assert isinstance(weight, torch.Tensor)
    linear = nn.Linear(weight.shape[0], weight.shape[1], bias is not None, device=weight.device)
    with torch.no_grad():
        linear.weight.copy_(weight.detach().T)
        if isinstance(bias, torch.Tensor):
            linear.bias.copy_(bias.detach())
    return linear


def _where(entry: _Planned) -> str:
    return f"quantize_weight_only: {entry.name or '<root>'} ({type(entry.module).__name__})"


# bytes of input Hessians (float32 [in_features, in_features] per Linear) one calibration pass
# records: a 7B decoder's would need tens of GB at once; more passes over the data instead
HESSIAN_BUDGET_BYTES = 1 << 30


def _hessian_passes(linears: list[_Planned]) -> list[list[_Planned]]:
    """``linears`` cut, in order, into runs whose Hessians fit HESSIAN_BUDGET_BYTES (at least
    one Linear a run)."""
    passes: list[list[_Planned]] = []
    used = HESSIAN_BUDGET_BYTES
    for entry in linears:
        assert isinstance(entry.weighted, nn.Linear)
        size = 4 * entry.weighted.in_features**2
        if used + size > HESSIAN_BUDGET_BYTES:
            passes.append([])
            used = 0
        passes[-1].append(entry)
        used += size
    return passes


def _record_hessians(
    model: nn.Module,
    linears: list[_Planned],
    calibration_data: Iterable[Any] | None,
    input_fn: Callable[[Any], Any] | None,
    max_batches: int | None,
) -> dict[str, HessianRecorder]:
    """One calibration pass of the (still float) ``model``: the input Hessian of each of
    ``linears``, by forward pre-hooks."""
    if not linears:
        return {}
    if calibration_data is None:
        more = f" (and {len(linears) - 1} more Linears)" if len(linears) > 1 else ""
        raise FxQuantError(
            f"{_where(linears[0])}{more}: its weight observer is data-aware (GPTQ) and "
            "needs the layer's inputs: pass calibration_data=... (an iterable of model inputs, "
            "as for calibrate), or use method='minmax'"
        )
    recorders: dict[str, HessianRecorder] = {}
    handles = []
    try:
        for entry in linears:
            assert isinstance(entry.weighted, nn.Linear)
            recorder = recorders[entry.name] = HessianRecorder(entry.weighted.in_features)
            handles.append(
                entry.module.register_forward_pre_hook(recorder.pre_hook, with_kwargs=True)
            )
        calibrate(model, calibration_data, input_fn=input_fn, max_batches=max_batches,
                  progress=False, sync=False)  # fmt: skip
    finally:
        for handle in handles:
            handle.remove()
    for entry in linears:
        if recorders[entry.name].tokens == 0:
            raise FxQuantError(
                f"{_where(entry)}: it received no input in the calibration pass, so "
                "GPTQ has nothing to fit; check that calibration_data runs it, or give it "
                "method='minmax' (or qconfig None)"
            )
    return recorders


def _check_weight_only(
    entry: _Planned, backend_config: BackendConfig, probe: ObserverProbe
) -> None:
    qconfig = entry.qconfig
    kind = type(entry.weighted)
    where = _where(entry)
    activation = probe(qconfig.activation)
    weight = probe(qconfig.weight)
    if getattr(activation, "dtype", None) != torch.float32 or not is_per_group_observer(weight):
        raise FxQuantError(
            f"{where}: its qconfig is not weight-only per group (activation "
            f"{type(activation).__name__} dtype {getattr(activation, 'dtype', None)}, weight "
            f"{type(weight).__name__}); use quantbridge.qconfig.group_weight_only_qconfig(...) "
            "for it, or set its qconfig to None to keep it float"
        )
    weight_param = entry.weighted.weight
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
