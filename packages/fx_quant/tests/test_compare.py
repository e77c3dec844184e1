"""compare_layers / compare_weights on reference models: the sensitive layer is named, the
numbers equal a direct computation, and weight errors match torch.ao's extract_weights."""

from __future__ import annotations

import copy
import math
import sys
from typing import Any

import pytest
import torch
from torch import nn

from quantbridge.fx_quant import (
    FxQuantError,
    calibrate,
    compare_layers,
    compare_weights,
    convert_to_reference_fx,
    get_backend_config,
    prepare_fx,
)
from quantbridge.qconfig import get_default_qconfig_mapping

Q = torch.ops.quantbridge


class Sensitive(nn.Module):
    """conv1+bn+relu -> conv2+relu (one output channel x300, undone in conv3) -> conv3 ->
    average pool -> flatten -> fc (a classifier head). The float function does not depend
    on the x300."""

    def __init__(self, scale: float = 300.0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)
        with torch.no_grad():
            self.bn1.running_mean.uniform_(-0.2, 0.2)
            self.bn1.running_var.uniform_(0.5, 2.0)
            self.bn1.weight.uniform_(0.5, 1.5)
            self.conv2.weight[3] *= scale
            self.conv2.bias[3] *= scale
            self.conv3.weight[:, 3] /= scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.conv2(x))
        x = self.pool(self.conv3(x))
        return self.fc(torch.flatten(x, 1))


def _data(n: int = 6, seed: int = 0) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, 6, 6, generator=g),) for _ in range(n)]


def _reference(model: nn.Module, data: list[tuple[torch.Tensor]], **kw: Any) -> Any:
    bc = get_backend_config("x86")
    mapping = get_default_qconfig_mapping("x86")
    prepared = prepare_fx(copy.deepcopy(model), mapping, data[0], backend_config=bc, **kw)
    calibrate(prepared, data, progress=False)
    return convert_to_reference_fx(prepared, backend_config=bc)


@pytest.fixture(scope="module")
def setup() -> tuple[nn.Module, Any, list[tuple[torch.Tensor]]]:
    torch.manual_seed(0)
    model = Sensitive().eval()
    data = _data()
    return model, _reference(model, data), data


