"""convert_to_reference_fx: observers become quantize/dequantize ops; weighted modules become
reference modules.

Each observer call becomes ``quantize -> dequantize`` with ``torch.ops.quantbridge`` ops on
plain tensors (per-tensor: the ``.tensor`` overloads with scale and zero point read from
buffers registered on the model, so they travel in ``state_dict``; per-channel: scale and
zero-point buffers plus the axis; dynamic: ``choose_qparams_per_tensor`` at run time;
float16: a cast round trip). The graph keeps torch.ao's reference shape
``dequantize -> float op -> quantize`` around every quantized pattern, which is what lowering
passes match. Weighted modules (Linear, Conv, Embedding, and fused modules rooted at them)
whose node was observed and whose qconfig a DTypeConfig of their pattern accepts become the
backend's reference quantized module, with the weight observed here (post-training) or taken
from the QAT module's fake quantize.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node
from torch.nn.utils.parametrize import type_before_parametrizations

from quantbridge.fx_quant._custom_config import ConvertCustomConfig
from quantbridge.fx_quant._dtype_matching import ObserverProbe
from quantbridge.fx_quant._equalize import apply_equalization
from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._ops import dtype_range
from quantbridge.fx_quant._prepare import (
    PREPARED_ATTRS_KEY,
    attach_preserved_attributes,
    resolve_backend_config,
)
from quantbridge.fx_quant._qconfig_propagation import (
    copy_mapping,
    is_observer_module,
    node_qconfigs,
    update_qconfig_for_fusion,
    update_qconfig_for_qat,
)
from quantbridge.fx_quant._range_check import warn_dominated_ranges
from quantbridge.fx_quant._state import (
    DECISIONS_KEY,
    OBSERVED_KEY,
    ObservedState,
    RecordedDecisions,
)
from quantbridge.fx_quant.nn.intrinsic import FusedModule
from quantbridge.qconfig import (
    BackendConfig,
    DTypeConfig,
    PlaceholderObserver,
    QConfigAny,
    QConfigMapping,
    QScheme,
    qconfig_equals,
)

__all__ = ["NotPreparedError", "convert_reference", "observed_state"]

_ops = torch.ops.quantbridge
_QUANTIZED = (torch.uint8, torch.int8, torch.uint16, torch.int16, torch.int32)


class NotPreparedError(FxQuantError):
    """convert was given a model that prepare_fx / prepare_qat_fx did not produce."""


def observed_state(model: object, where: str) -> ObservedState:
    meta = getattr(model, "meta", None)
    state = meta.get(OBSERVED_KEY) if isinstance(meta, dict) else None
    if not isinstance(model, GraphModule) or not isinstance(state, ObservedState):
        kind = type(model).__name__
        raise NotPreparedError(
            f"{where} needs the model returned by prepare_fx or prepare_qat_fx (after "
            f"calibration or training); got a {kind} without observer state"
            + (" (already converted?)" if isinstance(model, GraphModule) else "")
            + ". Call prepared = prepare_fx(model, qconfig_mapping, example_inputs) first"
        )
    return state


def _has_none_qconfig(arg: object, qconfigs: dict[str, QConfigAny]) -> bool:
    return isinstance(arg, Node) and arg.name in qconfigs and qconfigs[arg.name] is None


class _Converter:
    def __init__(self, model: GraphModule, state: ObservedState, bc: BackendConfig) -> None:
        self.model = model
        self.graph: Graph = model.graph
        self.state = state
        self.bc = bc
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self.qconfigs = state.node_name_to_qconfig
        self.scope = state.node_name_to_scope
        self.attr_counters: dict[str, int] = {}
        self.probe = ObserverProbe()
        devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
        self.device = next(iter(devices)) if len(devices) == 1 else None

    # -- qparam buffers -----------------------------------------------------------------------

    def buffer_node(self, prefix: str, value: torch.Tensor) -> Node:
        prefix = prefix.replace(".", "_")
        i = self.attr_counters.get(prefix, 0)
        while hasattr(self.model, f"{prefix}{i}"):
            i += 1
        self.attr_counters[prefix] = i + 1
        name = f"{prefix}{i}"
        self.model.register_buffer(name, value.detach().clone().to(self.device))
        return self.graph.create_node("get_attr", name)

    def module_path_and_prefix(self, obs_node: Node) -> tuple[str, str]:
        observed = obs_node.args[0]
        assert isinstance(observed, Node)
        input_only = self.qconfigs.get(observed.name, 0) is None
        if input_only:
            users = list(obs_node.users)
            first: Node | None = users[0] if users else None
            for user in users:
                if user.op == "call_function" and user.target is torch.nn.functional.linear:
                    first = user
                    break
            prefix = "_input"
        else:
            first, prefix = observed, ""
        path = self.scope[first.name][0] if first is not None and first.name in self.scope else ""
        return path, prefix

    # -- observers ------------------------------------------------------------------------------

    def replace_observer(self, node: Node) -> None:
        observer = self.modules[str(node.target)]
        graph = self.graph
        source = node.args[0]
        skip = all(_has_none_qconfig(n, self.qconfigs) for n in list(node.args) + list(node.users))
        dtype = getattr(observer, "dtype", None)
        dynamic = bool(getattr(observer, "is_dynamic", False))
        supported = (dtype in _QUANTIZED and not dynamic) or dynamic or dtype == torch.float16
        assert isinstance(source, Node)
        if skip or not supported:
            node.replace_all_uses_with(source)
            graph.erase_node(node)
            return
        path, prefix = self.module_path_and_prefix(node)
        with graph.inserting_before(node):
            if dtype in _QUANTIZED and not dynamic:
                scale, zero_point = observer.calculate_qparams()
                # The reference model clamps to the dtype's full range, as torch.ao's does;
                # the observer's narrower range only shaped scale and zero point.
                qmin, qmax = dtype_range(dtype)
                qscheme = getattr(observer, "qscheme", QScheme.PER_TENSOR_AFFINE)
                scale_node = self.buffer_node(path + prefix + "_scale_", torch.as_tensor(scale))
                zp_node = self.buffer_node(
                    path + prefix + "_zero_point_", torch.as_tensor(zero_point)
                )
                if isinstance(qscheme, QScheme) and qscheme.is_per_channel:
                    axis = int(observer.ch_axis)
                    q = graph.call_function(
                        _ops.quantize_per_channel.default,
                        (source, scale_node, zp_node, axis, qmin, qmax, dtype),
                    )
                    dq = graph.call_function(
                        _ops.dequantize_per_channel.default,
                        (q, scale_node, zp_node, axis, qmin, qmax, dtype),
                    )
                else:
                    q = graph.call_function(
                        _ops.quantize_per_tensor.tensor,
                        (source, scale_node, zp_node, qmin, qmax, dtype),
                    )
                    dq = graph.call_function(
                        _ops.dequantize_per_tensor.tensor,
                        (q, scale_node, zp_node, qmin, qmax, dtype),
                    )
            elif dynamic and dtype != torch.float16:
                if dtype not in (torch.uint8, torch.int8):
                    raise FxQuantError(
                        f"observer {node.target!r}: dynamic quantization to {dtype} is not "
                        "supported; use uint8 or int8"
                    )
                qmin, qmax = dtype_range(dtype)
                # torch.ao's dynamic reference op on x86 halves the uint8 range.
                choose = graph.call_function(
                    _ops.choose_qparams_per_tensor.default,
                    (source, qmin, qmax, dtype == torch.uint8),
                )
                scale_n = graph.call_function(operator.getitem, (choose, 0))
                zp_n = graph.call_function(operator.getitem, (choose, 1))
                q = graph.call_function(
                    _ops.quantize_per_tensor.tensor,
                    (source, scale_n, zp_n, int(qmin), int(qmax), dtype),
                )
                dq = graph.call_function(
                    _ops.dequantize_per_tensor.tensor,
                    (q, scale_n, zp_n, int(qmin), int(qmax), dtype),
                )
            else:  # float16, static or dynamic: a cast round trip
                q = graph.call_method("to", (source, torch.float16))
                dq = graph.call_method("to", (q, torch.float32))
        node.replace_all_uses_with(dq)
        graph.erase_node(node)

    # -- weights ------------------------------------------------------------------------------

    def run_weight_observers(self) -> None:
        """Observe call_function weights (weight-only / dynamic ops observe them here)."""
        configs = self.bc.complex_format_to_config
        for node in self.graph.nodes:
            if node.op != "call_function":
                continue
            config = configs.get(node.target)
            index = config.input_type_to_index.get("weight") if config is not None else None
            weight = node.kwargs.get("weight")
            if weight is None and index is not None and index < len(node.args):
                weight = node.args[index]
            if not isinstance(weight, Node):
                continue
            producers = _producer_nodes(weight)
            if producers is None:
                continue
            sub = Graph()
            env: dict[Node, Node] = {}
            for p in reversed(producers):
                env[p] = sub.node_copy(p, env.__getitem__)
            sub.output(env[producers[0]])
            GraphModule(self.model, sub)()

    def convert_weighted(self, node: Node) -> None:
        target = str(node.target)
        module = self.modules[target]
        qconfig: QConfigAny = getattr(module, "qconfig", None)
        weight_post_process = None
        qat_classes = tuple(c.qat_module for c in self.bc.configs if c.qat_module is not None)
        if qat_classes and isinstance(module, qat_classes):
            weight_post_process = module.weight_fake_quant
            module = module.to_float()  # type: ignore[operator]
            _set_module(self.model, target, module)
            self.modules[target] = module
        if (
            qconfig is None
            or _has_none_qconfig(node, self.qconfigs)
            or node.name not in self.state.observed_node_names
        ):
            return
        config = self.bc.complex_format_to_config.get(type_before_parametrizations(module))
        dtype_configs = config.dtype_configs if config is not None else []
        probe = self.probe
        if not _qconfig_supported(qconfig, dtype_configs, probe):
            return
        if probe(qconfig.weight).dtype == torch.float32:
            return  # weight not quantized
        fused: Any = None
        float_module: Any = module
        if isinstance(module, nn.Sequential) and _is_fused(module):
            fused = module
            float_module = module[0]
        if isinstance(float_module, (nn.RNNCellBase, nn.LSTM, nn.GRU)):
            self.convert_recurrent(target, float_module, qconfig)
            return
        post: Any = weight_post_process
        if post is None:
            weight_ctor: Any = qconfig.weight
            post = weight_ctor()
            if self.device is not None:
                post.to(self.device)
        post(float_module.weight)
        weight_post_process = post
        qparams = _qparam_dict(weight_post_process)
        ref_class = _reference_class(self.bc, target, float_module)
        ref = ref_class.from_float(float_module, qparams)  # type: ignore[attr-defined]
        if fused is not None:
            fused[0] = ref
        else:
            _set_module(self.model, target, ref)
            self.modules[target] = ref

    def convert_recurrent(self, target: str, module: Any, qconfig: Any) -> None:
        """LSTM/GRU and RNN cells have several weights: one qparams dict per weight, keyed by
        its name, as torch.ao builds it (layers observe only int8 weights)."""
        if isinstance(module, nn.RNNCellBase):
            names = ["weight_ih", "weight_hh"]
        else:
            names = [n for n in module._flat_weights_names if n.startswith("weight")]
        qparams: dict[str, Any] = {}
        for name in names:
            post = qconfig.weight()
            if isinstance(module, nn.RNNCellBase) or post.dtype == torch.int8:
                post(getattr(module, name))
            qparams[name] = _qparam_dict(post)
        ref_class = _reference_class(self.bc, target, module)
        ref = ref_class.from_float(module, qparams)  # type: ignore[attr-defined]
        _set_module(self.model, target, ref)
        self.modules[target] = ref

    # -- quantized graph inputs / outputs ----------------------------------------------------

    def dequantize_input(self, node: Node, index: int) -> None:
        """A graph input that arrives quantized (uint8): dequantize it with its qparam buffers."""
        with self.graph.inserting_after(node):
            scale = self.buffer_node(f"{node.name}_input_scale_", torch.tensor(1.0))
        with self.graph.inserting_after(scale):
            zp = self.buffer_node(f"{node.name}_input_zero_point_", torch.tensor(0))
        with self.graph.inserting_after(zp):
            dq = self.graph.call_function(
                _ops.dequantize_per_tensor.tensor, (node, scale, zp, 0, 255, torch.uint8)
            )
        for user in list(node.users):
            if user is not dq:
                user.replace_input_with(node, dq)


def _is_fused(module: nn.Module) -> bool:
    return isinstance(module, FusedModule) or any(
        c.__name__ == "_FusedModule" for c in type(module).__mro__
    )


def _producer_nodes(node: Node) -> list[Node] | None:
    """``node`` and what computes it back to get_attr nodes; None if it needs graph inputs."""
    nodes = [node]
    frontier = [node]
    while frontier:
        current = frontier.pop()
        for arg in list(current.args) + list(current.kwargs.values()):
            if not isinstance(arg, Node):
                continue
            if arg.op == "placeholder":
                return None
            nodes.append(arg)
            if not (arg.op == "call_function" and arg.target is getattr):
                frontier.append(arg)
    return nodes


def _qparam_dict(observer: nn.Module) -> dict[str, Any]:
    qscheme = getattr(observer, "qscheme", None)
    dtype = observer.dtype
    if not qscheme or isinstance(observer, PlaceholderObserver):
        return {"qscheme": None, "dtype": dtype}
    scale, zero_point = observer.calculate_qparams()  # type: ignore[operator]
    qparams: dict[str, Any] = {
        "qscheme": qscheme,
        "dtype": dtype,
        "scale": scale,
        "zero_point": zero_point,
    }
    if isinstance(qscheme, QScheme) and qscheme.is_per_channel:
        qparams["axis"] = int(observer.ch_axis)  # type: ignore[arg-type]
    if hasattr(observer, "quant_min"):
        qparams["quant_min"] = observer.quant_min
    if hasattr(observer, "quant_max"):
        qparams["quant_max"] = observer.quant_max
    return qparams


def _reference_class(bc: BackendConfig, target: str, float_module: nn.Module) -> type:
    """The reference quantized class ``bc`` configures for module ``target``'s class."""
    root = type_before_parametrizations(float_module)
    for config in bc.configs:
        if config.root_module is root and config.reference_quantized_module is not None:
            return config.reference_quantized_module
    raise FxQuantError(
        f"module {target!r}: no reference quantized module configured for "
        f"{root.__name__}; set reference_quantized_module on its BackendPatternConfig"
    )


