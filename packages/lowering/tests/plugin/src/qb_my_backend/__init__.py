"""The BackendConfig tutorial's ``my_backend`` (quantized linear and conv-relu only) as a plugin.

A third-party backend is a :class:`quantbridge.lowering.Backend` instance named by an entry
point in group ``quantbridge.backends``; quantbridge finds it through ``get_backend`` and
``convert_fx`` without importing this package by hand.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.fx import GraphModule

from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.fx_quant.nn import qat as nnqat
from quantbridge.fx_quant.nn import reference as nnqr
from quantbridge.fx_quant.nn.intrinsic import qat as nniqat
from quantbridge.lowering import Backend, lower_to_kernels
from quantbridge.qconfig import (
    BackendConfig,
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    MinMaxObserver,
    ObservationType,
    QConfig,
    QConfigMapping,
    default_weight_observer,
)

__all__ = ["MyBackend", "my_backend"]

_quint8 = DTypeWithConstraints(
    dtype=torch.quint8,
    quant_min_lower_bound=0,
    quant_max_upper_bound=255,
    scale_min_lower_bound=2**-12,
)
_weighted_int8 = DTypeConfig(
    input_dtype=_quint8, output_dtype=_quint8, weight_dtype=torch.qint8, bias_dtype=torch.float
)


def _fuse_conv2d_relu(is_qat: bool, conv: nn.Conv2d, relu: nn.ReLU) -> nn.Module:
    return nni.ConvReLU2d(conv, relu)


def my_backend_config() -> BackendConfig:
    linear = (
        BackendPatternConfig(nn.Linear)
        .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
        .add_dtype_config(_weighted_int8)
        .set_root_module(nn.Linear)
        .set_qat_module(nnqat.Linear)
        .set_reference_quantized_module(nnqr.Linear)
    )
    conv_relu_fusion = (
        BackendPatternConfig((nn.Conv2d, nn.ReLU))
        .set_fused_module(nni.ConvReLU2d)
        .set_fuser_method(_fuse_conv2d_relu)
    )
    conv_relu = (
        BackendPatternConfig(nni.ConvReLU2d)
        .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
        .add_dtype_config(_weighted_int8)
        .set_root_module(nn.Conv2d)
        .set_qat_module(nniqat.ConvReLU2d)
        .set_reference_quantized_module(nnqr.Conv2d)
    )
    return (
        BackendConfig("my_backend")
        .set_backend_pattern_config(linear)
        .set_backend_pattern_config(conv_relu_fusion)
        .set_backend_pattern_config(conv_relu)
    )


class MyBackend(Backend):
    """Linear and conv-relu, run by quantbridge's generic kernels."""

    def __init__(self) -> None:
        super().__init__(
            "my_backend", my_backend_config(), description="BackendConfig tutorial backend"
        )

    def qconfig_mapping(self, qat: bool = False) -> QConfigMapping:
        # full 8-bit activations: the lowering pass lowers uint8 quantize ops over [0, 255]
        act = MinMaxObserver.with_args(quant_min=0, quant_max=255, eps=2**-12)
        qconfig = QConfig(activation=act, weight=default_weight_observer)
        return (
            QConfigMapping()
            .set_object_type(nn.Linear, qconfig)
            .set_object_type(nn.Conv2d, qconfig)
            .set_object_type(nn.ReLU, qconfig)
        )

    def lower(self, reference_model: GraphModule) -> GraphModule:
        self._check_lowerable(reference_model)
        return lower_to_kernels(reference_model, "generic")


my_backend = MyBackend()
