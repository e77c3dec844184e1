"""Default QConfigs and QConfigMappings per backend, with torch.ao 2.13's exact choices.

PTQ (``get_default_qconfig``, version 0): HistogramObserver activations over uint8, with
``reduce_range=True`` on x86/fbgemm (their int8 kernels can overflow otherwise) and False on
qnnpack/onednn; per-channel symmetric int8 weights except qnnpack (per-tensor).
QAT (``get_default_qat_qconfig``): version 1 (default) uses the fused moving-average fake
quantize, version 0 the unfused one, same ranges. The mappings add torch.ao's per-op
entries: reshape reuses its input observer; ConvTranspose gets per-tensor weights on
x86/fbgemm; layer_norm gets placeholder weights; PReLU gets uint8 MinMax weights; sigmoid,
hardsigmoid, softmax and tanh get fixed qparams ([0, 1] and [-1, 1]).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from quantbridge.qconfig._default_factories import (
    default_debug_observer,
    default_dynamic_fake_quant,
    default_dynamic_quant_observer,
    default_embedding_fake_quant,
    default_embedding_fake_quant_4bit,
    default_fake_quant,
    default_fixed_qparams_range_0to1_observer,
    default_fixed_qparams_range_neg1to1_observer,
    default_float_qparams_observer,
    default_float_qparams_observer_4bit,
    default_fused_act_fake_quant,
    default_fused_per_channel_wt_fake_quant,
    default_fused_wt_fake_quant,
    default_observer,
    default_per_channel_weight_fake_quant,
    default_per_channel_weight_observer,
    default_placeholder_observer,
    default_reuse_input_observer,
    default_weight_fake_quant,
    default_weight_observer,
    fused_per_channel_wt_fake_quant_range_neg_127_to_127,
    fused_wt_fake_quant_range_neg_127_to_127,
    per_channel_weight_observer_range_neg_127_to_127,
    weight_observer_range_neg_127_to_127,
)
from quantbridge.qconfig._dtypes import QScheme
from quantbridge.qconfig._errors import QConfigError
from quantbridge.qconfig._factory import PartialWrapper
from quantbridge.qconfig._fake_quantize import (
    FakeQuantize,
    FixedQParamsFakeQuantize,
    FusedMovingAvgObsFakeQuantize,
)
from quantbridge.qconfig._histogram import HistogramObserver
from quantbridge.qconfig._minmax import MinMaxObserver, MovingAverageMinMaxObserver
from quantbridge.qconfig._passthrough import NoopObserver, PlaceholderObserver
from quantbridge.qconfig._per_group import PerGroupGPTQObserver, PerGroupMinMaxObserver
from quantbridge.qconfig._qconfig import QConfig
from quantbridge.qconfig._qconfig_mapping import QConfigMapping

SUPPORTED_BACKENDS: tuple[str, ...] = ("fbgemm", "x86", "qnnpack", "onednn")

# -- module-level qconfigs (torch.ao's names) ----------------------------------------------

default_qconfig = QConfig(activation=default_observer, weight=default_weight_observer)
default_debug_qconfig = QConfig(weight=default_weight_observer, activation=default_debug_observer)
default_per_channel_qconfig = QConfig(
    activation=default_observer, weight=default_per_channel_weight_observer
)
default_dynamic_qconfig = QConfig(
    activation=default_dynamic_quant_observer, weight=default_weight_observer
)
float16_dynamic_qconfig = QConfig(
    activation=PlaceholderObserver.with_args(dtype=torch.float16, is_dynamic=True),
    weight=PlaceholderObserver.with_args(dtype=torch.float16),
)
float16_static_qconfig = QConfig(
    activation=PlaceholderObserver.with_args(dtype=torch.float16),
    weight=PlaceholderObserver.with_args(dtype=torch.float16),
)
per_channel_dynamic_qconfig = QConfig(
    activation=default_dynamic_quant_observer, weight=default_per_channel_weight_observer
)
float_qparams_weight_only_qconfig = QConfig(
    activation=default_placeholder_observer, weight=default_float_qparams_observer
)
float_qparams_weight_only_qconfig_4bit = QConfig(
    activation=default_placeholder_observer, weight=default_float_qparams_observer_4bit
)
default_qat_qconfig = QConfig(activation=default_fake_quant, weight=default_weight_fake_quant)
default_dynamic_qat_qconfig = QConfig(
    activation=default_dynamic_fake_quant, weight=default_weight_fake_quant
)
default_weight_only_qconfig = QConfig(
    activation=torch.nn.Identity, weight=default_weight_fake_quant
)
default_activation_only_qconfig = QConfig(activation=default_fake_quant, weight=torch.nn.Identity)
default_qat_qconfig_v2 = QConfig(
    activation=default_fused_act_fake_quant, weight=default_fused_wt_fake_quant
)
default_reuse_input_qconfig = QConfig(activation=default_reuse_input_observer, weight=NoopObserver)
# Signed activations and [-127, 127] weights; eps=2**-12 keeps xnnpack's requantization
# scale within its lower bound.
default_symmetric_qnnpack_qconfig = QConfig(
    activation=HistogramObserver.with_args(dtype=torch.int8, reduce_range=False, eps=2**-12),
    weight=weight_observer_range_neg_127_to_127,
)
default_per_channel_symmetric_qnnpack_qconfig = QConfig(
    activation=HistogramObserver.with_args(dtype=torch.int8, reduce_range=False, eps=2**-12),
    weight=per_channel_weight_observer_range_neg_127_to_127,
)
default_embedding_qat_qconfig = QConfig(
    activation=NoopObserver.with_args(dtype=torch.float32), weight=default_embedding_fake_quant
)
default_embedding_qat_qconfig_4bit = QConfig(
    activation=NoopObserver.with_args(dtype=torch.float32),
    weight=default_embedding_fake_quant_4bit,
)
default_quint8_weight_qconfig = QConfig(activation=HistogramObserver, weight=MinMaxObserver)


def _symmetric_qnnpack_qat_activation() -> PartialWrapper:
    """A fresh int8 activation fake-quant factory with QNNPACK's minimum scale (2**-12)."""
    return FusedMovingAvgObsFakeQuantize.with_args(
        observer=MovingAverageMinMaxObserver,
        quant_min=-128,
        quant_max=127,
        dtype=torch.int8,
        reduce_range=False,
        eps=2**-12,
    )


