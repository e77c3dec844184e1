"""Per-channel min/max observers: one running (or moving-average) range per channel."""

from __future__ import annotations

from typing import Any

import torch

from quantbridge.qconfig._dtypes import QScheme
from quantbridge.qconfig._errors import QConfigError
from quantbridge.qconfig._observer_base import (
    _FLOAT32_EPS,
    UniformQuantizationObserverBase,
    buffer_kwargs,
    check_averaging_constant,
    moving_average,
    resize_for_state_dict,
)


class PerChannelMinMaxObserver(UniformQuantizationObserverBase):
    """Records the running minimum and maximum of each slice along ``ch_axis``.

    Buffers: ``eps`` ``[1]``, ``min_val`` and ``max_val`` (shape ``[0]`` until the first
    input, then ``[C]``). A state_dict with ``[C]`` buffers loads into a fresh observer.
    """

    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(
        self,
        ch_axis: int = 0,
        dtype: object = torch.uint8,
        qscheme: object = QScheme.PER_CHANNEL_AFFINE,
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
        self._check_qscheme(per_channel=True)
        if isinstance(ch_axis, bool) or not isinstance(ch_axis, int):
            raise QConfigError(f"{name}: ch_axis must be an int, got {ch_axis!r}")
        self.ch_axis = ch_axis
        fk = buffer_kwargs(factory_kwargs)
        self.register_buffer("min_val", torch.tensor([], **fk))
        self.register_buffer("max_val", torch.tensor([], **fk))
        self._check_symmetric_reduce_range()

    def _channel_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as a ``[C, rest]`` matrix with the channel axis first."""
        if x.dim() == 0 or not -x.dim() <= self.ch_axis < x.dim():
            raise QConfigError(
                f"{type(self).__name__}: ch_axis={self.ch_axis} is out of range for an input "
                f"of shape {tuple(x.shape)}; set ch_axis to the channel dimension"
            )
        order = list(range(x.dim()))
        order[self.ch_axis] = 0
        order[0] = self.ch_axis if self.ch_axis >= 0 else x.dim() + self.ch_axis
        return torch.flatten(x.permute(order), start_dim=1)

    def _check_channels(self, count: int) -> None:
        if self.min_val.numel() not in (0, count):
            raise QConfigError(
                f"{type(self).__name__}: input has {count} channels along axis {self.ch_axis} "
                f"but the observer has recorded {self.min_val.numel()}; call "
                "reset_min_max_vals() before observing a differently shaped tensor"
            )

    def _store(self, new_min: torch.Tensor, new_max: torch.Tensor) -> None:
        self.min_val.resize_(new_min.shape)
        self.max_val.resize_(new_max.shape)
        self.min_val.copy_(new_min)
        self.max_val.copy_(new_max)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        rows = self._channel_rows(x_orig.detach()).to(self.min_val.dtype)
        cur_min, cur_max = torch.aminmax(rows, dim=1)
        self._check_channels(cur_min.numel())
        if self.min_val.numel() == 0 or self.max_val.numel() == 0:
            self._store(cur_min, cur_max)
        else:
            self._store(torch.min(cur_min, self.min_val), torch.max(cur_max, self.max_val))
        return x_orig

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._calculate_qparams(self.min_val, self.max_val)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}"

    def reset_min_max_vals(self) -> None:
        """Forget everything observed so far (back to empty ``[0]`` buffers)."""
        self.min_val.resize_(0)
        self.max_val.resize_(0)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # args: local_metadata, strict, missing_keys, unexpected_keys, error_msgs (nn.Module's)
        # A fresh observer has [0] buffers; resize them so [C] values can be copied in.
        resize_for_state_dict(self, state_dict, prefix, ("min_val", "max_val"))
        super()._load_from_state_dict(state_dict, prefix, *args)


class MovingAveragePerChannelMinMaxObserver(PerChannelMinMaxObserver):
    """Per-channel min/max as an exponential moving average with ``averaging_constant``."""

    def __init__(
        self,
        averaging_constant: float = 0.01,
        ch_axis: int = 0,
        dtype: object = torch.uint8,
        qscheme: object = QScheme.PER_CHANNEL_AFFINE,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        eps: float = _FLOAT32_EPS,
        is_dynamic: bool = False,
        **kwargs: Any,
    ) -> None:
        check_averaging_constant(averaging_constant, type(self).__name__)
        super().__init__(
            ch_axis=ch_axis,
            dtype=dtype,
            qscheme=qscheme,
            reduce_range=reduce_range,
            quant_min=quant_min,
            quant_max=quant_max,
            eps=eps,
            is_dynamic=is_dynamic,
            **kwargs,
        )
        self.averaging_constant = averaging_constant

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        rows = self._channel_rows(x_orig.detach().to(self.min_val.dtype))
        cur_min, cur_max = torch.aminmax(rows, dim=1)
        self._check_channels(cur_min.numel())
        if self.min_val.numel() == 0 or self.max_val.numel() == 0:
            self._store(cur_min, cur_max)
        else:
            self._store(
                moving_average(self.min_val, cur_min, self.averaging_constant),
                moving_average(self.max_val, cur_max, self.averaging_constant),
            )
        return x_orig
