"""Fake quantization for QAT: observe, then quantize-dequantize in float, with
straight-through gradients.

The quantize-dequantize step is ``torch.fake_quantize_per_tensor_affine`` /
``torch.fake_quantize_per_channel_affine`` and the fused module uses
``torch.fused_moving_avg_obs_fake_quant``: plain float aten ops (float in, float out; no
quantized tensor is created), the very kernels torch.ao's modules call, so outputs and
gradients are bit-identical to torch.ao's.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from quantbridge.qconfig._dtypes import QScheme, natural_quant_range
from quantbridge.qconfig._errors import QConfigError
from quantbridge.qconfig._factory import PartialWrapper, with_args, with_callable_args
from quantbridge.qconfig._minmax import MovingAverageMinMaxObserver
from quantbridge.qconfig._observer_base import resize_for_state_dict
from quantbridge.qconfig._passthrough import FixedQParamsObserver
from quantbridge.qconfig._per_channel import MovingAveragePerChannelMinMaxObserver


class FakeQuantizeBase(nn.Module, metaclass=abc.ABCMeta):
    """Base of fake-quantize modules: the ``fake_quant_enabled`` / ``observer_enabled``
    switches (``[1]`` uint8 buffers) and their enable/disable methods."""

    fake_quant_enabled: torch.Tensor
    observer_enabled: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("fake_quant_enabled", torch.tensor([1], dtype=torch.uint8))
        self.register_buffer("observer_enabled", torch.tensor([1], dtype=torch.uint8))

    @abc.abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Observe (if enabled) and fake-quantize (if enabled) ``x``."""

    @abc.abstractmethod
    def calculate_qparams(self) -> Any:
        """The current quantization parameters."""

    def enable_fake_quant(self, enabled: bool = True) -> None:
        self.fake_quant_enabled[0] = 1 if enabled else 0

    def disable_fake_quant(self) -> None:
        self.enable_fake_quant(False)

    def enable_observer(self, enabled: bool = True) -> None:
        self.observer_enabled[0] = 1 if enabled else 0

    def disable_observer(self) -> None:
        self.enable_observer(False)

    @classmethod
    def with_args(cls, **kwargs: Any) -> PartialWrapper:
        """A factory building this module with ``kwargs``."""
        return with_args(cls, **kwargs)

    @classmethod
    def with_callable_args(cls, **kwargs: Callable[[], Any]) -> PartialWrapper:
        """A factory whose ``kwargs`` are computed by calling each value at build time."""
        return with_callable_args(cls, **kwargs)


def _factory_dtype(observer: Any, observer_kwargs: dict[str, Any]) -> object:
    """The dtype the observer will be built with (its factory's keyword wins)."""
    dtype: object = observer_kwargs.get("dtype", torch.uint8)
    partial = getattr(observer, "p", None)
    keywords = getattr(partial, "keywords", None)
    if isinstance(keywords, dict):
        dtype = keywords.get("dtype", dtype)
    return dtype