default_symmetric_qnnpack_qat_qconfig = QConfig(
    activation=_symmetric_qnnpack_qat_activation(),
    weight=fused_wt_fake_quant_range_neg_127_to_127,
)
default_per_channel_symmetric_qnnpack_qat_qconfig = QConfig(
    activation=_symmetric_qnnpack_qat_activation(),
    weight=fused_per_channel_wt_fake_quant_range_neg_127_to_127,
)
# What FX prepare puts around ops that stay in float, and around uint8 placeholders
# (torch.ao's private _default_fp32_placeholder_qconfig / _default_quint8_placeholder_qconfig).
default_fp32_placeholder_qconfig = QConfig(
    activation=PlaceholderObserver.with_args(dtype=torch.float32),
    weight=PlaceholderObserver.with_args(dtype=torch.float32),
)
default_quint8_placeholder_qconfig = QConfig(
    activation=PlaceholderObserver.with_args(dtype=torch.uint8), weight=None
)


def _check_backend(backend: object, where: str) -> str:
    if not isinstance(backend, str) or backend not in SUPPORTED_BACKENDS:
        raise QConfigError(
            f"{where}: backend {backend!r} is not supported; use one of {list(SUPPORTED_BACKENDS)}"
        )
    return backend


def _warn_onednn_without_vnni() -> None:
    is_vnni = getattr(torch.cpu, "_is_vnni_supported", None)
    if callable(is_vnni) and not is_vnni():
        warnings.warn(
            "get_default_qconfig('onednn'): reduce_range=False activations may lose accuracy "
            "on CPUs without VNNI (Vector Neural Network Instructions)",
            stacklevel=3,
        )


def get_default_qconfig(backend: str = "x86", version: int = 0) -> QConfig:
    """The default post-training-quantization QConfig for ``backend``
    (``"x86"``, ``"fbgemm"``, ``"qnnpack"`` or ``"onednn"``); only ``version=0`` exists."""
    _check_backend(backend, "get_default_qconfig")
    if version != 0:
        raise QConfigError(
            f"get_default_qconfig: version {version!r} is not supported; the only version is 0"
        )
    if backend in ("x86", "fbgemm"):
        return QConfig(
            activation=HistogramObserver.with_args(reduce_range=True),
            weight=default_per_channel_weight_observer,
        )
    if backend == "qnnpack":
        return QConfig(
            activation=HistogramObserver.with_args(reduce_range=False),
            weight=default_weight_observer,
        )
    _warn_onednn_without_vnni()
    return QConfig(
        activation=HistogramObserver.with_args(reduce_range=False),
        weight=default_per_channel_weight_observer,
    )


