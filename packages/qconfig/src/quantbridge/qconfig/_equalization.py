"""Input-weight equalization: the observers, the scale formula and the default config.

Equalization rescales each input column ``j`` of a linear (or conv) layer by ``s_j`` and the
matching weight column by ``1 / s_j`` (the product is unchanged) so that activations and
weights share their ranges: ``s_j = sqrt(weight_range_j / input_range_j)``, as torch.ao's
``_equalize``. ``quantbridge.fx_quant`` applies it (``prepare_fx(...,
_equalization_config=...)``, then convert).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from quantbridge.qconfig._dtypes import QScheme, canonical_qscheme
from quantbridge.qconfig._errors import QConfigError
from quantbridge.qconfig._factory import PartialWrapper, with_args
from quantbridge.qconfig._per_channel import PerChannelMinMaxObserver
from quantbridge.qconfig._qconfig import QConfig

_PER_CHANNEL = {
    QScheme.PER_TENSOR_AFFINE: QScheme.PER_CHANNEL_AFFINE,
    QScheme.PER_TENSOR_SYMMETRIC: QScheme.PER_CHANNEL_SYMMETRIC,
}


def _check_ndim(x: torch.Tensor, where: str) -> None:
    if not 2 <= x.ndim <= 5:
        raise QConfigError(
            f"{where}: got a {x.ndim}-dim tensor; equalization supports the 2- to 5-dim "
            "inputs and weights of Linear and Conv layers"
        )


def _column_observer(
    dtype: object,
    scheme: QScheme,
    quant_min: int | None,
    quant_max: int | None,
    factory_kwargs: dict[str, Any] | None,
) -> PerChannelMinMaxObserver:
    """The min/max observer of every column (dim 1), with ``scheme``'s per-channel form
    (a per-channel ``scheme`` is kept as it is)."""
    return PerChannelMinMaxObserver(
        ch_axis=1,
        dtype=dtype,
        qscheme=_PER_CHANNEL.get(scheme, scheme),
        quant_min=quant_min,
        quant_max=quant_max,
        factory_kwargs=factory_kwargs,
    )


class InputEqualizationObserver(nn.Module):
    """Records the running min/max of every input column (dim 1) in ``input_obs`` (a
    :class:`PerChannelMinMaxObserver`); holds the equalization scale once computed.
    ``qscheme`` must be per-tensor (it is the per-tensor scheme of the layer's input)."""

    equalization_scale: torch.Tensor

    def __init__(
        self,
        dtype: object = torch.uint8,
        qscheme: object = QScheme.PER_TENSOR_AFFINE,
        quant_min: int | None = None,
        quant_max: int | None = None,
        factory_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        scheme = canonical_qscheme(qscheme, where="InputEqualizationObserver: qscheme")
        if scheme not in _PER_CHANNEL:
            raise QConfigError(
                f"InputEqualizationObserver: qscheme must be per_tensor_affine or "
                f"per_tensor_symmetric, got {scheme.value}"
            )
        self.qscheme = scheme
        self.input_obs = _column_observer(dtype, scheme, quant_min, quant_max, factory_kwargs)
        self.dtype = self.input_obs.dtype
        self.equalization_scale = torch.tensor(1)
        self.equalization_shape: list[int] = []

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        _check_ndim(x_orig, "InputEqualizationObserver")
        self.equalization_shape = [1] * x_orig.ndim
        self.equalization_shape[1] = x_orig.size(1)
        out: torch.Tensor = self.input_obs(x_orig)
        return out

    def get_input_minmax(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_obs.min_val, self.input_obs.max_val

    def set_equalization_scale(self, equalization_scale: torch.Tensor) -> None:
        """Keep ``equalization_scale`` shaped to multiply the input along dim 1 (a scalar 1,
        the "no equalization" value, leaves the observer unchanged)."""
        if _is_unit(equalization_scale):
            return
        self.equalization_scale = torch.reshape(equalization_scale, self.equalization_shape)

    def calculate_scaled_minmax(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The min and max over the columns of the input scaled by the equalization scale
        (None, None before a scale was set)."""
        if _is_unit(self.equalization_scale):
            return None, None
        low, high = self.get_input_minmax()
        scale = self.equalization_scale.reshape(-1)
        return torch.min(low * scale), torch.max(high * scale)

    @classmethod
    def with_args(cls, **kwargs: Any) -> PartialWrapper:
        return with_args(cls, **kwargs)


class WeightEqualizationObserver(nn.Module):
    """Records the running min/max of every weight column (dim 1, the input channels) in
    ``weight_col_obs``; holds the equalization scale once computed."""

    equalization_scale: torch.Tensor

    def __init__(
        self,
        dtype: object = torch.int8,
        qscheme: object = QScheme.PER_TENSOR_AFFINE,
        quant_min: int | None = None,
        quant_max: int | None = None,
        factory_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        scheme = canonical_qscheme(qscheme, where="WeightEqualizationObserver: qscheme")
        self.qscheme = scheme
        self.ch_axis = 1
        self.weight_col_obs = _column_observer(dtype, scheme, quant_min, quant_max, factory_kwargs)
        self.dtype = self.weight_col_obs.dtype
        self.equalization_scale = torch.tensor(1)

    def forward(self, w_orig: torch.Tensor) -> torch.Tensor:
        _check_ndim(w_orig, "WeightEqualizationObserver")
        out: torch.Tensor = self.weight_col_obs(w_orig)
        return out

    def get_weight_col_minmax(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weight_col_obs.min_val, self.weight_col_obs.max_val

    def set_equalization_scale(self, equalization_scale: torch.Tensor) -> None:
        self.equalization_scale = equalization_scale

    @classmethod
    def with_args(cls, **kwargs: Any) -> PartialWrapper:
        return with_args(cls, **kwargs)


def _is_unit(scale: torch.Tensor) -> bool:
    return scale.numel() == 1 and bool(scale == 1)


def _observed(low: torch.Tensor, high: torch.Tensor) -> bool:
    return (
        low.numel() > 0
        and high.numel() > 0
        and not bool(torch.isinf(low).any())
        and not bool(torch.isinf(high).any())
    )


def calculate_equalization_scale(
    input_obs: InputEqualizationObserver, weight_obs: WeightEqualizationObserver
) -> torch.Tensor:
    """``sqrt((w_max - w_min) / (x_max - x_min))`` per input column; columns where that is
    0, inf or NaN get 1. Before both observers saw data: the scalar 1 (with a warning)."""
    x_low, x_high = input_obs.get_input_minmax()
    w_low, w_high = weight_obs.get_weight_col_minmax()
    if not (_observed(x_low, x_high) and _observed(w_low, w_high)):
        warnings.warn(
            "calculate_equalization_scale: an equalization observer saw no data (run "
            "calibration data through the prepared model); this layer is not equalized",
            stacklevel=2,
        )
        return torch.tensor(1)
    if x_low.shape != w_low.shape:
        raise QConfigError(
            f"calculate_equalization_scale: the input has {tuple(x_low.shape)} columns but the "
            f"weight {tuple(w_low.shape)}; equalization needs the layer's input channels to "
            "match its weight's dim 1"
        )
    scale = torch.sqrt((w_high - w_low) / (x_high - x_low))
    scale[scale == 0.0] = 1
    return torch.nan_to_num(scale, nan=1, posinf=1, neginf=1)


class EqualizationQConfig(QConfig):
    """Equalization observer constructors for a layer's input and weight:
    ``EqualizationQConfig(input_activation=..., weight=...)``, as torch.ao's. Used only in
    the ``_equalization_config`` mapping of ``prepare_fx``. ``input_activation`` is stored
    in the ``activation`` field of the :class:`QConfig` it extends."""

    __slots__ = ()

    def __new__(
        cls,
        input_activation: Any = nn.Identity,
        weight: Any = nn.Identity,
    ) -> EqualizationQConfig:
        return super().__new__(cls, input_activation, weight)  # type: ignore[return-value]

    @property
    def input_activation(self) -> Any:
        return self.activation

    def __repr__(self) -> str:
        return f"EqualizationQConfig(input_activation={self.activation!r}, weight={self.weight!r})"


input_equalization_observer = InputEqualizationObserver.with_args(
    dtype=torch.uint8, qscheme=QScheme.PER_TENSOR_SYMMETRIC
)
weight_equalization_observer = WeightEqualizationObserver.with_args(
    dtype=torch.int8, qscheme=QScheme.PER_CHANNEL_SYMMETRIC
)
default_equalization_qconfig = EqualizationQConfig(
    input_activation=input_equalization_observer, weight=weight_equalization_observer
)
