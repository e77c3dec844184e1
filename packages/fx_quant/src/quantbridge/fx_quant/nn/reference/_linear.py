"""Reference quantized Linear: ``F.linear(x, dequantize(quantize(weight)), bias)``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantbridge.fx_quant.nn._module_args import copy_parameters
from quantbridge.fx_quant.nn.reference._base import ReferenceQuantizedModule

__all__ = ["Linear"]


class Linear(nn.Linear, ReferenceQuantizedModule):
    """Reference quantized Linear (activations stay float; the weight round-trips)."""

    _IS_REFERENCE = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias_: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        weight_qparams: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias_, device, dtype)
        self._init_weight_qparams(weight_qparams, device)

    def _get_name(self) -> str:
        return "QuantizedLinear(Reference)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.get_weight(), self.bias)

    @classmethod
    def from_float(cls, float_linear: nn.Linear, weight_qparams: Mapping[str, Any]) -> Linear:
        """A reference Linear with ``float_linear``'s parameters (detached) and these qparams."""
        ref = cls(
            float_linear.in_features,
            float_linear.out_features,
            float_linear.bias is not None,
            device=float_linear.weight.device,
            dtype=float_linear.weight.dtype,
            weight_qparams=weight_qparams,
        )
        copy_parameters(ref, float_linear, ("weight", "bias"))
        ref._check_weight_qparams()
        return ref
