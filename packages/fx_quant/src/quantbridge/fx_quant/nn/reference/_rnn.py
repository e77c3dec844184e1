"""Reference quantized LSTM, GRU and RNN cells: recurrent kernels on round-tripped weights.

Used for dynamic quantization: activations stay float, every ``weight_*`` tensor is
quantize-dequantized with its own qparams (``weight_qparams_dict`` maps each flat weight name,
e.g. ``weight_ih_l0``, or ``weight_ih``/``weight_hh`` for cells, to a torch.ao-style qparams
dict); biases stay float.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

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
from quantbridge.qconfig import QScheme, canonical_dtype

__all__ = ["GRU", "LSTM", "GRUCell", "LSTMCell", "RNNCell"]

_BUFFER_SUFFIXES = ("_scale", "_zero_point", "_axis")


class _PerWeightQParams(nn.Module):
    """Per-weight qparams for modules with several quantized weights (recurrent ones).

    Buffers ``<name>_scale``, ``<name>_zero_point``, ``<name>_axis`` per weight (torch.ao's
    names); scheme, dtype and quant range travel as extra state, so state_dicts load with
    ``torch.load(weights_only=True)``.
    """

    _IS_REFERENCE = True

    def _init_per_weight(
        self,
        names: list[str],
        weight_qparams_dict: Mapping[str, Any] | None,
        device: Any,
    ) -> None:
        self._weight_names = names
        # name -> (qscheme, dtype, quant_min, quant_max); tensors live in buffers.
        self._weight_qparams: dict[str, tuple[QScheme | None, torch.dtype, int, int]] = {}
        given = {} if weight_qparams_dict is None else dict(weight_qparams_dict)
        given.pop("is_decomposed", None)
        if weight_qparams_dict is not None:
            missing = [n for n in names if n not in given]
            unknown = sorted(set(given) - set(names))
            if missing or unknown:
                raise FxQuantError(
                    f"{self._where()}: weight_qparams_dict must have one entry per weight "
                    f"{names}; missing {missing}, unknown {unknown}"
                )
        for name in names:
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

    @property
    def weight_names(self) -> tuple[str, ...]:
        """The names of the quantized weights (``weight_ih_l0``, ...), in parameter order."""
        return tuple(self._weight_names)

    def weight_qparams(self, name: str) -> tuple[QScheme | None, torch.dtype, int, int]:
        """(qscheme, dtype, quant_min, quant_max) of weight ``name``."""
        return self._weight_qparams[name]

    def get_weight(self, name: str) -> torch.Tensor:
        """Weight ``name`` after quantize -> dequantize."""
        qscheme, dtype, qmin, qmax = self._weight_qparams[name]
        scale, zero_point, axis = self._buffers_of(name)
        return fake_quantize_weight(
            getattr(self, name), qscheme, dtype, qmin, qmax, scale, zero_point, axis
        )

    def get_quantized_weight(self, name: str) -> QuantizedWeight:
        """Weight ``name`` as plain integers with its qparams."""
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

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # args: local_metadata, strict, missing_keys, unexpected_keys, error_msgs (nn.Module's)
        # Per-channel qparams may differ in length from the placeholders: take them as saved.
        for name in self._weight_names:
            for suffix in _BUFFER_SUFFIXES:
                value = state_dict.get(prefix + name + suffix)
                if isinstance(value, torch.Tensor):
                    setattr(self, name + suffix, value.detach().clone())
        super()._load_from_state_dict(state_dict, prefix, *args)


class _RNNBase(_PerWeightQParams, nn.RNNBase):
    """Layers: forward swaps the round-tripped weights into torch's flat weight list."""

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
        names = [n for n in self._flat_weights_names if n.startswith("weight")]
        self._init_per_weight(names, weight_qparams_dict, device)

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


_Cell = TypeVar("_Cell", bound="_CellBase")


