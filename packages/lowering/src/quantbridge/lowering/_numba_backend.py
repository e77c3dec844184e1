"""The numba backends: lower reference models to quantbridge.kernels for one CPU target."""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule

from quantbridge import kernels as K
from quantbridge.fx_quant import get_native_backend_config, quantize_weight_only
from quantbridge.fx_quant.nn import qat as nnqat
from quantbridge.fx_quant.nn.intrinsic import qat as nniqat
from quantbridge.lowering._backend import Backend, SupportedOp
from quantbridge.lowering._lower import lower_to_kernels
from quantbridge.lowering._rules import backend_config_from_rules, dtype_mode
from quantbridge.lowering._table import WEIGHTED_CLAMPS, default_lowering_rules
from quantbridge.lowering._weight_only import lower_weight_only
from quantbridge.qconfig import (
    FIXED_QPARAMS_OP_TO_OBSERVER,
    GROUP_SIZES,
    BackendConfig,
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    FusedMovingAvgObsFakeQuantize,
    HistogramObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    ObservationType,
    PerChannelMinMaxObserver,
    QConfig,
    QConfigMapping,
    QScheme,
    default_dynamic_quant_observer,
    get_default_qat_qconfig_mapping,
    get_default_qconfig_mapping,
    group_weight_only_qconfig,
)

__all__ = ["NumbaBackend", "numba_backend_config"]

# kept float by qconfig_mapping(transformer=True): the residual stream, the norms and the
# attention-mask arithmetic (elementwise ops on tensors of very different ranges), dropout
# (identity in eval) between a projection and its residual add, so the projection's output
# reaches the add in float, and concatenations (a ViT joins its class token, which carries
# trained models' massive activations, to the patch embeddings in one shared range)
_TRANSFORMER_FLOAT_OPS: tuple[Callable[..., Any] | str, ...] = (
    operator.add, operator.iadd, torch.add, "add", "add_",
    operator.sub, operator.isub, torch.sub, torch.rsub, "sub", "sub_",
    operator.mul, operator.imul, torch.mul, "mul", "mul_",
    operator.truediv, operator.itruediv, torch.div, "div", "div_",
    nn.LayerNorm, F.layer_norm, nn.GroupNorm, F.group_norm,
    nn.Dropout, F.dropout, "dropout",
    torch.cat, torch.concat, torch.concatenate,
)  # fmt: skip

# the Linear / conv modules (float, QAT, QAT with BatchNorm) a clamp after them is observed with
_CLAMPED_WEIGHTED: tuple[type[nn.Module], ...] = (
    nn.Linear, nnqat.Linear, nniqat.LinearBn1d,
    nn.Conv1d, nnqat.Conv1d, nniqat.ConvBn1d,
    nn.Conv2d, nnqat.Conv2d, nniqat.ConvBn2d,
)  # fmt: skip


# observed after the pool (see _own_observer_pools)
_POOLS_WITH_OWN_OBSERVER: tuple[Any, ...] = (nn.AdaptiveAvgPool2d, F.adaptive_avg_pool2d)


def _weight_observer(bits: int, qat: bool) -> Any:
    """Per-channel symmetric int8 weights over ``bits`` bits, in the narrow range
    ``[-(2**(bits-1) - 1), 2**(bits-1) - 1]``: an observer, or for QAT a fake quantize.

    torch.ao's x86 defaults span [-128, 127] with the scale ``max|w| / 127.5``, so each
    channel's largest positive weight rounds past 127 and is clipped; the narrow range maps
    ``max|w|`` to the last code exactly, as ONNX Runtime, OpenVINO and TensorRT do."""
    largest = 2 ** (bits - 1) - 1
    narrow = {
        "quant_min": -largest,
        "quant_max": largest,
        "dtype": torch.int8,
        "qscheme": QScheme.PER_CHANNEL_SYMMETRIC,
    }
    if qat:
        return FusedMovingAvgObsFakeQuantize.with_args(
            observer=MovingAveragePerChannelMinMaxObserver, **narrow
        )
    return PerChannelMinMaxObserver.with_args(**narrow)


