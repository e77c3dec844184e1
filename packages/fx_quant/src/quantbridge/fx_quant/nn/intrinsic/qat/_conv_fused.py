"""QAT convolutions fused with batch norm and/or ReLU.

``ConvBn*`` fold batch norm into the weight the quantizer sees: with the per-channel factor
``s = bn.weight / sqrt(bn.running_var + bn.eps)`` the forward is
``bn(conv(x, fq(W * s), 0) / s + b)``. The convolution thus runs on the weight inference will
use, while ``bn`` still normalizes with batch statistics during training (and updates its
running statistics unless frozen with :meth:`freeze_bn_stats`). ``to_float`` folds the running
statistics into a plain conv. This is torch.ao's "approximate" single-pass scheme.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import init
from torch.nn.utils.fusion import fuse_conv_bn_weights

from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.fx_quant.nn import qat as nnqat
from quantbridge.fx_quant.nn._module_args import conv_args, copy_parameters, float_with_relu
from quantbridge.fx_quant.nn.intrinsic.qat._bn import BnStatsMixin, adopt_bn, make_bn
from quantbridge.fx_quant.nn.intrinsic.qat._linear_bn import LinearBn1d
from quantbridge.fx_quant.nn.qat._common import (
    build_weight_fake_quant,
    float_module_qconfig,
    require_qconfig,
)

__all__ = [
    "ConvBn1d",
    "ConvBn2d",
    "ConvBn3d",
    "ConvBnReLU1d",
    "ConvBnReLU2d",
    "ConvBnReLU3d",
    "ConvReLU1d",
    "ConvReLU2d",
    "ConvReLU3d",
    "freeze_bn_stats",
    "update_bn_stats",
]


class _ConvBnNd(BnStatsMixin, nn.modules.conv._ConvNd, nni.FusedModule):
    _version = 2
    _FLOAT_MODULE: ClassVar[type[nn.Module]]
    _FLOAT_CONV_MODULE: ClassVar[type[nn.modules.conv._ConvNd]]
    _FLOAT_BN_MODULE: ClassVar[type[nn.Module]]
    _FLOAT_RELU_MODULE: ClassVar[type[nn.Module] | None] = None
    _FUSED_FLOAT_MODULE: ClassVar[type[nn.Module] | None] = None

    bn: Any  # BatchNormNd or SyncBatchNorm

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Any,
        stride: Any = 1,
        padding: Any = 0,
        dilation: Any = 1,
        groups: int = 1,
        bias: bool | None = None,
        padding_mode: Any = "zeros",
        eps: float = 1e-05,
        momentum: float | None = 0.1,
        freeze_bn: bool = False,
        qconfig: Any = None,
    ) -> None:
        conv_cls: Any = self._FLOAT_CONV_MODULE
        conv_cls.__init__(
            self,
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            False,  # the conv bias is kept apart: it is added after undoing the BN scale
            padding_mode,
        )
        self.qconfig = require_qconfig(qconfig, f"qat.{type(self).__name__}")
        self.freeze_bn = freeze_bn if self.training else True
        self.bn = make_bn(self._FLOAT_BN_MODULE, out_channels, eps, momentum)
        self.weight_fake_quant = build_weight_fake_quant(qconfig, None, None)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_channels))
        else:
            self.register_parameter("bias", None)
        self.reset_bn_parameters()
        if self.training and not freeze_bn:
            self.update_bn_stats()
        else:
            self.freeze_bn_stats()
        # torch.ao's switch for the two-pass forward (exact with bn.weight == 0).
        self._enable_slow_path_for_better_numerical_stability = False

    def reset_bn_parameters(self) -> None:
        self.reset_running_stats()
        init.uniform_(self.bn.weight)
        init.zeros_(self.bn.bias)
        if self.bias is not None:  # the conv bias, initialised like nn.Conv's
            fan_in, _ = init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in)
            init.uniform_(self.bias, -bound, bound)

    def _shapes(self) -> tuple[list[int], list[int]]:
        """Broadcast shapes of a per-output-channel vector: over the weight, over the output."""
        ndim = self.weight.dim()
        return [-1] + [1] * (ndim - 1), [1, -1] + [1] * (ndim - 2)

    def _scaled_weight(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(fake-quantized W * s, s, running std) with s = bn.weight / running std."""
        weight_shape, _ = self._shapes()
        running_std = torch.sqrt(self.bn.running_var + self.bn.eps)
        scale_factor = self.bn.weight / running_std
        scaled = self.weight_fake_quant(self.weight * scale_factor.reshape(weight_shape))
        return scaled, scale_factor, running_std

    def _forward(self, input: torch.Tensor) -> torch.Tensor:
        if self._enable_slow_path_for_better_numerical_stability:
            return self._forward_slow(input)
        return self._forward_approximate(input)

    def _forward_approximate(self, input: torch.Tensor) -> torch.Tensor:
        """One pass: undo the BN scale after the conv and let ``bn`` normalise."""
        _, channel_shape = self._shapes()
        scaled_weight, scale_factor, _ = self._scaled_weight()
        zero_bias = (
            torch.zeros_like(self.bias, dtype=input.dtype)
            if self.bias is not None
            else torch.zeros(self.out_channels, device=scaled_weight.device, dtype=input.dtype)
        )
        conv = self._conv_forward(input, scaled_weight, zero_bias)
        conv_orig = conv / scale_factor.reshape(channel_shape)
        if self.bias is not None:
            conv_orig = conv_orig + self.bias.reshape(channel_shape)
        result: torch.Tensor = self.bn(conv_orig)
        return result

    def _forward_slow(self, input: torch.Tensor) -> torch.Tensor:
        """Two passes (Krishnamoorthi 2018, sec. 3.2): fold with running statistics, then
        rescale to batch statistics while training. Well defined when bn.weight is 0."""
        _, channel_shape = self._shapes()
        zero_bias = torch.zeros(self.out_channels, device=self.weight.device, dtype=input.dtype)
        if self.bn.training:
            # Float conv to get the batch statistics (and update the running ones).
            conv_out = self._conv_forward(input, self.weight, zero_bias)
            with torch.no_grad():
                biased = (
                    conv_out if self.bias is None else conv_out + self.bias.reshape(channel_shape)
                )
                self.bn(biased)
            scaled_weight, _, running_std = self._scaled_weight()
            conv_bn = self._conv_forward(input, scaled_weight, zero_bias)
            dims = [0, *range(2, self.weight.dim())]
            batch_mean = conv_out.mean(dims)
            batch_var = torch.square(conv_out - batch_mean.reshape(channel_shape)).mean(dims)
            batch_std = torch.sqrt(batch_var + self.bn.eps)
            # conv(x, r W / running_std) * (running_std / batch_std) = conv(x, r W / batch_std)
            conv_bn *= (running_std / batch_std).reshape(channel_shape)
            fused_mean, fused_std = batch_mean, batch_std
        else:
            scaled_weight, _, running_std = self._scaled_weight()
            conv_bn = self._conv_forward(input, scaled_weight, zero_bias)
            fused_mean = self.bn.running_mean - (self.bias if self.bias is not None else 0)
            fused_std = running_std
        fused_bias = self.bn.bias - self.bn.weight * fused_mean / fused_std
        conv_bn += fused_bias.reshape(channel_shape)
        if self.bias is not None:
            # Keep the conv bias in the autograd graph (DDP expects every parameter used).
            conv_bn += (self.bias - self.bias).reshape(channel_shape)
        return conv_bn

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._forward(input)

    def train(self, mode: bool = True) -> _ConvBnNd:
        # A frozen batch norm keeps its eval behaviour whatever mode the model is put in.
        self.training = mode
        if not self.freeze_bn:
            for module in self.children():
                module.train(mode)
        return self

    @classmethod
    def from_float(cls, mod: nn.Module, use_precomputed_fake_quant: bool = False) -> Any:
        """QAT module for a fused float ConvBn(ReLU) (parameters and BN statistics shared)."""
        qconfig = float_module_qconfig(mod, (cls._FLOAT_MODULE,), f"qat.{cls.__name__}")
        conv, bn = mod[0], mod[1]  # type: ignore[index]
        args = (*conv_args(conv), bn.eps, bn.momentum, False, qconfig)
        qat = cls(*args)
        qat.weight = conv.weight
        qat.bias = conv.bias
        adopt_bn(qat, bn)
        return qat

    def to_float(self) -> nn.Module:
        """A float conv with the running BN statistics folded in (plus ReLU if fused)."""
        float_cls: Any = self._FLOAT_CONV_MODULE
        conv: Any = float_cls(*conv_args(self))
        copy_parameters(conv, self, ("weight", "bias"))
        assert self.bn.running_mean is not None
        assert self.bn.running_var is not None
        conv.weight, conv.bias = fuse_conv_bn_weights(
            conv.weight,
            conv.bias,
            self.bn.running_mean,
            self.bn.running_var,
            self.bn.eps,
            self.bn.weight,
            self.bn.bias,
        )
        return float_with_relu(self, conv)


