"""export_onnx: the QDQ file computes what the reference model computes.

Oracles: torch.ao's quantized tensors for the weight codes stored in the file, the reference
model for the outputs (ONNX Runtime with its graph optimizations off runs the file's ops as
written), ONNX Runtime's optimized graph for "the file runs on integer kernels".
"""

from __future__ import annotations

import copy
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import fx, nn

import quantbridge.fx_quant as fq
import quantbridge.qconfig as qc

if str(Path(__file__).parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))
import flow_zoo

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

_Q = torch.ops.quantbridge


def _prepared(name: str, mapping: Any = None, backend: str = "x86", **kw: Any) -> fx.GraphModule:
    model = flow_zoo.build(name).eval()
    example = flow_zoo.example_inputs(name)
    mapping = mapping if mapping is not None else qc.get_default_qconfig_mapping("x86")
    backend_config = fq.get_backend_config(backend)
    prepared = fq.prepare_fx(model, mapping, example, backend_config=backend_config, **kw)
    for seed in range(1, 4):
        prepared(*flow_zoo.example_inputs(name, seed))
    return prepared


def _run(path: Path, inputs: tuple[torch.Tensor, ...], optimized: bool = False) -> torch.Tensor:
    options = ort.SessionOptions()
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if optimized
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs, strict=True)}
    return torch.from_numpy(session.run(None, feeds)[0])


def _optimized_ops(path: Path, tmp_path: Path) -> Counter[str]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node)


def _coarsest_step(reference: fx.GraphModule) -> float:
    scales = [
        float(getattr(reference, str(n.args[1].target)).max())
        for n in reference.graph.nodes
        if n.target is _Q.quantize_per_tensor.tensor and n.args[1].op == "get_attr"
    ]
    return max(scales)


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


STATIC = ("mlp", "cnn", "residual", "depthwise", "attention", "functional_mix", "nested")


@pytest.mark.parametrize("name", STATIC)
def test_file_computes_the_reference_model(name: str, tmp_path: Path) -> None:
    prepared = _prepared(name)
    reference = fq.convert_to_reference_fx(copy.deepcopy(prepared))
    path = tmp_path / f"{name}.onnx"
    report = fq.export_onnx(prepared, flow_zoo.example_inputs(name), path)
    assert report.path == path
    assert report.opset == 21
    assert report.activation_quantizers > 0
    x = flow_zoo.example_inputs(name, seed=7)
    with torch.no_grad():
        want = _first(reference(*x))
    got = _run(path, x)
    # QuantizeLinear divides by the scale where the reference multiplies by its inverse: a
    # value on a rounding tie may land one code away
    assert (got - want).abs().max() <= _coarsest_step(reference)


def test_weights_are_stored_as_torch_ao_codes(tmp_path: Path) -> None:
    prepared = _prepared("cnn")
    reference = fq.convert_to_reference_fx(copy.deepcopy(prepared))
    path = tmp_path / "cnn.onnx"
    report = fq.export_onnx(reference, flow_zoo.example_inputs("cnn"), path)
    model = onnx.load(str(path))
    stored = [onnx.numpy_helper.to_array(i) for i in model.graph.initializer]
    weighted = [
        m for m in reference.modules() if isinstance(m, fq.nn.reference.ReferenceQuantizedModule)
    ]
    assert len(weighted) == len(report.weights) == 3
    for module in weighted:
        want = torch.quantize_per_channel(
            module.weight.detach(),
            module.weight_scale.double(),
            module.weight_zero_point.long(),
            module.weight_axis_int,
            torch.qint8,
        ).int_repr()
        assert any(
            a.dtype == np.int8 and a.shape == tuple(want.shape) and (a == want.numpy()).all()
            for a in stored
        ), f"{type(module).__name__}: its codes are not in the file"
    # no float copy of a weight travels along
    shapes = {tuple(m.weight.shape) for m in weighted}
    assert not [a for a in stored if a.dtype == np.float32 and a.shape in shapes]


def test_optimized_graph_runs_integer_kernels(tmp_path: Path) -> None:
    path = tmp_path / "residual.onnx"
    fq.export_onnx(_prepared("residual"), flow_zoo.example_inputs("residual"), path)
    ops = _optimized_ops(path, tmp_path)
    assert ops["QLinearConv"] == 3
    assert ops["QLinearAdd"] == 1
    assert not {"Conv", "FusedConv", "Add"} & set(ops)


