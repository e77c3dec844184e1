"""The onednn backend (Intel CPUs through oneDNN), with conv-add and linear-eltwise fusions."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantbridge.fx_quant._backend_configs import _common as c
from quantbridge.fx_quant._backend_configs import _dtype_configs as d
from quantbridge.fx_quant._backend_configs import _fusers as f
from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.fx_quant.nn import reference as nnqr
from quantbridge.patterns import MatchAllNode, Pattern
from quantbridge.qconfig import BackendConfig, BackendPatternConfig, DTypeConfig

_ADD_OPS: tuple[Callable[..., Any], ...] = (torch.add, operator.add)
_Getter = Callable[[Any], Any]
# (fuser, root node getter, extra inputs getter), keyed by (relu?, conv on the left?, bn?).
_CONV_ADD_FUNCTIONS: dict[tuple[bool, bool, bool], tuple[Callable[..., Any], _Getter, _Getter]] = {
    (False, True, True): (
        f.fuse_conv_bn_add_left,
        f.conv_bn_add_root_node_getter_left,
        f.conv_bn_add_extra_inputs_getter_left,
    ),
    (False, True, False): (
        f.fuse_conv_add_left,
        f.conv_add_root_node_getter_left,
        f.conv_add_extra_inputs_getter_left,
    ),
    (False, False, True): (
        f.fuse_conv_bn_add_right,
        f.conv_bn_add_root_node_getter_right,
        f.conv_bn_add_extra_inputs_getter_right,
    ),
    (False, False, False): (
        f.fuse_conv_add_right,
        f.conv_add_root_node_getter_right,
        f.conv_add_extra_inputs_getter_right,
    ),
    (True, True, True): (
        f.fuse_conv_bn_add_relu_left,
        f.conv_bn_add_relu_root_node_getter_left,
        f.conv_bn_add_relu_extra_inputs_getter_left,
    ),
    (True, True, False): (
        f.fuse_conv_add_relu_left,
        f.conv_add_relu_root_node_getter_left,
        f.conv_add_relu_extra_inputs_getter_left,
    ),
    (True, False, True): (
        f.fuse_conv_bn_add_relu_right,
        f.conv_bn_add_relu_root_node_getter_right,
        f.conv_bn_add_relu_extra_inputs_getter_right,
    ),
    (True, False, False): (
        f.fuse_conv_add_relu_right,
        f.conv_add_relu_root_node_getter_right,
        f.conv_add_relu_extra_inputs_getter_right,
    ),
}


def _conv_add_configs(dtype_configs: list[DTypeConfig], *, relu: bool) -> c.Configs:
    """``add(conv(x), y)`` / ``add(y, conv(x))``, with or without a batch norm after the conv,
    for ``torch.add`` and ``operator.add``; wrapped in ``nn.ReLU`` when ``relu``. Then the
    fused module itself, which convert treats as a Conv2d."""
    fused = nni.ConvAddReLU2d if relu else nni.ConvAdd2d
    configs: c.Configs = []
    for conv_left in (True, False):
        for with_bn, add in itertools.product((True, False), _ADD_OPS):
            conv: Pattern = (nn.BatchNorm2d, nn.Conv2d) if with_bn else nn.Conv2d
            operands = (conv, MatchAllNode) if conv_left else (MatchAllNode, conv)
            pattern: Pattern = (add, *operands)
            if relu:
                pattern = (nn.ReLU, pattern)
            fuser, root_getter, extra_getter = _CONV_ADD_FUNCTIONS[(relu, conv_left, with_bn)]
            configs.append(
                BackendPatternConfig()
                .set_pattern_complex_format(pattern)
                .set_dtype_configs(list(dtype_configs))
                .set_fuser_method(fuser)
                .set_root_node_getter(root_getter)
                .set_extra_inputs_getter(extra_getter)
                .set_fused_module(fused)
            )
    configs.append(c.weighted_root_config(fused, dtype_configs, nn.Conv2d, nnqr.Conv2d))
    return configs


def get_onednn_backend_config() -> BackendConfig:
    """The BackendConfig of the onednn backend: native's families plus conv + add (+ relu)
    fusions (conv on either side of the add, with or without batch norm) and linear +
    leaky_relu / tanh fusions; int8 dynamic linear and RNNs; int8 weight-only embeddings."""
    weighted = d.weighted_op_quint8()
    default_op = d.default_op_quint8()
    dynamic = d.dynamic_int8()
    conv_dtypes = [weighted]
    linear_dtypes = [weighted, dynamic]
    conv = (
        c.conv_configs(conv_dtypes)
        + _conv_add_configs(conv_dtypes, relu=False)
        + _conv_add_configs(conv_dtypes, relu=True)
    )
    leaky = c.linear_eltwise_configs(
        linear_dtypes, nn.LeakyReLU, F.leaky_relu, f.fuse_linear_leaky_relu, nni.LinearLeakyReLU
    )
    # Linear + bn + leaky relu folds the bn and lands on the same fused module.
    leaky.append(
        c.fusion_config(
            (nn.Linear, nn.BatchNorm1d, nn.LeakyReLU),
            linear_dtypes,
            f.fuse_linear_bn_leaky_relu,
            nni.LinearLeakyReLU,
        )
    )
    tanh = c.linear_eltwise_configs(
        linear_dtypes, nn.Tanh, torch.tanh, f.fuse_linear_tanh, nni.LinearTanh
    )
    return (
        BackendConfig("onednn")
        .set_backend_pattern_configs(conv)
        .set_backend_pattern_configs(c.linear_configs(linear_dtypes) + leaky + tanh)
        .set_backend_pattern_configs(c.binary_op_configs([default_op]))
        .set_backend_pattern_configs(c.cat_configs([default_op]))
        .set_backend_pattern_configs(c.default_op_configs([default_op]))
        .set_backend_pattern_configs(c.fixed_qparams_op_configs([default_op]))
        .set_backend_pattern_configs(c.share_qparams_op_configs([default_op]))
        .set_backend_pattern_configs(c.bn_configs([default_op]))
        .set_backend_pattern_configs(c.layer_norm_configs([d.input_output_only_quint8()]))
        .set_backend_pattern_configs(c.rnn_configs([dynamic]))
        .set_backend_pattern_configs(c.embedding_configs([d.weight_only_qint8()]))
    )
