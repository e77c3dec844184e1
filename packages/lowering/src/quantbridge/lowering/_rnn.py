"""Dynamic int8 LSTM and GRU: gate GEMMs on ``kernels.linear_dynamic``, the recurrence in float.

Per layer, the input projection of every time step and both directions is one GEMM (one
dynamic activation scale for the layer's whole input sequence); the hidden projection runs
once per step and direction (its own dynamic scale, as torch's dynamic LSTM quantizes each
step's hidden state). Each direction's time loop is one ``kernels.lstm_sequence`` /
``gru_sequence`` call; its gate nonlinearities and cell update are ``kernels.lstm_cell`` /
``gru_cell`` (float32, torch's gate order: LSTM i, f, g, o; GRU r, z, n). Weights are the
reference module's int8 values and qparams; biases stay float and are added in the GEMM epilogue.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from quantbridge import kernels as K
from quantbridge.fx_quant.nn import reference as nnqr
from quantbridge.lowering._custom_ops import is_tracing
from quantbridge.lowering._errors import LoweringError
from quantbridge.lowering._modules import LoweredModule, QuantizedDynamicLinear

__all__ = ["QuantizedDynamicGRU", "QuantizedDynamicLSTM", "rnn_unsupported_reason"]


def rnn_unsupported_reason(mod: nnqr.LSTM | nnqr.GRU) -> str | None:
    """Why ``mod`` cannot be lowered (None when it can)."""
    if getattr(mod, "proj_size", 0):
        return "LSTM with proj_size is not supported"
    for name in mod.weight_names:
        qscheme, dtype, _, _ = mod.weight_qparams(name)
        if dtype != torch.int8:  # dtypes are canonical (qint8 arrives as int8)
            return f"weight {name} is {dtype} (int8 weights only)"
        if qscheme is None:
            return f"weight {name} is not quantized"
    return None


def _int8(mod: nnqr.LSTM | nnqr.GRU, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 values [N, K], per-row scale [N], per-row zero point [N]) of weight ``name``."""
    qw = mod.get_quantized_weight(name)
    n = qw.values.shape[0]
    scale = qw.scale.reshape(-1).to(torch.float64)
    zero_point = qw.zero_point.reshape(-1).to(torch.int64)
    if scale.numel() == 1:  # per tensor: spread over the rows, so directions can be stacked
        scale, zero_point = scale.expand(n), zero_point.expand(n)
    return qw.values.to(torch.int8), scale, zero_point


