"""Importable objects for the configuration and JSON tests (a stand-in for a user's backend).

JSON refers to these by qualified name (``config_backend_helpers.fuse_conv2d_relu``), so they
must live at module level of an importable module. Nothing here imports torch.ao.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = str(Path(__file__).resolve().parent)


def make_importable() -> None:
    """Put this directory on sys.path (tests run under --import-mode=importlib)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)


class DummyObserver(nn.Module):
    """An observer-shaped module with the usual constructor arguments."""

    def __init__(
        self,
        dtype: torch.dtype = torch.uint8,
        qscheme: Any = "per_tensor_affine",
        quant_min: int | None = None,
        quant_max: int | None = None,
        eps: float = torch.finfo(torch.float32).eps,
        observer: Any = None,
    ) -> None:
        super().__init__()
        self.dtype = dtype
        self.qscheme = qscheme
        self.quant_min = quant_min
        self.quant_max = quant_max
        self.eps = eps
        self.observer = observer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class DummyWeightObserver(DummyObserver):
    pass


class ConvReLU2dStandIn(nn.Sequential):
    """Fused conv-relu stand-in."""


class QATConvReLU2dStandIn(nn.Sequential):
    pass


class ReferenceConv2dStandIn(nn.Conv2d):
    pass


def fuse_conv2d_relu(is_qat: bool, conv: nn.Module, relu: nn.Module) -> nn.Module:
    """The seed tutorial's fuser: conv + relu -> one fused module."""
    try:  # the tutorial builds torch.ao's ConvReLU2d; fall back where torch.ao is gone
        from torch.ao.nn.intrinsic import ConvReLU2d

        return ConvReLU2d(conv, relu)  # type: ignore[no-any-return]
    except ImportError:  # pragma: no cover
        return ConvReLU2dStandIn(conv, relu)


def fuse_four(is_qat: bool, a: nn.Module, b: nn.Module, c: nn.Module, d: nn.Module) -> nn.Module:
    return nn.Sequential(a, b, c, d)


def root_node_getter(pattern: Any) -> Any:
    _relu, (_bn, conv) = pattern
    return conv


def extra_inputs_getter(pattern: Any) -> list[Any]:
    _add, extra, _ = pattern
    return [extra]


def make_local_function() -> Any:
    def local_fuser(is_qat: bool, *mods: nn.Module) -> nn.Module:
        return nn.Sequential(*mods)

    return local_fuser
