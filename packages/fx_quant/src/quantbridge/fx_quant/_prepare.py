"""prepare: trace, fuse, assign qconfigs, match the backend's patterns, insert observers.

The steps of torch.ao 2.13's ``prepare_fx``/``prepare_qat_fx``; see ``_observer_insertion``
for where observers go and ``_dtype_matching`` for which qconfigs a backend accepts. Every
decision is recorded on the observed model (``explain`` prints it); ``strict=True`` turns
"this node has a qconfig but stays float" into an error instead of a silent skip.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Interpreter, Node
from torch.nn.utils.parametrize import type_before_parametrizations

from quantbridge.fx_quant._custom_config import (
    FuseCustomConfig,
    PrepareCustomConfig,
    QuantType,
)
from quantbridge.fx_quant._dtype_matching import ObserverProbe, describe_dtype_config
from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._export_capture import (
    CAPTURES,
    ExportCaptureError,
    capture_export,
    exported_mode,
    is_exported_module,
    lift_exported,
)
from quantbridge.fx_quant._fuse import fuse
from quantbridge.fx_quant._observer_insertion import (
    NoTensorCache,
    PatternMatch,
    count_tensor_args,
    describe_non_float_observations,
    insert_observers,
    non_float_observations,
)
from quantbridge.fx_quant._qconfig_propagation import (
    copy_mapping,
    module_to_qat_module,
    node_qconfigs,
    propagate_module_qconfigs,
    update_qconfig_for_fusion,
    update_qconfig_for_qat,
)
from quantbridge.fx_quant._state import OBSERVED_KEY, NodeDecision, ObservedState, SwappedModule
from quantbridge.fx_quant._tracer import trace
from quantbridge.fx_quant._transformer_swap import (
    ATTENTION_CORE_REASON,
    attention_core_reason,
    swap_transformer_modules,
)
from quantbridge.fx_quant._weight_only import reject_per_group
from quantbridge.fx_quant.nn.intrinsic import FusedModule
from quantbridge.fx_quant.nn.quantizable import FLOAT_ONLY, OutlierSplitLinear
from quantbridge.patterns import Nested, describe_pattern_element, find_matches
from quantbridge.qconfig import BackendConfig, QConfigAny, QConfigMapping

__all__ = [
    "PREPARED_ATTRS_KEY",
    "StrictPrepareError",
    "attach_preserved_attributes",
    "fuse_model",
    "prepare",
    "resolve_backend_config",
]

PREPARED_ATTRS_KEY = "_quantbridge_preserved_attributes"
# Reason for nodes with no tensor data to quantize (shape and size queries, int arithmetic).
_NO_TENSOR_DATA = "no tensor data (shape or size query)"
# Reason for nodes that only move integer data (an attention mask sliced and reshaped).
_INTEGER_DATA = "integer tensor from integer inputs: nothing to quantize"


class StrictPrepareError(FxQuantError):
    """``prepare_fx(..., strict=True)``: nodes with a qconfig would have stayed float."""


class ExampleInputsError(FxQuantError):
    """``example_inputs`` do not fit the model."""


def resolve_backend_config(backend_config: BackendConfig | dict[str, Any] | None) -> BackendConfig:
    """The BackendConfig to use: the given one (dicts converted) or the native default."""
    if backend_config is None:
        try:
            from quantbridge.fx_quant._backend_configs import (  # type: ignore[import-not-found,unused-ignore]
                get_native_backend_config,
            )
        except ImportError:
            raise FxQuantError(
                "no backend_config given and the built-in native BackendConfig is not "
                "available in this build; pass backend_config=..."
            ) from None
        result: BackendConfig = get_native_backend_config()
        return result
    if isinstance(backend_config, dict):
        warnings.warn(
            "passing a BackendConfig as a dict is deprecated (as in torch.ao); pass a "
            "BackendConfig",
            FutureWarning,
            stacklevel=3,
        )
        return BackendConfig.from_dict(backend_config)
    if not isinstance(backend_config, BackendConfig):
        raise FxQuantError(
            f"backend_config must be a quantbridge.qconfig.BackendConfig, got "
            f"{type(backend_config).__name__}"
        )
    return backend_config


def _as_prepare_config(config: PrepareCustomConfig | dict[str, Any] | None) -> PrepareCustomConfig:
    if config is None:
        return PrepareCustomConfig()
    if isinstance(config, dict):
        return PrepareCustomConfig.from_dict(config)
    if not isinstance(config, PrepareCustomConfig):
        raise FxQuantError(
            f"prepare_custom_config must be a PrepareCustomConfig, got {type(config).__name__}"
        )
    return config


def attach_preserved_attributes(model: GraphModule, attributes: dict[str, Any]) -> None:
    model.meta[PREPARED_ATTRS_KEY] = dict(attributes)
    for name, value in attributes.items():
        setattr(model, name, value)


def _preserved(model: nn.Module, names: list[str]) -> dict[str, Any]:
    return {name: getattr(model, name) for name in names if hasattr(model, name)}


def fuse_model(
    model: nn.Module,
    is_qat: bool,
    fuse_custom_config: FuseCustomConfig | dict[str, Any] | None,
    backend_config: BackendConfig | dict[str, Any] | None,
) -> GraphModule:
    """fuse_fx's body: trace if needed, fuse, keep preserved attributes."""
    if fuse_custom_config is None:
        fuse_custom_config = FuseCustomConfig()
    elif isinstance(fuse_custom_config, dict):
        fuse_custom_config = FuseCustomConfig.from_dict(fuse_custom_config)
    bc = resolve_backend_config(backend_config)
    preserved = _preserved(model, fuse_custom_config.preserved_attributes)
    gm = model if isinstance(model, GraphModule) else trace(model)[0]
    fused = fuse(gm, is_qat, bc)
    attach_preserved_attributes(fused, preserved)
    return fused


