"""The torch_native backend: lowering to torch's x86 quantized engine.

Checked three ways: against the reference model it lowers (within one output quantization
step), against torch.ao's own ``convert_fx`` x86 model (same bytes), and against the numba
backends on the same reference model (same bytes for linear and conv).
"""

from __future__ import annotations

import copy
import importlib
import io
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.fx import GraphModule

from quantbridge.fx_quant import calibrate, convert_to_reference_fx, prepare_fx
from quantbridge.kernels import cpu_features
from quantbridge.lowering import LoweringError, available_backends, get_backend
from quantbridge.lowering import _torch_native as native
from quantbridge.qconfig import QConfigMapping, default_dynamic_qconfig

if not native.is_available():
    pytest.skip(f"torch_native unavailable: {native.unavailable_reason()}", allow_module_level=True)


class LinearNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x)))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, groups=4)
        self.bn2 = nn.BatchNorm2d(16)
        self.conv3 = nn.Conv2d(16, 8, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv3(self.bn2(self.conv2(self.relu1(self.conv1(x)))))


class Conv1dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv1d(8, 8, 5, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.relu(self.conv(x)))


class MixedNet(nn.Module):
    """Everything torch_native lowers: conv(+relu), residual add(+relu), pools, cat, flatten."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.avg = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(16 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.conv1(x))
        x = self.relu2(x + self.conv2(x))
        x = self.pool(x)
        x = torch.cat([x, x], 1)
        x = torch.flatten(self.avg(x), 1)
        return self.fc(x)


def _batches(shape: tuple[int, ...], n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _reference(
    model: nn.Module, mapping: QConfigMapping, data: list[torch.Tensor], backend_name: str
) -> GraphModule:
    torch.manual_seed(0)
    backend = get_backend(backend_name)
    prepared = prepare_fx(model.eval(), mapping, (data[0],), backend_config=backend.backend_config)
    calibrate(prepared, data, progress=False)
    return convert_to_reference_fx(prepared, backend_config=backend.backend_config)


def _output_scale(reference: GraphModule) -> float:
    """Scale of the last quantize before the output (the reference model's output step)."""
    out = next(n for n in reference.graph.nodes if n.op == "output")
    deq = out.args[0]
    scale = deq.args[1]
    return float(getattr(reference, scale.target)) if hasattr(scale, "target") else float(scale)


MODELS: list[tuple[str, Callable[[], nn.Module], tuple[int, ...]]] = [
    ("linear", LinearNet, (8, 32)),
    ("conv2d", ConvNet, (2, 3, 12, 12)),
    ("conv1d", Conv1dNet, (2, 4, 20)),
    ("mixed", MixedNet, (2, 3, 8, 8)),
]


@pytest.mark.parametrize(("name", "factory", "shape"), MODELS, ids=[m[0] for m in MODELS])
def test_within_one_step_of_reference_and_lowered(
    name: str, factory: Callable[[], nn.Module], shape: tuple[int, ...]
) -> None:
    torch.manual_seed(1)
    data = _batches(shape, 4, seed=2)
    reference = _reference(factory(), native.torch_native.qconfig_mapping(), data, "torch_native")
    lowered = native.torch_native.lower(copy.deepcopy(reference))
    # every weighted module became a torch op; nothing reference-quantized is left
    kinds = {type(m).__name__ for m in lowered.modules()}
    assert not kinds & {"Linear", "Conv1d", "Conv2d", "LinearReLU", "ConvReLU2d"}, kinds
    assert any(isinstance(m, (native.NativeLinear, native.NativeConv)) for m in lowered.modules())
    # no dequantize -> quantize round trip between consecutive quantized ops
    code = lowered.code
    assert code.count("quantbridge.quantize") == 0
    assert code.count(".dequantize()") == 1
    step = _output_scale(reference)
    for x in _batches(shape, 3, seed=3):
        with torch.no_grad():
            want, got = reference(x), lowered(x)
        assert got.dtype == torch.float32
        assert got.shape == want.shape
        assert float((want - got).abs().max()) <= step * 1.0001, name


def test_print_shows_what_runs() -> None:
    data = _batches((4, 32), 2, seed=0)
    reference = _reference(LinearNet(), native.torch_native.qconfig_mapping(), data, "torch_native")
    text = str(native.torch_native.lower(reference))
    assert "torch.ops.quantized.linear_relu" in text
    assert "torch.quantize_per_tensor" in text


def test_dynamic_linear_matches_reference_closely() -> None:
    data = _batches((8, 32), 3, seed=4)
    mapping = QConfigMapping().set_global(default_dynamic_qconfig)
    reference = _reference(LinearNet(), mapping, data, "torch_native")
    lowered = native.torch_native.lower(copy.deepcopy(reference))
    dyn = [m for m in lowered.modules() if isinstance(m, native.NativeDynamicLinear)]
    assert len(dyn) == 2
    assert dyn[0].relu
    assert not dyn[1].relu
    assert "choose_qparams" not in lowered.code
    for x in _batches((8, 32), 2, seed=5):
        with torch.no_grad():
            want, got = reference(x), lowered(x)
        # float outputs; the only differences are the accumulator's float rounding
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_state_dict_round_trip_repacks() -> None:
    data = _batches((2, 3, 12, 12), 3, seed=6)
    ref = _reference(ConvNet(), native.torch_native.qconfig_mapping(), data, "torch_native")
    lowered = native.torch_native.lower(copy.deepcopy(ref))
    buffer = io.BytesIO()
    torch.save(lowered.state_dict(), buffer)
    # a second lowering of another calibration, then loaded with the first one's state
    other = _reference(ConvNet(), native.torch_native.qconfig_mapping(), data, "torch_native")
    target = native.torch_native.lower(other)
    x = data[0]
    with torch.no_grad():
        before = target(x)
        buffer.seek(0)
        target.load_state_dict(torch.load(buffer, weights_only=False))
        assert not torch.equal(before, lowered(x))  # different random weights
        assert torch.equal(target(x), lowered(x))


def test_backend_registered_and_config_named() -> None:
    assert "torch_native" in available_backends()
    backend = get_backend("torch_native")
    assert backend is native.torch_native
    assert backend.backend_config.name == "torch_native"
    table = backend.support_table()
    rows = {line.split("  ")[0]: line for line in table.splitlines()}
    assert "quantized::linear_relu;" in rows["(nn.Linear, nn.ReLU)"]
    assert rows["nn.Conv2d"].endswith("quantized::conv2d")
    assert rows["nn.MaxPool2d"].endswith("torch op on the quantized tensor")
    assert rows["nn.Conv3d"].endswith("reference")  # torch's engine has it; not lowered here


def test_lower_rejects_non_graph_module() -> None:
    with pytest.raises(LoweringError, match="convert_to_reference_fx"):
        native.torch_native.lower(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_engine_restored_after_lowering() -> None:
    previous = torch.backends.quantized.engine
    engines = torch.backends.quantized.supported_engines
    other = "qnnpack" if "qnnpack" in engines else previous
    torch.backends.quantized.engine = other
    try:
        data = _batches((4, 32), 2, seed=0)
        ref = _reference(LinearNet(), native.torch_native.qconfig_mapping(), data, "torch_native")
        native.torch_native.lower(ref)
        assert torch.backends.quantized.engine == other
    finally:
        torch.backends.quantized.engine = previous


# --- torch.ao's own x86 convert_fx model as oracle ---------------------------------------


@pytest.mark.parametrize(("name", "factory", "shape"), MODELS, ids=[m[0] for m in MODELS])
def test_same_bytes_as_torch_ao_convert_fx(
    name: str, factory: Callable[[], nn.Module], shape: tuple[int, ...]
) -> None:
    pytest.importorskip("torch.ao.quantization")
    importlib.import_module("torch.ao.quantization.backend_config.utils")  # torch 2.13 quirk
    ao_fx = importlib.import_module("torch.ao.quantization.quantize_fx")
    ao_q = importlib.import_module("torch.ao.quantization")
    ao_bc = importlib.import_module("torch.ao.quantization.backend_config.x86")
    torch.manual_seed(7)
    model = factory().eval()
    data = _batches(shape, 3, seed=8)
    ours = native.torch_native.lower(
        _reference(
            copy.deepcopy(model), native.torch_native.qconfig_mapping(), data, "torch_native"
        )
    )
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "x86"
    try:
        prepared = ao_fx.prepare_fx(
            copy.deepcopy(model),
            ao_q.get_default_qconfig_mapping("x86"),
            (data[0],),
            backend_config=ao_bc.get_x86_backend_config(),
        )
        with torch.no_grad():
            for x in data:
                prepared(x)
        theirs = ao_fx.convert_fx(prepared, backend_config=ao_bc.get_x86_backend_config())
        for x in _batches(shape, 2, seed=9):
            with torch.no_grad():
                assert torch.equal(ours(x), theirs(x)), name
    finally:
        torch.backends.quantized.engine = previous


# --- numba backends: same bytes on the same reference model -------------------------------


def _numba_backends() -> list[str]:
    return [n for n in available_backends() if n.startswith("numba_")]


@pytest.mark.parametrize(("name", "factory", "shape"), MODELS[:3], ids=[m[0] for m in MODELS[:3]])
def test_same_bytes_as_numba_backends(
    name: str, factory: Callable[[], nn.Module], shape: tuple[int, ...]
) -> None:
    numba_names = _numba_backends()
    if not numba_names:
        pytest.skip("no numba backend registered in quantbridge.lowering")
    torch.manual_seed(11)
    data = _batches(shape, 3, seed=12)
    # One reference model for all. With AVX512-VNNI: the numba mapping (full-range activations),
    # valid for both. Without it torch's engine adds each pair of uint8 x int8 products into a
    # saturating int16, exact only for 7-bit activations: there, torch_native's own mapping
    # (reduce_range=True, like torch.ao's x86 qconfigs), which the numba backends run exactly.
    first = get_backend(numba_names[0])
    mapping = (
        first.qconfig_mapping()
        if "avx512vnni" in cpu_features()
        else native.torch_native.qconfig_mapping()
    )
    reference = _reference(factory(), mapping, data, numba_names[0])
    ours = native.torch_native.lower(copy.deepcopy(reference))
    for backend_name in numba_names:
        theirs = get_backend(backend_name).lower(copy.deepcopy(reference))
        for x in _batches(shape, 2, seed=13):
            with torch.no_grad():
                assert torch.equal(ours(x), theirs(x)), (name, backend_name)


@pytest.mark.parametrize("qat", [False, True])
def test_default_qconfigs_reduce_range_like_torch_ao_x86(qat: bool) -> None:
    qconfig = native.torch_native.qconfig_mapping(qat=qat).global_qconfig
    assert qconfig is not None
    activation, weight = qconfig.activation(), qconfig.weight()
    # 7-bit activations: what torch's engine needs so that its 16-bit pair sums cannot saturate
    assert (activation.quant_min, activation.quant_max) == (0, 127)
    assert weight.dtype == torch.int8
    assert str(weight.qscheme.value if hasattr(weight.qscheme, "value") else weight.qscheme) == (
        "per_channel_symmetric"
    )


def test_dynamic_linear_same_as_torch_ao_convert_fx() -> None:
    pytest.importorskip("torch.ao.quantization")
    importlib.import_module("torch.ao.quantization.backend_config.utils")  # torch 2.13 quirk
    ao_fx = importlib.import_module("torch.ao.quantization.quantize_fx")
    ao_q = importlib.import_module("torch.ao.quantization")
    ao_bc = importlib.import_module("torch.ao.quantization.backend_config.x86")
    torch.manual_seed(21)
    model = LinearNet().eval()
    data = _batches((8, 32), 2, seed=22)
    mapping = QConfigMapping().set_global(default_dynamic_qconfig)
    ours = native.torch_native.lower(
        _reference(copy.deepcopy(model), mapping, data, "torch_native")
    )
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "x86"
    try:
        ao_mapping = ao_q.QConfigMapping().set_global(ao_q.default_dynamic_qconfig)
        config = ao_bc.get_x86_backend_config()
        prepared = ao_fx.prepare_fx(model, ao_mapping, (data[0],), backend_config=config)
        theirs = ao_fx.convert_fx(prepared, backend_config=config)
        for x in _batches((8, 32), 3, seed=23):
            with torch.no_grad():
                assert torch.equal(ours(x), theirs(x))
    finally:
        torch.backends.quantized.engine = previous
