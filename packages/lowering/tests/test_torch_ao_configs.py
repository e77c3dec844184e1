"""The torch.ao-named CPU configs (x86, fbgemm, onednn, native) lower through convert_fx to
the numba backend, as torch.ao lowered them to its engines."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

if str(Path(__file__).parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))
import lowering_zoo as zoo

import quantbridge.lowering as L
from quantbridge.fx_quant import (
    convert_fx,
    convert_to_reference_fx,
    explain,
    get_backend_config,
    get_lowering,
    prepare_fx,
    prepare_qat_fx,
)
from quantbridge.qconfig import (
    QConfigMapping,
    default_dynamic_qconfig,
    float_qparams_weight_only_qconfig,
    float_qparams_weight_only_qconfig_4bit,
    get_default_qat_qconfig_mapping,
    get_default_qconfig_mapping,
)

NAMES = ("x86", "fbgemm", "onednn", "native")
# the torch.ao default mapping users pair with each config (native: fbgemm's)
MAPPING = {"x86": "x86", "fbgemm": "fbgemm", "onednn": "onednn", "native": "fbgemm"}
_DQ = torch.ops.quantbridge.dequantize_per_tensor.tensor


def _mapping(case: zoo.Case, name: str) -> QConfigMapping:
    if case.mode == "static":
        return get_default_qconfig_mapping(MAPPING[name])
    return zoo.qconfig_mapping_for(case, L.get_backend("numba"))


def _prepared(case: zoo.Case, name: str) -> GraphModule:
    torch.manual_seed(0)
    prepared = prepare_fx(
        case.model().eval(),
        _mapping(case, name),
        case.inputs(0),
        backend_config=get_backend_config(name),
    )
    with torch.no_grad():
        for i in range(3):
            prepared(*case.inputs(100 + i))
    return prepared


def _outputs(result: Any) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple) else [result]


def test_the_torch_ao_names_are_backends_that_lower_with_numba() -> None:
    numba = L.get_backend("numba")
    for name in NAMES:
        backend = L.get_backend(name)  # one name space: configs, lowerings and backends
        assert backend.name == name
        assert get_lowering(name) is backend
        assert backend.backend_config.to_dict() == get_backend_config(name).to_dict()
        assert backend.supported_ops() == numba.supported_ops()
    for name in ("qnnpack", "executorch", "tensorrt"):
        assert get_lowering(name) is None
        with pytest.raises(L.LoweringError, match=r"no lowering.*get_backend\('numba'\)"):
            L.get_backend(name)
    # they are names of numba, not backends of their own: the list of backends leaves them out
    assert not set(NAMES) & set(L.available_backends())


def test_get_backend_x86_converts_like_convert_fx_with_the_x86_config() -> None:
    case = zoo.STATIC_CASES[1]
    prepared = _prepared(case, "x86")
    via_backend = L.get_backend("x86").convert(copy.deepcopy(prepared))
    via_config = convert_fx(copy.deepcopy(prepared), backend_config=get_backend_config("x86"))
    via_name = convert_fx(copy.deepcopy(prepared), backend="x86")
    x = case.inputs(5)
    assert torch.equal(via_backend(*x), via_config(*x))
    assert torch.equal(via_name(*x), via_config(*x))


# where the numba backend's own config converts differently from the torch.ao-named one:
# onednn fuses conv + add + relu (numba's config does not name ConvAddReLU2d, so its convert
# leaves that weight float) and has no embedding patterns (numba's convert quantizes them)
_CONFIGS_DIFFER = {("onednn", "residual_add_mul"), ("onednn", "embeddings")}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", zoo.ALL_CASES, ids=lambda c: c.name)
def test_convert_fx_equals_the_numba_backends_convert(case: zoo.Case, name: str) -> None:
    prepared = _prepared(case, name)
    numba = L.get_backend("numba")
    got_model = convert_fx(copy.deepcopy(prepared), backend_config=get_backend_config(name))
    # the numba pass on the reference model this config gives
    reference = convert_to_reference_fx(
        copy.deepcopy(prepared), backend_config=get_backend_config(name)
    )
    same_pass = numba.lower(reference)
    # the numba backend's own convert (its config's reference model, then the same pass)
    wants = [same_pass]
    if (name, case.name) not in _CONFIGS_DIFFER:
        wants.append(numba.convert(copy.deepcopy(prepared)))
    lowered = [type(m).__name__ for m in got_model.modules() if isinstance(m, L.LoweredModule)]
    if case.fully_lowered and case.mode == "static":
        assert "Quantize" in lowered
        assert "Dequantize" in lowered
    for want_model in wants:
        assert lowered == [
            type(m).__name__ for m in want_model.modules() if isinstance(m, L.LoweredModule)
        ]
        assert L.lowering_report(got_model).lowered == L.lowering_report(want_model).lowered
        for seed in range(2):
            inputs = case.inputs(seed)
            for got, want in zip(
                _outputs(got_model(*inputs)), _outputs(want_model(*inputs)), strict=True
            ):
                assert torch.equal(got, want)


class Beyond(nn.Module):
    """Ops the torch.ao configs quantize but the numba kernels do not run: conv3d, transposed
    convs, norms, PReLU, 1-d pools, softmax, interpolate, mean, stack; float modules with
    parameters feed quantized ops (their outputs require grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.c3, self.bn3 = nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4)
        self.ct, self.bn2 = nn.ConvTranspose2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.ln, self.gn, self.inorm = nn.LayerNorm(6), nn.GroupNorm(2, 4), nn.InstanceNorm2d(4)
        self.prelu, self.elu, self.hs = nn.PReLU(), nn.ELU(), nn.Hardswish()
        self.sm, self.fc = nn.Softmax(-1), nn.Linear(6, 5)
        self.p1, self.ap1, self.c1t = nn.MaxPool1d(2), nn.AvgPool1d(2), nn.ConvTranspose1d(4, 4, 3)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.bn3(self.c3(x)).mean(2)
        y = self.inorm(self.gn(self.bn2(self.ct(y))))
        y = self.conv(self.hs(self.elu(self.prelu(y))))
        y = F.interpolate(self.ln(y), scale_factor=2.0)[..., :6, :6]
        y = self.sm(y)
        z = self.c1t(self.ap1(self.p1(y.flatten(2))))
        z = torch.sigmoid(z) + torch.tanh(z)
        return self.fc(y), z, torch.stack([z, z]).sum(0)


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.gru = nn.LSTM(6, 8, batch_first=True), nn.GRU(8, 8, batch_first=True)
        self.fc, self.bag, self.emb = nn.Linear(8, 4), nn.EmbeddingBag(20, 6), nn.Embedding(20, 6)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, offsets: torch.Tensor) -> Any:
        out, _ = self.lstm(x)
        out, _ = self.gru(out)
        return self.fc(out), self.bag(idx, offsets), self.emb(idx)