def _check_inputs_tuple(example_inputs: object) -> None:
    if not isinstance(example_inputs, tuple):
        raise ExampleInputsError(
            f"example_inputs must be a tuple of positional inputs, got "
            f"{type(example_inputs).__name__}; for one input write (x,)"
        )


def _check_example_inputs(
    gm: GraphModule, example_inputs: tuple[Any, ...], exported: bool = False
) -> _DtypeRecorder:
    """Run ``gm`` on ``example_inputs`` (eval, no grad); what each node held (the recorder).

    An exported graph's placeholders are its flattened inputs, which export checked already.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    required = [n for n in placeholders if not n.args]  # args hold a default value
    if not exported and not len(required) <= len(example_inputs) <= len(placeholders):
        names = ", ".join(n.name for n in placeholders)
        upto = f" to {len(placeholders)}" if len(placeholders) > len(required) else ""
        raise ExampleInputsError(
            f"example_inputs has {len(example_inputs)} values but the model's forward takes "
            f"{len(required)}{upto} ({names})"
        )
    training = {m: m.training for m in gm.modules()}
    gm.eval()
    recorder = _DtypeRecorder(gm)
    try:
        with torch.no_grad():
            recorder.run(*example_inputs)
    except Exception as e:
        raise ExampleInputsError(
            f"the model fails on example_inputs ({_describe_values(example_inputs)}): "
            f"{type(e).__name__}: {e}; pass inputs of the shapes and dtypes forward expects"
        ) from e
    finally:
        for module, mode in training.items():
            module.training = mode
    return recorder


class _DtypeRecorder(Interpreter):
    """Runs a graph and notes the dtype of every node whose value is a tensor, and the
    nodes whose value is a Python number (``scalars``: e.g. a ``scale: float`` argument)."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm)
        self.extra_traceback = False  # keep the model's own error message as it is
        self.dtypes: dict[str, torch.dtype] = {}
        self.scalars: dict[str, str] = {}  # node name -> Python type name

    def run_node(self, n: Node) -> Any:
        value = super().run_node(n)
        if isinstance(value, torch.Tensor):
            self.dtypes[n.name] = value.dtype
        elif isinstance(value, (bool, int, float, complex)):
            self.scalars[n.name] = type(value).__name__
        return value