class _CellBase(_PerWeightQParams, nn.RNNCellBase):
    """Cells: ``weight_ih`` and ``weight_hh`` round-trip, the biases stay float."""

    _NUM_CHUNKS: int

    def _init_cell(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool,
        device: Any,
        dtype: Any,
        weight_qparams_dict: Mapping[str, Any] | None,
    ) -> None:
        nn.RNNCellBase.__init__(
            self, input_size, hidden_size, bias, self._NUM_CHUNKS, device=device, dtype=dtype
        )
        self._init_per_weight(["weight_ih", "weight_hh"], weight_qparams_dict, device)

    def get_weight_ih(self) -> torch.Tensor:
        return self.get_weight("weight_ih")

    def get_weight_hh(self) -> torch.Tensor:
        return self.get_weight("weight_hh")

    def get_quantized_weight_ih(self) -> QuantizedWeight:
        return self.get_quantized_weight("weight_ih")

    def get_quantized_weight_hh(self) -> QuantizedWeight:
        return self.get_quantized_weight("weight_hh")

    def _batched(self, input: torch.Tensor) -> tuple[torch.Tensor, bool]:
        if input.dim() not in (1, 2):
            raise FxQuantError(f"{self._where()}: expected a 1-d or 2-d input, got {input.dim()}-d")
        is_batched = input.dim() == 2
        return (input if is_batched else input.unsqueeze(0)), is_batched

    def _zeros(self, input: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input.size(0), self.hidden_size, dtype=input.dtype, device=input.device)

    def _share(self, mod: Any) -> None:
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            setattr(self, name, getattr(mod, name))
        for name in self._weight_names:
            self._check(name)

    @classmethod
    def _extra_args(cls, cell: Any) -> tuple[Any, ...]:
        """Constructor arguments between ``bias`` and ``device`` (RNNCell's nonlinearity)."""
        return ()

    @classmethod
    def from_float(
        cls: type[_Cell], mod: nn.Module, weight_qparams_dict: Mapping[str, Any]
    ) -> _Cell:
        """A reference cell sharing ``mod``'s parameters, with per-weight qparams."""
        cell: Any = mod
        ref = cls(  # type: ignore[call-arg]
            cell.input_size,
            cell.hidden_size,
            cell.bias,
            *cls._extra_args(cell),
            cell.weight_ih.device,
            cell.weight_ih.dtype,
            weight_qparams_dict,
        )
        ref._share(cell)
        return ref


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


class RNNCell(_CellBase):
    """Reference quantized RNNCell (tanh or relu)."""

    _NUM_CHUNKS = 1

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        nonlinearity: str = "tanh",
        device: Any = None,
        dtype: Any = None,
        weight_qparams_dict: Mapping[str, Any] | None = None,
    ) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise FxQuantError(
                f"reference RNNCell: nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}"
            )
        self._init_cell(input_size, hidden_size, bias, device, dtype, weight_qparams_dict)
        self.nonlinearity = nonlinearity

    def _get_name(self) -> str:
        return "QuantizedRNNCell(Reference)"

    def forward(self, input: torch.Tensor, hx: torch.Tensor | None = None) -> torch.Tensor:
        x, is_batched = self._batched(input)
        h = self._zeros(x) if hx is None else (hx if is_batched else hx.unsqueeze(0))
        cell = torch.rnn_tanh_cell if self.nonlinearity == "tanh" else torch.rnn_relu_cell
        out: torch.Tensor = cell(
            x, h, self.get_weight_ih(), self.get_weight_hh(), self.bias_ih, self.bias_hh
        )
        return out if is_batched else out.squeeze(0)

    @classmethod
    def _extra_args(cls, cell: Any) -> tuple[Any, ...]:
        return (cell.nonlinearity,)


class LSTMCell(_CellBase):
    """Reference quantized LSTMCell."""

    _NUM_CHUNKS = 4

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        device: Any = None,
        dtype: Any = None,
        weight_qparams_dict: Mapping[str, Any] | None = None,
    ) -> None:
        self._init_cell(input_size, hidden_size, bias, device, dtype, weight_qparams_dict)

    def _get_name(self) -> str:
        return "QuantizedLSTMCell(Reference)"

    def forward(
        self, input: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, is_batched = self._batched(input)
        if hx is None:
            zeros = self._zeros(x)
            state = (zeros, zeros)
        else:
            state = hx if is_batched else (hx[0].unsqueeze(0), hx[1].unsqueeze(0))
        h, c = torch.lstm_cell(
            x, state, self.get_weight_ih(), self.get_weight_hh(), self.bias_ih, self.bias_hh
        )
        return (h, c) if is_batched else (h.squeeze(0), c.squeeze(0))


class GRUCell(_CellBase):
    """Reference quantized GRUCell."""

    _NUM_CHUNKS = 3

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        device: Any = None,
        dtype: Any = None,
        weight_qparams_dict: Mapping[str, Any] | None = None,
    ) -> None:
        self._init_cell(input_size, hidden_size, bias, device, dtype, weight_qparams_dict)

    def _get_name(self) -> str:
        return "QuantizedGRUCell(Reference)"

    def forward(self, input: torch.Tensor, hx: torch.Tensor | None = None) -> torch.Tensor:
        x, is_batched = self._batched(input)
        h = self._zeros(x) if hx is None else (hx if is_batched else hx.unsqueeze(0))
        out: torch.Tensor = torch.gru_cell(
            x, h, self.get_weight_ih(), self.get_weight_hh(), self.bias_ih, self.bias_hh
        )
        return out if is_batched else out.squeeze(0)
