"""Before tracing, swap torch's attention and transformer modules for traceable equivalents.

``nn.MultiheadAttention`` and the ``nn.Transformer*`` modules are leaves for the tracer, so
their ``nn.Linear`` layers would never be quantized. This pass replaces each one the user
did not keep (non-traceable, standalone or custom module in the PrepareCustomConfig, or a
qconfig set to None for it by name, regex or type) with its ``nn.quantizable`` class. The
user's model is not modified: the modules on the path to a swap are shallow copies that
share everything else (parameters included) with it.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn
from torch.fx import Node
from torch.nn.utils import parametrize
from torch.nn.utils.parametrize import type_before_parametrizations

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._state import SwappedModule
from quantbridge.fx_quant._tracer import _is_flow_module
from quantbridge.fx_quant.nn.quantizable import FLOAT_TO_TRACEABLE, AttentionCore
from quantbridge.qconfig import QConfigMapping

__all__ = [
    "ATTENTION_CORE_REASON",
    "TransformerSwapError",
    "attention_core_reason",
    "swap_transformer_modules",
    "with_traceable_attention",
]

# explain's reason for the attention core node and its outputs (strict mode accepts it).
ATTENTION_CORE_REASON = "attention core (softmax, matmuls) of a swapped module stays float"

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


class TransformerSwapError(FxQuantError):
    """A transformer module cannot be swapped for its traceable equivalent."""


def _check_swappable(module: nn.Module, name: str) -> None:
    kind = type_before_parametrizations(module).__name__
    where = f"module {name!r} ({kind})" if name else kind
    fix = (
        f"or keep it float and unquantized with PrepareCustomConfig()"
        f".set_non_traceable_module_names([{name!r}])"
    )
    # Submodules are reused as they are, except MultiheadAttention's: the packed projection
    # is split into copies and out_proj is rebuilt around its weight.
    owners: dict[str, nn.Module] = {"": module}
    if isinstance(module, nn.MultiheadAttention):
        owners["out_proj"] = module.out_proj
    hooked = [
        o or "the module" for o, m in owners.items() if m._forward_hooks or m._forward_pre_hooks
    ]
    if hooked:
        raise TransformerSwapError(
            f"{where} has forward hooks ({', '.join(hooked)}); prepare replaces it with a "
            "traceable equivalent to quantize its Linear layers and the hooks would be lost. "
            f"Remove the hooks, {fix}"
        )
    parametrized = sorted(
        f"{owner}.{p}".lstrip(".")
        for owner, sub in owners.items()
        if parametrize.is_parametrized(sub)
        for p in getattr(sub, "parametrizations", {})
    )
    if parametrized:
        raise TransformerSwapError(
            f"{where} has parametrized parameters ({', '.join(parametrized)}); prepare "
            "replaces it with a traceable equivalent and would freeze them. Remove the "
            f"parametrizations (parametrize.remove_parametrizations), {fix}"
        )


def _describe(cls: type) -> str:
    if cls.__module__.startswith("torch.nn"):
        return f"nn.{cls.__name__}"
    return f"quantizable.{cls.__name__}"


def swap_transformer_modules(
    model: nn.Module,
    mapping: QConfigMapping,
    skipped_names: Sequence[str],
    skipped_classes: Sequence[Callable[..., Any]],
) -> tuple[nn.Module, list[SwappedModule]]:
    """``model`` with its transformer modules swapped (or ``model`` itself if none was).

    ``mapping`` (prepare's private copy) gets each traceable class the object-type qconfig
    of the class it replaces. Raises TransformerSwapError for modules with hooks or
    parametrizations.
    """
    skipped = set(skipped_names)
    skipped_types = {c for c in skipped_classes if isinstance(c, type)}
    swapped: list[SwappedModule] = []

    def kept(module: nn.Module, name: str) -> bool:
        kind = type_before_parametrizations(module)
        if name in skipped or kind in skipped_types:
            return True
        match = mapping.qconfig_for(name, kind)
        return match.qconfig is None and match.rule != "global"

    # A module registered under several names (shared layers) gets one replacement, so its
    # parameters stay shared (QAT trains one set of projection copies).
    # (The key module is kept in the value so that its id cannot be reused meanwhile.)
    replacements: dict[int, tuple[nn.Module, nn.Module]] = {}

    def visit(module: nn.Module, name: str) -> nn.Module:
        if id(module) in replacements:
            return replacements[id(module)][1]
        result = _visit(module, name)
        replacements[id(module)] = (module, result)
        return result

    def _visit(module: nn.Module, name: str) -> nn.Module:
        traceable = FLOAT_TO_TRACEABLE.get(type_before_parametrizations(module))
        if traceable is not None:
            if kept(module, name):
                return module
            _check_swappable(module, name)
            new: nn.Module = traceable.from_float(module)  # type: ignore[attr-defined]
            linears = tuple(
                f"{name}.{n}" if name else n
                for n, child in new.named_children()
                if type(child) is nn.Linear
            )
            kind = type_before_parametrizations(module)
            swapped.append(SwappedModule(name, _describe(kind), _describe(traceable), linears))
            module, is_new = new, True
        elif name in skipped or type(module) in skipped_types:
            return module
        elif _is_flow_module(module) and not isinstance(module, _CONTAINERS):
            return module  # a leaf for the tracer: what is inside is never traced
        else:
            is_new = False
        replaced = {}
        for child_name, child in list(module._modules.items()):  # aliases included
            if child is None:
                continue
            result = visit(child, f"{name}.{child_name}" if name else child_name)
            if result is not child:
                replaced[child_name] = result
        if replaced and not is_new:
            module = copy.copy(module)
            module._modules = dict(module._modules)  # the copy's own; the user's is unchanged
        for child_name, child in replaced.items():
            setattr(module, child_name, child)
        return module

    result = visit(model, "")
    object_types = mapping.object_type_qconfigs
    for float_type, traceable in FLOAT_TO_TRACEABLE.items():
        if float_type in object_types:
            object_types[traceable] = object_types[float_type]
    return result, swapped


def with_traceable_attention(model: nn.Module) -> nn.Module:
    """``model`` with every ``nn.MultiheadAttention`` and ``nn.Transformer*`` module swapped
    for its ``nn.quantizable`` class (what prepare does), so that a pass working on
    ``nn.Linear`` layers (outlier split, SmoothQuant) also reaches their projections."""
    swapped, _ = swap_transformer_modules(model, QConfigMapping(), (), ())
    return swapped


def attention_core_reason(node: Node, modules: Mapping[str, nn.Module]) -> str | None:
    """ATTENTION_CORE_REASON for an AttentionCore call or an item of its result, else None."""
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        if not isinstance(source, Node):
            return None
        node = source
    if node.op == "call_module" and isinstance(modules.get(str(node.target)), AttentionCore):
        return ATTENTION_CORE_REASON
    return None