def _output_scales(reference: GraphModule) -> list[float | None]:
    out = next(n for n in reference.graph.nodes if n.op == "output").args[0]
    scales: list[float | None] = []
    for o in out if isinstance(out, (tuple, list)) else [out]:
        if isinstance(o, Node) and o.target is _DQ:
            scales.append(float(getattr(reference, str(o.args[1].target))))  # type: ignore[union-attr]
        else:
            scales.append(None)
    return scales


@pytest.mark.parametrize("name", NAMES)
def test_ops_numba_cannot_lower_stay_reference_no_crash_same_numbers(name: str) -> None:
    x = (torch.randn(2, 2, 3, 6, 6, generator=torch.Generator().manual_seed(0)),)
    torch.manual_seed(0)
    prepared = prepare_fx(
        Beyond().eval(),
        get_default_qconfig_mapping(MAPPING[name]),
        x,
        backend_config=get_backend_config(name),
    )
    for _ in range(3):
        prepared(*x)
    reference = convert_to_reference_fx(copy.deepcopy(prepared))
    lowered = convert_fx(prepared, backend_config=get_backend_config(name))
    report = L.lowering_report(lowered)
    kept = {node for node, _ in report.kept}
    assert {"c3", "ct", "gn", "inorm", "prelu", "ln", "sm", "p1", "ap1", "c1t"} <= kept
    assert any(n == "conv" or n.startswith("conv_") for n, _ in report.lowered)
    # grad mode on: float ops with parameters feed the lowered quantize modules
    got, want = lowered(*x), reference(*x)
    scales = _output_scales(reference)
    assert scales[0] is not None
    assert scales[1] is not None
    for g, w, scale in zip(got, want, scales, strict=True):
        # within one quantization step of the reference (the float sum: its input's step)
        step = scale if scale is not None else 2 * max(s for s in scales if s is not None)
        assert float((g - w).abs().max()) <= step * 1.0001