def _qconfig_supported(
    qconfig: QConfigAny, dtype_configs: list[DTypeConfig], probe: ObserverProbe
) -> bool:
    """torch.ao's module-level check: some DTypeConfig has exactly the qconfig's dtypes."""
    assert qconfig is not None
    act = probe(qconfig.activation)
    weight = probe(qconfig.weight)
    act_dtype, weight_dtype = act.dtype, weight.dtype
    act_dynamic = bool(getattr(act, "is_dynamic", False))
    for dc in dtype_configs:
        dynamic = bool(dc.is_dynamic)
        input_dtype = dc.input_dtype or torch.float32
        weight_dc = dc.weight_dtype or torch.float32
        bias_dc = dc.bias_dtype or torch.float32
        output_dc = dc.output_dtype or torch.float32
        bias = (
            torch.float16
            if act_dtype == torch.float16 and weight_dtype == torch.float16 and not dynamic
            else torch.float32
        )
        if dynamic:
            ok = (
                act_dynamic
                and input_dtype == act_dtype
                and output_dc == torch.float32
                and weight_dc == weight_dtype
            )
        else:
            ok = (
                input_dtype == act_dtype
                and output_dc == act_dtype
                and weight_dc == weight_dtype
                and bias_dc == bias
            )
        if ok:
            return True
    return False


