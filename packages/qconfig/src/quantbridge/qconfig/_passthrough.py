"""Observers that record no range: fixed qparams, placeholders, input reuse and recording."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from quantbridge.qconfig._dtypes import QScheme, canonical_qscheme
from quantbridge.qconfig._errors import QConfigError
from quantbridge.qconfig._observer_base import _FLOAT32_EPS, ObserverBase, reject_unknown_kwargs


def _no_qparams(observer: ObserverBase) -> QConfigError:
    return QConfigError(
        f"{type(observer).__name__} computes no quantization parameters; calculate_qparams "
        "must not be called on it (it only carries dtype/configuration)"
    )


class FixedQParamsObserver(ObserverBase):
    """Returns the same (scale, zero point) whatever it sees; for ops with a known output
    range such as sigmoid (``[0, 1]``) or tanh (``[-1, 1]``).

    Buffers: ``scale`` ``[1]`` float32 and ``zero_point`` ``[1]`` int32.
    """

    scale: torch.Tensor
    zero_point: torch.Tensor

    def __init__(
        self,
        scale: float,
        zero_point: int,
        dtype: object = torch.uint8,
        qscheme: object = QScheme.PER_TENSOR_AFFINE,
        quant_min: int = 0,
        quant_max: int = 255,
        is_dynamic: bool = False,
        **kwargs: Any,
    ) -> None:
        if is_dynamic:
            raise QConfigError("FixedQParamsObserver does not support dynamic quantization")
        reject_unknown_kwargs("FixedQParamsObserver", kwargs)
        super().__init__(dtype=dtype, is_dynamic=is_dynamic)
        if not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
            raise QConfigError(
                f"FixedQParamsObserver: scale must be a positive finite float, got {scale!r}"
            )
        for name, value in (
            ("zero_point", zero_point),
            ("quant_min", quant_min),
            ("quant_max", quant_max),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise QConfigError(f"FixedQParamsObserver: {name} must be an int, got {value!r}")
        if not quant_min <= zero_point <= quant_max:
            raise QConfigError(
                f"FixedQParamsObserver: zero_point {zero_point} is outside "
                f"[quant_min, quant_max] = [{quant_min}, {quant_max}]"
            )
        self.quant_min = quant_min
        self.quant_max = quant_max
        self.register_buffer("scale", torch.tensor([scale], dtype=torch.float))
        self.register_buffer("zero_point", torch.tensor([zero_point], dtype=torch.int))
        self.qscheme = canonical_qscheme(qscheme, where="FixedQParamsObserver: qscheme")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scale, self.zero_point


class PlaceholderObserver(ObserverBase):
    """Observes nothing; carries ``dtype`` (and the other settings) to convert, e.g. for
    float16 or dynamic quantization, where the range is chosen at run time.

    ``compute_dtype`` is deprecated (use ``is_dynamic``); as in torch.ao 2.13 it only warns.
    """

    def __init__(
        self,
        dtype: object = torch.float32,
        custom_op_name: str = "",
        compute_dtype: object = None,
        quant_min: int | None = None,
        quant_max: int | None = None,
        qscheme: object = None,
        eps: float | None = None,
        is_dynamic: bool = False,
    ) -> None:
        super().__init__(dtype=dtype, is_dynamic=is_dynamic)
        self.qscheme = canonical_qscheme(
            QScheme.PER_TENSOR_AFFINE if qscheme is None else qscheme,
            where="PlaceholderObserver: qscheme",
        )
        self.quant_min = quant_min
        self.quant_max = quant_max
        self.eps = _FLOAT32_EPS if eps is None else eps
        self.custom_op = custom_op_name
        if compute_dtype:
            warnings.warn(
                "PlaceholderObserver: compute_dtype is deprecated and has no effect; pass "
                "is_dynamic=True for dynamic quantization",
                FutureWarning,
                stacklevel=2,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}, is_dynamic={self.is_dynamic}"

    def calculate_qparams(self) -> Any:
        raise _no_qparams(self)


class NoopObserver(ObserverBase):
    """Observes nothing; carries ``dtype`` (default float16) to convert."""

    def __init__(self, dtype: object = torch.float16, custom_op_name: str = "") -> None:
        super().__init__(dtype=dtype, is_dynamic=False)
        self.custom_op = custom_op_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> Any:
        raise _no_qparams(self)


class ReuseInputObserver(ObserverBase):
    """Marks an op (reshape, view, ...) whose output shares its input's observer; FX prepare
    reuses the input's observer instead of inserting this one."""

    def __init__(self) -> None:
        super().__init__(torch.uint8, is_dynamic=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> Any:
        raise _no_qparams(self)


class RecordingObserver(ObserverBase):
    """Debugging aid: keeps a copy of every tensor it sees in ``tensor_val``."""

    def __init__(self, dtype: object = torch.uint8) -> None:
        super().__init__(dtype=dtype, is_dynamic=False)
        self.tensor_val: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tensor_val.append(x.clone())
        return x

    def get_tensor_value(self) -> list[torch.Tensor]:
        return self.tensor_val

    def calculate_qparams(self) -> Any:
        raise _no_qparams(self)
