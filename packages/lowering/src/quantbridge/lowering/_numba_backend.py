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
    QConfig,
    QConfigMapping,
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


def numba_backend_config(name: str) -> BackendConfig:
    """The BackendConfig named ``name`` allowing exactly what the numba lowering table lowers:
    fx_quant's native entries whose operators the rules cover, in the modes they declare."""
    return backend_config_from_rules(name, default_lowering_rules(), get_native_backend_config())


class NumbaBackend(Backend):
    """Lowers to ``quantbridge.kernels`` compiled for one target (``None``: the best one).

    Activations are uint8 over the full [0, 255] range, weights int8 (per channel by
    default). The kernels accumulate int8 x uint8 products in int32 (no 16-bit intermediate
    that could saturate, unlike fbgemm's AVX2 path), so the default qconfigs use
    ``reduce_range=False``: activations keep all 8 bits, one more than torch.ao's x86 default.
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

    def qconfig_mapping(self, qat: bool = False, *, transformer: bool = False) -> QConfigMapping:
        """x86-style defaults with ``reduce_range=False`` activations (see class docstring).

        ``transformer=True``: the same, with elementwise add / sub / mul / div and the norms
        kept float (None), so the residual stream, LayerNorm and the attention-mask arithmetic
        (``(1 - mask) * finfo.min`` added to the scores) are never observed: Linears, the
        attention matmuls and activations stay int8.
        """
        mapping = self._default_mapping(qat)
        if transformer:
            for op in _TRANSFORMER_FLOAT_OPS:
                mapping.set_object_type(op, None)
        return mapping

    def _default_mapping(self, qat: bool) -> QConfigMapping:
        if qat:
            mapping = get_default_qat_qconfig_mapping("x86")
            qconfig = QConfig(
                activation=FusedMovingAvgObsFakeQuantize.with_args(
                    observer=MovingAverageMinMaxObserver,
                    quant_min=0,
                    quant_max=255,
                    reduce_range=False,
                ),
                weight=default_fused_per_channel_wt_fake_quant,
            )
        else:
            mapping = get_default_qconfig_mapping("x86")
            qconfig = QConfig(
                activation=HistogramObserver.with_args(reduce_range=False),
                weight=default_per_channel_weight_observer,
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
