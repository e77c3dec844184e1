"""Per-tensor min/max observers: running extremes and their moving average."""

from __future__ import annotations

from typing import Any

import torch

from quantbridge.qconfig._dtypes import QScheme
from quantbridge.qconfig._errors import QConfigError
from quantbridge.qconfig._observer_base import (
    _FLOAT32_EPS,
    UniformQuantizationObserverBase,
    check_averaging_constant,
    moving_average,
)


class MinMaxObserver(UniformQuantizationObserverBase):
    """Records the running minimum and maximum of every tensor it sees (per tensor).

    Buffers: ``eps`` ``[1]``, ``min_val`` and ``max_val`` (0-dim, ``inf``/``-inf`` until the
    first non-empty input). ``calculate_qparams`` gives torch.ao's affine or symmetric qparams
    for ``[min(min_val, 0), max(max_val, 0)]``.
    """

    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(
        self,
        dtype: object = torch.uint8,
        qscheme: object = QScheme.PER_TENSOR_AFFINE,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        factory_kwargs: dict[str, Any] | None = None,
        eps: float = _FLOAT32_EPS,
        is_dynamic: bool = False,
        **kwargs: Any,
    ) -> None:
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
        self._init_per_tensor_range(factory_kwargs)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        x = x_orig.detach().to(self.min_val.dtype)
        cur_min, cur_max = torch.aminmax(x)
        self.min_val.copy_(torch.min(cur_min, self.min_val))
        self.max_val.copy_(torch.max(cur_max, self.max_val))
        return x_orig

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._calculate_qparams(self.min_val, self.max_val)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}"

    def reset_min_max_vals(self) -> None:
        """Forget everything observed so far."""
        self.min_val.fill_(float("inf"))
        self.max_val.fill_(float("-inf"))


class MovingAverageMinMaxObserver(MinMaxObserver):
    """Per-tensor min/max as an exponential moving average:
    ``min_val += averaging_constant * (min(x) - min_val)`` (likewise max); the first input
    sets them directly. ``averaging_constant=1`` makes it memoryless (dynamic quantization).
    """

    def __init__(
        self,
        averaging_constant: float = 0.01,
        dtype: object = torch.uint8,
        qscheme: object = QScheme.PER_TENSOR_AFFINE,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        eps: float = _FLOAT32_EPS,
        is_dynamic: bool = False,
        **kwargs: Any,
    ) -> None:
        check_averaging_constant(averaging_constant, type(self).__name__)
        if is_dynamic and averaging_constant != 1:
            raise QConfigError(
                f"MovingAverageMinMaxObserver: is_dynamic=True needs averaging_constant=1 "
                f"(got {averaging_constant}); dynamic quantization uses each input's own range"
            )
        super().__init__(
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
        x = x_orig.detach().to(self.min_val.dtype)
        cur_min, cur_max = torch.aminmax(x)
        if bool(self.min_val == float("inf")) and bool(self.max_val == float("-inf")):
            new_min, new_max = cur_min, cur_max
        else:
            new_min = moving_average(self.min_val, cur_min, self.averaging_constant)
            new_max = moving_average(self.max_val, cur_max, self.averaging_constant)
        self.min_val.copy_(new_min)
        self.max_val.copy_(new_max)
        return x_orig
