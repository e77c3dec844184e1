"""Does a qconfig fit a backend's DTypeConfig? And if not, which constraint says no?

torch.ao 2.13's rules, per candidate DTypeConfig of a matched pattern:

* input activation (arguments of the pattern's root node that are neither weight nor bias):
  the dtype and ``is_dynamic`` of the qconfig's activation observer must equal the config's,
  and the observer must satisfy the input ``DTypeWithConstraints``;
* weight (``input_type_to_index["weight"]`` or a ``weight=`` keyword): same dtype, constraints;
* bias: the bias placeholder dtype (float32, float16 for fp16 static) must equal ``bias_dtype``;
* output (the pattern's last node): same dtype (float32 for dynamic), constraints.

A constraint check only applies when the observer's dtype equals the constrained dtype; it
fails on a quant range outside the backend's bounds, an ``eps`` below ``scale_min_lower_bound``,
or, for fixed-qparams ops, anything but a fixed-qparams observer with the exact scale and
zero point (float16 qconfigs are accepted there). Instead of torch.ao's warnings, each check
returns the reason as text, which ``explain`` shows and ``strict=True`` raises.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from quantbridge.qconfig import (
    DTypeConfig,
    DTypeWithConstraints,
    FakeQuantizeBase,
    FixedQParamsFakeQuantize,
    FixedQParamsObserver,
    QConfigAny,
    QScheme,
    float16_dynamic_qconfig,
    float16_static_qconfig,
    qconfig_equals,
)

__all__ = [
    "DTypeMismatch",
    "ObserverProbe",
    "TargetInfo",
    "describe_dtype_config",
    "is_per_group_observer",
    "dtype_config_rejection",
    "format_number",
    "inputs_rejection",
]

Ctor = Callable[..., Any] | None


class DTypeMismatch(str):
    """A rejection because a dtype (or ``is_dynamic``) differs from the DTypeConfig's, as
    opposed to a constraint the qconfig breaks; the text says which."""

    __slots__ = ()


@dataclass
class TargetInfo:
    """What prepare wants around one node: observer constructors and argument roles."""

    input_act: Ctor
    output_act: Ctor
    weight: Ctor = None
    bias: Ctor = None
    weight_index: int | None = None
    bias_index: int | None = None
    reuse_input: bool = False
    share_observers: bool = False
    is_standalone: bool = False


class ObserverProbe:
    """Builds one throw-away instance per observer constructor to read its settings.

    The flow asks the same few constructors the same questions thousands of times; building a
    fresh observer each time is what makes torch.ao's prepare slow.
    """

    def __init__(self) -> None:
        self._cache: dict[int, tuple[Any, Any]] = {}

    def __call__(self, ctor: Ctor) -> Any:
        if ctor is None:
            return None
        hit = self._cache.get(id(ctor))
        if hit is not None and hit[0] is ctor:
            return hit[1]
        instance = ctor()
        self._cache[id(ctor)] = (ctor, instance)
        return instance

    def dtype(self, ctor: Ctor) -> tuple[torch.dtype | None, bool]:
        obs = self(ctor)
        if obs is None:
            return None, False
        return obs.dtype, bool(getattr(obs, "is_dynamic", False))


def format_number(value: float) -> str:
    """``2**-12`` for powers of two, else a short float."""
    if value > 0:
        exponent = math.log2(value)
        if exponent == int(exponent) and abs(exponent) >= 4:
            return f"2**{int(exponent)}"
    return f"{value:.3g}"


def _inner_observer(obs: Any) -> Any:
    # A fake quantize carries its settings on its activation_post_process.
    if isinstance(obs, FakeQuantizeBase) and hasattr(obs, "activation_post_process"):
        return obs.activation_post_process
    return obs


def constraint_violation(
    qconfig: QConfigAny,
    constraints: DTypeWithConstraints,
    role: str,
    probe: ObserverProbe,
) -> str | None:
    """Why ``qconfig``'s activation (or weight) breaks ``constraints``; None if it doesn't."""
    if qconfig is None or constraints.dtype is None:
        return None
    ctor = qconfig.activation if role != "weight" else qconfig.weight
    if ctor is None:
        return None
    app = probe(ctor)
    if app.dtype != constraints.dtype:
        return None
    obs = _inner_observer(app)
    kind = "activation" if role != "weight" else "weight"
    qmin = getattr(obs, "quant_min", None)
    qmax = getattr(obs, "quant_max", None)
    lo, hi = constraints.quant_min_lower_bound, constraints.quant_max_upper_bound
    if lo is not None and hi is not None:
        if qmin is None or qmax is None:
            return f"{kind} observer {type(obs).__name__} sets no quant_min/quant_max"
        if qmin < lo or qmax > hi:
            return f"{kind} quant range [{qmin}, {qmax}] outside backend range [{lo}, {hi}]"
    grouped = _group_rejection(obs, constraints.group_sizes, kind)
    if grouped is not None:
        return grouped
    smin = constraints.scale_min_lower_bound
    if smin is not None:
        eps = getattr(obs, "eps", None)
        if eps is None:
            return f"{kind} observer {type(obs).__name__} sets no eps"
        eps_value = float(eps.item()) if isinstance(eps, torch.Tensor) else float(eps)
        if eps_value < smin:
            return (
                f"{kind} eps {eps_value:.3g} below backend scale_min {format_number(float(smin))}"
            )
    exact_scale = constraints.scale_exact_match
    exact_zp = constraints.zero_point_exact_match
    if exact_scale is not None and exact_zp is not None:
        if qconfig_equals(qconfig, float16_static_qconfig) or qconfig_equals(
            qconfig, float16_dynamic_qconfig
        ):
            return None
        if not isinstance(app, (FixedQParamsObserver, FixedQParamsFakeQuantize)):
            return (
                f"fixed-qparams op needs a FixedQParamsObserver/FixedQParamsFakeQuantize "
                f"{kind}, got {type(app).__name__}"
            )
        scale = float(obs.scale.reshape(-1)[0])
        zp = int(obs.zero_point.reshape(-1)[0])
        if scale != exact_scale or zp != exact_zp:
            return (
                f"fixed {kind} qparams (scale {scale!r}, zero_point {zp}) differ from the "
                f"backend's (scale {exact_scale!r}, zero_point {exact_zp})"
            )
    return None


def is_per_group_observer(obs: Any) -> bool:
    """Whether ``obs`` computes per-group qparams (``QScheme.PER_GROUP_*``)."""
    qscheme = getattr(obs, "qscheme", None)
    return isinstance(qscheme, QScheme) and qscheme.is_per_group


def _group_rejection(obs: Any, sizes: tuple[int, ...] | None, kind: str) -> str | None:
    """Per-group qparams need a backend that declares their group size, and such a backend
    takes nothing else for that dtype."""
    if is_per_group_observer(obs):
        size = getattr(obs, "group_size", None)
        if sizes is None:
            return f"{kind} is quantized per group (group_size {size}); the backend takes no groups"
        if size not in sizes:
            return f"{kind} group_size {size} is not one of the backend's {list(sizes)}"
    elif sizes is not None:
        return (
            f"backend takes {kind}s per group (group sizes {list(sizes)}), but "
            f"{type(obs).__name__} is not a per-group observer"
        )
    return None


def _arg_role(node: Node, arg: Node, info: TargetInfo | None) -> str:
    if info is not None:
        wi, bi = info.weight_index, info.bias_index
        if wi is not None and wi < len(node.args) and node.args[wi] is arg:
            return "weight"
        if bi is not None and bi < len(node.args) and node.args[bi] is arg:
            return "bias"
    if node.kwargs.get("weight") is arg:
        return "weight"
    if node.kwargs.get("bias") is arg:
        return "bias"
    return "activation"


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _input_rejection(
    arg: Any,
    node: Node,
    info: TargetInfo | None,
    qconfig: QConfigAny,
    dc: DTypeConfig,
    probe: ObserverProbe,
) -> str | None:
    if isinstance(arg, (list, tuple)):
        for a in arg:
            reason = _input_rejection(a, node, info, qconfig, dc, probe)
            if reason is not None:
                return reason
        return None
    if not isinstance(arg, Node):
        return None
    role = _arg_role(node, arg, info)
    if role == "activation":
        if dc.input_dtype is None:
            return None
        dtype, dynamic = probe.dtype(info.input_act if info is not None else None)
        if dtype != dc.input_dtype:
            return DTypeMismatch(
                f"input dtype {_dtype_name(dtype)} != backend input_dtype "
                f"{_dtype_name(dc.input_dtype)}"
            )
        if bool(dc.is_dynamic) != dynamic:
            return DTypeMismatch(
                f"is_dynamic {dynamic} != backend is_dynamic {bool(dc.is_dynamic)}"
            )
        return constraint_violation(qconfig, dc.input_dtype_with_constraints, "input", probe)
    if role == "weight":
        if dc.weight_dtype is None:
            return None
        dtype, _ = probe.dtype(info.weight if info is not None else None)
        if dtype != dc.weight_dtype:
            return DTypeMismatch(
                f"weight dtype {_dtype_name(dtype)} != backend weight_dtype "
                f"{_dtype_name(dc.weight_dtype)}"
            )
        return constraint_violation(qconfig, dc.weight_dtype_with_constraints, "weight", probe)
    if dc.bias_dtype is None:
        return None
    dtype, _ = probe.dtype(info.bias if info is not None else None)
    if dtype != dc.bias_dtype:
        return DTypeMismatch(
            f"bias dtype {_dtype_name(dtype)} != backend bias_dtype {_dtype_name(dc.bias_dtype)}"
        )
    return None


def inputs_rejection(
    dc: DTypeConfig,
    root: Node,
    infos: dict[Node, TargetInfo],
    qconfig: QConfigAny,
    probe: ObserverProbe,
) -> str | None:
    """Why ``dc`` cannot take the inputs (activations, weight, bias) of ``root``; None if it can."""
    info = infos.get(root)
    for arg in list(root.args) + list(root.kwargs.values()):
        reason = _input_rejection(arg, root, info, qconfig, dc, probe)
        if reason is not None:
            return reason
    return None


def dtype_config_rejection(
    dc: DTypeConfig,
    root: Node,
    output_node: Node,
    infos: dict[Node, TargetInfo],
    qconfig: QConfigAny,
    probe: ObserverProbe,
    default_output: Ctor,
) -> str | None:
    """Why ``dc`` cannot serve this match; None when it can (torch.ao's decision)."""
    reason = inputs_rejection(dc, root, infos, qconfig, probe)
    if reason is not None:
        return reason
    if dc.output_dtype is None:
        return None
    out_info = infos.get(output_node)
    out_ctor = out_info.output_act if out_info is not None else default_output
    dtype, dynamic = probe.dtype(out_ctor)
    if dynamic:
        dtype = torch.float32  # dynamic quantization leaves the output in float
    if dtype != dc.output_dtype:
        return DTypeMismatch(
            f"output dtype {_dtype_name(dtype)} != backend output_dtype "
            f"{_dtype_name(dc.output_dtype)}"
        )
    return constraint_violation(qconfig, dc.output_dtype_with_constraints, "output", probe)


def describe_dtype_config(dc: DTypeConfig) -> str:
    """``in=uint8 out=uint8 w=int8 b=float32`` (dynamic marked)."""
    parts = []
    for label, dtype in (
        ("in", dc.input_dtype),
        ("out", dc.output_dtype),
        ("w", dc.weight_dtype),
        ("b", dc.bias_dtype),
    ):
        if dtype is not None:
            parts.append(f"{label}={_dtype_name(dtype)}")
    if dc.is_dynamic:
        parts.append("dynamic")
    return " ".join(parts) or "(no dtypes)"
