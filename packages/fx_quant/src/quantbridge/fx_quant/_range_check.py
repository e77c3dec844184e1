"""Observers whose range is dominated by sentinel values (finfo.min, -inf, +-1e30).

An attention mask written the Hugging Face way, ``(1.0 - mask) * torch.finfo(dtype).min``,
added to the scores, gives the mul and the add outputs of about -3.4e38. One uint8 observer
over that range has a scale near 1e36: every ordinary value rounds to the zero point, and the
model silently loses the mask and the scores. ``find_dominated_ranges`` lists such observers
on a calibrated model; ``warn_dominated_ranges`` (called by ``calibrate`` and at convert)
warns once per observer with the node, the range, the scale and the exact QConfigMapping call
that keeps the node float. ``explain()`` shows the same lines.
"""

from __future__ import annotations

import math
import operator
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from quantbridge.fx_quant._qconfig_propagation import is_observer_module
from quantbridge.fx_quant._state import OBSERVED_KEY, ObservedState

__all__ = [
    "HUGE_RANGE",
    "RANGES_KEY",
    "RangeFinding",
    "find_dominated_ranges",
    "warn_dominated_ranges",
]

# |value| at or above this is a sentinel, not data (float32's finfo.min is -3.4e38)
HUGE_RANGE = 1e30
RANGES_KEY = "_quantbridge_dominated_ranges"  # meta: findings already reported


@dataclass(frozen=True)
class RangeFinding:
    """One observer whose range is dominated by a sentinel value."""

    observer: str  # the observer module's name
    nodes: tuple[str, ...]  # the nodes whose outputs it observes (shared observers: several)
    ops: tuple[str, ...]  # what each computes, e.g. "operator.mul(sub, -3.4028234663852886e+38)"
    min_val: float
    max_val: float
    scale: float
    fixes: tuple[str, ...]  # per node, the exact QConfigMapping call keeping it float

    def message(self) -> str:
        seen = ", ".join(f"{n!r} ({op})" for n, op in zip(self.nodes, self.ops, strict=True))
        fixes = "; ".join(
            f"for {n!r}: {fix}" for n, fix in zip(self.nodes, self.fixes, strict=True)
        )
        return (
            f"observer {self.observer!r} of {seen} saw min {self.min_val:.6g}, max "
            f"{self.max_val:.6g}: a sentinel such as torch.finfo(dtype).min or -inf dominates "
            f"its range, so its scale is {self.scale:.6g} and every ordinary value quantizes "
            f"to the zero point. Keep these nodes float in the QConfigMapping given to "
            f"prepare_fx: {fixes}"
        )


def _name(target: Any) -> str:
    if isinstance(target, str):
        return repr(target)  # a method name: set_object_type("mul", None)
    module = str(getattr(target, "__module__", None) or "")
    qualname = str(
        getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or target
    )
    if target in vars(operator).values():
        return f"operator.{qualname}"
    if module.startswith("torch") and getattr(torch, qualname, None) is target:
        return f"torch.{qualname}"
    if module.startswith("torch") and getattr(torch.nn.functional, qualname, None) is target:
        return f"torch.nn.functional.{qualname}"
    return f"{module}.{qualname}" if module else qualname


def _arg(value: Any) -> str:
    if isinstance(value, Node):
        return value.name
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _describe(node: Node) -> str:
    if node.op == "call_module":
        return f"module {node.target}"
    if node.op in ("call_function", "call_method"):
        args = ", ".join(_arg(a) for a in node.args)
        return f"{_name(node.target)}({args})"
    return f"{node.op} {node.target}"


def _call_index(node: Node, scope: dict[str, tuple[str, Any]]) -> int:
    """The node's index among the calls of its function in its module (torch.ao's counting)."""
    path = scope.get(node.name, ("", None))[0]
    index = 0
    for other in node.graph.nodes:
        if other is node:
            return index
        if (
            other.op == "call_function"
            and other.target is node.target
            and scope.get(other.name, ("", None))[0] == path
        ):
            index += 1
    return index


def _fix(node: Node, model: GraphModule) -> str:
    if node.op == "call_module":
        return f'.set_module_name("{node.target}", None)'
    state = model.meta.get(OBSERVED_KEY)
    scope = state.node_name_to_scope if isinstance(state, ObservedState) else {}
    by_type = f"set_object_type({_name(node.target)}, None)"
    if node.op == "call_function":
        path = scope.get(node.name, ("", None))[0]
        index = _call_index(node, scope)
        return (
            f'.set_module_name_object_type_order("{path}", {_name(node.target)}, {index}, '
            f"None) (this call only) or .{by_type} (every such call)"
        )
    return f".{by_type}"


def _range(observer: nn.Module) -> tuple[float, float] | None:
    inner = getattr(observer, "activation_post_process", observer)
    lo, hi = getattr(inner, "min_val", None), getattr(inner, "max_val", None)
    if not isinstance(lo, torch.Tensor) or not isinstance(hi, torch.Tensor) or lo.numel() == 0:
        return None
    low, high = float(lo.min()), float(hi.max())
    if low > high:  # nothing observed yet
        return None
    return low, high


def _scale(observer: nn.Module) -> float:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scale = observer.calculate_qparams()[0]  # type: ignore[operator]
        return float(torch.as_tensor(scale).max())
    except Exception:  # an observer that cannot compute qparams: report the range only
        return math.nan


def find_dominated_ranges(model: nn.Module) -> list[RangeFinding]:
    """Activation observers of ``model`` whose min or max reaches ``HUGE_RANGE`` (or inf)."""
    if not isinstance(model, GraphModule):
        return []
    # a shared observer is one instance under several names: group its calls by instance
    observed: dict[int, tuple[str, nn.Module, list[Node]]] = {}
    for node in model.graph.nodes:
        if node.op != "call_module" or not node.args or not isinstance(node.args[0], Node):
            continue
        try:
            observer = model.get_submodule(str(node.target))
        except AttributeError:
            continue
        if is_observer_module(observer):
            entry = observed.setdefault(id(observer), (str(node.target), observer, []))
            entry[2].append(node.args[0])
    findings = []
    for name, observer, sources in observed.values():
        found = _range(observer)
        if found is None or max(abs(found[0]), abs(found[1])) < HUGE_RANGE:
            continue
        findings.append(
            RangeFinding(
                name,
                tuple(s.name for s in sources),
                tuple(_describe(s) for s in sources),
                found[0],
                found[1],
                _scale(observer),
                tuple(_fix(s, model) for s in sources),
            )
        )
    return findings


def warn_dominated_ranges(model: nn.Module, where: str) -> list[RangeFinding]:
    """Warn (UserWarning) once per dominated observer; record the findings for explain()."""
    findings = find_dominated_ranges(model)
    meta = getattr(model, "meta", None)
    if not isinstance(meta, dict):
        return findings
    reported: dict[str, RangeFinding] = meta.setdefault(RANGES_KEY, {})
    for finding in findings:
        if finding.observer in reported and reported[finding.observer] == finding:
            continue
        reported[finding.observer] = finding
        warnings.warn(f"{where}: {finding.message()}", UserWarning, stacklevel=3)
    return findings