def get_default_qat_qconfig(backend: str = "x86", version: int = 1) -> QConfig:
    """The default quantization-aware-training QConfig for ``backend``. ``version=1``
    (default) uses FusedMovingAvgObsFakeQuantize, ``version=0`` FakeQuantize."""
    _check_backend(backend, "get_default_qat_qconfig")
    if version == 0:
        fake_quant: Any = FakeQuantize
        per_tensor_weight: PartialWrapper = default_weight_fake_quant
        per_channel_weight: PartialWrapper = default_per_channel_weight_fake_quant
    elif version == 1:
        fake_quant = FusedMovingAvgObsFakeQuantize
        per_tensor_weight = default_fused_wt_fake_quant
        per_channel_weight = default_fused_per_channel_wt_fake_quant
    else:
        raise QConfigError(
            f"get_default_qat_qconfig: version {version!r} is not supported; use 0 or 1"
        )
    if backend == "onednn":  # the observer's default (reduce_range=False), not spelled out
        activation = fake_quant.with_args(
            observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255
        )
    else:
        activation = fake_quant.with_args(
            observer=MovingAverageMinMaxObserver,
            quant_min=0,
            quant_max=255,
            reduce_range=backend in ("x86", "fbgemm"),
        )
    weight = per_tensor_weight if backend == "qnnpack" else per_channel_weight
    return QConfig(activation=activation, weight=weight)


# Ops whose output range is known: they get fixed qparams, whatever the backend.
FIXED_QPARAMS_OP_TO_OBSERVER: dict[Callable[..., Any] | str, PartialWrapper] = {
    torch.nn.Hardsigmoid: default_fixed_qparams_range_0to1_observer,
    torch.nn.functional.hardsigmoid: default_fixed_qparams_range_0to1_observer,
    "hardsigmoid": default_fixed_qparams_range_0to1_observer,
    "hardsigmoid_": default_fixed_qparams_range_0to1_observer,
    torch.nn.Sigmoid: default_fixed_qparams_range_0to1_observer,
    torch.sigmoid: default_fixed_qparams_range_0to1_observer,
    "sigmoid": default_fixed_qparams_range_0to1_observer,
    "sigmoid_": default_fixed_qparams_range_0to1_observer,
    torch.nn.Softmax: default_fixed_qparams_range_0to1_observer,
    torch.nn.Tanh: default_fixed_qparams_range_neg1to1_observer,
    torch.tanh: default_fixed_qparams_range_neg1to1_observer,
    "tanh": default_fixed_qparams_range_neg1to1_observer,
    "tanh_": default_fixed_qparams_range_neg1to1_observer,
}


def _default_mapping(is_qat: bool, backend: str, version: int) -> QConfigMapping:
    if is_qat:
        qconfig = get_default_qat_qconfig(backend, version)
    else:
        qconfig = get_default_qconfig(backend, version)
    default_weight = default_weight_fake_quant if is_qat else default_weight_observer
    # x86/fbgemm have no per-channel ConvTranspose weights: per-tensor there.
    if backend in ("fbgemm", "x86"):
        qconfig_transpose = QConfig(activation=qconfig.activation, weight=default_weight)
    else:
        qconfig_transpose = qconfig
    qconfig_layernorm = QConfig(activation=qconfig.activation, weight=default_placeholder_observer)

    mapping = (
        QConfigMapping()
        .set_global(qconfig)
        .set_object_type("reshape", default_reuse_input_qconfig)
        .set_object_type(torch.nn.ConvTranspose1d, qconfig_transpose)
        .set_object_type(torch.nn.ConvTranspose2d, qconfig_transpose)
        .set_object_type(torch.nn.ConvTranspose3d, qconfig_transpose)
        .set_object_type(torch.nn.functional.conv_transpose1d, qconfig_transpose)
        .set_object_type(torch.nn.functional.conv_transpose2d, qconfig_transpose)
        .set_object_type(torch.nn.functional.conv_transpose3d, qconfig_transpose)
        .set_object_type(torch.nn.functional.layer_norm, qconfig_layernorm)
        .set_object_type(torch.nn.LayerNorm, qconfig_layernorm)
        .set_object_type(torch.nn.PReLU, default_quint8_weight_qconfig)
    )
    # One QConfig object per fixed-qparams observer, shared by all its ops (as torch.ao).
    shared: dict[int, QConfig] = {}
    for op, observer in FIXED_QPARAMS_OP_TO_OBSERVER.items():
        fixed = shared.get(id(observer))
        if fixed is None:
            activation: Any = (
                FixedQParamsFakeQuantize.with_args(observer=observer) if is_qat else observer
            )
            fixed = QConfig(activation=activation, weight=default_weight)
            shared[id(observer)] = fixed
        mapping.set_object_type(op, fixed)
    return mapping


def get_default_qconfig_mapping(backend: str = "x86", version: int = 0) -> QConfigMapping:
    """The default post-training-quantization QConfigMapping for ``backend``."""
    return _default_mapping(False, backend, version)


def get_default_qat_qconfig_mapping(backend: str = "x86", version: int = 1) -> QConfigMapping:
    """The default quantization-aware-training QConfigMapping for ``backend``."""
    return _default_mapping(True, backend, version)