def test_every_dimension_stays_dynamic(tmp_path: Path) -> None:
    prepared = _prepared("cnn")
    reference = fq.convert_to_reference_fx(copy.deepcopy(prepared))
    path = tmp_path / "cnn.onnx"
    report = fq.export_onnx(prepared, flow_zoo.example_inputs("cnn"), path)
    assert report.dynamic_axes == {"x": (0, 2, 3)}  # the conv fixes the channels
    x = (torch.randn(5, 3, 17, 9),)
    with torch.no_grad():
        want = reference(*x)
    assert (_run(path, x) - want).abs().max() <= _coarsest_step(reference)
    fixed = fq.export_onnx(prepared, flow_zoo.example_inputs("cnn"), path, dynamic=False)
    assert fixed.dynamic_axes == {"x": ()}


@pytest.mark.parametrize("opset", [18, 23])
def test_opsets(opset: int, tmp_path: Path) -> None:
    prepared = _prepared("mlp")
    reference = fq.convert_to_reference_fx(copy.deepcopy(prepared))
    path = tmp_path / "mlp.onnx"
    fq.export_onnx(prepared, flow_zoo.example_inputs("mlp"), path, opset=opset)
    assert onnx.load(str(path)).opset_import[0].version == opset
    x = flow_zoo.example_inputs("mlp", seed=5)
    with torch.no_grad():
        want = reference(*x)
    assert (_run(path, x) - want).abs().max() <= _coarsest_step(reference)


def test_export_capture_reference(tmp_path: Path) -> None:
    prepared = _prepared("mlp", capture="export")
    reference = fq.convert_to_reference_fx(copy.deepcopy(prepared))
    path = tmp_path / "mlp.onnx"
    fq.export_onnx(prepared, flow_zoo.example_inputs("mlp"), path)
    x = flow_zoo.example_inputs("mlp", seed=6)
    with torch.no_grad():
        want = reference(*x)
    assert (_run(path, x) - want).abs().max() <= _coarsest_step(reference)


def test_dynamic_quantization_qparams_match_the_reference(tmp_path: Path) -> None:
    mapping = qc.QConfigMapping().set_global(qc.default_dynamic_qconfig)
    prepared = _prepared("mlp", mapping)
    reference = fq.convert_to_reference_fx(copy.deepcopy(prepared))
    path = tmp_path / "mlp.onnx"
    fq.export_onnx(prepared, flow_zoo.example_inputs("mlp"), path)
    g = torch.Generator().manual_seed(3)
    # ordinary rows, a range too small for its scale (raised to 6.1e-5), a zero range
    for x in (
        torch.randn(4, 16, generator=g),
        torch.randn(4, 16, generator=g) * 1e-6,
        torch.zeros(4, 16),
        torch.rand(4, 16, generator=g) + 0.5,  # all positive: zero point at the bottom
    ):
        with torch.no_grad():
            want = reference(x)
        assert torch.allclose(_run(path, (x,)), want, rtol=0, atol=1e-5)


def _hand_written(quant_min: int, quant_max: int, dtype: torch.dtype, zp: int) -> fx.GraphModule:
    """relu -> quantize -> dequantize, written by hand (convert always uses full ranges)."""
    root = nn.Module()
    root.register_buffer("scale", torch.tensor([0.05]))
    root.register_buffer("zero_point", torch.tensor([zp], dtype=torch.int32))
    graph = fx.Graph()
    x = graph.placeholder("x")
    relu = graph.call_function(torch.relu, (x,))
    scale, zero_point = graph.get_attr("scale"), graph.get_attr("zero_point")
    q = graph.call_function(
        _Q.quantize_per_tensor.tensor, (relu, scale, zero_point, quant_min, quant_max, dtype)
    )
    dq = graph.call_function(
        _Q.dequantize_per_tensor.tensor, (q, scale, zero_point, quant_min, quant_max, dtype)
    )
    graph.output(dq)
    return fx.GraphModule(root, graph)


def test_narrow_range_is_clipped_exactly(tmp_path: Path) -> None:
    model = _hand_written(0, 127, torch.uint8, zp=0)
    path = tmp_path / "narrow.onnx"
    report = fq.export_onnx(model, (torch.randn(4, 8),), path)
    assert report.clipped == ("scale",)
    x = torch.linspace(-20, 20, 4001).reshape(1, -1)  # far past code 127 (6.35)
    assert torch.equal(_run(path, (x,)), model(x))


