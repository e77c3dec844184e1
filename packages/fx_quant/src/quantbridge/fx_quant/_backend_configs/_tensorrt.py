"""The TensorRT backend (symmetric int8 activations and weights; experimental in torch.ao)."""

from __future__ import annotations

from typing import Any

import torch

from quantbridge.fx_quant._backend_configs import _common as c
from quantbridge.fx_quant._backend_configs import _dtype_configs as d
from quantbridge.qconfig import BackendConfig


def get_tensorrt_backend_config() -> BackendConfig:
    """The BackendConfig of the TensorRT backend: int8 conv, linear, addmm, binary ops, cat
    and shape ops."""
    weighted = d.weighted_op_qint8()
    default_op = d.default_op_qint8()
    addmm = c.op_config(torch.addmm, [weighted]).set_input_type_to_index(
        {"bias": 0, "input": 1, "weight": 2}
    )
    return (
        BackendConfig("tensorrt")
        .set_backend_pattern_configs(c.conv_configs([weighted]))
        .set_backend_pattern_config(addmm)
        .set_backend_pattern_configs(c.cat_configs([default_op]))
        .set_backend_pattern_configs(c.linear_configs([weighted]))
        .set_backend_pattern_configs(c.binary_op_configs([weighted]))
        .set_backend_pattern_configs(c.share_qparams_op_configs([default_op]))
        .set_backend_pattern_configs(c.tensor_info_op_configs([default_op]))
    )


def get_tensorrt_backend_config_dict() -> dict[str, Any]:
    """:func:`get_tensorrt_backend_config` in dict form (``BackendConfig.to_dict()``)."""
    return get_tensorrt_backend_config().to_dict()