def _integer_nodes(gm: GraphModule, dtypes: dict[str, torch.dtype]) -> dict[str, torch.dtype]:
    """Nodes whose value (on the example inputs) is an integer or bool tensor computed only
    from such tensors: masks and indices being sliced and reshaped. They are never observed;
    an op that mixes one with float data is still reported (non_float_observations)."""
    found: dict[str, torch.dtype] = {}
    for node in gm.graph.nodes:
        dtype = dtypes.get(node.name)
        if dtype is None or dtype.is_floating_point or node.op == "placeholder":
            continue
        inputs = [dtypes.get(n.name) for n in node.all_input_nodes]
        if all(d is None or not d.is_floating_point for d in inputs):
            found[node.name] = dtype
    return found


def _describe_values(values: tuple[Any, ...]) -> str:
    parts = []
    for v in values:
        if isinstance(v, torch.Tensor):
            parts.append(f"Tensor{tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}")
        else:
            parts.append(type(v).__name__)
    return ", ".join(parts)


def _set_module(root: nn.Module, target: str, module: nn.Module) -> None:
    parent, _, name = target.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def _qat_swap(module: nn.Module, mapping: dict[Any, type[nn.Module]], skip: set[type]) -> None:
    for name, child in list(module.named_children()):
        kind = type_before_parametrizations(child)
        if not isinstance(child, FusedModule) and kind not in skip:
            _qat_swap(child, mapping, skip)
        qat_class = mapping.get(kind)
        if qat_class is not None and getattr(child, "qconfig", None) is not None:
            swapped = qat_class.from_float(child)  # type: ignore[attr-defined]
            setattr(module, name, swapped)


def _quant_type(qconfig: QConfigAny, probe: ObserverProbe) -> QuantType:
    assert qconfig is not None
    act = probe(qconfig.activation)
    if getattr(act, "is_dynamic", False):
        return QuantType.DYNAMIC
    if act.dtype in (torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32):
        return QuantType.STATIC
    return QuantType.WEIGHT_ONLY