def test_relu_the_quantize_makes_redundant_is_dropped(tmp_path: Path) -> None:
    x = torch.linspace(-20, 20, 4001).reshape(1, -1)
    dropped = _hand_written(0, 255, torch.uint8, zp=0)
    path = tmp_path / "relu.onnx"
    assert fq.export_onnx(dropped, (x,), path).removed_clamps == 1
    assert "Relu" not in {n.op_type for n in onnx.load(str(path)).graph.node}
    assert torch.equal(_run(path, (x,)), dropped(x))
    # zero point 10: codes 0-9 exist below 0, so the relu changes the result and stays
    kept = _hand_written(0, 255, torch.uint8, zp=10)
    assert fq.export_onnx(kept, (x,), path).removed_clamps == 0
    assert torch.equal(_run(path, (x,)), kept(x))


class _Reduce(nn.Module):
    def __init__(self, op: str, dims: tuple[int, ...], keepdim: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.op, self.dims, self.keepdim = op, dims, keepdim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self.fc(x), self.op)(self.dims, keepdim=self.keepdim)


@pytest.mark.parametrize(
    ("op", "dims", "keepdim", "as_matrix"),
    [
        ("sum", (1,), False, True),
        ("sum", (1,), True, True),
        ("mean", (0, 2), True, True),
        ("sum", (-1,), False, False),
        ("mean", (1, 2), False, False),
    ],
)
def test_a_reduction_of_a_dequantized_value_over_middle_dims_reduces_a_matrix(
    op: str, dims: tuple[int, ...], keepdim: bool, as_matrix: bool, tmp_path: Path
) -> None:
    # OpenVINO 2026.4 computes DequantizeLinear -> ReduceSum over a middle axis of a rank-3
    # value as zeros past the first batch row; on a matrix, or over the last axes, it is right
    model = _Reduce(op, dims, keepdim).eval()
    x = torch.randn(4, 6, 5)
    prepared = fq.prepare_fx(model, qc.get_default_qconfig_mapping("x86"), (x,))
    prepared(x)
    reference = fq.convert_to_reference_fx(prepared)
    path = tmp_path / "reduce.onnx"
    fq.export_onnx(reference, (x,), path)
    nodes = [n.op_type for n in onnx.load(str(path)).graph.node]
    reduce = "ReduceSum" if op == "sum" else "ReduceMean"
    assert nodes.count(reduce) == 1
    assert (nodes[nodes.index(reduce) - 1] == "Reshape") == as_matrix
    y = torch.randn(3, 6, 5)
    with torch.no_grad():
        want = reference(y)
    got = _run(path, (y,))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


class _Bags(nn.Module):
    def __init__(self, mode: str, **kwargs: Any) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 6, mode=mode, **kwargs)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.bag(indices, offsets)


