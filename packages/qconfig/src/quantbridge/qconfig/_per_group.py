"""PerGroupMinMaxObserver: one (scale, zero point) per group of a weight row's input features.

Weight-only quantization of LLM Linears and Embeddings (llama.cpp's Q4_0 / Q8_0, torchao's
int4 weight-only, OpenVINO's group-wise INT4): a weight ``[out_features, in_features]`` is
cut along its last axis into groups of ``group_size`` consecutive values, and each group gets
its own qparams. The qparams are computed from each group's min and max by the per-channel
rule (torch.ao's arithmetic, ``_qparams.compute_qparams``), so a group of a
``per_group_symmetric`` weight has ``scale = max|w| / ((quant_max - quant_min) / 2)``.

PerGroupGPTQObserver asks for GPTQ (Frantar et al. 2022) instead: the same qparams rule, but
applied by ``fx_quant.quantize_weight_only`` to weights it corrects column by column from
calibration inputs (``data_aware = True``). Called alone on a weight it is the min/max observer.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from quantbridge.qconfig._dtypes import QScheme
from quantbridge.qconfig._errors import QConfigError
from quantbridge.qconfig._observer_base import (
    _FLOAT32_EPS,
    UniformQuantizationObserverBase,
    buffer_kwargs,
    resize_for_state_dict,
)
from quantbridge.qconfig._qparams import compute_qparams

__all__ = ["GROUP_SIZES", "PerGroupGPTQObserver", "PerGroupMinMaxObserver"]

# the group sizes the observer accepts (those of llama.cpp, torchao and OpenVINO)
GROUP_SIZES = (32, 64, 128)

_AS_PER_CHANNEL = {
    QScheme.PER_GROUP_AFFINE: QScheme.PER_CHANNEL_AFFINE,
    QScheme.PER_GROUP_SYMMETRIC: QScheme.PER_CHANNEL_SYMMETRIC,
}


class PerGroupMinMaxObserver(UniformQuantizationObserverBase):
    """Records the minimum and maximum of every group of ``group_size`` consecutive values
    along the last axis of each row (a weight ``[out_features, in_features]``; leading axes
    of a larger input are rows too).

    ``calculate_qparams()`` returns ``scale`` (float32) and ``zero_point`` of shape
    ``[rows, in_features // group_size]``. Buffers ``min_val``/``max_val`` are ``[0]`` until
    the first input, then ``[rows, groups]``; a state_dict with such buffers loads into a
    fresh observer. 4-bit weights: ``dtype=torch.int8, quant_min=-8, quant_max=7`` (symmetric)
    or ``dtype=torch.uint8, quant_min=0, quant_max=15`` (affine).
    """

    # whether weight-only quantization must compute the codes from calibration data (GPTQ)
    data_aware: bool = False

    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(
        self,
        group_size: int = 32,
        dtype: object = torch.int8,
        qscheme: object = QScheme.PER_GROUP_SYMMETRIC,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        factory_kwargs: dict[str, Any] | None = None,
        eps: float = _FLOAT32_EPS,
        is_dynamic: bool = False,
        **kwargs: Any,
    ) -> None:
        name = type(self).__name__
        if is_dynamic:
            raise QConfigError(f"{name} does not support dynamic quantization (is_dynamic=True)")
        super().__init__(
            dtype=dtype,
            qscheme=qscheme,
            reduce_range=reduce_range,
            quant_min=quant_min,
            quant_max=quant_max,
            factory_kwargs=factory_kwargs,
            eps=eps,
            is_dynamic=is_dynamic,
            **kwargs,
        )
        self._check_qscheme(per_channel=False, per_group=True)
        self._check_symmetric_reduce_range()
        if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
            raise QConfigError(
                f"{name}: group_size must be one of {list(GROUP_SIZES)}, got {group_size!r}"
            )
        self.group_size = int(group_size)
        fk = buffer_kwargs(factory_kwargs)
        self.register_buffer("min_val", torch.tensor([], **fk))
        self.register_buffer("max_val", torch.tensor([], **fk))

    def _groups(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as ``[rows, groups, group_size]``."""
        name = type(self).__name__
        if x.dim() < 2:
            raise QConfigError(
                f"{name}: expects a weight [out_features, in_features], got shape {tuple(x.shape)}"
            )
        features = x.shape[-1]
        if features % self.group_size:
            fits = [g for g in GROUP_SIZES if features % g == 0]
            choice = f"group_size {fits}" if fits else f"no group size of {list(GROUP_SIZES)}"
            raise QConfigError(
                f"{name}: in_features {features} (shape {tuple(x.shape)}) is not a multiple of "
                f"group_size {self.group_size}; {choice} divides it: use it, or keep this "
                "module float (qconfig None)"
            )
        return x.reshape(-1, features // self.group_size, self.group_size)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        groups = self._groups(x_orig.detach()).to(self.min_val.dtype)
        cur_min, cur_max = torch.aminmax(groups, dim=2)
        if self.min_val.numel() not in (0, cur_min.numel()) or (
            self.min_val.numel() and self.min_val.shape != cur_min.shape
        ):
            raise QConfigError(
                f"{type(self).__name__}: input has groups {tuple(cur_min.shape)} but the "
                f"observer has recorded {tuple(self.min_val.shape)}; call reset_min_max_vals() "
                "before observing a differently shaped weight"
            )
        if self.min_val.numel():
            cur_min, cur_max = torch.min(cur_min, self.min_val), torch.max(cur_max, self.max_val)
        self.min_val.resize_(cur_min.shape)
        self.max_val.resize_(cur_max.shape)
        self.min_val.copy_(cur_min)
        self.max_val.copy_(cur_max)
        return x_orig

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, zero_point)``, each ``[rows, groups]``."""
        shape = self.min_val.shape
        scale, zero_point = compute_qparams(
            self.min_val.reshape(-1),
            self.max_val.reshape(-1),
            self._qrange,
            _AS_PER_CHANNEL[self.qscheme],
            self.eps,
            type(self).__name__,
        )
        if self.min_val.numel() == 0:
            return scale, zero_point
        return scale.reshape(shape), zero_point.reshape(shape)

    def extra_repr(self) -> str:
        return f"group_size={self.group_size}, min_val={self.min_val}, max_val={self.max_val}"

    def reset_min_max_vals(self) -> None:
        """Forget everything observed so far (back to empty ``[0]`` buffers)."""
        self.min_val.resize_(0)
        self.max_val.resize_(0)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        resize_for_state_dict(self, state_dict, prefix, ("min_val", "max_val"))
        super()._load_from_state_dict(state_dict, prefix, *args)


class PerGroupGPTQObserver(PerGroupMinMaxObserver):
    """GPTQ (Frantar et al. 2022) for per-group weights: the qconfig of a Linear whose codes
    ``fx_quant.quantize_weight_only`` computes from calibration inputs.

    There, the weight is quantized one input feature (column) at a time and each column's
    rounding error is spread over the columns not yet quantized, weighted by the inverse of
    the Hessian ``H = sum x x^T`` of the layer's calibration inputs, so the layer's outputs on
    such inputs move as little as the codes allow. Each group's qparams are this class's
    min/max rule on the group's weights as GPTQ has updated them when it reaches the group.

    ``damp``: the fraction of H's mean diagonal added to its diagonal before inverting (the
    paper's 1 %; raise it if a layer's Hessian is reported not positive definite), in (0, 1].
    ``act_order``: quantize the columns in order of decreasing ``H_ii`` (the paper's
    "act-order"), the qparams of each group still those of a contiguous group of input
    features, computed from the weights before any update ("static groups", what the kernels'
    packed format needs).

    Called on a weight alone (no calibration data) it records min/max like its base class, so
    its ``calculate_qparams`` are the min/max observer's.
    """

    data_aware = True

    def __init__(
        self,
        group_size: int = 32,
        dtype: object = torch.int8,
        qscheme: object = QScheme.PER_GROUP_SYMMETRIC,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        factory_kwargs: dict[str, Any] | None = None,
        eps: float = _FLOAT32_EPS,
        is_dynamic: bool = False,
        damp: float = 0.01,
        act_order: bool = False,
        **kwargs: Any,
    ) -> None:
        name = type(self).__name__
        if (
            isinstance(damp, bool)
            or not isinstance(damp, (int, float))
            or not math.isfinite(damp)
            or not 0.0 < damp <= 1.0
        ):
            raise QConfigError(
                f"{name}: damp must be a number in (0, 1] (a fraction of the Hessian's mean "
                f"diagonal; GPTQ uses 0.01), got {damp!r}"
            )
        if not isinstance(act_order, bool):
            raise QConfigError(f"{name}: act_order must be True or False, got {act_order!r}")
        super().__init__(
            group_size=group_size,
            dtype=dtype,
            qscheme=qscheme,
            reduce_range=reduce_range,
            quant_min=quant_min,
            quant_max=quant_max,
            factory_kwargs=factory_kwargs,
            eps=eps,
            is_dynamic=is_dynamic,
            **kwargs,
        )
        self.damp = float(damp)
        self.act_order = act_order

    def extra_repr(self) -> str:
        return f"damp={self.damp}, act_order={self.act_order}, {super().extra_repr()}"
