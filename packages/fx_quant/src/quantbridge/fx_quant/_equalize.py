"""Input-weight equalization in the graph: observers after prepare, scaling at convert.

Behaviour follows torch.ao 2.13's ``fx/_equalize.py`` (the documentation's
"Debugging accuracy" page, "Input-weight equalization", lists the rules):

prepare (``insert_equalization_observers``): for every Linear / Conv1-3d module (also fused
with ReLU) and every ``F.linear`` / ``F.conv1-3d`` call that is observed and has an
:class:`~quantbridge.qconfig.EqualizationQConfig` in the equalization mapping, an input
equalization observer is inserted between its input observer and the op; a functional op's
weight also gets a weight equalization observer after its weight observer. A layer whose
input feeds another quantized layer too (a branch) is not equalized (warning).

convert (``apply_equalization``, before anything else): the scale ``s`` of every layer is
computed from its two observers; the input gets ``x * s`` (a ``mul`` node before its input
observer, whose min/max become those of the scaled columns), the weight ``W / s`` along dim 1.
When a layer's output (through a ReLU) directly feeds another equalized layer, no ``mul`` is
inserted there: the first layer's weight rows and bias are multiplied by the second's scale.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._qconfig_propagation import (
    copy_mapping,
    is_observer_module,
    update_qconfig_for_fusion,
)
from quantbridge.fx_quant._state import OBSERVED_KEY
from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.qconfig import (
    EqualizationQConfig,
    InputEqualizationObserver,
    QConfigMapping,
    WeightEqualizationObserver,
    calculate_equalization_scale,
)

__all__ = ["EQUALIZATION_KEY", "apply_equalization", "insert_equalization_observers"]

# GraphModule.meta key: op node name -> its EqualizationQConfig (convert builds module weight
# equalization observers from it, as torch.ao does).
EQUALIZATION_KEY = "_quantbridge_equalization"

_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_FUSED = (nni.LinearReLU, nni.ConvReLU1d, nni.ConvReLU2d, nni.ConvReLU3d)
_FUNCTIONS = (F.linear, F.conv1d, F.conv2d, F.conv3d)


def _supports(node: Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return type(modules[str(node.target)]) in _MODULES + _FUSED
    return node.op == "call_function" and node.target in _FUNCTIONS


def _float_module(module: nn.Module) -> nn.Module:
    if isinstance(module, _FUSED):
        first: nn.Module = module[0]
        return first
    return module


def _weight_arg(node: Node) -> tuple[str, int | str] | None:
    if len(node.args) > 1:
        return ("args", 1)
    if "weight" in node.kwargs:
        return ("kwargs", "weight")
    return None


def _get_arg(node: Node, where: tuple[str, int | str]) -> Any:
    return node.args[where[1]] if where[0] == "args" else node.kwargs[str(where[1])]  # type: ignore[index]


def _set_arg(node: Node, where: tuple[str, int | str], value: Any) -> None:
    if where[0] == "args":
        args = list(node.args)
        args[int(where[1])] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, str(where[1]): value}


def _check_mapping(mapping: QConfigMapping) -> None:
    entries: list[tuple[str, Any]] = [("global", mapping.global_qconfig)]
    entries += [(f"object_type {k!r}", v) for k, v in mapping.object_type_qconfigs.items()]
    entries += [(f"module_name {k!r}", v) for k, v in mapping.module_name_qconfigs.items()]
    entries += [
        (f"module_name_regex {k!r}", v) for k, v in mapping.module_name_regex_qconfigs.items()
    ]
    entries += [
        (f"module_name_object_type_order {k!r}", v)
        for k, v in mapping.module_name_object_type_order_qconfigs.items()
    ]
    for where, value in entries:
        if value is not None and not isinstance(value, EqualizationQConfig):
            raise FxQuantError(
                f"prepare_fx: _equalization_config entry {where} is a {type(value).__name__}, "
                "not an EqualizationQConfig; use quantbridge.qconfig.default_equalization_qconfig "
                "or EqualizationQConfig(input_activation=..., weight=...)"
            )


def _new_name(model: nn.Module, prefix: str) -> str:
    index = 0
    while hasattr(model, f"{prefix}{index}"):
        index += 1
    return f"{prefix}{index}"


def _insert_after(model: GraphModule, arg: Node, observer: nn.Module) -> Node:
    name = _new_name(model, f"{arg.name}_equalization_process_")
    setattr(model, name, observer)
    with model.graph.inserting_after(arg):
        return model.graph.call_module(name, (arg,))


def _build_observer(make: Any, expected: type[nn.Module], node: Node, field: str) -> nn.Module:
    """Call the equalization qconfig's ``field`` constructor; refuse what is not ``expected``."""
    observer = make()
    if not isinstance(observer, expected):
        article = "an" if expected.__name__[0] in "AEIOU" else "a"
        raise FxQuantError(
            f"node {node.name!r}: the equalization qconfig's {field} built a "
            f"{type(observer).__name__}, not {article} {expected.__name__}"
        )
    return observer