class _DynamicRNN(LoweredModule):
    """Shared layer/direction loop; subclasses give the gate count and the step."""

    kernel = "kernels.linear_dynamic"
    _MODE = ""
    _GATES = 0

    def __init__(self, mod: nnqr.LSTM | nnqr.GRU, target: str) -> None:
        nn.Module.__init__(self)
        self.input_size = int(mod.input_size)
        self.hidden_size = int(mod.hidden_size)
        self.num_layers = int(mod.num_layers)
        self.batch_first = bool(mod.batch_first)
        self.bidirectional = bool(mod.bidirectional)
        self.num_directions = 2 if mod.bidirectional else 1
        suffixes = ["", "_reverse"][: self.num_directions]
        for layer in range(self.num_layers):
            parts = [_int8(mod, f"weight_ih_l{layer}{s}") for s in suffixes]
            biases = [getattr(mod, f"bias_ih_l{layer}{s}", None) for s in suffixes]
            bias = None
            if all(isinstance(b, torch.Tensor) for b in biases):
                bias = torch.cat([b.detach() for b in biases if b is not None])
            # both directions' input projections in one GEMM: rows stacked
            self.add_module(
                f"ih_l{layer}",
                QuantizedDynamicLinear(
                    torch.cat([p[0] for p in parts]),
                    torch.cat([p[1] for p in parts]),
                    torch.cat([p[2] for p in parts]),
                    bias,
                    target,
                    None,
                    None,
                ),
            )
            for s in suffixes:
                w, ws, wz = _int8(mod, f"weight_hh_l{layer}{s}")
                b = getattr(mod, f"bias_hh_l{layer}{s}", None)
                self.add_module(
                    f"hh_l{layer}{s}",
                    QuantizedDynamicLinear(w, ws, wz, b, target, None, None),
                )
        LoweredModule.__init__(self, target, None, None)

    def _details(self) -> str:
        return (
            f"{self._MODE} input={self.input_size}, hidden={self.hidden_size}, "
            f"layers={self.num_layers}, bidirectional={self.bidirectional}, "
            f"batch_first={self.batch_first}, recurrence in float"
        )

    def _check_input(self, x: Any) -> tuple[torch.Tensor, bool]:
        """x as float32 [T, B, I] and whether it was batched."""
        where = f"lowered dynamic {self._MODE}"
        if isinstance(x, PackedSequence):
            raise LoweringError(
                f"{where}: packed sequences are not supported; pad the batch "
                "(torch.nn.utils.rnn.pad_packed_sequence) and pass the padded tensor, or keep "
                "this module float with QConfigMapping().set_object_type(nn."
                f"{self._MODE}, None)"
            )
        if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
            got = f"{x.dim()}-d tensor" if isinstance(x, torch.Tensor) else type(x).__name__
            raise LoweringError(f"{where}: expected a 2-d or 3-d input tensor, got {got}")
        if x.shape[-1] != self.input_size:
            raise LoweringError(
                f"{where}: input has {x.shape[-1]} features, the module expects {self.input_size}"
            )
        if not x.dtype.is_floating_point:
            raise LoweringError(f"{where}: expected a floating point input, got {x.dtype}")
        batched = x.dim() == 3
        x = x.detach().to(torch.float32)
        if not batched:
            x = x.unsqueeze(1)
        elif self.batch_first:
            x = x.transpose(0, 1)
        return x.contiguous(), batched

    def _check_state(self, h: Any, batch: int, batched: bool, what: str) -> torch.Tensor:
        shape = (self.num_layers * self.num_directions, batch, self.hidden_size)
        if not isinstance(h, torch.Tensor):
            raise LoweringError(
                f"lowered dynamic {self._MODE}: {what} must be a tensor, got {type(h).__name__}"
            )
        state = h.detach().to(torch.float32)
        if not batched:
            state = state.unsqueeze(1)
        if tuple(state.shape) != shape:
            raise LoweringError(
                f"lowered dynamic {self._MODE}: {what} has shape {tuple(h.shape)}, "
                f"expected {shape if batched else (shape[0], shape[2])}"
            )
        return state.contiguous()

    def _run(
        self, x: torch.Tensor, states: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """x [T, B, I]; states: per state kind (h, and c for LSTM) [L*D, B, H]."""
        if is_tracing(x):
            raise LoweringError(
                f"lowered dynamic {self._MODE}: torch.export / torch.compile cannot trace it "
                "(its time loop calls the kernels directly); export the model without it"
            )
        gates = self._GATES * self.hidden_size
        finals: list[list[np.ndarray]] = [[] for _ in states]
        layer_in = x.numpy()
        for layer in range(self.num_layers):
            proj: QuantizedDynamicLinear = getattr(self, f"ih_l{layer}")
            gi_all = K.linear_dynamic(layer_in, proj._packed)  # [T, B, D * gates]
            outs: list[np.ndarray] = []
            for d in range(self.num_directions):
                cell: QuantizedDynamicLinear = getattr(
                    self, f"hh_l{layer}{'_reverse' if d else ''}"
                )
                gi = gi_all[..., d * gates : (d + 1) * gates]
                index = layer * self.num_directions + d
                seq_out, *state = self._sequence(
                    gi, cell._packed, [s[index].numpy() for s in states], bool(d)
                )
                outs.append(seq_out)
                for kind, value in enumerate(state):
                    finals[kind].append(value)
            # one direction's outputs are the layer's as they are (no copy)
            layer_in = outs[0] if len(outs) == 1 else np.concatenate(outs, axis=2)
        return torch.from_numpy(layer_in), [torch.from_numpy(np.stack(f)) for f in finals]

    def _sequence(
        self, gi: np.ndarray, packed: K.PackedLinearWeight, state: list[np.ndarray], reverse: bool
    ) -> tuple[np.ndarray, ...]:
        """(outputs [T, B, H], *final states) of one direction of one layer."""
        raise NotImplementedError

    def _output(self, out: torch.Tensor, batched: bool) -> torch.Tensor:
        if not batched:
            return out.squeeze(1)
        return out.transpose(0, 1) if self.batch_first else out


class QuantizedDynamicLSTM(_DynamicRNN):
    """float ``nn.LSTM`` interface (no projections, no packed sequences); int8 gate GEMMs."""

    _MODE = "LSTM"
    _GATES = 4

    def _sequence(
        self, gi: np.ndarray, packed: K.PackedLinearWeight, state: list[np.ndarray], reverse: bool
    ) -> tuple[np.ndarray, ...]:
        return K.lstm_sequence(gi, packed, state[0], state[1], reverse=reverse)

    def forward(
        self, x: Any, hx: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        seq, batched = self._check_input(x)
        if hx is None:
            zeros = seq.new_zeros(
                self.num_layers * self.num_directions, seq.shape[1], self.hidden_size
            )
            states = [zeros, zeros]
        else:
            if not isinstance(hx, (tuple, list)) or len(hx) != 2:
                raise LoweringError("lowered dynamic LSTM: hx must be a tuple (h_0, c_0)")
            states = [
                self._check_state(hx[0], seq.shape[1], batched, "h_0"),
                self._check_state(hx[1], seq.shape[1], batched, "c_0"),
            ]
        out, (h, c) = self._run(seq, states)
        if not batched:
            h, c = h.squeeze(1), c.squeeze(1)
        return self._output(out, batched), (h, c)


class QuantizedDynamicGRU(_DynamicRNN):
    """float ``nn.GRU`` interface (no packed sequences); int8 gate GEMMs."""

    _MODE = "GRU"
    _GATES = 3

    def _sequence(
        self, gi: np.ndarray, packed: K.PackedLinearWeight, state: list[np.ndarray], reverse: bool
    ) -> tuple[np.ndarray, ...]:
        return K.gru_sequence(gi, packed, state[0], reverse=reverse)

    def forward(self, x: Any, hx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        seq, batched = self._check_input(x)
        if hx is None:
            states = [
                seq.new_zeros(self.num_layers * self.num_directions, seq.shape[1], self.hidden_size)
            ]
        else:
            states = [self._check_state(hx, seq.shape[1], batched, "h_0")]
        out, (h,) = self._run(seq, states)
        return self._output(out, batched), (h if batched else h.squeeze(1))