class _Rows(_Bags):
    def forward(self, indices: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.bag(indices)


class _Weighted(_Bags):
    def forward(  # type: ignore[override]
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        return self.bag(indices, offsets, weights)


_BAG_INPUTS = {  # indices, offsets (bag 1 empty), per-sample weights
    "offsets": lambda n: (torch.arange(n) % 30, torch.tensor([0, 3, 3, n - 2])),
    "rows": lambda n: ((torch.arange(4 * n) % 30).reshape(n, 4),),
    "weighted": lambda n: (
        torch.arange(n) % 30,
        torch.tensor([0, 3, 3, n - 2]),
        torch.linspace(-1, 2, n),
    ),
}


@pytest.mark.parametrize(
    ("mode", "inputs", "kwargs"),
    [
        ("sum", "offsets", {}),
        ("mean", "offsets", {}),
        ("max", "offsets", {}),
        ("mean", "rows", {"padding_idx": 2}),
        ("sum", "weighted", {}),
        ("sum", "offsets", {"include_last_offset": True}),
    ],
)
def test_embedding_bags_need_no_loop(
    mode: str, inputs: str, kwargs: dict[str, Any], tmp_path: Path
) -> None:
    # torch.onnx writes embedding_bag as a Loop, which OpenVINO 2026.4 does not read
    kind = {"offsets": _Bags, "rows": _Rows, "weighted": _Weighted}[inputs]
    model = kind(mode, **kwargs).eval()
    mapping = qc.QConfigMapping().set_object_type(
        nn.EmbeddingBag, qc.float_qparams_weight_only_qconfig
    )
    example = _BAG_INPUTS[inputs](9)
    prepared = fq.prepare_fx(model, mapping, example)
    reference = fq.convert_to_reference_fx(prepared)
    path = tmp_path / "bags.onnx"
    fq.export_onnx(reference, example, path)
    assert "Loop" not in {n.op_type for n in onnx.load(str(path)).graph.node}
    for n in (9, 14):  # dynamic: more indices than the example's
        x = _BAG_INPUTS[inputs](n)
        with torch.no_grad():
            want = reference(*x)
        torch.testing.assert_close(_run(path, x), want, rtol=1e-5, atol=1e-5)


def test_sixteen_bit_activations_need_opset_21(tmp_path: Path) -> None:
    model = _hand_written(-32768, 32767, torch.int16, zp=0)
    x = torch.randn(2, 8)
    with pytest.raises(fq.OnnxExportError, match=r"from opset 21; pass opset=21"):
        fq.export_onnx(model, (x,), tmp_path / "a.onnx", opset=18)
    path = tmp_path / "b.onnx"
    fq.export_onnx(model, (x,), path, opset=21)
    assert torch.equal(_run(path, (x,)), model(x))


def test_tensorrt_profile(tmp_path: Path) -> None:
    prepared = _prepared("residual", qc.get_tensorrt_qconfig_mapping(), backend="tensorrt")
    reference = fq.convert_to_reference_fx(copy.deepcopy(prepared))
    path = tmp_path / "trt.onnx"
    fq.export_onnx(prepared, flow_zoo.example_inputs("residual"), path, profile="tensorrt")
    model = onnx.load(str(path))
    arrays = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    qdq = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert qdq
    for node in qdq:
        zero_point = arrays[node.input[2]]
        assert zero_point.dtype == np.int8
        assert not zero_point.any()
        if node.input[0] in arrays:  # a weight
            assert arrays[node.input[0]].min() >= -127
    x = flow_zoo.example_inputs("residual", seed=4)
    with torch.no_grad():
        want = reference(*x)
    assert (_run(path, x) - want).abs().max() <= _coarsest_step(reference)


def test_tensorrt_profile_refuses_asymmetric_quantizers(tmp_path: Path) -> None:
    prepared = _prepared("residual")
    with pytest.raises(fq.OnnxExportError) as caught:
        fq.export_onnx(
            prepared, flow_zoo.example_inputs("residual"), tmp_path / "a.onnx", profile="tensorrt"
        )
    message = str(caught.value)
    assert "stem_input_scale_0: torch.uint8, not torch.int8" in message
    assert "weight of stem: weights in [-128, 127], not [-127, 127]" in message
    assert "get_tensorrt_qconfig_mapping()" in message
    assert not (tmp_path / "a.onnx").exists()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"profile": "openvino"}, r"profile='openvino'; use 'ort' or 'tensorrt'"),
        ({"opset": 17}, r"opset=17 is not supported; use 18 to 23"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str, tmp_path: Path) -> None:
    prepared = _prepared("mlp")
    with pytest.raises(fq.OnnxExportError, match=match):
        fq.export_onnx(prepared, flow_zoo.example_inputs("mlp"), tmp_path / "a.onnx", **kwargs)


def test_inputs_must_be_a_tuple(tmp_path: Path) -> None:
    with pytest.raises(fq.OnnxExportError, match=r"wrap a single tensor as \(x,\)"):
        fq.export_onnx(_prepared("mlp"), torch.randn(4, 16), tmp_path / "a.onnx")  # type: ignore[arg-type]


def test_float_model_is_refused(tmp_path: Path) -> None:
    model = flow_zoo.build("mlp").eval()
    with pytest.raises(fq.OnnxExportError, match=r"MLP holds no quantize or dequantize op"):
        fq.export_onnx(model, flow_zoo.example_inputs("mlp"), tmp_path / "a.onnx")
    traced = fx.symbolic_trace(model)
    with pytest.raises(fq.OnnxExportError, match=r"pass the prepared and calibrated model"):
        fq.export_onnx(traced, flow_zoo.example_inputs("mlp"), tmp_path / "a.onnx")


def test_tensorrt_profile_after_qat(tmp_path: Path) -> None:
    model = flow_zoo.build("qat_conv_bn").train()
    example = flow_zoo.example_inputs("qat_conv_bn")
    prepared = fq.prepare_qat_fx(
        model,
        qc.get_tensorrt_qconfig_mapping(is_qat=True),
        example,
        backend_config=fq.get_tensorrt_backend_config(),
    )
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.01)
    for seed in range(3):
        loss = prepared(*flow_zoo.example_inputs("qat_conv_bn", seed)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    prepared.eval()
    reference = fq.convert_to_reference_fx(copy.deepcopy(prepared))
    path = tmp_path / "qat.onnx"
    fq.export_onnx(prepared, example, path, profile="tensorrt")
    x = flow_zoo.example_inputs("qat_conv_bn", seed=8)
    with torch.no_grad():
        want = reference(*x)
    assert (_run(path, x) - want).abs().max() <= _coarsest_step(reference)
