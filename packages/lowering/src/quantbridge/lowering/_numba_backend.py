"""The numba backends: lower reference models to quantbridge.kernels for one CPU target."""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule

from quantbridge import kernels as K
from quantbridge.fx_quant import get_native_backend_config
from quantbridge.lowering._backend import Backend, SupportedOp
from quantbridge.lowering._lower import lower_to_kernels
from quantbridge.lowering._rules import backend_config_from_rules
from quantbridge.lowering._table import default_lowering_rules
from quantbridge.qconfig import (
    FIXED_QPARAMS_OP_TO_OBSERVER,
    BackendConfig,
    FusedMovingAvgObsFakeQuantize,
    HistogramObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
    QConfig,
    QConfigMapping,
    QScheme,
    default_dynamic_quant_observer,
    default_fused_per_channel_wt_fake_quant,
    default_per_channel_weight_observer,
    get_default_qat_qconfig_mapping,
    get_default_qconfig_mapping,
)

__all__ = ["NumbaBackend", "numba_backend_config"]

# kept float by qconfig_mapping(transformer=True): the residual stream, the norms and the
# attention-mask arithmetic (elementwise ops on tensors of very different ranges)
_TRANSFORMER_FLOAT_OPS: tuple[Callable[..., Any] | str, ...] = (
    operator.add, operator.iadd, torch.add, "add", "add_",
    operator.sub, operator.isub, torch.sub, torch.rsub, "sub", "sub_",
    operator.mul, operator.imul, torch.mul, "mul", "mul_",
    operator.truediv, operator.itruediv, torch.div, "div", "div_",
    nn.LayerNorm, F.layer_norm, nn.GroupNorm, F.group_norm,
)  # fmt: skip


def _weight_observer(bits: int, qat: bool) -> Any:
    """Per-channel symmetric int8 weights over ``bits`` bits: an observer, or for QAT a fake
    quantize (torch.ao's x86 defaults; for 7 bits narrowed to [-63, 63], symmetric, so no
    weight rounds past the range and torch.ao's reference modules agree)."""
    if bits == 8:
        if qat:
            return default_fused_per_channel_wt_fake_quant
        return default_per_channel_weight_observer
    narrow = {
        "quant_min": -63,
        "quant_max": 63,
        "dtype": torch.int8,
        "qscheme": QScheme.PER_CHANNEL_SYMMETRIC,
    }
    if qat:
        return FusedMovingAvgObsFakeQuantize.with_args(
            observer=MovingAveragePerChannelMinMaxObserver, **narrow
        )
    return PerChannelMinMaxObserver.with_args(**narrow)


def numba_backend_config(name: str) -> BackendConfig:
    """The BackendConfig named ``name`` allowing exactly what the numba lowering table lowers:
    fx_quant's native entries whose operators the rules cover, in the modes they declare."""
    return backend_config_from_rules(name, default_lowering_rules(), get_native_backend_config())


class NumbaBackend(Backend):
    """Lowers to ``quantbridge.kernels`` compiled for one target (``None``: the best one).

    Activations are uint8 over the full [0, 255] range, weights int8 (per channel by
    default). The kernels are exact for every int8 x uint8 product: no 16-bit intermediate
    ever saturates (fbgemm's AVX2 path can), so the default qconfigs use
    ``reduce_range=False``: activations keep all 8 bits, one more than torch.ao's x86 default.
    On the ``avx2`` target the default weights use 7 bits instead (``qconfig_mapping``'s
    ``weight_bits``), which lets the kernels use the faster 16-bit-pair multiply exactly.
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
    ) -> QConfigMapping:
        """x86-style defaults with ``reduce_range=False`` activations (see class docstring).

        ``transformer=True``: the same, with elementwise add / sub / mul / div and the norms
        kept float (None), so the residual stream, LayerNorm and the attention-mask arithmetic
        (``(1 - mask) * finfo.min`` added to the scores) are never observed: Linears, the
        attention matmuls and activations stay int8.

        ``dynamic=True``: dynamic quantization instead: ``nn.Linear``, ``nn.LSTM`` and
        ``nn.GRU`` get int8 per-channel weights and activations quantized at run time; every
        other op stays float.

        ``weight_bits``: 8 (codes in [-128, 127]) or 7 (codes in [-63, 63], per-channel
        symmetric). None picks 7 on the ``avx2`` target and 8 elsewhere: CPUs without VNNI
        multiply with ``vpmaddubsw``, which adds two products in 16 bits and is exact only
        when no such pair can overflow. With 7-bit weights it never can, so the AVX2 kernels
        run ~1.2-1.7x faster than with 8-bit weights (those run on exact but slower 16-bit
        kernels). The price is precision: 3-4 dB of output SQNR on ResNet-18 and MobileNetV2,
        6.5 dB on ResNet-50, whose 53 convs add up the weight error (below torch.ao's x86
        defaults there); pass ``weight_bits=8`` when that matters more than speed.
        """
        bits = self._weight_bits(weight_bits)
        if dynamic:
            if qat or transformer:
                raise ValueError(
                    "qconfig_mapping: dynamic=True cannot be combined with qat or transformer "
                    "(dynamic quantization has no calibration or training step)"
                )
            dyn = QConfig(
                activation=default_dynamic_quant_observer,
                weight=_weight_observer(bits, qat=False),
            )
            mapping = QConfigMapping()
            for module in (nn.Linear, nn.LSTM, nn.GRU):
                mapping.set_object_type(module, dyn)
            return mapping
        mapping = self._default_mapping(qat, bits)
        if transformer:
            for op in _TRANSFORMER_FLOAT_OPS:
                mapping.set_object_type(op, None)
        return mapping

    def _weight_bits(self, weight_bits: int | None) -> int:
        if weight_bits is None:
            return 7 if self.target == "avx2" else 8
        if isinstance(weight_bits, bool) or weight_bits not in (7, 8):
            raise ValueError(
                f"qconfig_mapping: weight_bits must be 7, 8 or None, got {weight_bits!r}"
            )
        return int(weight_bits)

    def _default_mapping(self, qat: bool, bits: int) -> QConfigMapping:
        if qat:
            mapping = get_default_qat_qconfig_mapping("x86")
            qconfig = QConfig(
                activation=FusedMovingAvgObsFakeQuantize.with_args(
                    observer=MovingAverageMinMaxObserver,
                    quant_min=0,
                    quant_max=255,
                    reduce_range=False,
                ),
                weight=_weight_observer(bits, qat=True),
            )
        else:
            mapping = get_default_qconfig_mapping("x86")
            qconfig = QConfig(
                activation=HistogramObserver.with_args(reduce_range=False),
                weight=_weight_observer(bits, qat=False),
            )
        mapping.set_global(qconfig)
        for key in list(mapping.object_type_qconfigs):
            if key not in FIXED_QPARAMS_OP_TO_OBSERVER:
                mapping.set_object_type(key, qconfig)
        return mapping

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
