"""Fused float modules (``torch.ao.nn.intrinsic``'s layout): the units fusion produces.

QAT versions live in :mod:`quantbridge.fx_quant.nn.intrinsic.qat`.
"""

from quantbridge.fx_quant.nn.intrinsic._fused import (
    BNReLU2d,
    BNReLU3d,
    ConvAdd2d,
    ConvAddReLU2d,
    ConvBn1d,
    ConvBn2d,
    ConvBn3d,
    ConvBnReLU1d,
    ConvBnReLU2d,
    ConvBnReLU3d,
    ConvReLU1d,
    ConvReLU2d,
    ConvReLU3d,
    FusedModule,
    LinearBn1d,
    LinearLeakyReLU,
    LinearReLU,
    LinearTanh,
)

__all__ = [
    "BNReLU2d",
    "BNReLU3d",
    "ConvAdd2d",
    "ConvAddReLU2d",
    "ConvBn1d",
    "ConvBn2d",
    "ConvBn3d",
    "ConvBnReLU1d",
    "ConvBnReLU2d",
    "ConvBnReLU3d",
    "ConvReLU1d",
    "ConvReLU2d",
    "ConvReLU3d",
    "FusedModule",
    "LinearBn1d",
    "LinearLeakyReLU",
    "LinearReLU",
    "LinearTanh",
]