def prepare(
    model: nn.Module,
    qconfig_mapping: QConfigMapping | dict[str, Any],
    is_qat: bool,
    example_inputs: tuple[Any, ...],
    prepare_custom_config: PrepareCustomConfig | dict[str, Any] | None = None,
    backend_config: BackendConfig | dict[str, Any] | None = None,
    *,
    strict: bool = False,
    is_standalone: bool = False,
    capture: str = "fx",
) -> GraphModule:
    """prepare_fx / prepare_qat_fx (see the module docstring)."""
    pcc = _as_prepare_config(prepare_custom_config)
    bc = resolve_backend_config(backend_config)
    mapping = copy_mapping(qconfig_mapping)
    reject_per_group(mapping, "prepare_qat_fx" if is_qat else "prepare_fx")
    _check_inputs_tuple(example_inputs)
    preserved = _preserved(model, pcc.preserved_attributes)
    exported = check_capture(capture, model)

    skipped_names = list(pcc.non_traceable_module_names)
    skipped_classes: list[Any] = list(pcc.non_traceable_module_classes)
    if not is_standalone:
        skipped_names += list(pcc.standalone_module_names)
        skipped_classes += list(pcc.standalone_module_classes)
        skipped_classes += pcc.custom_module_classes
    if exported:
        gm, scope, swapped = _capture_with_export(
            model, example_inputs, mapping, pcc, is_qat, skipped_names, skipped_classes
        )
    else:
        # Attention/transformer modules are tracer leaves: swap them so their Linears are
        # reached.
        model, swapped = swap_transformer_modules(model, mapping, skipped_names, skipped_classes)
        gm, scope = trace(model, skipped_names, skipped_classes)
    recorded = _check_example_inputs(gm, example_inputs, exported)
    dtypes = recorded.dtypes
    gm = fuse(gm, is_qat, bc, recompile=False)  # recompiled once, after observers

    update_qconfig_for_fusion(gm, mapping)
    propagate_module_qconfigs(gm, mapping, pcc)
    if is_qat:
        _qat_swap(gm, module_to_qat_module(bc), set(pcc.custom_module_classes))
        update_qconfig_for_qat(mapping, bc)

    modules = dict(gm.named_modules(remove_duplicate=False))
    qmatches = node_qconfigs(gm, modules, mapping, scope)
    qconfigs = {name: m.qconfig for name, m in qmatches.items()}
    integer_nodes = _integer_nodes(gm, dtypes)
    for name in integer_nodes:
        qconfigs[name] = None

    probe = ObserverProbe()
    no_tensors = NoTensorCache(modules, recorded.scalars)
    configs = {  # typed patterns: the matcher refuses BackendConfig's bare tuples
        Nested.from_tuple(p): c for p, c in bc.complex_format_to_config.items()
    }
    getters = {p: c.root_node_getter for p, c in configs.items() if c.root_node_getter}
    found = find_matches(gm, list(configs), root_node_getters=getters, mode="prepare")
    matches: dict[str, PatternMatch] = {}
    for m in found:
        config = configs[m.pattern]
        root = m.root
        if not isinstance(root, Node):
            raise FxQuantError(
                f"pattern {m.pattern!r} at node {m.anchor.name!r}: the root node getter "
                f"returned {root!r}, not a node"
            )
        obs_type = config.observation_type
        by_count = config.num_tensor_args_to_observation_type
        if by_count:
            count = count_tensor_args(root, no_tensors)
            if count not in by_count:
                raise FxQuantError(
                    f"node {root.name!r} matches pattern {m.pattern!r} with {count} tensor "
                    f"arguments, but the BackendPatternConfig's "
                    f"num_tensor_args_to_observation_type only covers {sorted(by_count)}; add "
                    f"an entry for {count}"
                )
            obs_type = by_count[count]
        pm = PatternMatch(m.anchor, m.node_pattern, m.pattern, config, root, obs_type)
        for n in m.claimed:
            matches[n.name] = pm
    custom_classes = set(pcc.custom_module_classes)
    standalone_nodes: list[Node] = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = modules[str(node.target)]
        kind = type_before_parametrizations(module)
        if kind in custom_classes:
            matches[node.name] = PatternMatch(node, node, None, None, node, is_custom=True)
        if str(node.target) in pcc.standalone_module_names or kind in pcc.standalone_module_classes:
            matches[node.name] = PatternMatch(node, node, None, None, node, is_standalone=True)
            standalone_nodes.append(node)

    for node in standalone_nodes:
        _prepare_standalone(gm, node, modules, qconfigs.get(node.name), pcc, bc, is_qat)

    def swap_custom(node: Node, qconfig: QConfigAny) -> None:
        module = modules[str(node.target)]
        qt = _quant_type(qconfig, probe)
        table = pcc.float_to_observed_mapping.get(qt, {})
        observed_class = table.get(type_before_parametrizations(module))
        if observed_class is None:
            raise FxQuantError(
                f"custom module {node.target!r} ({type(module).__name__}) has a {qt.name} "
                f"qconfig but PrepareCustomConfig maps it only for "
                f"{[q.name for q, t in pcc.float_to_observed_mapping.items() if type(module) in t]}"
            )
        observed = observed_class.from_float(module)  # type: ignore[attr-defined]
        _set_module(gm, str(node.target), observed)
        modules[str(node.target)] = observed

    original_nodes = list(gm.graph.nodes)
    result = insert_observers(
        gm,
        matches,
        qconfigs,
        bc,
        pcc.input_quantized_indexes,
        pcc.output_quantized_indexes,
        probe,
        swap_custom,
        recorded.scalars,
        pcc.output_float_indexes,
        _outlier_split_outputs(gm, scope),
    )
    decisions = _decisions(
        original_nodes,
        matches,
        qmatches,
        result.rejections,
        result.observed_node_names,
        bc,
        no_tensors,
        recorded.scalars,
        integer_nodes,
    )
    if strict:
        _raise_if_skipped(decisions, bc)
    non_float = non_float_observations(gm, dtypes)
    if non_float:
        raise ExampleInputsError(
            "example_inputs show that "
            + describe_non_float_observations(gm, non_float, qconfigs, scope)
        )

    gm.recompile()
    prepared = gm
    prepared.meta[OBSERVED_KEY] = ObservedState(
        node_name_to_qconfig=qconfigs,
        node_name_to_qconfig_match=qmatches,
        node_name_to_scope=scope,
        prepare_custom_config=pcc,
        qconfig_mapping=mapping,
        backend_config=bc,
        is_qat=is_qat,
        observed_node_names=result.observed_node_names,
        decisions=decisions,
        is_standalone=is_standalone,
        swapped_modules=swapped,
    )
    attach_preserved_attributes(prepared, preserved)
    return prepared


