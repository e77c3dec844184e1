"""SmoothQuant: migrate activation outliers into the weights before static quantization.

For a group of Linears reading the same value X (q/k/v read one LayerNorm output), per input
channel j: ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` (W: the group's weights stacked),
from a calibration pass. Then ``W[:, j] *= s_j`` and X is divided by s: folded into the
producing LayerNorm's weight and bias when the Linears are its only users, else by an explicit
per-channel ``mul`` node inserted before them. The float function is unchanged (up to float
rounding); X's channel ranges are flattened, so a per-tensor activation scale wastes fewer
levels on outlier channels, while per-channel weight scales absorb the growth of W's columns.
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
from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._tracer import trace

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


class _ChannelMax(nn.Module):
    """Records max |x| per last-axis channel; returns x unchanged (calibration only)."""

    amax: torch.Tensor | None

    def __init__(self) -> None:
        super().__init__()
        self.amax: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            m = x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float()
            seen = self.amax
            self.amax = m if seen is None else torch.maximum(seen, m)
        return x


class _ChannelScale(nn.Module):
    """``x * inv_scale`` per last-axis channel: 1/s where no LayerNorm can absorb it."""

    inv_scale: torch.Tensor

    def __init__(self, inv_scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("inv_scale", inv_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.inv_scale


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
) -> GraphModule:
    """A traced copy of ``model`` with SmoothQuant's scale migration applied (``model`` is
    not changed); prepare it as usual (``prepare_fx``), then calibrate again.

    ``calibration_data``/``input_fn``/``max_batches`` as in :func:`calibrate`. Each group of
    ``nn.Linear`` modules reading one value is smoothed (see the module docstring); the
    result's ``meta["smooth_quant"]`` is a :class:`SmoothQuantReport`.
    """
    cfg = SmoothQuantConfig() if config is None else config
    if not isinstance(cfg, SmoothQuantConfig):
        raise FxQuantError(
            f"smooth_quant: config must be a SmoothQuantConfig, got {type(cfg).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise FxQuantError(f"smooth_quant: model must be an nn.Module, got {type(model).__name__}")
    gm, _ = trace(copy.deepcopy(model).eval())
    groups = _groups(gm)
    recorders: dict[Node, _ChannelMax] = {}
    for i, value in enumerate(groups):
        name = f"_smooth_quant_max_{i}"
        recorders[value] = _ChannelMax()
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
        amax = recorders[value].amax
        linears: list[nn.Linear] = [gm.get_submodule(str(n.target)) for n in readers]  # type: ignore[misc]
        if amax is None:
            continue  # never ran during calibration
        w_amax = torch.stack([m.weight.detach().abs().amax(0) for m in linears]).amax(0).float()
        if w_amax.shape != amax.shape:
            continue  # input not laid out [..., in_features]
        alpha = float(cfg.alpha)
        s = amax.clamp(min=cfg.min_scale).pow(alpha) / w_amax.clamp(min=cfg.min_scale).pow(
            1.0 - alpha
        )
        s = torch.where((amax > 0) & (w_amax > 0), s.clamp(min=cfg.min_scale), torch.ones_like(s))
        with torch.no_grad():
            for m in linears:
                m.weight.mul_(s.to(m.weight.dtype))
            norm = _foldable_norm(gm, value, readers)
            if norm is not None:
                norm.weight.div_(s.to(norm.weight.dtype))
                norm.bias.div_(s.to(norm.bias.dtype))
                into = f"LayerNorm {value.target}"
            else:
                name = f"{str(readers[0].target).replace('.', '_')}_smooth"
                gm.add_submodule(name, _ChannelScale((1.0 / s).detach()))
                with gm.graph.inserting_after(value):
                    scaled = gm.graph.call_module(name, (value,))
                for linear in readers:
                    linear.replace_input_with(value, scaled)
                into = f"mul {name}"
        report.append((tuple(str(n.target) for n in readers), into, float(s.min()), float(s.max())))
    gm.recompile()
    gm.meta["smooth_quant"] = SmoothQuantReport(tuple(report))
    return gm
