"""Calibration helpers of the model transforms (``smooth_quant``, ``keep_outlier_channels_float``):
the largest magnitude of each channel of a value, and replacing a submodule by name."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ChannelMax(nn.Module):
    """Records max |x| per last-axis channel; returns x unchanged (calibration only). Called
    as a graph node, or as a module's forward pre-hook on its first argument (``pre_hook``)."""

    amax: torch.Tensor | None

    def __init__(self) -> None:
        super().__init__()
        self.amax: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
            m = x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float()
            seen = self.amax
            self.amax = m if seen is None else torch.maximum(seen, m)
        return x

    def pre_hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if args:
            self(args[0])


def replace_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at the qualified ``name`` under ``root``."""
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)