def check_capture(capture: str, model: nn.Module) -> bool:
    """Validate ``capture``; True when the model is (or will be) an exported ATen graph."""
    if capture not in CAPTURES:
        raise FxQuantError(f"capture must be one of {list(CAPTURES)}, got {capture!r}")
    return capture == "export" or is_exported_module(model)


def _capture_with_export(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    mapping: QConfigMapping,
    pcc: PrepareCustomConfig,
    is_qat: bool,
    skipped_names: list[str],
    skipped_classes: list[Any],
) -> tuple[GraphModule, dict[str, tuple[str, Any]], list[SwappedModule]]:
    """torch.export capture, lifted to BackendConfig level (``_export_capture``)."""
    unsupported = [
        what
        for what, present in (
            ("standalone modules", pcc.standalone_module_names or pcc.standalone_module_classes),
            ("custom modules", pcc.custom_module_classes),
        )
        if present
    ]
    if unsupported:
        raise ExportCaptureError(
            f"capture='export' does not support {' or '.join(unsupported)} in the "
            "PrepareCustomConfig (export inlines every module); use capture='fx' for them"
        )
    swapped: list[SwappedModule] = []
    if is_exported_module(model):
        exported = model
        assert isinstance(exported, GraphModule)
    else:
        model, swapped = swap_transformer_modules(model, mapping, skipped_names, skipped_classes)
        exported = capture_export(model, example_inputs)
    mode, witness = exported_mode(exported)
    if mode is not None and mode != is_qat:
        exported_as, call, other = (
            ("training", "prepare_fx", "model.eval()") if mode else ("eval", "prepare_qat_fx",
                                                                      "model.train()")
        )  # fmt: skip
        raise ExportCaptureError(
            f"{call}: the model was exported in {exported_as} mode (node {witness!r} says so); "
            f"export it again after {other}, "
            + ("or use prepare_qat_fx for quantization-aware training" if mode else
               "or use prepare_fx for post-training quantization")
        )  # fmt: skip
    lifted = lift_exported(exported, training=is_qat)
    # Non-traceable modules stay float: export inlines them, so their ops get no qconfig.
    # So do the flow's float-only helpers (an outlier split's float columns).
    for path, kind in lifted.module_classes.items():
        if path in skipped_names or any(
            isinstance(c, type) and issubclass(kind, c) for c in (*skipped_classes, *FLOAT_ONLY)
        ):
            mapping.set_module_name(path, None)
    for name in skipped_names + lifted.guards:
        mapping.set_module_name(name, None)
    return lifted.graph_module, lifted.scope, swapped


_SPLIT_OUTPUT = (
    "an outlier split's result: observed with its Linear's activation observer, as it feeds "
    "an attention core that runs on codes"
)


