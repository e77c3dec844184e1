"""Dynamic int8 LSTM / GRU on the numba backend: int8 gate GEMMs, float recurrence.

Checked against an int64 numpy reference of the same numerics (per layer one dynamic scale
for the input sequence, one per step for the hidden state; the float cell update is the
kernels' own, tested in the kernels package) and against torch.ao's dynamic LSTM/GRU.
"""

from __future__ import annotations

import copy
import io
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import quantbridge.lowering as L
from quantbridge import kernels as K
from quantbridge.fx_quant import prepare_fx
from quantbridge.qconfig import (
    QConfigMapping,
    default_dynamic_qconfig,
    per_channel_dynamic_qconfig,
)

IN, HID = 12, 10


class _Net(nn.Module):
    def __init__(self, cls: type[nn.Module], **kwargs: Any) -> None:
        super().__init__()
        self.rnn = cls(IN, HID, **kwargs)

    def forward(self, x: Tensor, hx: Any = None) -> Any:
        return self.rnn(x, hx)


def _lower(model: nn.Module, x: Tensor, qconfig: Any = per_channel_dynamic_qconfig) -> Any:
    backend = L.get_backend("numba")
    mapping = QConfigMapping().set_global(qconfig)
    prepared = prepare_fx(model, mapping, (x,), backend_config=backend.backend_config)
    prepared(x)
    return backend.convert(prepared)


# --- the int64 numpy reference --------------------------------------------------------------


def _choose_qparams(x: np.ndarray) -> tuple[float, int]:
    """torch's dynamic rule: uint8 [0, 255] over [min(x, 0), max(x, 0)]."""
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = float(np.float32((hi - lo) / 255))
    if scale == 0.0:
        scale = 0.1
    from_min, from_max = -lo / scale, 255 - hi / scale
    initial = from_min if -abs(lo / scale) < 255 - abs(hi / scale) else from_max
    return scale, int(min(max(np.rint(initial), 0), 255))


def _gemm(x: np.ndarray, w: Any) -> np.ndarray:
    """Dynamic linear: quantize x, int64 accumulate, float32 epilogue, float bias."""
    values, scale, zp, bias = w
    s, z = _choose_qparams(x)
    inv = np.float32(np.float32(1.0) / np.float32(s))
    q = np.clip(np.rint(x.astype(np.float64) * inv + z), 0, 255).astype(np.int64)
    acc = (q - z) @ (values.astype(np.int64) - zp[:, None]).T
    atws = (np.float32(s) * scale.astype(np.float32)).astype(np.float64)
    out = acc.astype(np.float32).astype(np.float64) * atws
    if bias is not None:
        out = out + bias.astype(np.float64)
    return out.astype(np.float32)


def _weights(lowered: nn.Module, name: str) -> Any:
    mod = lowered.get_submodule(name)
    bias = None if mod.bias is None else mod.bias.numpy()
    return mod.weight.numpy(), mod.weight_scale.numpy(), mod.weight_zero_point.numpy(), bias


def _reference(
    lowered: nn.Module, rnn: nn.Module, x: Tensor, hx: Any, lstm: bool
) -> tuple[np.ndarray, list[np.ndarray]]:
    seq = x.numpy() if not rnn.batch_first else x.transpose(0, 1).contiguous().numpy()
    dirs, hidden = 2 if rnn.bidirectional else 1, rnn.hidden_size
    gates = (4 if lstm else 3) * hidden
    shape = (rnn.num_layers * dirs, seq.shape[1], hidden)
    if hx is None:
        states = [np.zeros(shape, np.float32) for _ in range(2 if lstm else 1)]
    else:
        states = [s.numpy() for s in (hx if lstm else (hx,))]
    finals: list[list[np.ndarray]] = [[] for _ in states]
    layer_in = seq
    for layer in range(rnn.num_layers):
        gi_all = _gemm(layer_in, _weights(lowered, f"rnn_dynamic.ih_l{layer}"))
        outs = []
        for d in range(dirs):
            w_hh = _weights(lowered, f"rnn_dynamic.hh_l{layer}{'_reverse' if d else ''}")
            state = [s[layer * dirs + d] for s in states]
            out = np.empty((seq.shape[0], seq.shape[1], hidden), np.float32)
            for t in range(seq.shape[0] - 1, -1, -1) if d else range(seq.shape[0]):
                gi = np.ascontiguousarray(gi_all[t][:, d * gates : (d + 1) * gates])
                gh = _gemm(state[0], w_hh)
                state = (
                    list(K.lstm_cell(gi, gh, state[1])) if lstm else [K.gru_cell(gi, gh, state[0])]
                )
                out[t] = state[0]
            outs.append(out)
            for kind, value in enumerate(state):
                finals[kind].append(value)
        layer_in = np.concatenate(outs, axis=2)
    if rnn.batch_first:
        layer_in = layer_in.transpose(1, 0, 2)
    return layer_in, [np.stack(f) for f in finals]


CASES = [  # (cls, kwargs, with initial state)
    (nn.LSTM, {"num_layers": 2}, False),
    (nn.LSTM, {"num_layers": 2, "bidirectional": True, "batch_first": True}, True),
    (nn.LSTM, {"num_layers": 1, "bias": False}, True),
    (nn.GRU, {"num_layers": 2}, True),
    (nn.GRU, {"num_layers": 2, "bidirectional": True, "batch_first": True}, False),
]