@pytest.mark.parametrize("name", NAMES)
def test_dynamic_recurrent_and_weight_only_modules(name: str) -> None:
    inputs = (
        torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(1)),
        torch.randint(0, 20, (10,), generator=torch.Generator().manual_seed(2)),
        torch.tensor([0, 4, 4, 8]),
    )
    mapping = (
        QConfigMapping()
        .set_object_type(nn.LSTM, default_dynamic_qconfig)
        .set_object_type(nn.GRU, default_dynamic_qconfig)
        .set_object_type(nn.Linear, default_dynamic_qconfig)
        .set_object_type(nn.EmbeddingBag, float_qparams_weight_only_qconfig_4bit)
        .set_object_type(nn.Embedding, float_qparams_weight_only_qconfig)
    )
    torch.manual_seed(0)
    prepared = prepare_fx(
        Recurrent().eval(), mapping, inputs, backend_config=get_backend_config(name)
    )
    reference = convert_to_reference_fx(copy.deepcopy(prepared))
    want_model = L.get_backend("numba").lower(copy.deepcopy(reference))
    lowered = convert_fx(prepared, backend_config=get_backend_config(name))
    assert any(type(m).__name__ == "QuantizedDynamicLinear" for m in lowered.modules())
    for got, want, ref in zip(
        lowered(*inputs), want_model(*inputs), reference(*inputs), strict=True
    ):
        assert torch.equal(got, want)
        assert got.shape == ref.shape


def test_qat_with_the_x86_config_lowers() -> None:
    case = zoo.STATIC_CASES[1]  # conv-bn CNN
    torch.manual_seed(0)
    model = prepare_qat_fx(
        case.model().train(),
        get_default_qat_qconfig_mapping("x86"),
        case.inputs(0),
        backend_config=get_backend_config("x86"),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(2):
        loss = model(*case.inputs(i)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    want = L.get_backend("numba").convert(copy.deepcopy(model))
    got = convert_fx(model, backend_config=get_backend_config("x86"))
    assert torch.equal(got(*case.inputs(5)), want(*case.inputs(5)))
    assert any(isinstance(m, L.LoweredModule) for m in got.modules())


def test_explain_on_the_lowered_model() -> None:
    case = zoo.STATIC_CASES[0]
    prepared = _prepared(case, "x86")
    before = str(explain(prepared))
    lowered = convert_fx(prepared, backend_config=get_backend_config("x86"))
    assert str(explain(lowered)) == before
    assert explain(lowered).quantized() == ["fc1", "fc2", "fc3"]
    assert explain(copy.deepcopy(lowered)).quantized() == explain(lowered).quantized()


def test_explain_on_the_torch_native_lowered_model() -> None:
    if "torch_native" not in L.available_backends():
        pytest.skip("torch_native is not available with this torch")
    backend = L.get_backend("torch_native")
    case = zoo.STATIC_CASES[1]
    torch.manual_seed(0)
    prepared = prepare_fx(
        case.model().eval(),
        backend.qconfig_mapping(),
        case.inputs(0),
        backend_config=backend.backend_config,
    )
    prepared(*case.inputs(1))
    before = str(explain(prepared))
    assert str(explain(backend.convert(prepared))) == before


def test_convert_fx_lowers_with_only_fx_quant_imported() -> None:
    """The entry points: a user who imports quantbridge.fx_quant only gets the numba model."""
    script = textwrap.dedent(
        """
        import sys, warnings
        import torch
        from quantbridge.fx_quant import convert_fx, get_backend_config, prepare_fx
        from quantbridge.qconfig import get_default_qconfig_mapping

        assert "quantbridge.lowering" not in sys.modules
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
        x = (torch.randn(2, 4),)
        bc = get_backend_config("x86")
        prepared = prepare_fx(model, get_default_qconfig_mapping("x86"), x, backend_config=bc)
        prepared(*x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lowered = convert_fx(prepared, backend_config=bc)
        from quantbridge.lowering import LoweredModule
        print(sorted(type(m).__name__ for m in lowered.modules() if isinstance(m, LoweredModule)))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['Dequantize', 'Quantize', 'QuantizedLinear']"