def _outlier_split_outputs(gm: GraphModule, scope: dict[str, tuple[str, Any]]) -> set[str]:
    """The nodes that return an ``OutlierSplitLinear``'s result: made in its scope, read
    only outside it."""
    found = set()
    for node in gm.graph.nodes:
        path, kind = scope.get(node.name, ("", None))
        if not (isinstance(kind, type) and issubclass(kind, OutlierSplitLinear)) or not path:
            continue
        users = [scope.get(user.name, ("", None))[0] for user in node.users]
        if users and not any(p == path or p.startswith(path + ".") for p in users):
            found.add(node.name)
    return found


def _prepare_standalone(
    gm: GraphModule,
    node: Node,
    modules: dict[str, nn.Module],
    qconfig: QConfigAny,
    pcc: PrepareCustomConfig,
    bc: BackendConfig,
    is_qat: bool,
) -> None:
    target = str(node.target)
    module = modules[target]
    entry = pcc.standalone_module_names.get(target) or pcc.standalone_module_classes.get(
        type(module)
    )
    assert entry is not None
    child_pcc = entry.prepare_custom_config or PrepareCustomConfig()
    if child_pcc.input_quantized_indexes or child_pcc.output_quantized_indexes:
        raise FxQuantError(
            f"standalone module {target!r}: input/output quantized indexes are not supported "
            "(quantized values are plain tensors here and would lose their qparams at the "
            "module boundary); leave them empty so the boundary stays float"
        )
    mapping = entry.qconfig_mapping or QConfigMapping().set_global(qconfig)
    prepared = prepare(
        module,
        mapping,
        is_qat,
        entry.example_inputs,
        child_pcc,
        entry.backend_config or bc,
        is_standalone=True,
    )
    _set_module(gm, target, prepared)
    modules[target] = prepared


def _describe_callable(fn: Any) -> str:
    """``torch.conv2d``, ``F.linear``, ``operator.add`` rather than their internal homes."""
    if isinstance(fn, torch._ops.OpOverload):
        return str(fn)  # aten.slice.Tensor
    name = getattr(fn, "__name__", None)
    module = getattr(fn, "__module__", None) or ""
    if name is None:
        return describe_pattern_element(fn)
    if module == "torch.nn.functional" or module == "torch._C._nn":
        return f"F.{name}"
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    if module == "builtins":
        return str(name)
    qualname = getattr(fn, "__qualname__", "")
    if module.startswith("torch") and qualname.startswith("_VariableFunctionsClass"):
        return f"torch.{name}"
    if module.startswith("torch") and hasattr(torch, name) and getattr(torch, name) is fn:
        return f"torch.{name}"
    return describe_pattern_element(fn)


