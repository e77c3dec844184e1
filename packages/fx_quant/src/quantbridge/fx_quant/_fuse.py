"""fuse: replace matched module sequences (conv -> bn -> relu, ...) by their fused module.

The fusion patterns are the BackendConfig entries with a ``fuser_method``. Matching follows
torch.ao's fusion matcher (``find_matches(mode="fuse")``); for each match the root node (the
config's ``_root_node_getter``, by default the first module of the sequence) is kept and its
module replaced with what the fuser method returns; the other matched nodes are dropped, and
the extra inputs the config's ``_extra_inputs_getter`` names are appended to the root node's
arguments.

Fuser methods of sequential patterns receive ``(is_qat, *modules)`` in execution order (any
length); those of complex-format patterns receive the matched modules in the reverse-nested
structure of the pattern, as in torch.ao.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.patterns import MatchAllNode, Nested, find_matches
from quantbridge.qconfig import BackendConfig, BackendPatternConfig

__all__ = ["FusionError", "fuse"]


class FusionError(FxQuantError):
    """A fusion pattern matched but could not be fused."""


def _set_module(root: nn.Module, target: str, module: nn.Module) -> None:
    parent, _, name = target.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def _as_modules(structure: Any, named: dict[str, nn.Module], training: bool) -> Any:
    """Nodes of a matched structure -> the modules (or functions) the fuser method gets."""
    if isinstance(structure, (list, tuple)):
        return tuple(_as_modules(s, named, training) for s in structure)
    if not isinstance(structure, Node):
        return MatchAllNode
    if structure.op == "call_module":
        return named[str(structure.target)]
    if structure.op == "call_function" and structure.target is torch.nn.functional.relu:
        relu = nn.ReLU()
        relu.training = training
        return relu
    if structure.op in ("call_function", "call_method"):
        return structure.target
    return MatchAllNode


def _chain_forward(structure: tuple[Any, ...]) -> list[Any]:
    """(relu, (bn, conv)) -> [conv, bn, relu]."""
    chain: list[Any] = []
    current: Any = structure
    while isinstance(current, tuple):
        chain.append(current[0])
        current = current[1] if len(current) > 1 else None
    if current is not None:
        chain.append(current)
    return chain[::-1]


def _call_fuser(
    config: BackendPatternConfig, is_qat: bool, modules: tuple[Any, ...], where: str
) -> nn.Module:
    fuser = config.fuser_method
    assert fuser is not None
    try:
        if config.pattern_complex_format is not None or not isinstance(config.pattern, tuple):
            fused = fuser(is_qat, *modules)
        else:
            fused = fuser(is_qat, *_chain_forward(modules))
    except FxQuantError as e:
        raise FusionError(f"{where}: {e}") from None
    except Exception as e:
        raise FusionError(
            f"{where}: the fuser method {getattr(fuser, '__name__', fuser)!r} failed with "
            f"{type(e).__name__}: {e}"
        ) from e
    if not isinstance(fused, nn.Module):
        raise FusionError(
            f"{where}: the fuser method returned {type(fused).__name__}, not an nn.Module"
        )
    return fused


def _position(graph: Graph) -> Any:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def fuse(
    model: GraphModule, is_qat: bool, backend_config: BackendConfig, *, recompile: bool = True
) -> GraphModule:
    """Fuse ``model`` (a traced GraphModule) in place following ``backend_config``."""
    configs = {  # typed patterns: the matcher refuses BackendConfig's bare tuples
        Nested.from_tuple(pattern): config
        for pattern, config in backend_config.complex_format_to_config.items()
        if config.fuser_method is not None
    }
    if not configs:
        return model
    getters = {p: c.root_node_getter for p, c in configs.items() if c.root_node_getter}
    matches = find_matches(model, list(configs), root_node_getters=getters, mode="fuse")
    if not matches:
        return model
    named = dict(model.named_modules(remove_duplicate=False))
    graph = model.graph
    dropped_targets: set[str] = set()
    fused_targets: dict[str, tuple[Any, tuple[nn.Module, ...], nn.Module]] = {}
    for match in matches:
        config = configs[match.pattern]
        root = match.root
        names = ", ".join(n.name for n in match.nodes)
        where = f"fusing nodes ({names})"
        if not isinstance(root, Node) or root.op != "call_module":
            raise FusionError(
                f"{where}: the root node must call a module, got {root!r}; check the "
                "pattern's _root_node_getter"
            )
        target = str(root.target)
        members = tuple(
            named[str(n.target)] for n in match.nodes if n is not root and n.op == "call_module"
        )
        earlier = fused_targets.get(target)
        if earlier is not None and earlier[:2] == (match.pattern, members):
            # The module is called again in the same pattern (a shared layer): as in torch.ao
            # every call uses the one fused module.
            fused = earlier[2]
        else:
            root_module = named[target]
            modules = _as_modules(match.nested_node_pattern, named, root_module.training)
            fused = _call_fuser(config, is_qat, modules, where)
            _set_module(model, target, fused)
            named[target] = fused
            fused_targets[target] = (match.pattern, members, fused)
        extra: list[Any] = []
        if config.extra_inputs_getter is not None:
            extra = list(config.extra_inputs_getter(match.nested_node_pattern))
        # The root takes the anchor's place (extra inputs may be computed after the root),
        # the other matched nodes go.
        anchor = match.anchor
        if root is not anchor:
            anchor.prepend(root)
            anchor.replace_all_uses_with(root)
        if extra:
            root.args = tuple(root.args) + tuple(extra)
        for node in sorted(
            (n for n in match.nodes if n is not root), key=_position(graph), reverse=True
        ):
            if node.op == "call_module":
                dropped_targets.add(str(node.target))
            graph.erase_node(node)
    # The folded batch norms and absorbed relus. (delete_all_unused_submodules alone misses
    # modules that now also live inside a fused module: named_modules() yields them once.)
    used = {str(n.target) for n in graph.nodes if n.op in ("call_module", "get_attr")}
    for target in dropped_targets - used:
        model.delete_submodule(target)
    model.delete_all_unused_submodules()
    if recompile:
        model.recompile()
    return model