def _sqnr(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    s = sum(float(r.double().square().sum()) for r in ref)
    n = sum(float((g.double() - r.double()).square().sum()) for r, g in zip(ref, got, strict=True))
    return 10 * math.log10(s / n)


def _qparams(ref_model: Any, op: str) -> tuple[float, int]:
    """scale, zero point of the quantize node reading node ``op`` (read from the graph)."""
    for node in ref_model.graph.nodes:
        if node.target is Q.quantize_per_tensor.tensor and node.args[0].name == op:
            scale = getattr(ref_model, node.args[1].target)
            zp = getattr(ref_model, node.args[2].target)
            return float(scale), int(zp)
    raise AssertionError(op)


def _fq(x: torch.Tensor, qp: tuple[float, int]) -> torch.Tensor:
    codes = torch.clamp(torch.round(x / qp[0]) + qp[1], 0, 255)
    return (codes - qp[1]) * qp[0]


def test_rows_names_and_fusion(setup: Any) -> None:
    model, ref, data = setup
    report = compare_layers(model, ref, data)
    assert [r.name for r in report] == ["conv1", "conv2", "conv3", "pool", "flatten", "fc"]
    conv1 = report["conv1"]
    assert conv1.module == "conv1"
    assert conv1.op == "Conv2d+BatchNorm2d+ReLU"
    assert conv1.float_node == "relu1"  # the fused chain's last float node
    assert report["conv2"].float_node == "relu2"
    assert report["flatten"].module is None
    assert report.batches == len(data)
    assert report.unmatched == []
    text = str(report)
    for name in ("conv1", "Conv2d+BatchNorm2d+ReLU", "isolated dB", "SQNR dB"):
        assert name in text
    d = report.to_dict()
    assert d["batches"] == len(data)
    assert [r["name"] for r in d["rows"]] == ["conv1", "conv2", "conv3", "pool", "flatten", "fc"]
    assert set(d["rows"][0]) >= {"sqnr_db", "isolated_sqnr_db", "max_abs_error", "output_min"}


def test_worst_names_the_sensitive_conv_in_both_views(setup: Any) -> None:
    model, ref, data = setup
    report = compare_layers(model, ref, data)
    for view in ("isolated", "propagated"):
        worst = report.worst(1, view=view)[0]
        # conv2 crushes the 7 small channels; conv3 is the op that reads them
        assert worst.name in ("conv2", "conv3"), (view, str(report))
    assert report.worst(1)[0].name == report.worst(1, view="isolated")[0].name
    iso = [r.isolated_sqnr_db for r in report.worst(5, view="isolated")]
    assert iso == sorted(iso)
    # a model without the x300 has no such weak layer
    torch.manual_seed(0)
    plain = Sensitive(scale=1.0).eval()
    calm = compare_layers(plain, _reference(plain, data), data)
    assert calm["conv3"].isolated_sqnr_db > report["conv3"].isolated_sqnr_db + 10


def test_propagated_sqnr_equals_direct_computation(setup: Any) -> None:
    model, ref, data = setup
    report = compare_layers(model, ref, data)
    with torch.no_grad():
        floats = [model(*b) for b in data]
        quants = [ref(*b) for b in data]
    fc = report["fc"]
    assert fc.sqnr_db == pytest.approx(_sqnr(floats, quants), rel=1e-9)
    err = max(float((q - f).abs().max()) for f, q in zip(floats, quants, strict=True))
    assert fc.max_abs_error == pytest.approx(err, rel=1e-6)
    assert fc.output_min == pytest.approx(min(float(f.min()) for f in floats))
    assert fc.output_max == pytest.approx(max(float(f.max()) for f in floats))

    # an inner op: the reference module's output through its output quantize, by hooks
    seen_f: list[torch.Tensor] = []
    seen_q: list[torch.Tensor] = []
    h1 = model.relu2.register_forward_hook(lambda m, i, o: seen_f.append(o))
    h2 = ref.conv2.register_forward_hook(lambda m, i, o: seen_q.append(o))
    try:
        with torch.no_grad():
            for b in data:
                model(*b)
                ref(*b)
    finally:
        h1.remove()
        h2.remove()
    qp = _qparams(ref, "conv2")
    assert report["conv2"].scale == pytest.approx(qp[0])
    direct = _sqnr(seen_f, [_fq(q, qp) for q in seen_q])
    assert report["conv2"].sqnr_db == pytest.approx(direct, rel=1e-6)


def test_isolated_sqnr_equals_direct_computation(setup: Any) -> None:
    """conv3 in isolation: the float relu2 output, quantized with conv2's output qparams,
    through the reference conv3, quantized with conv3's output qparams."""
    model, ref, data = setup
    report = compare_layers(model, ref, data)
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    h1 = model.relu2.register_forward_hook(lambda m, i, o: inputs.append(o))
    h2 = model.conv3.register_forward_hook(lambda m, i, o: outputs.append(o))
    try:
        with torch.no_grad():
            for b in data:
                model(*b)
    finally:
        h1.remove()
        h2.remove()
    qp_in, qp_out = _qparams(ref, "conv2"), _qparams(ref, "conv3")
    with torch.no_grad():
        got = [_fq(ref.conv3(_fq(x, qp_in)), qp_out) for x in inputs]
    direct = _sqnr(outputs, got)
    assert report["conv3"].isolated_sqnr_db == pytest.approx(direct, rel=1e-6)
    # conv1 reads the model input: both views agree
    assert report["conv1"].isolated_sqnr_db == report["conv1"].sqnr_db


def test_layers_left_float_are_not_rows(setup: Any) -> None:
    model, _, data = setup
    mapping = get_default_qconfig_mapping("x86").set_module_name("conv2", None)
    bc = get_backend_config("x86")
    prepared = prepare_fx(copy.deepcopy(model), mapping, data[0], backend_config=bc)
    calibrate(prepared, data, progress=False)
    ref = convert_to_reference_fx(prepared, backend_config=bc)
    names = [r.name for r in compare_layers(model, ref, data)]
    assert "conv2" not in names
    assert "conv3" in names


def test_errors(setup: Any) -> None:
    model, ref, data = setup
    with pytest.raises(FxQuantError, match="convert_fx"):
        compare_layers(model, model, data)
    with pytest.raises(FxQuantError, match="iterable of argument tuples"):
        compare_layers(model, ref, data[0][0])
    with pytest.raises(FxQuantError, match="no batch"):
        compare_layers(model, ref, [])
    with pytest.raises(FxQuantError, match=r"inputs\[0\]"):
        compare_layers(model, ref, [{"x": data[0][0]}])
    with pytest.raises(FxQuantError, match="float_model"):
        compare_layers("model", ref, data)  # type: ignore[arg-type]
    report = compare_layers(model, ref, data)
    with pytest.raises(FxQuantError, match="view"):
        report.worst(1, view="shadow")
    with pytest.raises(KeyError, match="no op"):
        report["nope"]


def test_nothing_quantized_is_a_clear_error(setup: Any) -> None:
    model, _, data = setup
    bc = get_backend_config("x86")
    mapping = get_default_qconfig_mapping("x86").set_global(None)
    prepared = prepare_fx(copy.deepcopy(model), mapping, data[0], backend_config=bc)
    ref = convert_to_reference_fx(prepared, backend_config=bc)
    with pytest.raises(FxQuantError, match="no quantized op output"):
        compare_layers(model, ref, data)
    assert len(compare_weights(model, ref)) == 0


def test_plot_without_matplotlib_is_a_clear_error(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, ref, data = setup
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(FxQuantError, match=r"quantbridge-fx-quant\[plot\]"):
        compare_layers(model, ref, data).plot()
    with pytest.raises(FxQuantError, match="matplotlib"):
        compare_weights(model, ref).plot()


def test_plot(setup: Any) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    model, ref, data = setup
    ax = compare_layers(model, ref, data).plot()
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "conv1",
        "conv2",
        "conv3",
        "pool",
        "flatten",
        "fc",
    ]


def test_compare_weights_reference(setup: Any) -> None:
    model, ref, _ = setup
    report = compare_weights(model, ref)
    assert [r.name for r in report] == ["conv1", "conv2", "conv3", "fc"]
    assert report["conv1"].quantized_module == "conv1.0"
    assert all(r.scheme == "per_channel" for r in report)
    # direct: batch norm folded by hand, per-channel symmetric int8 from the weight qparams
    conv, bn = model.conv1, model.bn1
    k = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    folded = conv.weight * k.reshape(-1, 1, 1, 1)
    s = ref.conv1[0].weight_scale.reshape(-1, 1, 1, 1)
    z = ref.conv1[0].weight_zero_point.reshape(-1, 1, 1, 1)
    deq = (torch.clamp(torch.round(folded / s) + z, -128, 127) - z) * s
    direct = _sqnr([folded.detach()], [deq.detach()])
    assert report["conv1"].sqnr_db == pytest.approx(direct, rel=1e-5)
    assert report.worst(1)[0].sqnr_db == min(r.sqnr_db for r in report)
    assert "per_channel" in str(report)
    assert report.to_dict()["rows"][0]["name"] == "conv1"


def test_compare_weights_matches_torch_ao_extract_weights(setup: Any) -> None:
    ao = pytest.importorskip("torch.ao.quantization")
    ns = pytest.importorskip("torch.ao.ns._numeric_suite_fx")
    from torch.ao.quantization import quantize_fx as ao_fx

    model, ref, data = setup
    prepared = ao_fx.prepare_fx(
        copy.deepcopy(model), ao.get_default_qconfig_mapping("x86"), data[0]
    )
    with torch.no_grad():
        for b in data:
            prepared(*b)
    prepared_copy = copy.deepcopy(prepared)
    quantized = ao_fx.convert_fx(prepared)
    results = ns.extract_weights("fp32", prepared_copy, "int8", quantized)
    theirs: dict[str, float] = {}
    for layer in results.values():
        fp32 = layer["weight"]["fp32"][0]
        w = fp32["values"][0]
        q = layer["weight"]["int8"][0]["values"][0].dequantize()
        theirs[fp32["fqn"]] = _sqnr([w.detach()], [q])
    ours = {r.module: r.sqnr_db for r in compare_weights(model, ref)}
    assert set(theirs) == set(ours)
    for name, value in theirs.items():
        assert ours[name] == pytest.approx(value, rel=1e-5), name