@pytest.mark.parametrize(("cls", "kwargs", "with_state"), CASES)
@pytest.mark.parametrize("qconfig", [per_channel_dynamic_qconfig, default_dynamic_qconfig])
def test_matches_int64_reference(
    cls: type[nn.Module], kwargs: dict[str, Any], with_state: bool, qconfig: Any
) -> None:
    torch.manual_seed(0)
    model = _Net(cls, **kwargs).eval()
    batch_first = kwargs.get("batch_first", False)
    x = torch.randn((3, 7, IN) if batch_first else (7, 3, IN))
    lowered = _lower(model, x, qconfig)
    report = L.lowering_report(lowered)
    assert any("gate GEMMs" in what for _, what in report.lowered), str(report)
    assert not any(isinstance(m, nn.RNNBase) for m in lowered.modules())
    lstm = cls is nn.LSTM
    dirs = 2 if kwargs.get("bidirectional") else 1
    hx: Any = None
    if with_state:
        shape = (kwargs["num_layers"] * dirs, 3, HID)
        hx = (torch.randn(shape), torch.randn(shape)) if lstm else torch.randn(shape)
    with torch.no_grad():
        out, state = lowered(x, hx)
        ideal, _ = model(x, hx)
    want_out, want_states = _reference(lowered, model.rnn, x, hx, lstm)
    np.testing.assert_allclose(out.numpy(), want_out, rtol=0, atol=1e-5)
    for got, want in zip(state if lstm else (state,), want_states, strict=True):
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-5)
    error = float((out - ideal).abs().max())
    assert 0 < error < 0.05  # int8 weights: near float, not equal to it


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_unbatched_input(cls: type[nn.Module]) -> None:
    torch.manual_seed(1)
    model = _Net(cls, num_layers=2).eval()
    x = torch.randn(5, 2, IN)
    lowered = _lower(model, x)
    with torch.no_grad():
        out, state = lowered(x[:, 0])
        batched, bstate = lowered(x[:, :1])
    assert out.shape == (5, HID)
    torch.testing.assert_close(out, batched[:, 0], rtol=0, atol=0)
    h = state[0] if cls is nn.LSTM else state
    bh = bstate[0] if cls is nn.LSTM else bstate
    assert h.shape == (2, HID)
    torch.testing.assert_close(h, bh[:, 0], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (nn.LSTM, {"num_layers": 2}),
        (nn.LSTM, {"num_layers": 2, "bidirectional": True}),
        (nn.GRU, {"num_layers": 2}),
    ],
)
def test_close_to_torch_ao_dynamic(cls: type[nn.Module], kwargs: dict[str, Any]) -> None:
    """torch.ao quantizes each step's input separately (we: the whole sequence at once) and
    its activations with reduce_range; documented bound: the two differ by at most twice
    torch.ao's own distance from float, and ours is not farther from float than 1.5x."""
    ao = pytest.importorskip("torch.ao.quantization")
    pytest.importorskip("torch.ao.nn.quantized.dynamic")
    torch.manual_seed(2)
    model = _Net(cls, **kwargs).eval()
    x = torch.randn(16, 4, IN)
    with warnings.catch_warnings():  # torch.ao's deprecation warnings are not under test
        warnings.simplefilter("ignore")
        # before prepare_fx, which leaves qconfig attributes on the float modules (as torch.ao's)
        reference = ao.quantize_dynamic(copy.deepcopy(model), {cls}, dtype=torch.qint8)
    lowered = _lower(model, x)
    with torch.no_grad():
        ours, theirs, ideal = lowered(x)[0], reference(x)[0], model(x)[0]
    err_ao = float((theirs - ideal).abs().max())
    assert float((ours - theirs).abs().max()) <= 2 * err_ao + 1e-4
    assert float((ours - ideal).abs().max()) <= 1.5 * err_ao + 1e-4


def test_packed_sequence_refused() -> None:
    torch.manual_seed(3)
    model = _Net(nn.LSTM).eval()
    x = torch.randn(6, 2, IN)
    lowered = _lower(model, x)
    packed = nn.utils.rnn.pack_padded_sequence(x, [6, 4])
    with pytest.raises(L.LoweringError, match="packed sequences are not supported"):
        lowered.get_submodule("rnn_dynamic")(packed)


def test_bad_state_shape_refused() -> None:
    model = _Net(nn.GRU, num_layers=2).eval()
    x = torch.randn(6, 2, IN)
    lowered = _lower(model, x)
    with pytest.raises(L.LoweringError, match=r"h_0 has shape \(1, 2, 10\), expected \(2, 2, 10\)"):
        lowered(x, torch.zeros(1, 2, HID))


def test_projection_kept_as_reference() -> None:
    model = _Net(nn.LSTM, proj_size=4).eval()
    x = torch.randn(6, 2, IN)
    lowered = _lower(model, x)
    kept = dict(L.lowering_report(lowered).kept)
    assert "proj_size" in " ".join(kept.values()), kept


def test_state_dict_round_trip() -> None:
    torch.manual_seed(4)
    model = _Net(nn.LSTM, num_layers=2, bidirectional=True).eval()
    x = torch.randn(6, 2, IN)
    lowered = _lower(model, x)
    buffer = io.BytesIO()
    torch.save(lowered.state_dict(), buffer)
    buffer.seek(0)
    other = _lower(_Net(nn.LSTM, num_layers=2, bidirectional=True).eval(), x)
    other.load_state_dict(torch.load(buffer, weights_only=True))
    with torch.no_grad():
        torch.testing.assert_close(other(x)[0], lowered(x)[0], rtol=0, atol=0)
    clone = copy.deepcopy(lowered)
    with torch.no_grad():
        torch.testing.assert_close(clone(x)[0], lowered(x)[0], rtol=0, atol=0)
