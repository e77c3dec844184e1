"""prepare_fx(..., capture="export"): models torch.fx cannot trace, through the whole flow.

The same BackendConfig and QConfigMapping must give the same quantized model whichever way
the model was captured: for every torchvision-style zoo model, both captures quantize the
same ops and their outputs agree within one quantization step. A Hugging Face-style BERT
(tests/hf_models.py), which symbolic tracing cannot follow, is quantized unmodified.
"""

from __future__ import annotations

import copy
import functools
import operator
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.fx import GraphModule

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
import hf_models as hf
import real_models as zoo

import quantbridge.fx_quant as fq
from quantbridge.fx_quant import ExportCaptureError, TraceError
from quantbridge.lowering import get_backend, lowering_report
from quantbridge.qconfig import (
    MinMaxObserver,
    PerChannelMinMaxObserver,
    QConfig,
    QConfigMapping,
    get_default_qconfig,
)

_Q = torch.ops.quantbridge.quantize_per_tensor.tensor
CALIBRATION = [zoo.example_input(seed) for seed in range(1, 3)]


def _calibrated(model: nn.Module, capture: str, mapping: QConfigMapping | None = None) -> Any:
    backend = get_backend("numba")
    prepared = fq.prepare_fx(
        model, mapping or backend.qconfig_mapping(), (zoo.example_input(0),), capture=capture
    )
    fq.calibrate(prepared, CALIBRATION, progress=False)
    return prepared


@functools.cache
def _both(name: str) -> dict[str, tuple[GraphModule, GraphModule, GraphModule]]:
    """Per capture: (prepared, reference, lowered) of zoo model ``name``."""
    backend = get_backend("numba")
    result = {}
    for capture in ("fx", "export"):
        prepared = _calibrated(zoo.build(name), capture)
        reference = fq.convert_to_reference_fx(copy.deepcopy(prepared))
        lowered = backend.convert(copy.deepcopy(prepared))
        result[capture] = (prepared, reference, lowered)
    return result


def _quantized_ops(prepared: GraphModule) -> Counter[str]:
    """What prepare quantized, by module path or operator (node names differ by capture)."""
    report = fq.explain(prepared)
    ops: Counter[str] = Counter()
    for d in report.rows:
        if d.status == "quantized":
            ops[d.target.replace("operator.iadd", "operator.add")] += 1
    return ops


def _output_scale(reference: GraphModule) -> float:
    output = next(n for n in reference.graph.nodes if n.op == "output")
    scales = []
    for n in reference.graph.nodes:
        if n.target is _Q:
            scales.append(float(getattr(reference, str(n.args[1].target))))
    assert scales, "the reference model quantizes nothing"
    del output
    return max(scales)


@pytest.mark.parametrize("name", zoo.MODELS)
def test_both_captures_quantize_the_same_ops(name: str) -> None:
    both = _both(name)
    fx_ops = _quantized_ops(both["fx"][0])
    export_ops = _quantized_ops(both["export"][0])
    assert fx_ops == export_ops
    assert sum(fx_ops.values()) > 10


@pytest.mark.parametrize("name", zoo.MODELS)
def test_both_captures_agree_within_one_step(name: str) -> None:
    both = _both(name)
    x = zoo.example_input(7)
    with torch.no_grad():
        ref_fx, ref_export = both["fx"][1](x), both["export"][1](x)
        low_fx, low_export = both["fx"][2](x), both["export"][2](x)
    step = _output_scale(both["fx"][1])
    assert (ref_fx - ref_export).abs().max().item() <= step * 1.0001
    assert (low_fx - low_export).abs().max().item() <= step * 1.0001
    # and the lowered export-captured model ran on kernels, not in float
    report = lowering_report(both["export"][2])
    assert len(report.lowered) >= len(lowering_report(both["fx"][2]).lowered)


def test_exported_module_is_accepted_directly() -> None:
    model = zoo.build("resnet18")
    exported = torch.export.export(model, (zoo.example_input(0),)).module()
    assert exported.training  # what torch reports, whatever the export mode
    prepared = _calibrated(exported, "fx")  # detected as an exported graph
    assert sum(_quantized_ops(prepared).values()) == sum(
        _quantized_ops(_both("resnet18")["export"][0]).values()
    )


