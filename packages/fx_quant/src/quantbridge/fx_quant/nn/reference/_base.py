"""What every reference quantized module shares: weight qparams and the weight round trip.

A reference module keeps its float weight and, in forward, runs the float op on
``dequantize(quantize(weight))`` computed with the ``torch.ops.quantbridge`` ops. That is the
exact arithmetic a backend must reproduce when it lowers the module to integer kernels.

``weight_qparams`` is a dict like torch.ao's: ``qscheme`` (a QScheme, its name, or a torch
qscheme object), ``dtype`` (``torch.uint8``/``int8``/``int32``, or ``torch.quint8``-style
aliases, or ``torch.float16``/``float32`` for no integer quantization), ``scale``,
``zero_point``, ``axis`` (per-channel) and optionally ``quant_min``/``quant_max`` (else the
dtype's full range, which is what torch.ao's reference modules clamp to).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.qconfig._dtypes import (
    QScheme,
    canonical_dtype,
    canonical_qscheme,
    natural_quant_range,
)

__all__ = ["QuantizedWeight", "ReferenceQuantizedModule"]

_ops = torch.ops.quantbridge

# Symmetric schemes store the same qparams as their affine counterparts (zero point fixed).
_AS_AFFINE = {
    QScheme.PER_TENSOR_SYMMETRIC: QScheme.PER_TENSOR_AFFINE,
    QScheme.PER_CHANNEL_SYMMETRIC: QScheme.PER_CHANNEL_AFFINE,
}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DEFAULT_QPARAMS: dict[str, Any] = {
    "qscheme": QScheme.PER_TENSOR_AFFINE,
    "dtype": torch.uint8,
    "scale": 1.0,
    "zero_point": 0,
}


class QuantizedWeight(NamedTuple):
    """A weight as plain integers plus what is needed to read it back as floats."""

    values: torch.Tensor  # uint8/int8/int32 tensor, same shape as the float weight
    scale: torch.Tensor
    zero_point: torch.Tensor
    axis: int | None  # the channel axis for per-channel schemes
    quant_min: int
    quant_max: int
    dtype: torch.dtype
    qscheme: QScheme


def _where(module: nn.Module) -> str:
    return f"reference {type(module).__name__}"


class ReferenceQuantizedModule(nn.Module):
    """Mixin holding ``weight_qscheme``, ``weight_dtype`` and the qparam buffers.

    Buffers (saved in state_dict): ``weight_scale`` (float), ``weight_zero_point`` (int32, or
    float for ``per_channel_affine_float_qparams``), ``weight_axis`` (int32). The scheme, dtype
    and quant range travel as the module's extra state (plain strings and ints), so a
    state_dict loads with ``torch.load(weights_only=True)``.
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_zero_point: torch.Tensor
    weight_axis: torch.Tensor
    weight_qscheme: QScheme | None
    weight_dtype: torch.dtype
    weight_quant_min: int
    weight_quant_max: int
    weight_axis_int: int

    def _init_weight_qparams(
        self, weight_qparams: Mapping[str, Any] | None, device: torch.device | str | None
    ) -> None:
        where = _where(self)
        qparams = dict(_DEFAULT_QPARAMS if weight_qparams is None else weight_qparams)
        if "dtype" not in qparams or "qscheme" not in qparams:
            raise FxQuantError(
                f"{where}: weight_qparams needs 'qscheme' and 'dtype' keys, got {sorted(qparams)}"
            )
        raw_dtype = qparams["dtype"]
        qscheme = None
        if qparams["qscheme"] is not None:
            try:
                qscheme = canonical_qscheme(
                    qparams["qscheme"], f"{where}: weight_qparams['qscheme']"
                )
            except ValueError as e:
                raise FxQuantError(str(e)) from None
            qscheme = _AS_AFFINE.get(qscheme, qscheme)
        try:
            dtype = canonical_dtype(raw_dtype, f"{where}: weight_qparams['dtype']")
        except ValueError as e:
            raise FxQuantError(str(e)) from None
        self.weight_qscheme = qscheme
        self.weight_dtype = dtype
        quantized = qscheme is not None and dtype not in _FLOAT_DTYPES
        if quantized:
            low, high = natural_quant_range(raw_dtype)
            qmin = qparams.get("quant_min")
            qmax = qparams.get("quant_max")
            self.weight_quant_min = low if qmin is None else int(qmin)
            self.weight_quant_max = high if qmax is None else int(qmax)
            if not low <= self.weight_quant_min <= self.weight_quant_max <= high:
                raise FxQuantError(
                    f"{where}: weight_qparams quant range [{qmin}, {qmax}] does not fit dtype "
                    f"{raw_dtype} ([{low}, {high}])"
                )
            for key in ("scale", "zero_point"):
                if key not in qparams:
                    raise FxQuantError(f"{where}: weight_qparams is missing {key!r}")
            scale = _as_tensor(qparams["scale"], torch.float32, device)
            zp_default = (
                torch.float32
                if qscheme is QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS
                else torch.int32
            )
            zero_point = _as_tensor(qparams["zero_point"], zp_default, device)
            if qscheme is not None and qscheme.is_per_channel:
                if qparams.get("axis") is None:
                    raise FxQuantError(
                        f"{where}: weight_qparams for {qscheme.value} needs an 'axis'"
                    )
                axis = _as_tensor(qparams["axis"], torch.int32, device)
            else:
                axis = torch.tensor(0, dtype=torch.int32, device=device)
        else:
            self.weight_quant_min, self.weight_quant_max = 0, 0
            scale = torch.tensor(1.0, dtype=torch.float32, device=device)
            zero_point = torch.tensor(0, dtype=torch.int32, device=device)
            axis = torch.tensor(0, dtype=torch.int32, device=device)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_zero_point", zero_point)
        self.register_buffer("weight_axis", axis)
        self.weight_axis_int = int(axis.item())
        if quantized:
            self._check_weight_qparams()

    def _check_weight_qparams(self) -> None:
        where = _where(self)
        qscheme = self.weight_qscheme
        if qscheme is None or not qscheme.is_per_channel:
            if self.weight_scale.numel() != 1 or self.weight_zero_point.numel() != 1:
                raise FxQuantError(
                    f"{where}: per-tensor weight_qparams need one scale and one zero_point, "
                    f"got {self.weight_scale.numel()} and {self.weight_zero_point.numel()}"
                )
            return
        ndim = self.weight.dim()
        axis = self.weight_axis_int
        if not -ndim <= axis < ndim:
            raise FxQuantError(
                f"{where}: weight_qparams axis={axis} is out of range for a {ndim}-d weight"
            )
        channels = self.weight.shape[axis]
        if self.weight_scale.numel() != channels or self.weight_zero_point.numel() != channels:
            raise FxQuantError(
                f"{where}: weight has {channels} channels along axis {axis} but weight_qparams "
                f"has {self.weight_scale.numel()} scales and {self.weight_zero_point.numel()} "
                "zero points"
            )

    def get_weight(self) -> torch.Tensor:
        """The weight after quantize -> dequantize with the weight qparams (float)."""
        qscheme = self.weight_qscheme
        if qscheme is None or self.weight_dtype == torch.float32:
            return self.weight
        if self.weight_dtype in _FLOAT_DTYPES:
            return self.weight.to(self.weight_dtype).to(self.weight.dtype)
        args = (self.weight_quant_min, self.weight_quant_max, self.weight_dtype)
        if qscheme.is_per_channel:
            axis = self.weight_axis_int
            q = _ops.quantize_per_channel(
                self.weight, self.weight_scale, self.weight_zero_point, axis, *args
            )
            result: torch.Tensor = _ops.dequantize_per_channel(
                q, self.weight_scale, self.weight_zero_point, axis, *args
            )
            return result
        q = _ops.quantize_per_tensor.tensor(
            self.weight, self.weight_scale, self.weight_zero_point, *args
        )
        result = _ops.dequantize_per_tensor.tensor(
            q, self.weight_scale, self.weight_zero_point, *args
        )
        return result

    def get_quantized_weight(self) -> QuantizedWeight:
        """The weight as a plain integer tensor with its qparams (no quantized tensor types)."""
        qscheme = self.weight_qscheme
        if qscheme is None or self.weight_dtype in _FLOAT_DTYPES:
            raise FxQuantError(
                f"{_where(self)}: weight dtype {self.weight_dtype} (qscheme {qscheme}) has no "
                "integer form; use get_weight()"
            )
        args = (self.weight_quant_min, self.weight_quant_max, self.weight_dtype)
        with torch.no_grad():
            if qscheme.is_per_channel:
                values = _ops.quantize_per_channel(
                    self.weight,
                    self.weight_scale,
                    self.weight_zero_point,
                    self.weight_axis_int,
                    *args,
                )
                axis: int | None = self.weight_axis_int
            else:
                values = _ops.quantize_per_tensor.tensor(
                    self.weight, self.weight_scale, self.weight_zero_point, *args
                )
                axis = None
        return QuantizedWeight(
            values,
            self.weight_scale,
            self.weight_zero_point,
            axis,
            self.weight_quant_min,
            self.weight_quant_max,
            self.weight_dtype,
            qscheme,
        )

    # --- serialization: qparam buffers may change shape; scheme and dtype are extra state --

    def get_extra_state(self) -> dict[str, Any]:
        return {
            "weight_qscheme": None if self.weight_qscheme is None else self.weight_qscheme.value,
            "weight_dtype": str(self.weight_dtype).removeprefix("torch."),
            "weight_quant_min": self.weight_quant_min,
            "weight_quant_max": self.weight_quant_max,
        }

    def set_extra_state(self, state: Any) -> None:
        where = _where(self)
        try:
            qscheme = state["weight_qscheme"]
            dtype = getattr(torch, state["weight_dtype"])
            self.weight_qscheme = None if qscheme is None else QScheme(qscheme)
            self.weight_dtype = canonical_dtype(dtype)
            self.weight_quant_min = int(state["weight_quant_min"])
            self.weight_quant_max = int(state["weight_quant_max"])
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise FxQuantError(f"{where}: unreadable weight qparam state {state!r}: {e}") from None

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Per-channel qparams may differ in length from this module's placeholders: take the
        # saved tensors as they are instead of copying into the existing buffers.
        for name in ("weight_scale", "weight_zero_point", "weight_axis"):
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.detach().clone().to(getattr(self, name).device))
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        self.weight_axis_int = int(self.weight_axis.item())


def _as_tensor(value: Any, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return (
            value.detach().clone().to(device=device)
            if device is not None
            else value.detach().clone()
        )
    return torch.tensor(value, dtype=dtype, device=device)
