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
from typing import Any

import torch
from torch import nn

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant.nn.reference._weight_qparams import (
    QuantizedWeight,
    check_weight_qparams,
    extra_state_from_torch_ao,
    fake_quantize_weight,
    parse_weight_qparams,
    quantize_weight,
)
from quantbridge.qconfig import QScheme, canonical_dtype

__all__ = ["QuantizedWeight", "ReferenceQuantizedModule"]


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
        parsed = parse_weight_qparams(weight_qparams, _where(self), device)
        self.weight_qscheme = parsed.qscheme
        self.weight_dtype = parsed.dtype
        self.weight_quant_min, self.weight_quant_max = parsed.quant_min, parsed.quant_max
        self.register_buffer("weight_scale", parsed.scale)
        self.register_buffer("weight_zero_point", parsed.zero_point)
        self.register_buffer("weight_axis", parsed.axis)
        self.weight_axis_int = int(parsed.axis.item())
        self._check_weight_qparams()

    def _check_weight_qparams(self) -> None:
        check_weight_qparams(
            self.weight,
            self.weight_qscheme,
            self.weight_dtype,
            self.weight_scale,
            self.weight_zero_point,
            self.weight_axis_int,
            _where(self),
        )

    def get_weight(self) -> torch.Tensor:
        """The weight after quantize -> dequantize with the weight qparams (float)."""
        return fake_quantize_weight(
            self.weight,
            self.weight_qscheme,
            self.weight_dtype,
            self.weight_quant_min,
            self.weight_quant_max,
            self.weight_scale,
            self.weight_zero_point,
            self.weight_axis_int,
        )

    def get_quantized_weight(self) -> QuantizedWeight:
        """The weight as a plain integer tensor with its qparams (no quantized tensor types)."""
        return quantize_weight(
            self.weight,
            self.weight_qscheme,
            self.weight_dtype,
            self.weight_quant_min,
            self.weight_quant_max,
            self.weight_scale,
            self.weight_zero_point,
            self.weight_axis_int,
            _where(self),
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

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # args: local_metadata, strict, missing_keys, unexpected_keys, error_msgs (nn.Module's)
        _accept_torch_ao_state(state_dict, prefix, self.weight_axis.device)
        # Per-channel qparams may differ in length from this module's placeholders: take the
        # saved tensors as they are instead of copying into the existing buffers.
        for name in ("weight_scale", "weight_zero_point", "weight_axis"):
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.detach().clone().to(getattr(self, name).device))
        super()._load_from_state_dict(state_dict, prefix, *args)
        self.weight_axis_int = int(self.weight_axis.item())


_ABSENT = object()


def _accept_torch_ao_state(state_dict: dict[str, Any], prefix: str, device: torch.device) -> None:
    """Rewrite a torch.ao reference module's entries into ours, in place.

    torch.ao stores ``weight_qscheme``/``weight_dtype`` as torch objects (no extra state) and
    leaves out the qparam buffers it does not use; here they become our extra state and
    placeholder buffers, so torch.ao checkpoints (loaded with ``weights_only=False``) load.
    """
    qscheme = state_dict.pop(prefix + "weight_qscheme", _ABSENT)
    dtype = state_dict.pop(prefix + "weight_dtype", _ABSENT)
    if dtype is _ABSENT or prefix + "_extra_state" in state_dict:
        return
    state_dict[prefix + "_extra_state"] = extra_state_from_torch_ao(
        None if qscheme is _ABSENT else qscheme, dtype
    )
    placeholders = {
        "weight_scale": torch.tensor(1.0, dtype=torch.float32, device=device),
        "weight_zero_point": torch.tensor(0, dtype=torch.int32, device=device),
        "weight_axis": torch.tensor(0, dtype=torch.int32, device=device),
    }
    for name, value in placeholders.items():
        state_dict.setdefault(prefix + name, value)