def _is_branch(node: Node, modules: dict[str, nn.Module], qconfigs: dict[str, Any]) -> bool:
    """Whether the value ``node`` reads first also feeds another quantized node."""
    arg = node.args[0] if node.args else None
    if not isinstance(arg, Node):
        return False
    values: list[Node] = [arg]
    source = arg.args[0] if arg.args else None
    if is_observer_module(modules.get(str(arg.target))) and isinstance(source, Node):
        values.append(source)
    for value in values:
        for user in value.users:
            if user is node or user in values:
                continue
            if user.op == "call_module" and is_observer_module(modules.get(str(user.target))):
                return True
            if qconfigs.get(user.name) is not None:
                return True
    return False


def insert_equalization_observers(
    model: GraphModule, equalization_config: QConfigMapping | dict[str, Any]
) -> None:
    """prepare_fx's equalization step (see the module docstring); edits ``model`` in place."""
    mapping = copy_mapping(equalization_config)
    _check_mapping(mapping)
    update_qconfig_for_fusion(model, mapping)
    state = model.meta[OBSERVED_KEY]
    modules = dict(model.named_modules(remove_duplicate=False))
    chosen: dict[str, Any] = {}  # node name -> EqualizationQConfig
    call_counts: dict[tuple[str, Any], int] = {}
    for node in list(model.graph.nodes):
        if not _supports(node, modules):
            continue
        if node.op == "call_module":
            target = str(node.target)
            match = mapping.qconfig_for(target, type(modules[target]))
        else:
            path, scope_type = state.node_name_to_scope.get(node.name, ("", None))
            index = call_counts.get((path, node.target), 0)
            call_counts[(path, node.target)] = index + 1
            match = mapping.qconfig_for(path, node.target, index, scope_type=scope_type)
        eq_qconfig = match.qconfig
        if eq_qconfig is None or node.name not in state.observed_node_names:
            continue
        if state.node_name_to_qconfig.get(node.name) is None:
            continue
        if _is_branch(node, modules, state.node_name_to_qconfig):
            warnings.warn(
                f"input-weight equalization: node {node.name!r} is not equalized because its "
                "input also feeds another quantized node (a branch)",
                stacklevel=3,
            )
            continue
        first = node.args[0] if node.args else None
        if not isinstance(first, Node):
            continue
        # EqualizationQConfig.input_activation is stored in the activation field.
        input_obs = _build_observer(
            eq_qconfig.activation, InputEqualizationObserver, node, "input_activation"
        )
        eq_node = _insert_after(model, first, input_obs)
        node.replace_input_with(first, eq_node)
        eq_node.args = (first,)
        if node.op == "call_function":
            where = _weight_arg(node)
            weight = _get_arg(node, where) if where is not None else None
            if isinstance(weight, Node):
                weight_obs = _build_observer(
                    eq_qconfig.weight, WeightEqualizationObserver, node, "weight"
                )
                w_node = _insert_after(model, weight, weight_obs)
                assert where is not None
                _set_arg(node, where, w_node)
        chosen[node.name] = eq_qconfig
    model.meta[EQUALIZATION_KEY] = chosen
    model.recompile()


# -- convert -------------------------------------------------------------------------------------


def _module(modules: dict[str, nn.Module], node: Node) -> nn.Module | None:
    return modules.get(str(node.target)) if node.op == "call_module" else None


def _next_user(node: Node, predicate: Any) -> Node | None:
    for user in node.users:
        if predicate(user):
            return user
    return None


def _weight_eq_node(op: Node, modules: dict[str, nn.Module]) -> Node | None:
    where = _weight_arg(op)
    arg = _get_arg(op, where) if where is not None else None
    if isinstance(arg, Node) and isinstance(_module(modules, arg), WeightEqualizationObserver):
        return arg
    return None


