"""QAT Linear: ``F.linear(x, weight_fake_quant(weight), bias)``."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrize import (
    is_parametrized,
    transfer_parametrizations_and_params,
    type_before_parametrizations,
)

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant.nn._module_args import copy_parameters
from quantbridge.fx_quant.nn.intrinsic import LinearReLU as FusedLinearReLU
from quantbridge.fx_quant.nn.qat._common import build_weight_fake_quant, require_qconfig

__all__ = ["Linear"]


class Linear(nn.Linear):
    """A Linear whose weight passes through ``qconfig.weight()`` (a fake-quant) in forward."""

    _FLOAT_MODULE: ClassVar[tuple[type[nn.Module], ...]] = (nn.Linear,)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        qconfig: Any = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.qconfig = require_qconfig(qconfig, type(self).__name__)
        self.weight_fake_quant = build_weight_fake_quant(qconfig, device, dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight_fake_quant(self.weight), self.bias)

    @classmethod
    def from_float(cls, mod: nn.Module, use_precomputed_fake_quant: bool = False) -> Linear:
        """The QAT module for float ``mod`` (sharing its parameters), using ``mod.qconfig``."""
        where = f"qat.{cls.__name__}"
        kind = type_before_parametrizations(mod)
        if kind not in cls._FLOAT_MODULE:
            names = " or ".join(t.__name__ for t in cls._FLOAT_MODULE)
            raise FxQuantError(f"{where}.from_float only works for {names}, got {kind.__name__}")
        qconfig = getattr(mod, "qconfig", None)
        if not qconfig:
            raise FxQuantError(f"{where}.from_float: the float module has no qconfig; attach one")
        linear = mod[0] if isinstance(mod, FusedLinearReLU) else mod
        assert isinstance(linear, nn.Linear)
        qat = cls(linear.in_features, linear.out_features, linear.bias is not None, qconfig)
        for name in ("weight", "bias"):
            if is_parametrized(linear, name):
                transfer_parametrizations_and_params(linear, qat, name)
            else:
                setattr(qat, name, getattr(linear, name))
        return qat

    def to_float(self) -> nn.Module:
        """A plain nn.Linear with copies of this module's weight and bias."""
        linear = nn.Linear(self.in_features, self.out_features, self.bias is not None)
        copy_parameters(linear, self, ("weight", "bias"))
        linear.train(self.training)
        return linear
