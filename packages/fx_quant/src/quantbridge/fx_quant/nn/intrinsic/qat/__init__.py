"""QAT fused modules (``torch.ao.nn.intrinsic.qat``'s layout), batch norm folded where fused."""

from quantbridge.fx_quant.nn.intrinsic.qat._conv_fused import (
    ConvBn1d,
    ConvBn2d,
    ConvBn3d,
    ConvBnReLU1d,
    ConvBnReLU2d,
    ConvBnReLU3d,
    ConvReLU1d,
    ConvReLU2d,
    ConvReLU3d,
    freeze_bn_stats,
    update_bn_stats,
)
from quantbridge.fx_quant.nn.intrinsic.qat._linear_bn import LinearBn1d
from quantbridge.fx_quant.nn.intrinsic.qat._linear_relu import LinearReLU

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
    "LinearBn1d",
    "LinearReLU",
    "freeze_bn_stats",
    "update_bn_stats",
]