class ConvBn1d(_ConvBnNd, nn.Conv1d):
    """QAT ``Conv1d -> BatchNorm1d`` with BN folded into the fake-quantized weight."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nni.ConvBn1d
    _FLOAT_CONV_MODULE = nn.Conv1d
    _FLOAT_BN_MODULE = nn.BatchNorm1d


class ConvBn2d(_ConvBnNd, nn.Conv2d):
    """QAT ``Conv2d -> BatchNorm2d`` with BN folded into the fake-quantized weight."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nni.ConvBn2d
    _FLOAT_CONV_MODULE = nn.Conv2d
    _FLOAT_BN_MODULE = nn.BatchNorm2d


class ConvBn3d(_ConvBnNd, nn.Conv3d):
    """QAT ``Conv3d -> BatchNorm3d`` with BN folded into the fake-quantized weight."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nni.ConvBn3d
    _FLOAT_CONV_MODULE = nn.Conv3d
    _FLOAT_BN_MODULE = nn.BatchNorm3d


class ConvBnReLU1d(ConvBn1d):
    """QAT ``Conv1d -> BatchNorm1d -> ReLU``."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nni.ConvBnReLU1d
    _FLOAT_RELU_MODULE = nn.ReLU
    _FUSED_FLOAT_MODULE = nni.ConvReLU1d

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.relu(self._forward(input))


