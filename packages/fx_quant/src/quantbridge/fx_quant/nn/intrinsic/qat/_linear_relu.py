"""QAT LinearReLU: ``relu(linear(x, weight_fake_quant(weight), bias))``."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.fx_quant.nn.qat import Linear

__all__ = ["LinearReLU"]


class LinearReLU(Linear, nni.FusedModule):
    """QAT version of the fused ``Linear -> ReLU``."""

    _FLOAT_MODULE: ClassVar[tuple[type[nn.Module], ...]] = (nni.LinearReLU,)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.relu(F.linear(input, self.weight_fake_quant(self.weight), self.bias))

    def to_float(self) -> nn.Module:
        """A fused float LinearReLU with copies of this module's parameters."""
        return nni.LinearReLU(super().to_float(), nn.ReLU())
