"""Reference quantized LSTM and GRU: the recurrent kernels run on round-tripped weights.

Used for dynamic quantization: activations stay float, every ``weight_*`` tensor is
quantize-dequantized with its own qparams (``weight_qparams_dict`` maps each flat weight name,
e.g. ``weight_ih_l0``, to a torch.ao-style qparams dict); biases stay float.
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
    fake_quantize_weight,
    parse_weight_qparams,
    quantize_weight,
)
from quantbridge.qconfig._dtypes import QScheme, canonical_dtype

__all__ = ["GRU", "LSTM"]

_BUFFER_SUFFIXES = ("_scale", "_zero_point", "_axis")


class _RNNBase(nn.RNNBase):
    """Holds per-weight qparams; forward swaps in the round-tripped weights."""

    _IS_REFERENCE = True
    _MODE: str

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device: Any = None,
        dtype: Any = None,
        weight_qparams_dict: Mapping[str, Any] | None = None,
    ) -> None:
        nn.RNNBase.__init__(
            self,
            self._MODE,
            input_size,
            hidden_size,
            num_layers,
            bias,
            batch_first,
            dropout,
            bidirectional,
            proj_size,
            device,
            dtype,
        )
        self._weight_names = [n for n in self._flat_weights_names if n.startswith("weight")]
        # name -> (qscheme, dtype, quant_min, quant_max); tensors live in buffers.
        self._weight_qparams: dict[str, tuple[QScheme | None, torch.dtype, int, int]] = {}
        given = {} if weight_qparams_dict is None else dict(weight_qparams_dict)
        given.pop("is_decomposed", None)
        if weight_qparams_dict is not None:
            missing = [n for n in self._weight_names if n not in given]
            unknown = sorted(set(given) - set(self._weight_names))
            if missing or unknown:
                raise FxQuantError(
                    f"{self._where()}: weight_qparams_dict must have one entry per weight; "
                    f"missing {missing}, unknown {unknown}"
                )
        for name in self._weight_names:
            parsed = parse_weight_qparams(given.get(name), f"{self._where()} {name}", device)
            if parsed.qscheme is QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS:
                raise FxQuantError(
                    f"{self._where()} {name}: per_channel_affine_float_qparams is for "
                    "embeddings; use per_tensor_affine or per_channel_affine"
                )
            self._weight_qparams[name] = (
                parsed.qscheme,
                parsed.dtype,
                parsed.quant_min,
                parsed.quant_max,
            )
            self.register_buffer(name + "_scale", parsed.scale)
            self.register_buffer(name + "_zero_point", parsed.zero_point)
            self.register_buffer(name + "_axis", parsed.axis)
            self._check(name)

    def _where(self) -> str:
        return f"reference {type(self).__name__}"

    def _buffers_of(self, name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        scale: torch.Tensor = getattr(self, name + "_scale")
        zero_point: torch.Tensor = getattr(self, name + "_zero_point")
        axis: torch.Tensor = getattr(self, name + "_axis")
        return scale, zero_point, int(axis.item())

    def _check(self, name: str) -> None:
        qscheme, dtype, _, _ = self._weight_qparams[name]
        scale, zero_point, axis = self._buffers_of(name)
        weight = getattr(self, name)
        check_weight_qparams(
            weight, qscheme, dtype, scale, zero_point, axis, f"{self._where()} {name}"
        )

    def weight_qparams(self, name: str) -> tuple[QScheme | None, torch.dtype, int, int]:
        """(qscheme, dtype, quant_min, quant_max) of flat weight ``name``."""
        return self._weight_qparams[name]

    def get_weight(self, name: str) -> torch.Tensor:
        """Flat weight ``name`` after quantize -> dequantize."""
        qscheme, dtype, qmin, qmax = self._weight_qparams[name]
        scale, zero_point, axis = self._buffers_of(name)
        return fake_quantize_weight(
            getattr(self, name), qscheme, dtype, qmin, qmax, scale, zero_point, axis
        )

    def get_quantized_weight(self, name: str) -> QuantizedWeight:
        """Flat weight ``name`` as plain integers with its qparams."""
        qscheme, dtype, qmin, qmax = self._weight_qparams[name]
        scale, zero_point, axis = self._buffers_of(name)
        return quantize_weight(
            getattr(self, name),
            qscheme,
            dtype,
            qmin,
            qmax,
            scale,
            zero_point,
            axis,
            f"{self._where()} {name}",
        )

    def get_flat_weights(self) -> list[torch.Tensor | None]:
        """The flat weight list with every weight round-tripped (biases as they are)."""
        flat: list[torch.Tensor | None] = []
        for name in self._flat_weights_names:
            if not hasattr(self, name):
                flat.append(None)
            elif name in self._weight_qparams:
                flat.append(self.get_weight(name))
            else:
                flat.append(getattr(self, name))
        return flat

    def forward(self, input: Any, hx: Any = None) -> Any:
        # torch's recurrent modules read self._flat_weights; bring it in sync with the
        # parameters, then substitute the round-tripped weights for this call only.
        self._update_flat_weights()
        saved = self._flat_weights
        self._flat_weights = self.get_flat_weights()
        try:
            return super().forward(input, hx)
        finally:
            self._flat_weights = saved

    @classmethod
    def from_float(cls, mod: nn.Module, weight_qparams_dict: Mapping[str, Any]) -> Any:
        """A reference module sharing ``mod``'s parameters, with per-weight qparams."""
        rnn: Any = mod
        kwargs: dict[str, Any] = {}
        if cls._MODE == "LSTM":
            kwargs["proj_size"] = rnn.proj_size
        ref = cls(
            rnn.input_size,
            rnn.hidden_size,
            rnn.num_layers,
            rnn.bias,
            rnn.batch_first,
            rnn.dropout,
            rnn.bidirectional,
            weight_qparams_dict=weight_qparams_dict,
            **kwargs,
        )
        for name in rnn._flat_weights_names:
            setattr(ref, name, getattr(rnn, name))
        for name in ref._weight_names:
            ref._check(name)
        return ref

    # --- serialization, as for the other reference modules --------------------------------

    def get_extra_state(self) -> dict[str, Any]:
        return {
            name: {
                "qscheme": None if qscheme is None else qscheme.value,
                "dtype": str(dtype).removeprefix("torch."),
                "quant_min": qmin,
                "quant_max": qmax,
            }
            for name, (qscheme, dtype, qmin, qmax) in self._weight_qparams.items()
        }

    def set_extra_state(self, state: Any) -> None:
        try:
            for name, entry in state.items():
                qscheme = None if entry["qscheme"] is None else QScheme(entry["qscheme"])
                dtype = canonical_dtype(getattr(torch, entry["dtype"]))
                self._weight_qparams[name] = (
                    qscheme,
                    dtype,
                    int(entry["quant_min"]),
                    int(entry["quant_max"]),
                )
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise FxQuantError(
                f"{self._where()}: unreadable weight qparam state {state!r}: {e}"
            ) from None

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
        for name in self._weight_names:
            for suffix in _BUFFER_SUFFIXES:
                value = state_dict.get(prefix + name + suffix)
                if isinstance(value, torch.Tensor):
                    setattr(self, name + suffix, value.detach().clone())
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


class LSTM(_RNNBase, nn.LSTM):
    """Reference quantized LSTM."""

    _MODE = "LSTM"

    def _get_name(self) -> str:
        return "QuantizedLSTM(Reference)"


class GRU(_RNNBase, nn.GRU):
    """Reference quantized GRU."""

    _MODE = "GRU"

    def _get_name(self) -> str:
        return "QuantizedGRU(Reference)"