def _next_input_eq_obs(op: Node, modules: dict[str, nn.Module]) -> InputEqualizationObserver | None:
    """The input equalization observer of the layer that ``op`` feeds directly (through an
    optional ReLU, then an observer), if any."""
    start = op
    relu = _next_user(
        op,
        lambda u: (
            isinstance(_module(modules, u), nn.ReLU)
            or (u.op == "call_function" and u.target in (F.relu, torch.relu))
        ),
    )
    if relu is not None:
        start = relu
    obs = _next_user(start, lambda u: is_observer_module(_module(modules, u)))
    if obs is None:
        return None
    eq = _next_user(obs, lambda u: isinstance(_module(modules, u), InputEqualizationObserver))
    if eq is None:
        return None
    found = _module(modules, eq)
    assert isinstance(found, InputEqualizationObserver)
    return found


def _unit(scale: torch.Tensor) -> bool:
    return scale.numel() == 1 and bool(scale == 1)


def _reshaped(scale: torch.Tensor, axis: int, like: torch.Tensor) -> torch.Tensor:
    shape = [1] * like.ndim
    shape[axis] = like.size(axis)
    return scale.view(shape)


def _scaled_weight(
    weight: torch.Tensor, scale: torch.Tensor, next_scale: torch.Tensor | None
) -> torch.Tensor:
    scaled = torch.mul(weight, torch.reciprocal(_reshaped(scale, 1, weight)))
    if next_scale is not None:
        scaled = torch.mul(scaled, _reshaped(next_scale, 0, scaled))
    return scaled


