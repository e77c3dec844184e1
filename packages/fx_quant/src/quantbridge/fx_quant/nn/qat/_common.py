"""Shared checks of the QAT modules: the qconfig a float module brings, and its weight factory."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quantbridge.fx_quant._errors import FxQuantError


def require_qconfig(qconfig: Any, where: str) -> Any:
    """``qconfig`` if it can build a weight fake-quant; FxQuantError otherwise."""
    if not qconfig:
        raise FxQuantError(
            f"{where}: a QAT module needs a qconfig (QConfig(activation=..., weight=...)); "
            "set module.qconfig or pass qconfig=..."
        )
    if not callable(getattr(qconfig, "weight", None)):
        raise FxQuantError(f"{where}: qconfig.weight must be a fake-quant factory, got {qconfig!r}")
    return qconfig


def float_module_qconfig(mod: nn.Module, expected: tuple[type[nn.Module], ...], where: str) -> Any:
    """The qconfig attached to float module ``mod`` after checking its exact type."""
    if type(mod) not in expected:
        names = " or ".join(t.__name__ for t in expected)
        raise FxQuantError(f"{where}.from_float only works for {names}, got {type(mod).__name__}")
    qconfig = getattr(mod, "qconfig", None)
    if not qconfig:
        raise FxQuantError(
            f"{where}.from_float: the float module has no qconfig; attach one "
            "(module.qconfig = ...) before converting it"
        )
    return require_qconfig(qconfig, where)


def build_weight_fake_quant(
    qconfig: Any, device: torch.device | str | None, dtype: torch.dtype | None
) -> nn.Module:
    """A fresh weight fake-quant from ``qconfig.weight``, on ``device``/``dtype`` if given."""
    if device is None and dtype is None:
        module: nn.Module = qconfig.weight()
    else:
        module = qconfig.weight(factory_kwargs={"device": device, "dtype": dtype})
    return module