def test_exported_in_training_mode_says_what_to_do() -> None:
    model = zoo.build("resnet18").train()
    exported = torch.export.export(model, (zoo.example_input(0),)).module()
    with pytest.raises(ExportCaptureError, match=r"exported in training mode.*model\.eval\(\)"):
        fq.prepare_fx(exported, get_backend("numba").qconfig_mapping(), (zoo.example_input(0),))
    # ... and that mode is what quantization-aware training wants
    qat = fq.prepare_qat_fx(
        exported, get_backend("numba").qconfig_mapping(qat=True), (zoo.example_input(0),)
    )
    assert qat.training
    out = qat(zoo.example_input(1))
    out.sum().backward()  # trains
    qat.eval()
    lowered = get_backend("numba").convert(qat)
    with torch.no_grad():
        assert torch.isfinite(lowered(zoo.example_input(2))).all()


def test_qat_with_export_capture_matches_fx_capture() -> None:
    backend = get_backend("numba")
    results = []
    for capture in ("fx", "export"):
        model = zoo.build("mobilenet_v2").train()
        prepared = fq.prepare_qat_fx(
            model, backend.qconfig_mapping(qat=True), (zoo.example_input(0),), capture=capture
        )
        results.append(_quantized_ops(prepared))
        torch.manual_seed(0)
        prepared(zoo.example_input(1)).sum().backward()
    assert results[0] == results[1]


def test_exported_in_eval_mode_refused_for_qat() -> None:
    exported = torch.export.export(zoo.build("resnet18"), (zoo.example_input(0),)).module()
    with pytest.raises(ExportCaptureError, match=r"exported in eval mode.*prepare_fx"):
        fq.prepare_qat_fx(
            exported, get_backend("numba").qconfig_mapping(qat=True), (zoo.example_input(0),)
        )


def test_module_name_rules_resolve_through_the_module_stack() -> None:
    base = get_backend("numba").qconfig_mapping()
    mapping = copy.deepcopy(base).set_module_name("layer1", None)
    mapping.set_module_name_regex(r"layer3\.0\..*", None)
    mapping.set_object_type(nn.AdaptiveAvgPool2d, None)
    ops = {}
    for capture in ("fx", "export"):
        ops[capture] = _quantized_ops(_calibrated(zoo.build("resnet18"), capture, mapping))
    assert ops["fx"] == ops["export"]
    assert not any(k.startswith(("layer1.", "layer3.0.")) for k in ops["export"])
    assert any(k.startswith("layer3.1.") for k in ops["export"])
    assert "avgpool" not in ops["export"]


def test_module_name_object_type_order_resolves() -> None:
    mapping = get_backend("numba").qconfig_mapping()
    # the second add inside layer2.0 (its residual add is the only one; index 0) off
    mapping.set_module_name_object_type_order("layer2.0", operator.add, 0, None)
    ops = {c: _quantized_ops(_calibrated(zoo.build("resnet18"), c, mapping)) for c in ("fx",)}
    export = _quantized_ops(_calibrated(zoo.build("resnet18"), "export", mapping))
    assert ops["fx"]["operator.add"] == export["operator.add"]


def test_trace_error_suggests_export_capture() -> None:
    model = hf.BertModel(hf.BertConfig()).eval()
    ids, mask = hf.token_batch(model.config, 2, 16)
    with pytest.raises(TraceError, match=r"capture='export'"):
        fq.prepare_fx(model, get_backend("numba").qconfig_mapping(), (ids, mask))


def test_unknown_capture_is_refused() -> None:
    with pytest.raises(fq.FxQuantError, match="capture must be one of"):
        fq.prepare_fx(
            zoo.build("resnet18"), QConfigMapping(), (zoo.example_input(),), capture="jit"
        )


def test_a_model_returning_its_kv_cache_is_told_to_drop_it() -> None:
    class DynamicCache:  # a generating model's cache object, unknown to torch.export
        def __init__(self, keys: torch.Tensor) -> None:
            self.keys = keys

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]:
            y = self.proj(x)
            return y, DynamicCache(y)

    with pytest.raises(ExportCaptureError, match=r"(?s)key/value cache.*use_cache = False"):
        fq.prepare_fx(Decoder().eval(), QConfigMapping(), (torch.randn(2, 4),), capture="export")


