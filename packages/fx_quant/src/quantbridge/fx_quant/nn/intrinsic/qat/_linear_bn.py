"""QAT LinearBn1d: linear with batch norm folded into the fake-quantized weight."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import init
from torch.nn.utils.fusion import fuse_linear_bn_weights

from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.fx_quant.nn.intrinsic.qat._bn import BnStatsMixin, adopt_bn, make_bn
from quantbridge.fx_quant.nn.qat._common import (
    build_weight_fake_quant,
    float_module_qconfig,
    require_qconfig,
)

__all__ = ["LinearBn1d"]


class LinearBn1d(BnStatsMixin, nn.Linear, nni.FusedModule):
    """``Linear -> BatchNorm1d`` for QAT, folding BN's scale into the weight before fake-quant.

    Forward: with ``s = bn.weight / sqrt(running_var + eps)``, compute
    ``linear(x, fq(W * s), 0) / s + b`` and feed it to ``bn`` (which updates its statistics
    while training and not frozen). The weight the quantizer sees is the one inference uses.
    """

    bn: Any  # BatchNorm1d or SyncBatchNorm

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        eps: float = 1e-05,
        momentum: float | None = 0.1,
        freeze_bn: bool = False,
        qconfig: Any = None,
    ) -> None:
        nn.Linear.__init__(self, in_features, out_features, bias)
        self.qconfig = require_qconfig(qconfig, "qat.LinearBn1d")
        self.freeze_bn = freeze_bn if self.training else True
        self.bn = make_bn(nn.BatchNorm1d, out_features, eps, momentum)
        self.weight_fake_quant = build_weight_fake_quant(qconfig, None, None)
        self.reset_bn_parameters()
        if self.training and not freeze_bn:
            self.update_bn_stats()
        else:
            self.freeze_bn_stats()

    def reset_bn_parameters(self) -> None:
        self.reset_running_stats()
        init.uniform_(self.bn.weight)
        init.zeros_(self.bn.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        running_std = torch.sqrt(self.bn.running_var + self.bn.eps)
        scale_factor = self.bn.weight / running_std
        scaled_weight = self.weight_fake_quant(self.weight * scale_factor.reshape(-1, 1))
        zero_bias = (
            torch.zeros_like(self.bias)
            if self.bias is not None
            else torch.zeros(self.out_features, device=scaled_weight.device)
        )
        out = F.linear(input, scaled_weight, zero_bias)
        out = out / scale_factor.reshape(1, -1)
        if self.bias is not None:
            out = out + self.bias.reshape(1, -1)
        result: torch.Tensor = self.bn(out)
        return result

    def train(self, mode: bool = True) -> LinearBn1d:
        # A frozen batch norm keeps its eval behaviour whatever mode the model is put in.
        self.training = mode
        if not self.freeze_bn:
            for module in self.children():
                module.train(mode)
        return self

    @classmethod
    def from_float(cls, mod: nn.Module, use_precomputed_fake_quant: bool = False) -> LinearBn1d:
        """QAT module for a fused float LinearBn1d (parameters and BN statistics shared)."""
        qconfig = float_module_qconfig(mod, (nni.LinearBn1d,), "qat.LinearBn1d")
        linear, bn = mod[0], mod[1]  # type: ignore[index]
        qat = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            bn.eps,
            bn.momentum,
            False,
            qconfig,
        )
        qat.weight = linear.weight
        qat.bias = linear.bias
        adopt_bn(qat, bn)
        return qat

    def to_float(self) -> nn.Linear:
        """A float Linear with batch norm folded in (running statistics)."""
        linear = nn.Linear(self.in_features, self.out_features)
        assert self.bn.running_mean is not None
        assert self.bn.running_var is not None
        linear.weight, linear.bias = fuse_linear_bn_weights(
            self.weight,
            self.bias,
            self.bn.running_mean,
            self.bn.running_var,
            self.bn.eps,
            self.bn.weight,
            self.bn.bias,
        )
        return linear