class FakeQuantize(FakeQuantizeBase):
    """``x -> (clamp(round(x / scale + zero_point), quant_min, quant_max) - zero_point) * scale``
    with scale and zero point from ``observer`` (a class or factory, built with
    ``observer_kwargs``), refreshed on every forward while the observer is enabled.

    Buffers: ``fake_quant_enabled``, ``observer_enabled``, ``scale`` (float32) and
    ``zero_point`` (int32; float32 for per_channel_affine_float_qparams), then the
    observer's under ``activation_post_process.`` — torch.ao's state_dict layout.
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    activation_post_process: Any

    def __init__(
        self,
        observer: Any = MovingAverageMinMaxObserver,
        quant_min: int | None = None,
        quant_max: int | None = None,
        is_dynamic: bool = False,
        **observer_kwargs: Any,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        for bound, value in (("quant_min", quant_min), ("quant_max", quant_max)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise QConfigError(f"{name}: {bound} must be an int or None, got {value!r}")
        if quant_min is not None and quant_max is not None:
            if quant_min > quant_max:
                raise QConfigError(
                    f"{name}: quant_min ({quant_min}) must not exceed quant_max ({quant_max})"
                )
            dtype = _factory_dtype(observer, observer_kwargs)
            low, high = natural_quant_range(dtype)
            if quant_min < low or quant_max > high:
                raise QConfigError(
                    f"{name}: [quant_min, quant_max] = [{quant_min}, {quant_max}] is outside "
                    f"the range [{low}, {high}] of dtype {dtype}"
                )
            observer_kwargs.update({"quant_min": quant_min, "quant_max": quant_max})
        observer_kwargs["is_dynamic"] = is_dynamic
        self.activation_post_process = observer(**observer_kwargs)
        post = self.activation_post_process
        if not isinstance(getattr(post, "qscheme", None), QScheme):
            raise QConfigError(
                f"{name}: observer {type(post).__name__} has no quantization scheme; use a "
                "quantbridge observer that computes qparams (e.g. MovingAverageMinMaxObserver)"
            )
        self.quant_min = post.quant_min
        self.quant_max = post.quant_max
        self.is_dynamic = post.is_dynamic
        qscheme: QScheme = post.qscheme
        if qscheme.is_per_group:
            raise QConfigError(
                f"{type(self).__name__}: qscheme {qscheme.value} is weight-only post-training "
                "quantization, which has no fake quantize; use its observer "
                "(PerGroupMinMaxObserver) in a QConfig without QAT"
            )
        zero_point_dtype = (
            torch.float if qscheme is QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS else torch.int
        )
        self.register_buffer("scale", torch.tensor([1.0], dtype=torch.float))
        self.register_buffer("zero_point", torch.tensor([0], dtype=zero_point_dtype))
        self.dtype: torch.dtype = post.dtype
        self.qscheme = qscheme
        self.ch_axis: int = getattr(post, "ch_axis", -1)
        self.is_per_channel = qscheme.is_per_channel

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        result: tuple[torch.Tensor, torch.Tensor] = self.activation_post_process.calculate_qparams()
        return result

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.observer_enabled[0] == 1:
            self.activation_post_process(x.detach())
            scale, zero_point = self.calculate_qparams()
            scale = scale.to(self.scale.device)
            zero_point = zero_point.to(self.zero_point.device)
            if self.scale.shape != scale.shape:
                self.scale.resize_(scale.shape)
                self.zero_point.resize_(zero_point.shape)
            self.scale.copy_(scale)
            self.zero_point.copy_(zero_point)

        if self.fake_quant_enabled[0] == 1:
            post = self.activation_post_process
            if self.is_per_channel:
                # The aten op wants a non-negative axis; torch.ao passes -1 through and fails.
                axis = self.ch_axis + x.dim() if self.ch_axis < 0 else self.ch_axis
                x = torch.fake_quantize_per_channel_affine(
                    x, self.scale, self.zero_point, axis, post.quant_min, post.quant_max
                )
            else:
                x = torch.fake_quantize_per_tensor_affine(
                    x, self.scale, self.zero_point, post.quant_min, post.quant_max
                )
        return x

    def extra_repr(self) -> str:
        post = self.activation_post_process
        return (
            f"fake_quant_enabled={self.fake_quant_enabled}, "
            f"observer_enabled={self.observer_enabled}, quant_min={post.quant_min}, "
            f"quant_max={post.quant_max}, dtype={self.dtype}, qscheme={self.qscheme}, "
            f"ch_axis={self.ch_axis}, scale={self.scale}, zero_point={self.zero_point}"
        )

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # args: local_metadata, strict, missing_keys, unexpected_keys, error_msgs (nn.Module's)
        # Per-channel qparams are [C], not the initial [1]: resize before copying.
        resize_for_state_dict(self, state_dict, prefix, ("scale", "zero_point"))
        super()._load_from_state_dict(state_dict, prefix, *args)


class FixedQParamsFakeQuantize(FakeQuantize):
    """Fake quantization with the fixed qparams of a :class:`FixedQParamsObserver` (the
    module's ``scale``/``zero_point`` are the observer's buffers)."""

    def __init__(self, observer: Any) -> None:
        super().__init__(observer=observer)
        if type(self.activation_post_process) is not FixedQParamsObserver:
            raise QConfigError(
                f"FixedQParamsFakeQuantize needs a FixedQParamsObserver factory, got "
                f"{type(self.activation_post_process).__name__}"
            )
        self._observer_ctr = observer
        self.scale = self.activation_post_process.scale
        self.zero_point = self.activation_post_process.zero_point
        if self.qscheme.is_per_channel:
            raise QConfigError(
                f"FixedQParamsFakeQuantize supports per-tensor qschemes only, got "
                f"{self.qscheme.value}"
            )

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scale, self.zero_point

    def extra_repr(self) -> str:
        post = self.activation_post_process
        return (
            f"fake_quant_enabled={self.fake_quant_enabled}, "
            f"observer_enabled={self.observer_enabled}, scale={self.scale}, "
            f"zero_point={self.zero_point}, dtype={self.dtype}, quant_min={post.quant_min}, "
            f"quant_max={post.quant_max}, qscheme={self.qscheme}"
        )


class FusedMovingAvgObsFakeQuantize(FakeQuantize):
    """Moving-average min/max observation, qparams and fake quantization in one aten call
    (``torch.fused_moving_avg_obs_fake_quant``). The observer must be a
    :class:`MovingAverageMinMaxObserver` or :class:`MovingAveragePerChannelMinMaxObserver`;
    the switches are int64 buffers, as in torch.ao.
    """

    def __init__(
        self,
        observer: Any = MovingAverageMinMaxObserver,
        quant_min: int = 0,
        quant_max: int = 255,
        **observer_kwargs: Any,
    ) -> None:
        super().__init__(observer, quant_min, quant_max, **observer_kwargs)
        if not isinstance(
            self.activation_post_process,
            (MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver),
        ):
            raise QConfigError(
                "FusedMovingAvgObsFakeQuantize needs a MovingAverageMinMaxObserver or "
                "MovingAveragePerChannelMinMaxObserver factory, got "
                f"{type(self.activation_post_process).__name__}"
            )
        self.register_buffer("fake_quant_enabled", torch.tensor([1], dtype=torch.long))
        self.register_buffer("observer_enabled", torch.tensor([1], dtype=torch.long))
        self.is_symmetric_quant = self.qscheme.is_symmetric

    def extra_repr(self) -> str:
        post = self.activation_post_process
        return (
            f"fake_quant_enabled={self.fake_quant_enabled}, "
            f"observer_enabled={self.observer_enabled}, scale={self.scale}, "
            f"zero_point={self.zero_point}, dtype={self.dtype}, quant_min={post.quant_min}, "
            f"quant_max={post.quant_max}, qscheme={self.qscheme}, "
            f"reduce_range={post.reduce_range}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        post = self.activation_post_process
        out = torch.fused_moving_avg_obs_fake_quant(
            x,
            self.observer_enabled,
            self.fake_quant_enabled,
            post.min_val,
            post.max_val,
            self.scale,
            self.zero_point,
            post.averaging_constant,
            post.quant_min,
            post.quant_max,
            self.ch_axis,
            self.is_per_channel,
            self.is_symmetric_quant,
        )
        # The fused op would carry NaN/inf into scale and zero point silently; the unfused
        # observers refuse them in calculate_qparams, so refuse them here too (O(C) check).
        if self.observer_enabled[0] == 1 and not bool(
            torch.isfinite(post.min_val).all() and torch.isfinite(post.max_val).all()
        ):
            raise QConfigError(
                f"FusedMovingAvgObsFakeQuantize: the observed range is not finite "
                f"(min_val={post.min_val.tolist()}, max_val={post.max_val.tolist()}); the "
                "input contained NaN or inf. Find its source; reset the observer "
                "(activation_post_process.reset_min_max_vals()) before continuing."
            )
        return out


def _switch(module: nn.Module, method: str) -> None:
    if isinstance(module, FakeQuantizeBase):
        getattr(module, method)()


def enable_fake_quant(mod: nn.Module) -> None:
    """Turn fake quantization on for ``mod`` if it is a fake-quantize module
    (``model.apply(enable_fake_quant)``)."""
    _switch(mod, "enable_fake_quant")


def disable_fake_quant(mod: nn.Module) -> None:
    """Turn fake quantization off for ``mod`` if it is a fake-quantize module."""
    _switch(mod, "disable_fake_quant")


def enable_observer(mod: nn.Module) -> None:
    """Turn observation on for ``mod`` if it is a fake-quantize module."""
    _switch(mod, "enable_observer")


def disable_observer(mod: nn.Module) -> None:
    """Turn observation off for ``mod`` if it is a fake-quantize module."""
    _switch(mod, "disable_observer")