def test_export_failure_names_the_model_and_the_alternative() -> None:
    class DataDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # export cannot capture data-dependent control flow
                return x
            return -x

    with pytest.raises(
        ExportCaptureError,
        match=r"(?s)DataDependent.*test_export_capture.py.*x.sum\(\) > 0.*capture='fx'",
    ):
        fq.prepare_fx(DataDependent().eval(), QConfigMapping(), (torch.randn(2),), capture="export")


def test_export_capture_refuses_standalone_and_custom_modules() -> None:
    pcc = fq.PrepareCustomConfig().set_standalone_module_name(
        "layer1", None, (torch.randn(2, 64, 8, 8),), None, None
    )
    with pytest.raises(ExportCaptureError, match="standalone modules"):
        fq.prepare_fx(
            zoo.build("resnet18"), QConfigMapping(), (zoo.example_input(),), pcc,
            capture="export",
        )  # fmt: skip


def test_non_traceable_modules_stay_float_with_export() -> None:
    pcc = fq.PrepareCustomConfig().set_non_traceable_module_names(["layer2"])
    prepared = fq.prepare_fx(
        zoo.build("resnet18"), get_backend("numba").qconfig_mapping(), (zoo.example_input(),),
        pcc, capture="export",
    )  # fmt: skip
    ops = _quantized_ops(prepared)
    assert not any(k.startswith("layer2.") for k in ops)
    assert any(k.startswith("layer3.") for k in ops)


def test_strict_explain_and_report_on_export_capture() -> None:
    prepared, _, lowered = _both("efficientnet_b0")["export"]
    text = str(fq.explain(prepared))
    assert "quantized" in text
    assert "quantized" in str(fq.explain(lowered))
    report = lowering_report(lowered)
    assert report.lowered
    model = hf.BertModel(hf.BertConfig()).eval()
    ids, mask = hf.token_batch(model.config, 2, 16)
    with pytest.raises(fq.StrictPrepareError):  # LayerNorm/softmax have qconfigs, stay float
        fq.prepare_fx(
            model, QConfigMapping().set_global(get_default_qconfig("x86")), (ids, mask),
            capture="export", strict=True,
        )  # fmt: skip


def test_lowered_export_capture_exports_again() -> None:
    _, _, lowered = _both("resnet18")["export"]
    x = zoo.example_input(5)
    program = torch.export.export(lowered, (x,))
    with torch.no_grad():
        assert torch.equal(program.module()(x), lowered(x))