def _describe_target(node: Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    if node.op == "call_method":
        return f".{node.target}()"
    return _describe_callable(node.target)


def _describe_pattern(pattern: Any) -> str:
    if isinstance(pattern, Nested):
        pattern = pattern.to_tuple()
    if isinstance(pattern, tuple):
        return "(" + ", ".join(_describe_pattern(p) for p in pattern) + ")"
    if isinstance(pattern, type):
        module = pattern.__module__
        if module.startswith("torch.nn."):
            return f"nn.{pattern.__name__}"
        if module.startswith("quantbridge.fx_quant.nn."):
            return f"{module.split('.')[3]}.{pattern.__name__}".replace("_fused.", "")
        return pattern.__name__
    if isinstance(pattern, str):
        return f".{pattern}()"
    return _describe_callable(pattern)


def _decisions(
    nodes: list[Node],
    matches: dict[str, PatternMatch],
    qmatches: dict[str, Any],
    verdicts: dict[int, list[str | None] | None],
    observed: set[str],
    bc: BackendConfig,
    no_tensors: NoTensorCache,
    scalars: dict[str, str],
    integer_nodes: dict[str, torch.dtype],
) -> list[NodeDecision]:
    rows: list[NodeDecision] = []
    for node in nodes:
        if node.op == "placeholder" and node.name in scalars:
            rows.append(_scalar_input_decision(node, scalars[node.name]))
            continue
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        match = matches.get(node.name)
        qm = qmatches.get(node.name)
        qconfig = qm.qconfig if qm is not None else None
        rule = qm.describe() if qm is not None else "-"
        candidates: list[tuple[str, str | None]] = []
        chosen = None
        pattern = None
        pattern_nodes: tuple[str, ...] = ()
        if match is not None:
            pattern_nodes = tuple(n.name for n in match.nodes())
            if match.is_custom:
                pattern = "custom module"
            elif match.is_standalone:
                pattern = "standalone module"
            else:
                pattern = _describe_pattern(match.pattern)
            verdict = verdicts.get(id(match))
            if verdict is not None and match.config is not None:
                for dc, reason in zip(match.config.dtype_configs, verdict, strict=True):
                    candidates.append((describe_dtype_config(dc), reason))
                chosen = next((i for i, r in enumerate(verdict) if r is None), None)
        if node.name in integer_nodes:
            dtype = str(integer_nodes[node.name]).removeprefix("torch.")
            status, reason = "float", f"{_INTEGER_DATA} ({dtype})"
        elif qconfig is None and node.name in observed:  # observe_split_output's
            status, reason = "quantized", _SPLIT_OUTPUT
        elif qconfig is None:
            status, reason = "float", f"qconfig is None ({rule})"
        elif node.name not in observed and no_tensors(node):
            status, reason = "float", _NO_TENSOR_DATA
        elif match is None and attention_core_reason(node, no_tensors.modules):
            status, reason = "float", ATTENTION_CORE_REASON
        elif match is None:
            status = "float"
            reason = f"no pattern of backend {bc.name!r} matches this node"
        elif match.is_custom:
            status, reason = "custom module", "swapped by PrepareCustomConfig"
        elif match.is_standalone:
            status, reason = "standalone module", "prepared on its own"
        elif match.config is not None and not match.config.dtype_configs:
            status, reason = "float", "the pattern has no DTypeConfigs (fusion only)"
        elif chosen is None:
            status, reason = "float", "no DTypeConfig accepts the qconfig"
        elif node.name in observed:
            status, reason = "quantized", f"DTypeConfig #{chosen}"
        else:
            status, reason = "float", "not observed"
        rows.append(
            NodeDecision(
                node=node.name,
                op=node.op,
                target=_describe_target(node),
                pattern=pattern,
                pattern_nodes=pattern_nodes,
                qconfig_rule=rule,
                qconfig=qconfig,
                candidates=candidates,
                chosen=chosen,
                status=status,
                reason=reason,
            )
        )
    return rows


def _scalar_input_decision(node: Node, type_name: str) -> NodeDecision:
    """A forward argument that holds a Python number: stays a number, never observed."""
    return NodeDecision(
        node=node.name,
        op=node.op,
        target=f"input {node.target!r}",
        pattern=None,
        pattern_nodes=(),
        qconfig_rule="-",
        qconfig=None,
        candidates=[],
        chosen=None,
        status="float",
        reason=(
            f"Python {type_name} input, not a tensor: not observed or quantized; ops that "
            "read it take it as a scalar (pass a tensor to quantize it)"
        ),
    )


def _raise_if_skipped(decisions: list[NodeDecision], bc: BackendConfig) -> None:
    bad = [
        d
        for d in decisions
        if d.qconfig is not None
        and d.status == "float"
        and d.reason not in (_NO_TENSOR_DATA, ATTENTION_CORE_REASON)
        and not d.reason.startswith(_INTEGER_DATA)
        and d.op != "get_attr"
    ]
    if not bad:
        return
    lines = []
    for d in bad:
        line = f"  {d.node} ({d.target}): {d.reason}; qconfig from {d.qconfig_rule}"
        rejected = [f"[{dc}] {r}" for dc, r in d.candidates if r is not None]
        if rejected:
            line += "; rejected: " + "; ".join(rejected)
        lines.append(line)
    raise StrictPrepareError(
        f"strict=True: {len(bad)} node(s) have a qconfig but would stay float with backend "
        f"{bc.name!r}:\n" + "\n".join(lines) + "\nfix the qconfigs (see explain(prepared)) or set "
        "their qconfig to None in the QConfigMapping"
    )