def _bits(name: str, value: int | None, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or value not in (7, 8):
        raise ValueError(f"qconfig_mapping: {name} must be 7, 8 or None, got {value!r}")
    return int(value)


def numba_backend_config(name: str) -> BackendConfig:
    """The BackendConfig named ``name`` allowing exactly what the numba lowering table lowers:
    fx_quant's native entries whose operators the rules cover, in the modes they declare,
    and a clamp (ReLU6, hardtanh) after a Linear / conv observed once, after the clamp."""
    config = backend_config_from_rules(name, default_lowering_rules(), get_native_backend_config())
    for entry in (*_weighted_clamp_configs(config), *_own_observer_pools(config)):
        config.set_backend_pattern_config(entry)
    _add_weight_only(config)
    return config


# weight-only, per group: (weight dtype, quant range) the kernels take, 4 and 8 bits
_WEIGHT_ONLY = (
    (torch.int8, -8, 7), (torch.uint8, 0, 15), (torch.int8, -127, 127), (torch.uint8, 0, 255),
)  # fmt: skip


def _add_weight_only(config: BackendConfig) -> None:
    """Float activations and per-group int4 / int8 weights for ``nn.Linear`` (the kernels'
    ``linear_weight_only``) and ``nn.Embedding`` (rows dequantized on lookup), in every group
    size the kernels take; used by ``quantize_weights`` (module swap), not by prepare."""
    entries = {entry.pattern: entry for entry in config.configs}
    for pattern in (nn.Linear, nn.Embedding):
        entry = entries.get(pattern)
        if entry is None:
            entry = BackendPatternConfig(pattern)
            config.set_backend_pattern_config(entry)
        for dtype, low, high in _WEIGHT_ONLY:
            weight = DTypeWithConstraints(
                dtype=dtype, quant_min_lower_bound=low, quant_max_upper_bound=high,
                group_sizes=GROUP_SIZES,
            )  # fmt: skip
            entry.add_dtype_config(
                DTypeConfig(
                    input_dtype=torch.float32,
                    output_dtype=torch.float32,
                    weight_dtype=weight,
                    is_dynamic=False,
                )
            )


def _own_observer_pools(config: BackendConfig) -> list[BackendPatternConfig]:
    """The adaptive average pools of ``config``, observed after the pool instead of sharing
    the input's observer: a mean spans a narrower range than its input (a ResNet's final
    pool averages 49 values), so its own scale is finer, and the kernel requantizes the
    mean in the same pass."""
    entries = {entry.pattern: entry for entry in config.configs}
    return [
        BackendPatternConfig(pool)
        .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
        .set_dtype_configs(entries[pool].dtype_configs)
        for pool in _POOLS_WITH_OWN_OBSERVER
        if pool in entries
    ]


def _weighted_clamp_configs(config: BackendConfig) -> list[BackendPatternConfig]:
    """``(weighted, clamp)`` for each Linear / conv module of ``config`` (float, QAT, QAT with
    BatchNorm) and each clamp, with the weighted entry's static dtype configs.

    torch.ao's configs let a clamp share the observer of the conv before it, so that range
    also spans the conv's negative outputs, which the clamp discards: MobileNetV2's ReLU6
    spends its codes on [min, 6] instead of [0, 6]."""
    entries = {entry.pattern: entry for entry in config.configs}
    out = []
    for root in _CLAMPED_WEIGHTED:
        entry = entries.get(root)
        if entry is None:
            continue
        static = [dc for dc in entry.dtype_configs if dtype_mode(dc) == "static"]
        for clamp in WEIGHTED_CLAMPS:
            out.append(
                BackendPatternConfig((root, clamp))
                .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
                .set_dtype_configs(static)
            )
    return out


class NumbaBackend(Backend):
    """Lowers to ``quantbridge.kernels`` compiled for one target (``None``: the best one).

    Activations are uint8, weights int8 (per channel by default); every kernel is exact
    for any codes. Weights are per-channel symmetric in the narrow range [-127, 127] (torch.ao's
    x86 defaults use [-128, 127] and clip each channel's largest weight). Activations on the
    ``avx2`` target are torch.ao's x86 defaults: calibrated over 7 bits (``reduce_range=True``),
    which the AVX2 kernels multiply with 8-bit weights by the fast 16-bit-pair instruction
    (rows where two codes could overflow it are recomputed exactly, and with these
    activations there are few or none).
    On targets with VNNI, activations keep all 8 bits (``reduce_range=False``): one more than
    torch.ao's x86 default. ``qconfig_mapping``'s ``weight_bits`` and ``activation_bits``
    choose otherwise.
    """

    _per_token = False

    def __init__(self, name: str, target: str | None) -> None:
        self._target = target
        super().__init__(
            name,
            numba_backend_config(name),
            description=f"quantbridge.kernels, target {target or 'best for this CPU'}",
        )

    @property
    def target(self) -> str:
        """The kernel target this backend compiles for."""
        return self._target if self._target is not None else K.best_target()

    def is_available(self) -> bool:
        return K.target_supported(self.target)

    def unavailable_reason(self) -> str:
        if self.is_available():
            return ""
        return (
            f"this CPU lacks the features of kernel target {self.target!r} "
            f"(it runs {K.available_targets()})"
        )

    def qconfig_mapping(
        self,
        qat: bool = False,
        *,
        transformer: bool = False,
        dynamic: bool = False,
        weight_bits: int | None = None,
        activation_bits: int | None = None,
        weight_only: bool = False,
        group_size: int = 32,
        symmetric: bool = True,
        method: str = "minmax",
    ) -> QConfigMapping:
        """x86-style defaults for this backend's target (see the class docstring).

        ``transformer=True``: the same, with elementwise add / sub / mul / div, the norms and
        ``torch.cat`` kept float (None), so the residual stream, LayerNorm and the
        attention-mask arithmetic (``(1 - mask) * finfo.min`` added to the scores) are never
        observed: Linears, the attention matmuls and activations stay int8. Activations keep
        8 bits on every target: on ``avx2`` a trained-like BERT's embeddings reach 37.4 dB
        against 34.5 dB with 7 bits, for 3 % more time.

        ``weight_only=True``: weight-only quantization by groups (decoder LLMs; see
        ``quantize_weights``): every ``nn.Linear`` gets ``group_weight_only_qconfig(
        weight_bits, group_size, symmetric=symmetric)`` (``weight_bits`` 4, the default, or
        8; ``group_size`` 32, 64 or 128), everything else stays float. Add
        ``.set_object_type(nn.Embedding, ...)`` to quantize embeddings too, or
        ``.set_module_name("lm_head", None)`` to keep the output projection float.
        ``method="gptq"`` (weight-only only): the Linears' codes come from GPTQ on
        calibration inputs (pass ``calibration_data`` to ``quantize_weights``); ``"minmax"``,
        the default, rounds each weight to the nearest code.

        ``dynamic=True``: dynamic quantization instead: ``nn.Linear``, ``nn.LSTM`` and
        ``nn.GRU`` get int8 per-channel weights and activations quantized at run time; every
        other op stays float.

        ``weight_bits``: 8 (codes in [-127, 127]) or 7 (codes in [-63, 63]), per-channel
        symmetric. ``activation_bits`` (static and QAT): 8 (``reduce_range=False``) or 7
        (``reduce_range=True``: scale and zero point from [0, 127], as torch.ao's x86
        defaults; codes past 127 still occur for values past the calibrated range). None
        picks, on the ``avx2`` target, 8-bit weights with 7-bit activations (transformer
        mappings: 8-bit activations; dynamic: 7-bit weights, the activations' codes span all
        8 bits) and elsewhere 8 and 8.

        Why: CPUs without VNNI multiply with ``vpmaddubsw``, which adds two uint8 x int8
        products in 16 bits. It is exact for every pair with 7-bit weights, and for a pair of
        codes adding up to at most 256 with 8-bit weights; the kernels find the rows holding a
        pair past that and redo them with exact 16-bit multiplies. 7-bit activations make such
        rows rare (on ResNet-18/50, ~60 rows of the stem conv per image, almost none elsewhere).
        The default keeps torch.ao's SQNR on the CNNs measured and runs 4-17 % slower than
        ``weight_bits=7`` (the check's cost), which is more precise on MobileNets and less on
        ResNets (3.6 dB below torch.ao on ResNet-50). 8-bit activations with 8-bit weights
        are the most precise and run ~1.2-1.7x slower (mostly on 16-bit multiplies).
        """
        if not weight_only and method != "minmax":
            raise ValueError(
                f"qconfig_mapping: method={method!r} chooses how weight-only codes are computed; "
                "it needs weight_only=True"
            )
        if weight_only:
            if qat or transformer or dynamic or activation_bits is not None:
                raise ValueError(
                    "qconfig_mapping: weight_only=True keeps activations float; it cannot be "
                    "combined with qat, transformer, dynamic or activation_bits"
                )
            bits = 4 if weight_bits is None else weight_bits
            if bits not in (4, 8):
                raise ValueError(
                    f"qconfig_mapping: weight_only takes weight_bits 4 or 8, got {bits!r}"
                )
            qconfig = group_weight_only_qconfig(
                bits, group_size, symmetric=symmetric, method=method
            )
            return QConfigMapping().set_object_type(nn.Linear, qconfig)
        if dynamic:
            if qat or transformer:
                raise ValueError(
                    "qconfig_mapping: dynamic=True cannot be combined with qat or transformer "
                    "(dynamic quantization has no calibration or training step)"
                )
            if activation_bits is not None:
                raise ValueError(
                    "qconfig_mapping: activation_bits applies to static and QAT mappings; "
                    "dynamic activations are quantized per call over their whole range"
                )
            bits = _bits("weight_bits", weight_bits, 7 if self.target == "avx2" else 8)
            dyn = QConfig(
                activation=default_dynamic_quant_observer,
                weight=_weight_observer(bits, qat=False),
            )
            mapping = QConfigMapping()
            for module in (nn.Linear, nn.LSTM, nn.GRU):
                mapping.set_object_type(module, dyn)
            return mapping
        bits = _bits("weight_bits", weight_bits, 8)
        narrow = self.target == "avx2" and bits == 8 and not transformer
        act_bits = _bits("activation_bits", activation_bits, 7 if narrow else 8)
        mapping = self._default_mapping(qat, bits, act_bits)
        if transformer:
            for op in _TRANSFORMER_FLOAT_OPS:
                mapping.set_object_type(op, None)
        return mapping

    def _default_mapping(self, qat: bool, bits: int, act_bits: int) -> QConfigMapping:
        reduce_range = act_bits == 7
        if qat:
            mapping = get_default_qat_qconfig_mapping("x86")
            qconfig = QConfig(
                activation=FusedMovingAvgObsFakeQuantize.with_args(
                    observer=MovingAverageMinMaxObserver,
                    quant_min=0,
                    quant_max=255,
                    reduce_range=reduce_range,
                ),
                weight=_weight_observer(bits, qat=True),
            )
        else:
            mapping = get_default_qconfig_mapping("x86")
            qconfig = QConfig(
                activation=HistogramObserver.with_args(reduce_range=reduce_range),
                weight=_weight_observer(bits, qat=False),
            )
        mapping.set_global(qconfig)
        for key in list(mapping.object_type_qconfigs):
            if key not in FIXED_QPARAMS_OP_TO_OBSERVER:
                mapping.set_object_type(key, qconfig)
        return mapping

    def quantize_weights(
        self,
        model: nn.Module,
        qconfig_mapping: QConfigMapping | None = None,
        *,
        calibration_data: Iterable[Any] | None = None,
        input_fn: Callable[[Any], Any] | None = None,
        inplace: bool = False,
    ) -> nn.Module:
        """Weight-only quantization of ``model`` (a copy unless ``inplace``) by module swap,
        lowered: its ``nn.Linear`` layers become ``WeightOnlyLinear`` kernel modules (and its
        ``nn.Embedding`` layers, where the mapping says so, reference modules that
        dequantize the rows they read). Nothing is traced, so a Hugging Face decoder's
        ``generate`` runs unchanged.

        ``qconfig_mapping``: per-group weight-only qconfigs (``group_weight_only_qconfig``)
        by module name, regex, type or global; None means ``qconfig_mapping(weight_only=True)``
        (every Linear 4-bit, group 32, symmetric).

        ``calibration_data`` / ``input_fn``: the model inputs GPTQ fits the Linears to, for a
        mapping made with ``method="gptq"`` (required then; see
        ``fx_quant.quantize_weight_only``).
        """
        mapping = (
            self.qconfig_mapping(weight_only=True) if qconfig_mapping is None else qconfig_mapping
        )
        reference = quantize_weight_only(
            model, mapping, backend_config=self.backend_config, inplace=inplace,
            calibration_data=calibration_data, input_fn=input_fn,
        )  # fmt: skip
        return lower_weight_only(reference, self.target, inplace=True)

    @property
    def per_token_activations(self) -> bool:
        """Whether dynamic linears quantize their input per row (token); see ``with_options``."""
        return self._per_token

    def with_options(self, *, per_token_activations: bool = False) -> NumbaBackend:
        """A copy of this backend (same name, BackendConfig, qconfigs and target) with options:

        ``per_token_activations=True``: each dynamic Linear quantizes every row (token) of its
        input with its own scale and zero point (``kernels.linear_dynamic(per_row=True)``;
        weights must be symmetric, as torch.ao's dynamic qconfigs make them) instead of one
        scale per tensor. The copy is not registered; use its ``lower``/``convert``.
        """
        if type(per_token_activations) is not bool:
            raise TypeError(
                f"with_options: per_token_activations must be True or False, got "
                f"{per_token_activations!r}"
            )
        other = copy.copy(self)
        other._per_token = per_token_activations
        return other

    def lower(self, reference_model: GraphModule) -> GraphModule:
        """A lowered copy of ``reference_model`` (the reference model is left unchanged)."""
        self._check_lowerable(reference_model)
        rules = default_lowering_rules(per_token_activations=self._per_token)
        return lower_to_kernels(copy.deepcopy(reference_model), self.target, rules=rules)

    def supported_ops(self) -> list[SupportedOp]:
        """One row per rule of the lowering table: what it lowers, in which modes, with what."""
        return [
            SupportedOp(rule.description or rule.name, rule.modes, f"{rule.kernel} [{self.target}]")
            for rule in default_lowering_rules()
        ]