def _with_global(mapping: QConfigMapping, qconfig: QConfig) -> QConfigMapping:
    """``mapping`` with ``qconfig`` as global and for every op entry but fixed-qparams ops."""
    mapping.set_global(qconfig)
    for key in list(mapping.object_type_qconfigs):
        if key not in FIXED_QPARAMS_OP_TO_OBSERVER:
            mapping.set_object_type(key, qconfig)
    return mapping


def get_symmetric_qnnpack_qconfig_mapping() -> QConfigMapping:
    """qnnpack's default mapping with ``default_symmetric_qnnpack_qconfig`` (int8
    activations, [-127, 127] weights) everywhere except the fixed-qparams ops."""
    return _with_global(get_default_qconfig_mapping("qnnpack"), default_symmetric_qnnpack_qconfig)


def get_symmetric_qnnpack_qat_qconfig_mapping() -> QConfigMapping:
    """The QAT counterpart of :func:`get_symmetric_qnnpack_qconfig_mapping`."""
    return _with_global(
        get_default_qat_qconfig_mapping("qnnpack"), default_symmetric_qnnpack_qat_qconfig
    )


def _tensorrt_activation(is_qat: bool) -> PartialWrapper:
    """Symmetric int8 activations, zero point 0 (TensorRT's explicit quantization)."""
    if is_qat:
        # moving-average ranges, symmetric int8 per tensor: the same fake quant as weights
        return default_weight_fake_quant
    return HistogramObserver.with_args(
        dtype=torch.int8, qscheme=QScheme.PER_TENSOR_SYMMETRIC, reduce_range=False
    )


def get_tensorrt_qconfig_mapping(is_qat: bool = False) -> QConfigMapping:
    """Symmetric int8 everywhere, as TensorRT's explicit quantization takes it: activations
    per tensor with zero point 0, weights per channel in [-127, 127].

    Use it with ``get_tensorrt_backend_config()`` and export with
    ``export_onnx(..., profile="tensorrt")``.
    """
    weight = (
        fused_per_channel_wt_fake_quant_range_neg_127_to_127
        if is_qat
        else per_channel_weight_observer_range_neg_127_to_127
    )
    return QConfigMapping().set_global(
        QConfig(activation=_tensorrt_activation(is_qat), weight=weight)
    )


_GROUP_METHODS: dict[str, type[PerGroupMinMaxObserver]] = {
    "minmax": PerGroupMinMaxObserver,
    "gptq": PerGroupGPTQObserver,
}


def group_weight_only_qconfig(
    bits: int = 4, group_size: int = 32, *, symmetric: bool = True, method: str = "minmax"
) -> QConfig:
    """Weight-only quantization by groups (decoder LLMs): float activations, the weight in
    groups of ``group_size`` input features, each with its own scale (and zero point if not
    ``symmetric``), computed from the group's min and max.

    * 4 bits, symmetric: int8 codes in [-8, 7], ``scale = max|w| / 7.5`` (like llama.cpp's
      Q4_0 and torchao's int4); 4 bits, affine: uint8 codes in [0, 15];
    * 8 bits, symmetric: int8 codes in [-127, 127], ``scale = max|w| / 127`` (Q8_0);
      8 bits, affine: uint8 codes in [0, 255].

    ``method``: ``"minmax"`` rounds each weight to the nearest code of its group
    (``PerGroupMinMaxObserver``); ``"gptq"`` (``PerGroupGPTQObserver``) has
    ``fx_quant.quantize_weight_only`` choose the codes of each ``nn.Linear`` by GPTQ from
    calibration inputs (pass it ``calibration_data``), with the same qparams rule per group.
    """
    where = "group_weight_only_qconfig"
    if not isinstance(method, str) or method not in _GROUP_METHODS:
        raise QConfigError(f"{where}: method must be one of {list(_GROUP_METHODS)}, got {method!r}")
    if isinstance(bits, bool) or bits not in (4, 8):
        raise QConfigError(f"{where}: bits must be 4 or 8, got {bits!r}")
    if not isinstance(symmetric, bool):
        raise QConfigError(f"{where}: symmetric must be True or False, got {symmetric!r}")
    if symmetric:
        dtype, qscheme = torch.int8, QScheme.PER_GROUP_SYMMETRIC
        qmin, qmax = (-8, 7) if bits == 4 else (-127, 127)
    else:
        dtype, qscheme = torch.uint8, QScheme.PER_GROUP_AFFINE
        qmin, qmax = (0, 15) if bits == 4 else (0, 255)
    observer = _GROUP_METHODS[method]
    weight = observer.with_args(
        group_size=group_size, dtype=dtype, qscheme=qscheme, quant_min=qmin, quant_max=qmax
    )
    observer(group_size=group_size)  # checks the group size now
    return QConfig(activation=PlaceholderObserver.with_args(dtype=torch.float32), weight=weight)
