"""Transformer models through prepare (which swaps nn.MultiheadAttention and the
nn.Transformer* modules for traceable equivalents) and the numba backend: every Linear,
attention projections included, runs on the int8 kernels; the attention core stays float."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.fx import GraphModule

import quantbridge.lowering as L
from quantbridge.fx_quant import convert_to_reference_fx, prepare_fx
from quantbridge.lowering._numba_backend import NumbaBackend
from quantbridge.qconfig import QConfigMapping, default_dynamic_qconfig

if str(Path(__file__).parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))
from test_lowering_numerics import _coarsest_step

# nn.Transformer's encoder warns that its nested-tensor fast path needs batch_first.
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")

E, HEADS = 16, 4
_DQ = torch.ops.quantbridge.dequantize_per_tensor.tensor


class _Encoder(nn.Module):
    """embed -> 2 encoder layers (relu: linear1 fuses with it) -> head."""

    def __init__(self, activation: str = "relu") -> None:
        super().__init__()
        self.embed = nn.Linear(6, E)
        layer = nn.TransformerEncoderLayer(
            E, HEADS, 32, batch_first=True, activation=activation, dropout=0.1
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.encoder(self.embed(x)))
        return out


class _Seq2Seq(nn.Module):
    """nn.Transformer (sequence first, gelu) between two Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, E)
        self.transformer = nn.Transformer(E, HEADS, 1, 1, 32, activation="gelu")
        self.head = nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        out: Tensor = self.head(self.transformer(h, h[:4]))
        return out


# nn.Linear modules after the swap: embed, head; per attention q/k/v/out; per layer 2.
MODELS = {  # name: (model, nn.Linear count, attention count)
    "encoder": (_Encoder, 2 + 2 * (4 + 2), 2),
    "seq2seq": (_Seq2Seq, 2 + (4 + 2) + (4 + 4 + 2), 3),
}


def _data(seed: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 2, 6, generator=g) for _ in range(4)]


def _prepared(model: nn.Module, mapping: QConfigMapping, backend: L.Backend) -> GraphModule:
    data = _data(0)
    prepared = prepare_fx(model, mapping, (data[0],), backend_config=backend.backend_config)
    for x in data:
        prepared(x)
    return prepared


def _linear_entries(report: L.LoweringReport, kernel: str) -> list[str]:
    return [name for name, what in report.lowered if what.startswith(f"kernels.{kernel} (")]


@pytest.mark.parametrize("name", list(MODELS))
def test_static_transformer_linears_lowered(name: str) -> None:
    cls, n_linears, n_attention = MODELS[name]
    torch.manual_seed(0)
    model = cls().eval()
    backend = L.get_backend("numba")
    prepared = _prepared(model, backend.qconfig_mapping(), backend)
    reference = convert_to_reference_fx(copy.deepcopy(prepared))
    lowered = backend.convert(prepared)
    report = L.lowering_report(lowered)
    linears = _linear_entries(report, "linear")
    assert len(linears) == n_linears, str(report)
    assert sum("_proj_" in n for n in linears) == 4 * n_attention  # q, k, v, out
    assert not any(isinstance(m, nn.Linear) for m in lowered.modules())  # none left float
    cores = [m for m in lowered.modules() if type(m).__name__ == "AttentionCore"]
    on_codes = [m for m in lowered.modules() if getattr(m, "heads", 0)]
    # batch-first attention without masks runs on the projections' codes (kernels.attention),
    # any other stays float
    assert len(cores) + len(on_codes) == n_attention
    assert len(on_codes) == (n_attention if name == "encoder" else 0)
    # one code apart at a rounding tie upstream is one step of that op's qparams downstream
    coarsest = _coarsest_step(reference)
    generic = NumbaBackend("numba_generic", "generic").lower(reference)
    for x in _data(1):
        with torch.no_grad():
            got, want, ideal = lowered(x), reference(x), model(x)
            assert torch.equal(got, generic(x))  # every target runs the same integer rule
        assert float((got - want).abs().max()) <= coarsest + 1e-6
        # int8 all through (layer norms included): near float, not equal to it
        error = float((want - ideal).abs().mean())
        assert 0 < error < 0.15 * float(ideal.abs().mean())


@pytest.mark.parametrize(
    ("name", "activation"), [("encoder", "relu"), ("encoder", "gelu"), ("seq2seq", "gelu")]
)
def test_dynamic_transformer_linears_lowered(name: str, activation: str) -> None:
    cls, n_linears, _ = MODELS[name]
    torch.manual_seed(0)
    # relu: linear1 fuses with it (LinearReLU), lowered as dynamic linear then float relu
    model = (cls(activation) if name == "encoder" else cls()).eval()
    backend = L.get_backend("numba")
    mapping = QConfigMapping().set_global(default_dynamic_qconfig)
    prepared = _prepared(model, mapping, backend)
    reference = convert_to_reference_fx(copy.deepcopy(prepared))
    lowered = backend.convert(prepared)
    report = L.lowering_report(lowered)
    assert len(_linear_entries(report, "linear_dynamic")) == n_linears, str(report)
    assert "choose_qparams" not in lowered.code
    for x in _data(2):
        with torch.no_grad():
            got, want, ideal = lowered(x), reference(x), model(x)
        # the kernels quantize activations over the full 8 bits (the reference: torch's
        # reduce_range rule), so the lowered model is as close to float as the reference
        err_ref = float((want - ideal).abs().max())
        err_low = float((got - ideal).abs().max())
        assert 0 < err_ref < 0.05
        assert err_low <= 1.5 * err_ref + 1e-4, (err_low, err_ref)


def test_layer_norms_feeding_the_residual_and_a_linear_run_on_the_float_kernel() -> None:
    # transformer mapping: a post-norm LayerNorm's output is quantized for the next linear and
    # kept float for the residual add; it is a float op on float values, not an op in
    # reference form (dequantize -> op -> quantize), so the float kernel takes it
    torch.manual_seed(0)
    model = _Encoder().eval()
    backend = L.get_backend("numba")
    prepared = _prepared(model, backend.qconfig_mapping(transformer=True), backend)
    reference = convert_to_reference_fx(copy.deepcopy(prepared))
    lowered = backend.convert(prepared)
    report = L.lowering_report(lowered)
    norms = [n for n, what in report.lowered if what.startswith("kernels.layer_norm")]
    assert len(norms) == 4, str(report)  # 2 layers x (norm1, norm2)
    assert not any("norm" in name for name, _ in report.kept), str(report)
    assert not any(isinstance(m, nn.LayerNorm) for m in lowered.modules())
    for x in _data(1):
        with torch.no_grad():
            got, want = lowered(x), reference(x)
        # the float kernel rounds like torch's LayerNorm to float32 precision, not bit for
        # bit: a code may move by one step at a rounding tie
        assert float((got - want).abs().max()) <= 2 * _coarsest_step(reference) + 1e-6