class ConvBnReLU2d(ConvBn2d):
    """QAT ``Conv2d -> BatchNorm2d -> ReLU``."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nni.ConvBnReLU2d
    _FLOAT_RELU_MODULE = nn.ReLU
    _FUSED_FLOAT_MODULE = nni.ConvReLU2d

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.relu(self._forward(input))


class ConvBnReLU3d(ConvBn3d):
    """QAT ``Conv3d -> BatchNorm3d -> ReLU``."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nni.ConvBnReLU3d
    _FLOAT_RELU_MODULE = nn.ReLU
    _FUSED_FLOAT_MODULE = nni.ConvReLU3d

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.relu(self._forward(input))


class _ReLUAfterConv:
    """The QAT conv's forward followed by ReLU (ConvReLU1d/2d/3d)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.relu(super().forward(input))  # type: ignore[misc]


class ConvReLU1d(_ReLUAfterConv, nnqat.Conv1d, nni.FusedModule):
    """QAT ``Conv1d -> ReLU``."""

    _FLOAT_MODULE: ClassVar[tuple[type[nn.Module], ...]] = (nni.ConvReLU1d,)
    _FLOAT_RELU_MODULE = nn.ReLU
    _FUSED_FLOAT_MODULE = nni.ConvReLU1d


class ConvReLU2d(_ReLUAfterConv, nnqat.Conv2d, nni.FusedModule):
    """QAT ``Conv2d -> ReLU``."""

    _FLOAT_MODULE: ClassVar[tuple[type[nn.Module], ...]] = (nni.ConvReLU2d,)
    _FLOAT_RELU_MODULE = nn.ReLU
    _FUSED_FLOAT_MODULE = nni.ConvReLU2d


class ConvReLU3d(_ReLUAfterConv, nnqat.Conv3d, nni.FusedModule):
    """QAT ``Conv3d -> ReLU``."""

    _FLOAT_MODULE: ClassVar[tuple[type[nn.Module], ...]] = (nni.ConvReLU3d,)
    _FLOAT_RELU_MODULE = nn.ReLU
    _FUSED_FLOAT_MODULE = nni.ConvReLU3d


def update_bn_stats(mod: nn.Module) -> None:
    """``model.apply(update_bn_stats)``: unfreeze batch norm in every BN-folding QAT module."""
    if isinstance(mod, (_ConvBnNd, LinearBn1d)):
        mod.update_bn_stats()


def freeze_bn_stats(mod: nn.Module) -> None:
    """``model.apply(freeze_bn_stats)``: freeze batch norm in every BN-folding QAT module."""
    if isinstance(mod, (_ConvBnNd, LinearBn1d)):
        mod.freeze_bn_stats()
