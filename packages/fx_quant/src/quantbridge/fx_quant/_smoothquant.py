"""SmoothQuant: migrate activation outliers into the weights before static quantization.

For a group of Linears reading the same value X (q/k/v read one LayerNorm output), per input
channel j: ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` (W: the group's weights stacked),
from a calibration pass. Then ``W[:, j] *= s_j`` and X is divided by s: folded into the
producing LayerNorm's weight and bias when the Linears are its only users, else by a
``ChannelScale`` module (``x * (1/s)``, never quantized) before them. The float function is
unchanged (up to float rounding); X's channel ranges are flattened, so a per-tensor
activation scale wastes fewer levels on outlier channels, while per-channel weight scales
absorb the growth of W's columns.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from quantbridge.fx_quant._calibrate import calibrate
from quantbridge.fx_quant._channel_max import ChannelMax, replace_submodule
from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._export_capture import CAPTURES, capture_export, lift_exported
from quantbridge.fx_quant._tracer import trace
from quantbridge.fx_quant._transformer_swap import with_traceable_attention
from quantbridge.fx_quant.nn.quantizable import ChannelScale

__all__ = ["SmoothQuantConfig", "SmoothQuantReport", "smooth_quant"]


@dataclass(frozen=True)
class SmoothQuantConfig:
    """``alpha`` in [0, 1]: how much of the activation range moves into the weights (0.5 is
    the paper's default; larger moves more). ``min_scale`` bounds s from below."""

    alpha: float = 0.5
    min_scale: float = 1e-5

    def __post_init__(self) -> None:
        if not isinstance(self.alpha, (int, float)) or not 0.0 <= float(self.alpha) <= 1.0:
            raise FxQuantError(f"SmoothQuantConfig: alpha must be in [0, 1], got {self.alpha!r}")
        if not isinstance(self.min_scale, (int, float)) or not float(self.min_scale) > 0.0:
            raise FxQuantError(
                f"SmoothQuantConfig: min_scale must be positive, got {self.min_scale!r}"
            )


@dataclass(frozen=True)
class SmoothQuantReport:
    """Per smoothed group: the Linears, where 1/s went, and the range of s."""

    groups: tuple[tuple[tuple[str, ...], str, float, float], ...]

    def __str__(self) -> str:
        lines = ["smooth_quant: linears <- 1/s folded into | s min .. max"]
        for linears, into, lo, hi in self.groups:
            lines.append(f"  {', '.join(linears)} <- {into} | {lo:.4g} .. {hi:.4g}")
        return "\n".join(lines)


def _groups(gm: GraphModule) -> dict[Node, list[Node]]:
    """Input value -> the nn.Linear call nodes reading it as their input (in graph order)."""
    groups: dict[Node, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module" or not node.args or not isinstance(node.args[0], Node):
            continue
        if type(gm.get_submodule(str(node.target))) is nn.Linear:
            groups.setdefault(node.args[0], []).append(node)
    return groups


def _foldable_norm(gm: GraphModule, value: Node, readers: list[Node]) -> nn.LayerNorm | None:
    """The LayerNorm producing ``value`` when the Linears are its only users."""
    if value.op != "call_module":
        return None
    module = gm.get_submodule(str(value.target))
    if type(module) is not nn.LayerNorm or not module.elementwise_affine or module.bias is None:
        return None
    if set(value.users) != set(readers):
        return None  # also the residual, or another op: dividing its output would change them
    return module


def smooth_quant(
    model: nn.Module,
    calibration_data: Iterable[Any],
    config: SmoothQuantConfig | None = None,
    *,
    input_fn: Callable[[Any], Any] | None = None,
    max_batches: int | None = None,
    capture: str = "fx",
) -> nn.Module:
    """A copy of ``model`` with SmoothQuant's scale migration applied (``model`` is not
    changed); prepare it as usual (``prepare_fx``, the same ``capture``), then calibrate again.

    ``calibration_data``/``input_fn``/``max_batches`` as in :func:`calibrate`. Each group of
    ``nn.Linear`` modules reading one value is smoothed (see the module docstring).
    ``capture="fx"``: returns the traced GraphModule. ``capture="export"`` (a model fx cannot
    trace, such as Hugging Face's): the graph comes from ``torch.export`` on the first
    calibration batch and only tells which Linears read one value and which LayerNorm made it;
    the copy keeps the model's own class, the Linears' weights scaled, ``1/s`` folded into the
    LayerNorm or applied by a ``ChannelScale`` before each Linear of the group (``nn.Sequential``
    in the Linear's place). Either way ``result.smooth_quant_report`` is a
    :class:`SmoothQuantReport` (for fx also ``result.meta["smooth_quant"]``).
    """
    cfg = SmoothQuantConfig() if config is None else config
    if not isinstance(cfg, SmoothQuantConfig):
        raise FxQuantError(
            f"smooth_quant: config must be a SmoothQuantConfig, got {type(cfg).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise FxQuantError(f"smooth_quant: model must be an nn.Module, got {type(model).__name__}")
    if capture not in CAPTURES:
        raise FxQuantError(
            f"smooth_quant: capture must be one of {list(CAPTURES)}, got {capture!r}"
        )
    if capture == "export":
        return _smooth_exported(model, calibration_data, cfg, input_fn, max_batches)
    gm, _ = trace(with_traceable_attention(copy.deepcopy(model).eval()))
    groups = _groups(gm)
    recorders: dict[Node, ChannelMax] = {}
    for i, value in enumerate(groups):
        name = f"_smooth_quant_max_{i}"
        recorders[value] = ChannelMax()
        gm.add_submodule(name, recorders[value])
        with gm.graph.inserting_after(value):
            rec = gm.graph.call_module(name, (value,))
        for linear in groups[value]:
            linear.replace_input_with(value, rec)
    gm.recompile()
    calibrate(gm, calibration_data, input_fn=input_fn, max_batches=max_batches, progress=False)

    report = []
    for i, (value, readers) in enumerate(groups.items()):
        rec_node = next(u for u in value.users if u.target == f"_smooth_quant_max_{i}")
        for linear in readers:
            linear.replace_input_with(rec_node, value)
        gm.graph.erase_node(rec_node)
        gm.delete_submodule(f"_smooth_quant_max_{i}")
        linears: list[nn.Linear] = [gm.get_submodule(str(n.target)) for n in readers]  # type: ignore[misc]
        s = _scale_weights(recorders[value].amax, linears, cfg)
        if s is None:
            continue
        with torch.no_grad():
            norm = _foldable_norm(gm, value, readers)
            if norm is not None:
                _fold(norm, s)
                into = f"LayerNorm {value.target}"
            else:
                name = f"{str(readers[0].target).replace('.', '_')}_smooth"
                gm.add_submodule(name, ChannelScale((1.0 / s).detach()))
                with gm.graph.inserting_after(value):
                    scaled = gm.graph.call_module(name, (value,))
                for linear in readers:
                    linear.replace_input_with(value, scaled)
                into = f"mul {name}"
        report.append((tuple(str(n.target) for n in readers), into, float(s.min()), float(s.max())))
    gm.recompile()
    gm.meta["smooth_quant"] = SmoothQuantReport(tuple(report))
    setattr(gm, "smooth_quant_report", gm.meta["smooth_quant"])  # noqa: B010  (not a tensor)
    return gm


def _scale_weights(
    amax: torch.Tensor | None, linears: list[nn.Linear], cfg: SmoothQuantConfig
) -> torch.Tensor | None:
    """s per input channel of a group, each Linear's ``W[:, j] *= s_j`` done; None (nothing
    done) when the group never ran or its input is not laid out [..., in_features]."""
    if amax is None:
        return None
    w_amax = torch.stack([m.weight.detach().abs().amax(0) for m in linears]).amax(0).float()
    if w_amax.shape != amax.shape:
        return None
    alpha = float(cfg.alpha)
    s = amax.clamp(min=cfg.min_scale).pow(alpha) / w_amax.clamp(min=cfg.min_scale).pow(1.0 - alpha)
    s = torch.where((amax > 0) & (w_amax > 0), s.clamp(min=cfg.min_scale), torch.ones_like(s))
    with torch.no_grad():
        for m in linears:
            m.weight.mul_(s.to(m.weight.dtype))
    return s


def _fold(norm: nn.LayerNorm, s: torch.Tensor) -> None:
    norm.weight.div_(s.to(norm.weight.dtype))
    norm.bias.div_(s.to(norm.bias.dtype))


def _first_inputs(data: Iterable[Any], input_fn: Callable[[Any], Any] | None) -> tuple[Any, ...]:
    for batch in data:
        inputs = input_fn(batch) if input_fn is not None else batch
        if isinstance(inputs, torch.Tensor):
            return (inputs,)
        if isinstance(inputs, (tuple, list)):
            return tuple(inputs)
        raise FxQuantError(
            "smooth_quant(capture='export'): the first calibration batch must be a tensor or a "
            f"tuple of positional inputs (torch.export takes those), got {type(inputs).__name__}"
        )
    raise FxQuantError("smooth_quant: calibration_data is empty")


def _smooth_exported(
    model: nn.Module,
    data: Iterable[Any],
    cfg: SmoothQuantConfig,
    input_fn: Callable[[Any], Any] | None,
    max_batches: int | None,
) -> nn.Module:
    result = with_traceable_attention(copy.deepcopy(model).eval())
    batches = list(data)  # read twice: the capture's example, then the calibration
    example = _first_inputs(batches, input_fn)
    # the graph only says which Linears read one value: the changes go to ``result``
    gm = lift_exported(capture_export(result, example), training=False).graph_module
    groups = _groups(gm)
    recorders = {value: ChannelMax() for value in groups}
    handles = [
        result.get_submodule(str(readers[0].target)).register_forward_pre_hook(
            recorders[value].pre_hook
        )
        for value, readers in groups.items()
    ]
    try:
        calibrate(result, batches, input_fn=input_fn, max_batches=max_batches, progress=False)
    finally:
        for h in handles:
            h.remove()
    report = []
    for value, readers in groups.items():
        names = [str(n.target) for n in readers]
        linears: list[nn.Linear] = [result.get_submodule(n) for n in names]  # type: ignore[misc]
        s = _scale_weights(recorders[value].amax, linears, cfg)
        if s is None:
            continue
        with torch.no_grad():
            norm = _foldable_norm(gm, value, readers)
            if norm is not None:
                _fold(result.get_submodule(str(value.target)), s)  # type: ignore[arg-type]
                into = f"LayerNorm {value.target}"
            else:
                for name, linear in zip(names, linears, strict=True):
                    scaled = nn.Sequential(ChannelScale((1.0 / s).detach()), linear)
                    replace_submodule(result, name, scaled)
                into = "ChannelScale before each"
        report.append((tuple(names), into, float(s.min()), float(s.max())))
    setattr(result, "smooth_quant_report", SmoothQuantReport(tuple(report)))  # noqa: B010
    return result