def _assign(owner: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(owner, name)
    if isinstance(old, nn.Parameter):
        setattr(owner, name, nn.Parameter(value.detach(), requires_grad=old.requires_grad))
    else:
        setattr(owner, name, value.detach())


def _resolve_attr(model: nn.Module, target: str) -> tuple[nn.Module, str]:
    owner_path, _, name = target.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    return owner, name


def _remove(model: GraphModule, node: Node, replacement: Node) -> None:
    node.replace_all_uses_with(replacement)
    model.graph.erase_node(node)


def apply_equalization(model: GraphModule) -> None:
    """convert's equalization step (see the module docstring); edits ``model`` in place.
    Does nothing for models prepared without ``_equalization_config``."""
    chosen: dict[str, Any] | None = model.meta.pop(EQUALIZATION_KEY, None)
    if not chosen:
        return
    modules = dict(model.named_modules(remove_duplicate=False))
    graph = model.graph

    # 1. the scales
    weight_observers: dict[str, WeightEqualizationObserver] = {}
    for node in graph.nodes:
        input_obs = _module(modules, node)
        if not isinstance(input_obs, InputEqualizationObserver):
            continue
        op = _next_user(node, lambda u: _supports(u, modules))
        if op is None or op.name not in chosen:
            continue
        is_linear = op.target is F.linear or isinstance(
            _module(modules, op), (nn.Linear, nni.LinearReLU)
        )
        if is_linear and len(input_obs.equalization_shape) not in (0, 2):
            raise FxQuantError(
                f"input-weight equalization of {op.name!r}: the Linear was fed "
                f"{len(input_obs.equalization_shape)}-dim inputs; equalization reads the input "
                "channels on dim 1, so it needs 2-dim (batch, features) inputs. Leave this "
                "layer out of the _equalization_config (set_module_name(name, None))"
            )
        weight_obs: Any
        if op.op == "call_module":
            weight_obs = chosen[op.name].weight()
            weight_obs(_float_module(modules[str(op.target)]).weight)
        else:
            w_node = _weight_eq_node(op, modules)
            if w_node is None:
                continue
            weight_obs = modules[str(w_node.target)]
        assert isinstance(weight_obs, WeightEqualizationObserver)
        found = calculate_equalization_scale(input_obs, weight_obs)
        input_obs.set_equalization_scale(found)
        weight_obs.set_equalization_scale(found)
        weight_observers[op.name] = weight_obs

    # 2. the graph and the weights
    for node in list(graph.nodes):
        input_obs = _module(modules, node)
        if isinstance(input_obs, InputEqualizationObserver):
            _convert_input(model, node, input_obs, modules)
        elif node.name in weight_observers:
            scale: torch.Tensor | None = weight_observers[node.name].equalization_scale
            if scale is not None and _unit(scale):
                scale = None  # not equalized
            next_obs = _next_input_eq_obs(node, modules)
            next_scale = None
            if next_obs is not None and not _unit(next_obs.equalization_scale):
                next_scale = next_obs.equalization_scale
            if node.op == "call_module":
                _scale_module(modules[str(node.target)], scale, next_scale)
            else:
                _scale_functional(model, node, modules, scale, next_scale)
    for name, module in list(model.named_children()):
        if isinstance(module, (InputEqualizationObserver, WeightEqualizationObserver)):
            delattr(model, name)
    model.recompile()


def _convert_input(
    model: GraphModule,
    node: Node,
    input_obs: InputEqualizationObserver,
    modules: dict[str, nn.Module],
) -> None:
    quant_obs_node = node.args[0]
    assert isinstance(quant_obs_node, Node)
    quant_obs = _module(modules, quant_obs_node)
    if not is_observer_module(quant_obs):
        # The input is not observed (not quantized): scale it right before the op.
        quant_obs_node, quant_obs, prev = node, None, quant_obs_node
    else:
        prev = quant_obs_node.args[0]  # type: ignore[assignment]
    assert isinstance(prev, Node)
    if quant_obs is not None and (_supports(prev, modules) or "relu" in prev.name):
        # Between two equalized layers the scale is folded into the first one's weight.
        _remove(model, node, quant_obs_node)
        return
    scale = input_obs.equalization_scale
    if _unit(scale):
        _remove(model, node, quant_obs_node if quant_obs is not None else prev)
        return
    if quant_obs is not None:
        low, high = input_obs.calculate_scaled_minmax()
        if low is not None and high is not None:
            # torch.ao assigns the scaled range to the observer's min/max (also a histogram's)
            quant_obs.min_val = low
            quant_obs.max_val = high
    name = _new_name(model, f"{prev.name}_equalization_scale")
    model.register_buffer(name, scale)
    anchor = quant_obs_node if quant_obs is not None else node
    with model.graph.inserting_before(anchor):
        scale_node = model.graph.get_attr(name)
        mul = model.graph.call_function(torch.mul, (prev, scale_node))
    if quant_obs is not None:
        quant_obs_node.replace_input_with(prev, mul)
        _remove(model, node, quant_obs_node)
    else:
        _remove(model, node, mul)


def _scale_module(
    module: nn.Module, scale: torch.Tensor | None, next_scale: torch.Tensor | None
) -> None:
    if scale is None:
        return
    op = _float_module(module)
    op.weight = nn.Parameter(_scaled_weight(op.weight, scale, next_scale))  # type: ignore[arg-type]
    bias = getattr(op, "bias", None)
    if next_scale is not None and isinstance(bias, torch.Tensor):
        op.bias = nn.Parameter(torch.mul(bias, _reshaped(next_scale, 0, bias)))


def _scale_functional(
    model: GraphModule,
    op: Node,
    modules: dict[str, nn.Module],
    scale: torch.Tensor | None,
    next_scale: torch.Tensor | None,
) -> None:
    w_eq_node = _weight_eq_node(op, modules)
    if w_eq_node is None:
        return
    weight_obs_node = w_eq_node.args[0]
    if scale is not None and isinstance(weight_obs_node, Node):
        weight_obs = _module(modules, weight_obs_node)
        get_attr = weight_obs_node.args[0] if is_observer_module(weight_obs) else weight_obs_node
        if not (isinstance(get_attr, Node) and get_attr.op == "get_attr"):
            raise FxQuantError(
                f"input-weight equalization: the weight of {op.name!r} is computed "
                f"({get_attr!r}), not a module attribute; only stored weights can be scaled"
            )
        owner, name = _resolve_attr(model, str(get_attr.target))
        _assign(owner, name, _scaled_weight(getattr(owner, name), scale, next_scale))
        if next_scale is not None:
            bias = op.args[2] if len(op.args) > 2 else op.kwargs.get("bias")
            if isinstance(bias, Node) and bias.op == "get_attr":
                b_owner, b_name = _resolve_attr(model, str(bias.target))
                value = getattr(b_owner, b_name)
                _assign(b_owner, b_name, torch.mul(value, _reshaped(next_scale, 0, value)))
        if is_observer_module(weight_obs):
            reset: Any = weight_obs.reset_min_max_vals  # type: ignore[union-attr]
            reset()
    _remove(model, w_eq_node, weight_obs_node)  # type: ignore[arg-type]