def _set_module(root: nn.Module, target: str, module: nn.Module) -> None:
    parent, _, name = target.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def _remove_qconfig(model: nn.Module) -> None:
    for module in model.modules():
        if "qconfig" in module.__dict__:
            del module.qconfig


def _override_qconfigs(
    model: GraphModule,
    state: ObservedState,
    mapping: QConfigMapping | dict[str, Any],
    bc: BackendConfig,
) -> dict[str, QConfigAny]:
    new_mapping = copy_mapping(mapping)
    if state.is_qat:
        update_qconfig_for_qat(new_mapping, bc)
    update_qconfig_for_fusion(model, new_mapping)
    modules = copy.deepcopy(dict(model.named_modules(remove_duplicate=False)))
    fresh = node_qconfigs(model, modules, new_mapping, state.node_name_to_scope)
    result: dict[str, QConfigAny] = {}
    for name, old in state.node_name_to_qconfig.items():
        new = fresh[name].qconfig if name in fresh else None
        if new is not None and not qconfig_equals(old, new):
            raise FxQuantError(
                f"convert's qconfig_mapping gives node {name!r} {new}, but prepare used {old}; "
                "at convert a qconfig can only be kept or set to None"
            )
        result[name] = new
    return result


def convert_reference(
    model: GraphModule,
    convert_custom_config: ConvertCustomConfig | dict[str, Any] | None = None,
    remove_qconfig: bool = True,
    qconfig_mapping: QConfigMapping | dict[str, Any] | None = None,
    backend_config: BackendConfig | dict[str, Any] | None = None,
    where: str = "convert_to_reference_fx",
) -> GraphModule:
    """convert_to_reference_fx's body (see the module docstring); converts in place."""
    state = observed_state(model, where)
    warn_dominated_ranges(model, where)  # a sentinel-dominated observer: say so, naming it
    apply_equalization(model)  # no-op unless prepared with _equalization_config
    if convert_custom_config is None:
        convert_custom_config = ConvertCustomConfig()
    elif isinstance(convert_custom_config, dict):
        convert_custom_config = ConvertCustomConfig.from_dict(convert_custom_config)
    bc = state.backend_config if backend_config is None else resolve_backend_config(backend_config)
    preserved = {
        a: getattr(model, a)
        for a in convert_custom_config.preserved_attributes
        if hasattr(model, a)
    }
    preserved_before = model.meta.get(PREPARED_ATTRS_KEY, {})
    conv = _Converter(model, state, bc)
    if qconfig_mapping is not None:
        conv.qconfigs = _override_qconfigs(model, state, qconfig_mapping, bc)
    conv.run_weight_observers()

    configs = bc.configs
    root_classes = {
        c.root_module
        for c in configs
        if c.root_module is not None and c.reference_quantized_module is not None
    }
    qat_classes = {c.qat_module for c in configs if c.qat_module is not None}
    fused_classes = {c.fused_module for c in configs if c.fused_module is not None}
    custom_map: dict[type, type] = {}
    for table in convert_custom_config.observed_to_quantized_mapping.values():
        custom_map.update(table)
    input_quantized = state.prepare_custom_config.input_quantized_indexes
    output_quantized = state.prepare_custom_config.output_quantized_indexes
    placeholder_index = 0
    for node in list(conv.graph.nodes):
        if node.op == "placeholder":
            if placeholder_index in input_quantized:
                conv.dequantize_input(node, placeholder_index)
            placeholder_index += 1
        elif node.op == "output":
            if output_quantized:
                _keep_outputs_quantized(node, output_quantized)
        elif node.op == "call_module":
            module = conv.modules[str(node.target)]
            kind = type_before_parametrizations(module)
            if is_observer_module(module):
                conv.replace_observer(node)
            elif isinstance(module, GraphModule) and isinstance(
                module.meta.get(OBSERVED_KEY), ObservedState
            ):
                converted = convert_reference(module, backend_config=bc, where=where)
                _set_module(model, str(node.target), converted)
            elif kind in root_classes or kind in qat_classes or kind in fused_classes:
                first = module[0] if kind in fused_classes else None
                if first is not None and type_before_parametrizations(first) not in root_classes:
                    continue
                conv.convert_weighted(node)
            elif kind in custom_map:
                quantized = custom_map[kind].from_observed(module)  # type: ignore[attr-defined]
                _set_module(model, str(node.target), quantized)

    conv.graph.eliminate_dead_code()
    for name, module in list(model._modules.items()):
        if is_observer_module(module):  # replaced above; shared ones hide from named_modules
            delattr(model, name)
    model.recompile()
    result = model
    if remove_qconfig:
        _remove_qconfig(result)
    result.delete_all_unused_submodules()
    attach_preserved_attributes(result, {**preserved_before, **preserved})
    model.meta.pop(OBSERVED_KEY, None)
    model.meta[DECISIONS_KEY] = RecordedDecisions(
        state.backend_config.name, tuple(state.decisions), tuple(state.swapped_modules)
    )
    return result


def _keep_outputs_quantized(output: Node, indexes: list[int]) -> None:
    """Return the quantized integers (not their dequantized floats) at these output indexes."""
    value = output.args[0]

    def strip(v: Any) -> Any:
        if (
            isinstance(v, Node)
            and v.op == "call_function"
            and v.target
            in (
                _ops.dequantize_per_tensor.tensor,
                _ops.dequantize_per_channel.default,
            )
        ):
            return v.args[0]
        return v

    if isinstance(value, (list, tuple)):
        items = list(value)
        for i in indexes:
            if i < len(items):
                items[i] = strip(items[i])
        output.args = (type(value)(items),)
    elif 0 in indexes:
        output.args = (strip(value),)
