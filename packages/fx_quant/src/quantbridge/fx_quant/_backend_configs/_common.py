"""Building blocks of the built-in BackendConfigs: one function per operator family.

Each function takes the DTypeConfigs a backend supports for that family and returns the
BackendPatternConfigs, in the order torch.ao 2.13 registers them (registration order is
observable: ``BackendConfig.configs`` keeps it, and a pattern registered twice keeps its first
position with the later settings, which several families rely on).

Modules named in the configs are ours (``quantbridge.fx_quant.nn...``); plain torch modules,
functions, operators and method-name strings are as in torch.ao.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantbridge.fx_quant._backend_configs import _fusers
from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._fuser_methods import (
    fuse_conv_bn,
    fuse_conv_bn_relu,
    fuse_convtranspose_bn,
    fuse_linear_bn,
)
from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.fx_quant.nn import qat as nnqat
from quantbridge.fx_quant.nn import reference as nnqr
from quantbridge.fx_quant.nn.intrinsic import qat as nniqat
from quantbridge.patterns import Pattern
from quantbridge.qconfig import (
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    ObservationType,
)

Configs = list[BackendPatternConfig]
DTypeConfigs = Sequence[DTypeConfig]
ModuleType = type[nn.Module]

_DIFFERENT = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
_SHARE = ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT
_NOT_OBSERVED = ObservationType.INPUT_OUTPUT_NOT_OBSERVED


def op_config(
    pattern: Pattern, dtype_configs: DTypeConfigs, observation_type: ObservationType = _DIFFERENT
) -> BackendPatternConfig:
    """The plainest entry: a pattern, where its observers go, and its dtype configs."""
    return (
        BackendPatternConfig(pattern)
        .set_observation_type(observation_type)
        .set_dtype_configs(list(dtype_configs))
    )


def weighted_root_config(
    pattern: Pattern,
    dtype_configs: DTypeConfigs,
    root: ModuleType,
    reference: ModuleType | None,
    qat: ModuleType | None = None,
) -> BackendPatternConfig:
    """An entry whose module convert swaps: root module, its reference module, its QAT module."""
    config = (
        op_config(pattern, dtype_configs)
        .set_root_module(root)
        .set_reference_quantized_module(reference)
    )
    return config.set_qat_module(qat) if qat is not None else config


def fusion_config(
    pattern: Pattern,
    dtype_configs: DTypeConfigs,
    fuser_method: Callable[..., nn.Module],
    fused_module: ModuleType | None,
) -> BackendPatternConfig:
    """A fusion entry: ``fuse_fx`` replaces ``pattern`` by what ``fuser_method`` returns."""
    return (
        BackendPatternConfig(pattern)
        .set_dtype_configs(list(dtype_configs))
        .set_fuser_method(fuser_method)
        .set_fused_module(fused_module)
    )


# -- conv ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvFamily:
    """Everything named for one conv dimensionality."""

    root: ModuleType
    transpose: ModuleType
    bn: ModuleType
    reference: ModuleType
    transpose_reference: ModuleType
    fused_conv_relu: ModuleType
    fused_conv_bn: ModuleType
    fused_conv_bn_relu: ModuleType
    qat: ModuleType
    relu_qat: ModuleType
    bn_qat: ModuleType
    bn_relu_qat: ModuleType
    func: Callable[..., Any]
    func_transpose: Callable[..., Any]
    relu_fuser: Callable[..., nn.Module]


CONV1D = ConvFamily(
    nn.Conv1d,
    nn.ConvTranspose1d,
    nn.BatchNorm1d,
    nnqr.Conv1d,
    nnqr.ConvTranspose1d,
    nni.ConvReLU1d,
    nni.ConvBn1d,
    nni.ConvBnReLU1d,
    nnqat.Conv1d,
    nniqat.ConvReLU1d,
    nniqat.ConvBn1d,
    nniqat.ConvBnReLU1d,
    F.conv1d,
    F.conv_transpose1d,
    _fusers.fuse_conv1d_relu,
)
CONV2D = ConvFamily(
    nn.Conv2d,
    nn.ConvTranspose2d,
    nn.BatchNorm2d,
    nnqr.Conv2d,
    nnqr.ConvTranspose2d,
    nni.ConvReLU2d,
    nni.ConvBn2d,
    nni.ConvBnReLU2d,
    nnqat.Conv2d,
    nniqat.ConvReLU2d,
    nniqat.ConvBn2d,
    nniqat.ConvBnReLU2d,
    F.conv2d,
    F.conv_transpose2d,
    _fusers.fuse_conv2d_relu,
)
CONV3D = ConvFamily(
    nn.Conv3d,
    nn.ConvTranspose3d,
    nn.BatchNorm3d,
    nnqr.Conv3d,
    nnqr.ConvTranspose3d,
    nni.ConvReLU3d,
    nni.ConvBn3d,
    nni.ConvBnReLU3d,
    nnqat.Conv3d,
    nniqat.ConvReLU3d,
    nniqat.ConvBn3d,
    nniqat.ConvBnReLU3d,
    F.conv3d,
    F.conv_transpose3d,
    _fusers.fuse_conv3d_relu,
)

# Functional weighted ops: where the weight and bias sit among the call's arguments.
_WEIGHT_BIAS_1_2 = {"weight": 1, "bias": 2}


def conv_configs(
    dtype_configs: DTypeConfigs,
    families: Sequence[ConvFamily] = (CONV1D, CONV2D, CONV3D),
    *,
    transpose: bool = True,
) -> Configs:
    """Conv modules and functions, alone, fused with relu and/or batch norm, their QAT and fused
    forms, and (with ``transpose``) conv-transpose with its batch-norm fusion."""
    configs: Configs = []
    for c in families:
        configs += [
            weighted_root_config(c.root, dtype_configs, c.root, c.reference, c.qat),
            weighted_root_config(c.qat, dtype_configs, c.root, c.reference),
            op_config(c.func, dtype_configs).set_input_type_to_index(dict(_WEIGHT_BIAS_1_2)),
            # conv + relu: fusion, the fused module and its QAT form, functional conv + relu
            fusion_config((c.root, nn.ReLU), dtype_configs, c.relu_fuser, c.fused_conv_relu),
            fusion_config((c.root, F.relu), dtype_configs, c.relu_fuser, c.fused_conv_relu),
            weighted_root_config(c.fused_conv_relu, dtype_configs, c.root, c.reference, c.relu_qat),
            weighted_root_config(c.relu_qat, dtype_configs, c.root, c.reference),
            op_config((c.func, nn.ReLU), dtype_configs),
            op_config((c.func, F.relu), dtype_configs),
            # torch.ao registers the fused conv-relu pair a second time; the later entries win
            # (the fused module keeps only its QAT module), and so they do here.
            BackendPatternConfig(c.fused_conv_relu)
            .set_dtype_configs(list(dtype_configs))
            .set_qat_module(c.relu_qat),
            weighted_root_config(c.relu_qat, dtype_configs, c.root, c.reference),
            # conv + bn (+ relu): fusion, then the fused and QAT forms
            fusion_config((c.root, c.bn), dtype_configs, fuse_conv_bn, c.fused_conv_bn),
            fusion_config(
                (c.root, c.bn, nn.ReLU), dtype_configs, fuse_conv_bn_relu, c.fused_conv_bn_relu
            ),
            fusion_config(
                (c.root, c.bn, F.relu), dtype_configs, fuse_conv_bn_relu, c.fused_conv_bn_relu
            ).set_root_module(c.root),
            BackendPatternConfig(c.fused_conv_bn)
            .set_dtype_configs(list(dtype_configs))
            .set_qat_module(c.bn_qat),
            BackendPatternConfig(c.fused_conv_bn_relu)
            .set_dtype_configs(list(dtype_configs))
            .set_qat_module(c.bn_relu_qat),
            weighted_root_config(c.bn_qat, dtype_configs, c.root, c.reference),
            weighted_root_config(c.bn_relu_qat, dtype_configs, c.root, c.reference),
        ]
        if transpose:
            configs += [
                weighted_root_config(
                    c.transpose, dtype_configs, c.transpose, c.transpose_reference
                ),
                # folded in place: the result is a plain conv-transpose, so no fused module
                fusion_config((c.transpose, c.bn), dtype_configs, fuse_convtranspose_bn, None)
                .set_root_module(c.transpose)
                .set_reference_quantized_module(c.transpose_reference),
                op_config(c.func_transpose, dtype_configs).set_input_type_to_index(
                    dict(_WEIGHT_BIAS_1_2)
                ),
            ]
    return configs


# -- linear --------------------------------------------------------------------------------


def linear_configs(dtype_configs: DTypeConfigs, *, fusions: bool = True) -> Configs:
    """Linear module, QAT module and functional linear; with ``fusions``, also linear + relu
    and linear + batch norm with their fused and QAT forms."""
    configs: Configs = [
        weighted_root_config(nn.Linear, dtype_configs, nn.Linear, nnqr.Linear, nnqat.Linear),
        weighted_root_config(nnqat.Linear, dtype_configs, nn.Linear, nnqr.Linear),
        op_config(F.linear, dtype_configs).set_input_type_to_index(dict(_WEIGHT_BIAS_1_2)),
    ]
    if not fusions:
        return configs
    relu_fuser = _fusers.fuse_linear_relu
    configs += [
        fusion_config((nn.Linear, nn.ReLU), dtype_configs, relu_fuser, nni.LinearReLU),
        fusion_config((nn.Linear, F.relu), dtype_configs, relu_fuser, nni.LinearReLU),
        weighted_root_config(
            nni.LinearReLU, dtype_configs, nn.Linear, nnqr.Linear, nniqat.LinearReLU
        ),
        weighted_root_config(nniqat.LinearReLU, dtype_configs, nn.Linear, nnqr.Linear),
        op_config((F.linear, nn.ReLU), dtype_configs),
        op_config((F.linear, F.relu), dtype_configs),
        fusion_config((nn.Linear, nn.BatchNorm1d), dtype_configs, fuse_linear_bn, nni.LinearBn1d),
        weighted_root_config(
            nni.LinearBn1d, dtype_configs, nn.Linear, nnqr.Linear, nniqat.LinearBn1d
        ),
        weighted_root_config(nniqat.LinearBn1d, dtype_configs, nn.Linear, nnqr.Linear),
    ]
    return configs


def linear_eltwise_configs(
    dtype_configs: DTypeConfigs,
    post_module: ModuleType,
    post_op: Callable[..., Any],
    fuser_method: Callable[..., nn.Module],
    fused_module: ModuleType,
) -> Configs:
    """Linear followed by an elementwise op (onednn's leaky relu and tanh): the two fusions,
    the fused module, and the functional linear + op pairs."""
    return [
        fusion_config((nn.Linear, post_module), dtype_configs, fuser_method, fused_module),
        fusion_config((nn.Linear, post_op), dtype_configs, fuser_method, fused_module),
        weighted_root_config(fused_module, dtype_configs, nn.Linear, nnqr.Linear),
        op_config((F.linear, post_module), dtype_configs),
        op_config((F.linear, post_op), dtype_configs),
    ]


# -- binary ops, cat -----------------------------------------------------------------------

# An add with one tensor and one scalar reuses its input's observer; with two tensors (or none,
# which prepare handles separately) input and output get their own.
_BINARY_OBSERVATION = {0: _DIFFERENT, 1: _SHARE, 2: _DIFFERENT}
DEFAULT_BINARY_OPS: tuple[Callable[..., Any], ...] = (
    operator.add,
    torch.add,
    operator.mul,
    torch.mul,
)


def binary_op_configs(
    dtype_configs: DTypeConfigs,
    ops: Sequence[Callable[..., Any]] = DEFAULT_BINARY_OPS,
    *,
    matmul: bool = True,
) -> Configs:
    """Each binary op alone and followed by ``nn.ReLU``, ``F.relu`` or ``torch.relu``; plus
    ``torch.matmul`` when ``matmul``."""
    configs: Configs = []
    for op in ops:
        for pattern in ((op, nn.ReLU), (op, F.relu), (op, torch.relu), op):
            configs.append(
                BackendPatternConfig(pattern)
                .set_dtype_configs(list(dtype_configs))
                .set_num_tensor_args_to_observation_type(dict(_BINARY_OBSERVATION))
            )
    if matmul:
        configs.append(BackendPatternConfig(torch.matmul).set_dtype_configs(list(dtype_configs)))
    return configs


def cat_configs(
    dtype_configs: DTypeConfigs, ops: Sequence[Callable[..., Any]] = (torch.cat,)
) -> Configs:
    """Concatenation shares one observer between its inputs and its output."""
    return [op_config(op, dtype_configs, _SHARE) for op in ops]


# -- single ops ----------------------------------------------------------------------------

DEFAULT_OPS: tuple[Pattern, ...] = (
    nn.ELU,
    nn.LeakyReLU,
    nn.Hardswish,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.Dropout,
    nn.PReLU,
    F.elu,
    F.hardswish,
    F.leaky_relu,
    F.dropout,
)


def default_op_configs(dtype_configs: DTypeConfigs) -> Configs:
    """Ops with their own output qparams, and the functional norms with float weight/bias."""
    return [op_config(op, dtype_configs) for op in DEFAULT_OPS] + [
        op_config(F.group_norm, dtype_configs).set_input_type_to_index({"weight": 2, "bias": 3}),
        op_config(F.instance_norm, dtype_configs).set_input_type_to_index({"weight": 3, "bias": 4}),
    ]


def layer_norm_configs(dtype_configs: DTypeConfigs) -> Configs:
    """LayerNorm module and function (weight and bias stay float)."""
    return [
        op_config(nn.LayerNorm, dtype_configs),
        op_config(F.layer_norm, dtype_configs).set_input_type_to_index({"weight": 2, "bias": 3}),
    ]


# Ops whose output range is fixed, so their output qparams are too: [0, 1] -> scale 1/256,
# zero point 0; [-1, 1] -> scale 2/256, zero point 128 (uint8).
def _fixed_0to1() -> DTypeWithConstraints:
    return DTypeWithConstraints(
        dtype=torch.uint8,
        quant_min_lower_bound=0,
        quant_max_upper_bound=255,
        scale_exact_match=1.0 / 256.0,
        zero_point_exact_match=0,
    )


def _fixed_neg1to1() -> DTypeWithConstraints:
    return DTypeWithConstraints(
        dtype=torch.uint8,
        quant_min_lower_bound=0,
        quant_max_upper_bound=255,
        scale_exact_match=2.0 / 256.0,
        zero_point_exact_match=128,
    )


FIXED_QPARAMS_OPS: tuple[tuple[Pattern, Callable[[], DTypeWithConstraints]], ...] = (
    (nn.Hardsigmoid, _fixed_0to1),
    (F.hardsigmoid, _fixed_0to1),
    ("hardsigmoid", _fixed_0to1),
    ("hardsigmoid_", _fixed_0to1),
    (nn.Sigmoid, _fixed_0to1),
    (torch.sigmoid, _fixed_0to1),
    ("sigmoid", _fixed_0to1),
    ("sigmoid_", _fixed_0to1),
    (nn.Softmax, _fixed_0to1),
    (nn.Tanh, _fixed_neg1to1),
    (torch.tanh, _fixed_neg1to1),
    ("tanh", _fixed_neg1to1),
    ("tanh_", _fixed_neg1to1),
)


def with_fixed_qparams(
    dtype_configs: DTypeConfigs, constraints: DTypeWithConstraints
) -> list[DTypeConfig]:
    """Copies of ``dtype_configs`` whose activations of ``constraints.dtype`` get its fixed
    range, scale and zero point; activations of other dtypes are left as they are."""
    out: list[DTypeConfig] = []
    for i, dtype_config in enumerate(dtype_configs):
        dc = copy.deepcopy(dtype_config)
        for side in (dc.input_dtype_with_constraints, dc.output_dtype_with_constraints):
            if side.dtype != constraints.dtype:
                continue
            for bound in ("scale_min_lower_bound", "scale_max_upper_bound"):
                if getattr(side, bound) is not None:
                    raise FxQuantError(
                        f"fixed-qparams dtype_configs[{i}]: {bound} is set, but ops with fixed "
                        "output qparams (sigmoid, tanh, ...) need an exact scale; drop the "
                        f"bound from this DTypeConfig: {dtype_config}"
                    )
            side.quant_min_lower_bound = constraints.quant_min_lower_bound
            side.quant_max_upper_bound = constraints.quant_max_upper_bound
            side.scale_exact_match = constraints.scale_exact_match
            side.zero_point_exact_match = constraints.zero_point_exact_match
        out.append(dc)
    return out


def fixed_qparams_op_configs(dtype_configs: DTypeConfigs) -> Configs:
    """Sigmoid, hardsigmoid, softmax and tanh with their fixed output qparams."""
    return [
        op_config(op, with_fixed_qparams(dtype_configs, constraints()))
        for op, constraints in FIXED_QPARAMS_OPS
    ]


# Ops whose quantized output reuses its input's qparams (pooling, reshaping, clamping).
SHARE_QPARAMS_OPS: tuple[Pattern, ...] = (
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.Hardtanh,
    nn.Identity,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.PixelShuffle,
    nn.PixelUnshuffle,
    nn.ReLU,
    nn.ReLU6,
    torch.adaptive_avg_pool1d,
    F.adaptive_avg_pool2d,
    F.adaptive_avg_pool3d,
    F.hardtanh,
    F.hardtanh_,
    F.interpolate,
    F.max_pool1d,
    F.max_pool2d,
    F.max_pool3d,
    F.pixel_shuffle,
    F.pixel_unshuffle,
    F.relu,
    F.relu6,
    torch.avg_pool1d,
    torch._C._nn.avg_pool2d,
    torch._C._nn.avg_pool3d,
    torch.clamp,
    torch.flatten,
    torch.mean,
    torch.narrow,
    torch.repeat_interleave,
    torch.transpose,
    torch.squeeze,
    torch.stack,
    torch.unsqueeze,
    operator.floordiv,
    "contiguous",
    "clamp",
    "detach",
    "detach_",
    "mean",
    "permute",
    "repeat",
    "repeat_interleave",
    "reshape",
    "resize_",
    "relu",
    "relu_",
    "squeeze",
    "squeeze_",
    "transpose",
    "unsqueeze",
    "unsqueeze_",
    "view",
)


def share_qparams_op_configs(
    dtype_configs: DTypeConfigs, ops: Sequence[Pattern] = SHARE_QPARAMS_OPS
) -> Configs:
    """Each op's output shares the observer of its input."""
    return [op_config(op, dtype_configs, _SHARE) for op in ops]


def tensor_info_op_configs(dtype_configs: DTypeConfigs) -> Configs:
    """``x.shape`` / ``x.size()``: they return no tensor, so nothing is observed."""
    return [op_config(op, dtype_configs, _NOT_OBSERVED) for op in ("shape", "size")]


# -- batch norm, RNNs, embeddings ----------------------------------------------------------

_BN_RELU: tuple[tuple[ModuleType, ModuleType, Callable[..., nn.Module]], ...] = (
    (nn.BatchNorm2d, nni.BNReLU2d, _fusers.fuse_bn2d_relu),
    (nn.BatchNorm3d, nni.BNReLU3d, _fusers.fuse_bn3d_relu),
)


def bn_configs(dtype_configs: DTypeConfigs) -> Configs:
    """BatchNorm2d/3d alone and fused with relu (module or functional)."""
    configs: Configs = []
    for bn, fused, fuser in _BN_RELU:
        configs += [
            fusion_config((bn, nn.ReLU), dtype_configs, fuser, fused),
            fusion_config((bn, F.relu), dtype_configs, fuser, fused),
            op_config(bn, dtype_configs),
        ]
    configs += [op_config(fused, dtype_configs) for _, fused, _ in _BN_RELU]
    return configs


_RNN_MODULES: tuple[tuple[ModuleType, ModuleType], ...] = (
    (nn.GRUCell, nnqr.GRUCell),
    (nn.LSTMCell, nnqr.LSTMCell),
    (nn.RNNCell, nnqr.RNNCell),
    (nn.LSTM, nnqr.LSTM),
    (nn.GRU, nnqr.GRU),
)


def rnn_configs(dtype_configs: DTypeConfigs) -> Configs:
    """Recurrent cells and layers (dynamic quantization) and their reference modules."""
    return [weighted_root_config(rnn, dtype_configs, rnn, ref) for rnn, ref in _RNN_MODULES]


_EMBEDDINGS: tuple[tuple[ModuleType, ModuleType, ModuleType], ...] = (
    (nn.Embedding, nnqat.Embedding, nnqr.Embedding),
    (nn.EmbeddingBag, nnqat.EmbeddingBag, nnqr.EmbeddingBag),
)


def embedding_configs(dtype_configs: DTypeConfigs, *, functional: bool = False) -> Configs:
    """Embedding and EmbeddingBag with their QAT modules; with ``functional``, also
    ``F.embedding`` (weight at argument 1) after the first pair, as executorch has it."""
    configs: Configs = []
    for float_mod, qat_mod, ref_mod in _EMBEDDINGS:
        configs += [
            weighted_root_config(float_mod, dtype_configs, float_mod, ref_mod, qat_mod),
            weighted_root_config(qat_mod, dtype_configs, float_mod, ref_mod),
        ]
        if functional and float_mod is nn.Embedding:
            configs.append(
                op_config(F.embedding, dtype_configs).set_input_type_to_index({"weight": 1})
            )
    return configs
