"""Which qconfig each node gets, and the module-level qconfig attributes QAT and convert read.

Per node, torch.ao 2.13's precedence (lowest to highest): the global qconfig, the object-type
entry of the node's own type, then (function and method calls only) the object-type entry of
the module class whose ``forward`` makes the call, the first matching module-name regex, the
nearest registered module name, and finally an exact (module name, object type, call index)
entry. Each result keeps the rule that supplied it (``QConfigMatch``) for ``explain``.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

from torch import nn
from torch.fx import GraphModule
from torch.nn.utils.parametrize import type_before_parametrizations

from quantbridge.fx_quant._custom_config import PrepareCustomConfig
from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant.nn.intrinsic import FusedModule
from quantbridge.qconfig import (
    BackendConfig,
    QConfigAny,
    QConfigMapping,
    QConfigMatch,
    qconfig_equals,
)

__all__ = [
    "FusionQConfigError",
    "is_observer_module",
    "node_qconfigs",
    "parent_name",
    "propagate_module_qconfigs",
    "update_qconfig_for_fusion",
    "update_qconfig_for_qat",
]


class FusionQConfigError(FxQuantError):
    """The members of a fused module were given different qconfigs."""


def parent_name(target: str) -> str:
    return target.rpartition(".")[0]


def is_observer_module(module: object) -> bool:
    """Observers and fake quantizes (the modules prepare inserts)."""
    from quantbridge.qconfig import FakeQuantizeBase, ObserverBase

    return isinstance(module, (ObserverBase, FakeQuantizeBase))


def update_qconfig_for_fusion(model: GraphModule, mapping: QConfigMapping) -> None:
    """Give fused module classes their members' object-type qconfig (mutates ``mapping``).

    Raises FusionQConfigError, naming the module and the member types, when the members of a
    fused module have different object-type qconfigs.
    """
    object_types = mapping.object_type_qconfigs
    if not object_types:
        return
    modules = dict(model.named_modules(remove_duplicate=False))
    for node in model.graph.nodes:
        if node.op != "call_module":
            continue
        fused = modules.get(str(node.target))
        if not isinstance(fused, FusedModule) and not _is_foreign_fused(fused):
            continue
        assert fused is not None
        members = list(fused._modules.values())
        first = object_types.get(type(members[0]))
        for member in members[1:]:
            other = object_types.get(type(member))
            if not qconfig_equals(other, first):
                raise FusionQConfigError(
                    f"fused module {node.target!r} ({type(fused).__name__}) has members with "
                    f"different qconfigs: {type(members[0]).__name__} -> {first}, "
                    f"{type(member).__name__} -> {other}. Members of a fused pattern are "
                    "quantized as one unit: give them the same qconfig with "
                    "QConfigMapping.set_object_type(...)"
                )
        if first is not None:
            object_types[type(fused)] = first


def _is_foreign_fused(module: object) -> bool:
    # torch.ao's fused modules, when a model built with them is quantized here.
    return any(c.__name__ == "_FusedModule" for c in type(module).__mro__)


def update_qconfig_for_qat(mapping: QConfigMapping, backend_config: BackendConfig) -> None:
    """Give each QAT module class the object-type qconfig of the class it replaces."""
    swaps = module_to_qat_module(backend_config)
    for key, qconfig in list(mapping.object_type_qconfigs.items()):
        if key in swaps:
            mapping.object_type_qconfigs[swaps[key]] = qconfig


def module_to_qat_module(backend_config: BackendConfig) -> dict[Any, type[nn.Module]]:
    return {
        pattern: config.qat_module
        for pattern, config in backend_config.complex_format_to_config.items()
        if config.qat_module is not None
    }


def propagate_module_qconfigs(
    model: nn.Module, mapping: QConfigMapping, prepare_custom_config: PrepareCustomConfig
) -> None:
    """Set ``module.qconfig`` on every module, eager style (what the QAT swap reads).

    Object-type and module-name entries apply and children inherit their parent's qconfig
    (regexes do not apply at this stage, as in torch.ao); an existing ``qconfig`` attribute
    wins. Children listed as non-traceable (by attribute name or class) are not visited.
    """
    flat: dict[Any, QConfigAny] = {"": mapping.global_qconfig}
    flat.update(mapping.object_type_qconfigs)
    flat.update(mapping.module_name_qconfigs)
    skip_names = set(prepare_custom_config.non_traceable_module_names)
    skip_classes = set(prepare_custom_config.non_traceable_module_classes)

    def visit(module: nn.Module, inherited: QConfigAny, prefix: str) -> None:
        qconfig = flat.get(type_before_parametrizations(module), inherited)
        qconfig = flat.get(prefix, qconfig)
        qconfig = getattr(module, "qconfig", qconfig)
        module.qconfig = qconfig  # type: ignore[assignment]
        for name, child in module.named_children():
            if name in skip_names or type(child) in skip_classes:
                continue
            visit(child, qconfig, f"{prefix}.{name}" if prefix else name)

    visit(model, None, "")


def node_qconfigs(
    model: GraphModule,
    modules: dict[str, nn.Module],
    mapping: QConfigMapping,
    node_name_to_scope: dict[str, tuple[str, Any]],
) -> dict[str, QConfigMatch]:
    """The qconfig of every node (with its rule); also sets ``qconfig`` on called modules."""
    result: dict[str, QConfigMatch] = {}
    # Per module path, how many calls of each object type were seen so far.
    counts: defaultdict[str, defaultdict[Any, int]] = defaultdict(lambda: defaultdict(int))
    order_rules = mapping.module_name_object_type_order_qconfigs
    none = QConfigMatch(None, "global")
    for node in model.graph.nodes:
        op = node.op
        if op == "get_attr":
            owner = parent_name(str(node.target))
            owner_module = modules.get(owner)
            result[node.name] = mapping.qconfig_for(
                owner, type(owner_module) if owner_module is not None else None
            )
        elif op == "call_function":
            path, scope_type = node_name_to_scope.get(node.name, ("", None))
            index = counts[path][node.target]
            counts[path][node.target] += 1
            result[node.name] = mapping.qconfig_for(path, node.target, index, scope_type=scope_type)
        elif op == "call_method":
            path, scope_type = node_name_to_scope.get(node.name, ("", None))
            result[node.name] = mapping.qconfig_for(path, node.target, scope_type=scope_type)
        elif op == "call_module":
            target = str(node.target)
            module = modules[target]
            if is_observer_module(module):
                continue
            match = mapping.qconfig_for(target, type(module))
            path, scope_type = node_name_to_scope.get(node.name, (target, type(module)))
            # torch.ao counts module calls in the parent, keyed by the traced module type.
            owner = parent_name(path)
            index = counts[owner][scope_type]
            counts[owner][scope_type] += 1
            key = (owner, scope_type, index)
            if order_rules and key in order_rules:
                match = QConfigMatch(order_rules[key], "module_name_object_type_order", key)
            module.qconfig = match.qconfig  # type: ignore[assignment]
            result[node.name] = match
        else:
            result[node.name] = none
    return result


def copy_mapping(mapping: QConfigMapping | dict[str, Any]) -> QConfigMapping:
    """A private deep copy of the user's mapping (a torch.ao-style dict is converted)."""
    if isinstance(mapping, dict):
        mapping = QConfigMapping.from_dict(mapping)
    if not isinstance(mapping, QConfigMapping):
        raise FxQuantError(
            f"qconfig_mapping must be a QConfigMapping (or its dict form), got "
            f"{type(mapping).__name__}; build one with QConfigMapping().set_global(...) or "
            "get_default_qconfig_mapping()"
        )
    return copy.deepcopy(mapping)
