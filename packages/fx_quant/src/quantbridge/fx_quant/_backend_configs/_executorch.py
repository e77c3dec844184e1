"""The executorch backend (what PyTorch lowers to through the executorch stack)."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

from quantbridge.fx_quant._backend_configs import _common as c
from quantbridge.fx_quant._backend_configs import _dtype_configs as d
from quantbridge.qconfig import BackendConfig

_BINARY_OPS = (operator.add, torch.add, operator.sub, torch.sub, operator.mul, torch.mul)
_SHARE_QPARAMS_OPS = (
    nn.Flatten,
    F.adaptive_avg_pool2d,
    F.elu,
    F.hardtanh,
    F.max_pool2d,
    F.pad,
    F.relu,
    F.relu6,
    F.leaky_relu,
    F.leaky_relu_,
    nn.AdaptiveAvgPool2d,
    nn.ConstantPad2d,
    nn.ELU,
    nn.MaxPool2d,
    nn.ReLU6,
    nn.Hardtanh,
    nn.LeakyReLU,
    torch.clamp,
    torch.flatten,
    torch.mean,
    torch.permute,
    torch.permute_copy,
    torch.squeeze,
    "clamp",
    "mean",
    "permute",
    "reshape",
    "relu",
    "relu_",
    "squeeze",
    "squeeze_",
    "leaky_relu",
)


def get_executorch_backend_config() -> BackendConfig:
    """The BackendConfig of the executorch backend: symmetric int8 (QNNPACK constraints) or
    uint8 for conv2d, linear, add/sub/mul, cat and shape-preserving ops; dynamic int8/float16
    linear; 8-bit weight-only embeddings."""
    symmetric_weighted = d.weighted_op_qint8_symmetric()
    symmetric_op = d.default_op_qint8_symmetric()
    weighted = d.weighted_op_quint8()
    default_op = d.default_op_quint8()
    linear = [
        symmetric_weighted,
        weighted,
        d.dynamic_int8(),
        d.dynamic_qint8_symmetric(),
        d.dynamic_float16(),
    ]
    ops = [symmetric_op, default_op]
    return (
        BackendConfig("executorch")
        .set_backend_pattern_configs(c.linear_configs(linear, fusions=False))
        .set_backend_pattern_configs(
            c.conv_configs([symmetric_weighted, weighted], [c.CONV2D], transpose=False)
        )
        # torch.ao lists the weighted-op config for binary ops; it is kept for equivalence.
        .set_backend_pattern_configs(
            c.binary_op_configs([symmetric_op, weighted], _BINARY_OPS, matmul=False)
        )
        .set_backend_pattern_configs(c.share_qparams_op_configs(ops, _SHARE_QPARAMS_OPS))
        .set_backend_pattern_configs([c.op_config(nn.BatchNorm2d, ops)])
        .set_backend_pattern_configs(
            c.cat_configs(ops, (torch.cat, torch.concat, torch.concatenate))
        )
        .set_backend_pattern_configs(c.embedding_configs([d.weight_only_quint8()], functional=True))
    )
