"""QAT Conv1d/2d/3d: the convolution runs on ``weight_fake_quant(weight)``."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from quantbridge.fx_quant.nn._module_args import conv_args, copy_parameters, float_with_relu
from quantbridge.fx_quant.nn.intrinsic import FusedModule
from quantbridge.fx_quant.nn.qat._common import (
    build_weight_fake_quant,
    float_module_qconfig,
    require_qconfig,
)

__all__ = ["Conv1d", "Conv2d", "Conv3d"]


class _ConvNd(nn.modules.conv._ConvNd):
    # Float module types from_float accepts, and what to_float builds.
    _FLOAT_MODULE: ClassVar[tuple[type[nn.Module], ...]]
    _FLOAT_CONV_MODULE: ClassVar[type[nn.modules.conv._ConvNd]]
    _FLOAT_RELU_MODULE: ClassVar[type[nn.Module] | None] = None
    # The fused float module to_float rebuilds when a ReLU follows.
    _FUSED_FLOAT_MODULE: ClassVar[type[nn.Module] | None] = None

    weight_fake_quant: nn.Module

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Any,
        stride: Any = 1,
        padding: Any = 0,
        dilation: Any = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: Any = "zeros",
        qconfig: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        # The float conv's __init__, then the qconfig and the weight fake-quant.
        float_init: Any = self._FLOAT_CONV_MODULE.__init__
        float_init(
            self, in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
            bias, padding_mode, device=device, dtype=dtype,
        )  # fmt: skip
        self.qconfig = require_qconfig(qconfig, type(self).__name__)
        self.weight_fake_quant = build_weight_fake_quant(qconfig, device, dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(input, self.weight_fake_quant(self.weight), self.bias)

    @classmethod
    def from_float(cls, mod: nn.Module, use_precomputed_fake_quant: bool = False) -> Any:
        """The QAT module for float ``mod`` (sharing its parameters), using ``mod.qconfig``."""
        qconfig = float_module_qconfig(mod, cls._FLOAT_MODULE, f"qat.{cls.__name__}")
        conv = mod[0] if isinstance(mod, FusedModule) else mod
        assert isinstance(conv, nn.modules.conv._ConvNd)
        qat = cls(*conv_args(conv), qconfig=qconfig)
        qat.weight = conv.weight
        qat.bias = conv.bias
        return qat

    def to_float(self) -> nn.Module:
        """The float conv (or fused conv-relu) with copies of this module's parameters."""
        float_cls: Any = self._FLOAT_CONV_MODULE
        conv: nn.Module = float_cls(*conv_args(self))
        copy_parameters(conv, self, ("weight", "bias"))
        return float_with_relu(self, conv)


class Conv1d(_ConvNd, nn.Conv1d):
    """QAT Conv1d."""

    _FLOAT_MODULE: ClassVar[tuple[type[nn.Module], ...]] = (nn.Conv1d,)
    _FLOAT_CONV_MODULE = nn.Conv1d


class Conv2d(_ConvNd, nn.Conv2d):
    """QAT Conv2d."""

    _FLOAT_MODULE: ClassVar[tuple[type[nn.Module], ...]] = (nn.Conv2d,)
    _FLOAT_CONV_MODULE = nn.Conv2d


class Conv3d(_ConvNd, nn.Conv3d):
    """QAT Conv3d."""

    _FLOAT_MODULE: ClassVar[tuple[type[nn.Module], ...]] = (nn.Conv3d,)
    _FLOAT_CONV_MODULE = nn.Conv3d