@pytest.mark.parametrize(
    "config_name", ["native", "fbgemm", "x86", "qnnpack", "onednn", "executorch", "tensorrt"]
)
def test_builtin_backend_configs_give_the_same_reference_model(config_name: str) -> None:
    config = fq.get_backend_config(config_name)
    # min/max observers: the configs are under test here, not the observers (and it is fast)
    mapping = QConfigMapping().set_global(
        QConfig(
            activation=MinMaxObserver.with_args(quant_min=0, quant_max=127),
            weight=PerChannelMinMaxObserver.with_args(
                dtype=torch.qint8, qscheme=torch.per_channel_symmetric
            ),
        )
    )
    outs = []
    decided = []
    x = zoo.example_input(9)
    for capture in ("fx", "export"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepared = fq.prepare_fx(
                zoo.build("mobilenet_v3_small"), mapping, (zoo.example_input(),),
                backend_config=config, capture=capture,
            )  # fmt: skip
            fq.calibrate(prepared, CALIBRATION, progress=False)
            decided.append(_quantized_ops(prepared))
            reference = fq.convert_to_reference_fx(prepared)
        with torch.no_grad():
            outs.append(reference(x))
    assert decided[0] == decided[1]
    assert torch.equal(outs[0], outs[1])


# --- a Hugging Face-style BERT, which symbolic tracing cannot follow --------------------------


@functools.cache
def _bert() -> hf.BertModel:
    torch.manual_seed(0)
    return hf.BertModel(hf.BertConfig()).eval()


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_bert_is_quantized_unmodified_and_lowered(mode: str) -> None:
    model = _bert()
    backend = get_backend("numba")
    # static: the transformer mapping keeps the residual stream and the mask arithmetic
    # (``(1 - mask) * finfo.min``) float; calibrating with it must not warn about a range
    # dominated by finfo.min (the plain mapping does, which is what that warning is for)
    mapping = backend.qconfig_mapping(transformer=True)
    if mode == "dynamic":
        from quantbridge.qconfig import default_dynamic_qconfig

        mapping = QConfigMapping().set_object_type(nn.Linear, default_dynamic_qconfig)
    calib = [hf.token_batch(model.config, 8, 64, seed=s) for s in range(3)]
    prepared = fq.prepare_fx(model, mapping, calib[0], capture="export")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fq.calibrate(prepared, calib, progress=False)
    quantized = {d.target for d in fq.explain(prepared).rows if d.status == "quantized"}
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert len(linears) == 6 * model.config.num_hidden_layers + 1
    assert linears <= quantized, sorted(linears - quantized)
    lowered = backend.convert(prepared)
    # calibrated at batch 8 x sequence 64, run at batch 1 x sequence 128
    ids, mask = hf.token_batch(model.config, 1, 128, seed=11)
    with torch.no_grad():
        expected = model(ids, mask)
        got = lowered(ids, mask)
    assert set(got) == {"last_hidden_state", "pooler_output"}
    assert got["last_hidden_state"].shape == (1, 128, model.config.hidden_size)
    cos = torch.nn.functional.cosine_similarity(
        hf.pooled(got, mask), hf.pooled(expected, mask)
    ).min()
    assert cos > (0.98 if mode == "dynamic" else 0.99)
    assert lowering_report(lowered).lowered


def test_documented_equivalence_rows_are_the_code() -> None:
    """The table of the user guide's "Models torch.fx cannot trace" page is the code's."""
    page = (Path(__file__).parents[1] / "docs" / "guide" / "export-capture.md").read_text()
    section = page.split("## How export graphs meet a BackendConfig", 1)[1].split("\n## ", 1)[0]
    rows = [
        tuple(cell.strip().strip("`") for cell in line.strip("|").split("|"))
        for line in section.splitlines()
        if line.startswith("| `aten.")
    ]
    table = fq.equivalence_table()
    assert rows
    assert all(row in table for row in rows)
    assert f"({len(table)} rows in all: `equivalence_table()`)" in section


def test_sync_observers_on_export_capture(tmp_path: Path) -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    prepared = _calibrated(zoo.build("mobilenet_v2"), "export")
    stats = {k: v.clone() for k, v in prepared.state_dict().items() if k.endswith("_val")}
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert fq.sync_observers(prepared) is prepared  # plans every observer of the graph
    finally:
        dist.destroy_process_group()
    after = prepared.state_dict()
    assert stats  # one rank: the statistics are what this process observed
    assert all(torch.equal(stats[k], after[k]) for k in stats)


class _Functional(nn.Module):
    """Functional ops on the model's own parameters, and a module reused twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.conv_w = nn.Parameter(torch.randn(8, 3, 3, 3) * 0.2)
        self.fc_w = nn.Parameter(torch.randn(10, 8) * 0.2)
        self.fc_b = nn.Parameter(torch.randn(10) * 0.1)
        self.act = nn.Hardswish()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(torch.nn.functional.conv2d(x, self.conv_w, padding=1))
        y = torch.nn.functional.relu(y + y.mean(dim=(2, 3), keepdim=True))
        y = self.act(y).flatten(1, 3).view(y.shape[0], 8, -1).mean(-1)
        return torch.nn.functional.linear(y, self.fc_w, self.fc_b)


def test_functional_ops_and_reused_modules_match_fx_capture() -> None:
    x = zoo.example_input(4)
    results = []
    for capture in ("fx", "export"):
        prepared = _calibrated(_Functional().eval(), capture)
        ops = _quantized_ops(prepared)
        reference = fq.convert_to_reference_fx(prepared)
        with torch.no_grad():
            results.append((ops, reference(x)))
    (fx_ops, fx_out), (export_ops, export_out) = results
    # x.flatten() and torch.flatten(x) are one ATen op, lifted to the function, which the
    # native config lists (its method form it does not): one more op sharing its input's
    # qparams, the same numbers
    assert not fx_ops - export_ops
    assert export_ops - fx_ops == Counter({"torch.flatten": 1})
    assert fx_ops["act"] == 2  # one Hardswish module, called twice, in both captures
    assert fx_ops["F.linear"] == 1
    assert torch.equal(fx_out, export_out)
