"""Code ported from torch.ao by changing imports: torch.ao.nn classes in configs, the warnings
torch.ao gave, convert_fx's lowering registry (entry points, warnings when nothing lowers) and
explain after convert."""

from __future__ import annotations

import copy
import importlib
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import quantbridge.fx_quant._registry as registry
import quantbridge.qconfig as qbq
from quantbridge.fx_quant import (
    ConvertCustomConfig,
    FxQuantError,
    PrepareCustomConfig,
    convert_fx,
    convert_to_reference_fx,
    explain,
    fuse_fx,
    get_backend_config,
    get_lowering,
    get_native_backend_config,
    prepare_fx,
    prepare_qat_fx,
    register_lowering,
    unregister_lowering,
)
from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.fx_quant.nn import qat as nnqat
from quantbridge.fx_quant.nn import reference as nnqr
from quantbridge.fx_quant.nn.intrinsic import qat as nniqat
from quantbridge.qconfig import (
    BackendConfig,
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    MinMaxObserver,
    ObservationType,
    QConfig,
    QConfigMapping,
    default_dynamic_qconfig,
    default_weight_observer,
    get_default_qat_qconfig_mapping,
    get_default_qconfig_mapping,
)

X = (torch.rand(1, 3, 10, 10, generator=torch.Generator().manual_seed(0)),)


def _ao() -> Any:
    """torch.ao.nn, the behavioural oracle (skips once PyTorch removes it)."""
    pytest.importorskip("torch.ao.quantization")
    for sub in ("intrinsic.qat", "qat.dynamic", "quantized.reference", "quantizable"):
        pytest.importorskip(f"torch.ao.nn.{sub}")
    return pytest.importorskip("torch.ao.nn")


@pytest.fixture(autouse=True)
def _fresh_warning_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # convert_fx warns once per process and name; each test starts with a clean slate
    monkeypatch.setattr(registry, "_warned_names", set())


# -- the tutorial (seed 002) with its torch.ao.nn names left inline -----------------------------


class MyModel(nn.Module):
    def __init__(self, use_bn: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(10, 3)
        self.conv = nn.Conv2d(3, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.relu = nn.ReLU()
        self.sigmoid = nn.Sigmoid()
        self.use_bn = use_bn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(self.linear(x))
        if self.use_bn:
            x = self.bn(x)
        return self.sigmoid(self.relu(x))


def tutorial_backend(
    fused: type,
    qat_linear: type,
    ref_linear: type,
    fused_pattern: type,
    qat_conv_relu: type,
    ref_conv: type,
    name: str = "porting_tutorial",
) -> BackendConfig:
    """The tutorial's BackendConfig with the seven class slots it fills with torch.ao.nn."""
    q8 = DTypeWithConstraints(
        dtype=torch.quint8,
        quant_min_lower_bound=0,
        quant_max_upper_bound=255,
        scale_min_lower_bound=2**-12,
    )
    dc = DTypeConfig(
        input_dtype=q8, output_dtype=q8, weight_dtype=torch.qint8, bias_dtype=torch.float
    )

    def fuse_conv2d_relu(is_qat: bool, conv: nn.Module, relu: nn.Module) -> nn.Module:
        return fused(conv, relu)  # type: ignore[no-any-return]

    linear = (
        BackendPatternConfig()
        .set_pattern(nn.Linear)
        .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
        .add_dtype_config(dc)
        .set_root_module(nn.Linear)
        .set_qat_module(qat_linear)
        .set_reference_quantized_module(ref_linear)
    )
    conv_relu = (
        BackendPatternConfig()
        .set_pattern((nn.Conv2d, nn.ReLU))
        .set_fused_module(fused)
        .set_fuser_method(fuse_conv2d_relu)
    )
    fused_conv_relu = (
        BackendPatternConfig()
        .set_pattern(fused_pattern)
        .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
        .add_dtype_config(dc)
        .set_root_module(nn.Conv2d)
        .set_qat_module(qat_conv_relu)
        .set_reference_quantized_module(ref_conv)
    )
    return (
        BackendConfig(name)
        .set_backend_pattern_config(linear)
        .set_backend_pattern_config(conv_relu)
        .set_backend_pattern_config(fused_conv_relu)
    )


def torch_ao_tutorial_backend() -> BackendConfig:
    ao = _ao()

    return tutorial_backend(
        ao.intrinsic.ConvReLU2d,  # set_fused_module, and built by the fuser method
        torch.nn.qat.Linear,  # the tutorial's spelling of torch.ao.nn.qat.Linear
        ao.quantized.reference.Linear,
        ao.intrinsic.ConvReLU2d,  # set_pattern
        ao.intrinsic.qat.ConvReLU2d,
        ao.quantized.reference.Conv2d,
    )


def quantbridge_tutorial_backend() -> BackendConfig:
    return tutorial_backend(
        nni.ConvReLU2d, nnqat.Linear, nnqr.Linear, nni.ConvReLU2d, nniqat.ConvReLU2d, nnqr.Conv2d
    )


def tutorial_mapping() -> QConfigMapping:
    act = MinMaxObserver.with_args(quant_min=0, quant_max=127, eps=2**-12)
    qconfig = QConfig(activation=act, weight=default_weight_observer)
    mapping = QConfigMapping()
    for t in (nn.Linear, nn.Conv2d, nn.BatchNorm2d, nn.ReLU):
        mapping.set_object_type(t, qconfig)
    return mapping


def _reference(backend: BackendConfig, use_bn: bool = False) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    prepared = prepare_fx(MyModel(use_bn).eval(), tutorial_mapping(), X, backend_config=backend)
    prepared(*X)
    return convert_to_reference_fx(prepared, backend_config=backend)


@pytest.mark.parametrize("use_bn", [False, True])
def test_tutorial_with_torch_ao_classes_equals_quantbridge_classes(use_bn: bool) -> None:
    theirs = _reference(torch_ao_tutorial_backend(), use_bn)
    ours = _reference(quantbridge_tutorial_backend(), use_bn)
    kinds = {n: type(m) for n, m in theirs.named_modules() if n}
    assert kinds == {n: type(m) for n, m in ours.named_modules() if n}
    assert not any(k.__module__.startswith("torch.ao") for k in kinds.values())
    assert type(theirs.linear) is nnqr.Linear
    if not use_bn:
        assert type(theirs.conv) is nni.ConvReLU2d  # the fuser's torch.ao result, rebuilt
        assert type(theirs.conv[0]) is nnqr.Conv2d
    buffers = dict(ours.named_buffers())
    for k, v in theirs.named_buffers():
        assert torch.equal(v, buffers[k]), k
    assert torch.equal(theirs(*X), ours(*X))


def test_tutorial_with_torch_ao_classes_matches_torch_ao_numbers() -> None:
    _ao()
    pytest.importorskip("torch.ao.quantization.backend_config.utils")
    import torch.ao.quantization as aoq
    from torch.ao.quantization import backend_config as aobc
    from torch.ao.quantization import quantize_fx as ao_fx

    ours = _reference(torch_ao_tutorial_backend())
    ao_backend = aobc.BackendConfig("porting_tutorial")
    q8 = aobc.DTypeWithConstraints(
        dtype=torch.quint8,
        quant_min_lower_bound=0,
        quant_max_upper_bound=255,
        scale_min_lower_bound=2**-12,
    )
    dc = aobc.DTypeConfig(
        input_dtype=q8, output_dtype=q8, weight_dtype=torch.qint8, bias_dtype=torch.float
    )
    ao_nni = torch.ao.nn.intrinsic
    ao_ref = torch.ao.nn.quantized.reference
    ao_backend.set_backend_pattern_config(
        aobc.BackendPatternConfig(nn.Linear)
        .add_dtype_config(dc)
        .set_root_module(nn.Linear)
        .set_reference_quantized_module(ao_ref.Linear)
    )
    ao_backend.set_backend_pattern_config(
        aobc.BackendPatternConfig((nn.Conv2d, nn.ReLU))
        .set_fused_module(ao_nni.ConvReLU2d)
        .set_fuser_method(lambda is_qat, c, r: ao_nni.ConvReLU2d(c, r))
    )
    ao_backend.set_backend_pattern_config(
        aobc.BackendPatternConfig(ao_nni.ConvReLU2d)
        .add_dtype_config(dc)
        .set_root_module(nn.Conv2d)
        .set_reference_quantized_module(ao_ref.Conv2d)
    )
    act = aoq.MinMaxObserver.with_args(quant_min=0, quant_max=127, eps=2**-12)
    qconfig = aoq.QConfig(activation=act, weight=aoq.default_weight_observer)
    mapping = aoq.QConfigMapping()
    for t in (nn.Linear, nn.Conv2d, nn.BatchNorm2d, nn.ReLU):
        mapping.set_object_type(t, qconfig)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = ao_fx.prepare_fx(MyModel().eval(), mapping, X, backend_config=ao_backend)
        prepared(*X)
        theirs = ao_fx.convert_to_reference_fx(prepared, backend_config=ao_backend)
        want = theirs(*X)
    assert torch.equal(ours(*X), want)


def test_tutorial_qat_swaps_in_quantbridge_qat_modules() -> None:
    torch.manual_seed(0)
    mapping = QConfigMapping().set_global(get_default_qat_qconfig_mapping().global_qconfig)
    prepared = prepare_qat_fx(
        MyModel().train(), mapping, X, backend_config=torch_ao_tutorial_backend()
    )
    assert type(prepared.linear) is nnqat.Linear
    assert type(prepared.conv) is nniqat.ConvReLU2d


def test_every_torch_ao_class_of_the_native_config_maps_to_quantbridge_native() -> None:
    """torch.ao's native BackendConfig with its own classes and fuser methods, ported, is
    quantbridge's native config: the same pattern, root, QAT, reference and fused classes."""
    _ao()
    pytest.importorskip("torch.ao.quantization.backend_config.utils")
    from torch.ao.quantization.backend_config import get_native_backend_config as ao_native

    from quantbridge.fx_quant._torch_ao_names import port_backend_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = ao_native().configs
    ours = get_native_backend_config().configs
    mixed = BackendConfig("native")
    seen: set[str] = set()
    for a, q in zip(theirs, ours, strict=True):
        c = copy.copy(q)
        c.pattern, c._pattern_complex_format = a.pattern, a._pattern_complex_format
        c.root_module, c.qat_module = a.root_module, a.qat_module
        c.reference_quantized_module, c.fused_module = a.reference_quantized_module, a.fused_module
        c.fuser_method = a.fuser_method
        for m in (a.root_module, a.qat_module, a.reference_quantized_module, a.fused_module):
            if m is not None and m.__module__.startswith("torch.ao"):
                seen.add(f"{m.__module__}.{m.__qualname__}")
        mixed.set_backend_pattern_config(c)
    assert len(seen) >= 40  # fused, QAT, fused QAT and reference classes
    ported = port_backend_config(mixed)
    for p, q in zip(ported.configs, ours, strict=True):
        assert p.pattern == q.pattern
        assert p._pattern_complex_format == q._pattern_complex_format
        assert p.root_module is q.root_module
        assert p.qat_module is q.qat_module
        assert p.reference_quantized_module is q.reference_quantized_module
        assert p.fused_module is q.fused_module
    _same_flow(mixed, get_native_backend_config())


class FusionZoo(nn.Module):
    """Fusions of the native config, through torch.ao's fuser methods when the config is
    torch.ao's: conv-bn-relu, conv-bn, conv-relu, linear-bn, linear-relu, bn-relu."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1, self.r1 = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()
        self.c2, self.b2 = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)
        self.c3, self.r3 = nn.Conv2d(4, 4, 1), nn.ReLU()
        self.b4, self.r4 = nn.BatchNorm2d(4), nn.ReLU()
        self.l1, self.lb = nn.Linear(4, 6), nn.BatchNorm1d(6)
        self.l2, self.r5 = nn.Linear(6, 2), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.r1(self.b1(self.c1(x)))
        x = self.b2(self.c2(x))
        x = self.r3(self.c3(x))
        x = self.r4(self.b4(x))
        x = x.mean((2, 3))
        return self.r5(self.l2(self.lb(self.l1(x))))


def _same_flow(theirs_bc: BackendConfig, ours_bc: BackendConfig) -> None:
    x = (torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1)),)
    results = []
    for bc in (theirs_bc, ours_bc):
        torch.manual_seed(0)
        model = FusionZoo()
        qat = prepare_qat_fx(
            copy.deepcopy(model).train(), get_default_qat_qconfig_mapping(), x, backend_config=bc
        )
        qat(*x)
        fused = fuse_fx(copy.deepcopy(model).eval(), backend_config=bc)
        prepared = prepare_fx(model.eval(), get_default_qconfig_mapping(), x, backend_config=bc)
        prepared(*x)
        reference = convert_to_reference_fx(prepared)
        results.append((qat, fused, reference))
    (qat_t, fused_t, ref_t), (qat_o, fused_o, ref_o) = results
    for a, b in ((qat_t, qat_o), (fused_t, fused_o), (ref_t, ref_o)):
        kinds = {n: type(m) for n, m in a.named_modules() if n}
        assert kinds == {n: type(m) for n, m in b.named_modules() if n}
        assert not any(k.__module__.startswith("torch.ao") for k in kinds.values())
    assert type(qat_t.c1) is nniqat.ConvBnReLU2d
    assert type(fused_t.c3) is nni.ConvReLU2d
    torch.testing.assert_close(qat_t(*x), qat_o(*x), rtol=0, atol=0)
    torch.testing.assert_close(ref_t(*x), ref_o(*x), rtol=0, atol=0)


def test_torch_ao_classes_without_equivalent_are_refused_naming_the_class_to_use() -> None:
    ao = _ao()

    bad = quantbridge_tutorial_backend()
    bad.configs[0].set_reference_quantized_module(ao.quantized.Linear)
    with pytest.raises(FxQuantError) as info:
        prepare_fx(MyModel().eval(), tutorial_mapping(), X, backend_config=bad)
    message = str(info.value)
    assert "torch.ao.nn.quantized.modules.linear.Linear" in message
    assert "reference_quantized_module" in message
    assert "quantbridge.fx_quant.nn.reference.Linear" in message
    assert "Linear'>" in message  # the pattern of the entry

    bad = quantbridge_tutorial_backend()
    bad.configs[0].set_qat_module(ao.qat.dynamic.Linear)
    with pytest.raises(FxQuantError) as info:
        convert_fx(_prepared_native(), backend_config=bad)
    message = str(info.value)
    assert "qat_module: torch.ao.nn.qat.dynamic.modules.linear.Linear cannot be used" in message
    assert "mirror of torch.ao.nn.qat.dynamic) has no Linear" in message


def _prepared_native() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    prepared = prepare_fx(MyModel().eval(), get_default_qconfig_mapping(), X)
    prepared(*X)
    return prepared


def test_fuser_returning_a_torch_ao_module_without_equivalent_is_refused() -> None:
    ao = _ao()

    bc = quantbridge_tutorial_backend()
    bc.configs[1].set_fuser_method(lambda is_qat, conv, relu: ao.quantized.ReLU6())
    with pytest.raises(FxQuantError, match=r"fuser method .* torch\.ao quantized module"):
        fuse_fx(MyModel().eval(), backend_config=bc)


def test_custom_configs_map_or_refuse_torch_ao_classes_when_set() -> None:
    ao = _ao()

    from quantbridge.fx_quant.nn import quantizable

    pcc = PrepareCustomConfig().set_float_to_observed_mapping(
        nn.MultiheadAttention, ao.quantizable.MultiheadAttention
    )
    (table,) = pcc.float_to_observed_mapping.values()
    assert table == {nn.MultiheadAttention: quantizable.MultiheadAttention}
    with pytest.raises(FxQuantError) as info:
        PrepareCustomConfig().set_float_to_observed_mapping(nn.LSTM, ao.quantizable.LSTM)
    assert "quantbridge.fx_quant.nn.quantizable" in str(info.value)
    assert "has no LSTM" in str(info.value)
    with pytest.raises(FxQuantError) as info:
        ConvertCustomConfig().set_observed_to_quantized_mapping(
            quantizable.MultiheadAttention, ao.quantized.MultiheadAttention
        )
    assert "set_observed_to_quantized_mapping: quantized_class" in str(info.value)
    assert "quantized tensors" in str(info.value)
    # from_dict goes through the same setters
    with pytest.raises(FxQuantError, match="quantized tensors"):
        ConvertCustomConfig.from_dict(
            {
                "observed_to_quantized_custom_module_class": {
                    "static": {quantizable.MultiheadAttention: ao.quantized.MultiheadAttention}
                }
            }
        )
    # a standalone module's BackendConfig is ported when set
    pcc = PrepareCustomConfig().set_standalone_module_name(
        "sub", None, X, None, torch_ao_tutorial_backend()
    )
    ported = pcc.standalone_module_names["sub"].backend_config
    assert ported is not None
    assert ported.configs[0].reference_quantized_module is nnqr.Linear


def test_configs_without_torch_ao_classes_are_used_as_given() -> None:
    from quantbridge.fx_quant._torch_ao_names import port_backend_config

    native = get_native_backend_config()
    assert port_backend_config(native) is native


# -- warnings when prepare ignores a qconfig (torch.ao warned) ---------------------------------


def _prepare_warnings(
    model: nn.Module, mapping: QConfigMapping, bc: BackendConfig, x: tuple[Any, ...] = X
) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare_fx(model.eval(), mapping, x, backend_config=bc)
    return [str(w.message) for w in caught if "ignored the qconfig" in str(w.message)]


def _ao_ignoring(model: nn.Module, ao_qconfig: Any, ao_bc: Any, x: tuple[Any, ...] = X) -> bool:
    from torch.ao.quantization import QConfigMapping as AoMapping
    from torch.ao.quantization import quantize_fx as ao_fx

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ao_fx.prepare_fx(model.eval(), AoMapping().set_global(ao_qconfig), x, backend_config=ao_bc)
    return any("ignoring" in str(w.message) for w in caught)


def test_eps_below_scale_min_warns_once_pointing_to_explain() -> None:
    model = MyModel(use_bn=True)
    messages = _prepare_warnings(
        model, get_default_qconfig_mapping(), quantbridge_tutorial_backend()
    )
    assert len(messages) == 1
    (message,) = messages
    assert "linear (activation eps 1.19e-07 below backend scale_min 2**-12)" in message
    assert "1 node(s)" in message
    assert "explain(prepared)" in message


def test_qat_prepare_warns_too() -> None:
    # qnnpack's symmetric int8 entries require scale >= 2**-12; the observer's eps is smaller
    qconfig = QConfig(
        activation=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
        weight=default_weight_observer,
    )
    with pytest.warns(UserWarning, match="prepare_qat_fx: backend 'qnnpack' ignored") as caught:
        prepare_qat_fx(
            MyModel().train(),
            QConfigMapping().set_global(qconfig),
            X,
            backend_config=get_backend_config("qnnpack"),
        )
    assert len([w for w in caught if "ignored the qconfig" in str(w.message)]) == 1


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc(x)) + torch.tanh(x)


@pytest.mark.parametrize(
    "case",
    ["eps_small", "range_wide", "fixed_qparams", "dtype_mismatch", "satisfied"],
)
def test_warns_exactly_where_torch_ao_warned(case: str) -> None:
    """Same qconfig, same backend: quantbridge warns iff torch.ao said 'ignoring QConfig'."""
    pytest.importorskip("torch.ao.quantization.backend_config.utils")
    import torch.ao.quantization as aoq
    from torch.ao.quantization import backend_config as aobc

    x = (torch.randn(3, 4),)
    # (activation observer kwargs, backend constraint kwargs, backend name)
    act: dict[str, Any] = {}
    bound: dict[str, Any] = {}
    name = "constrained"
    if case == "eps_small":
        bound = {"scale_min_lower_bound": 2**-12}
    elif case == "range_wide":
        bound = {"quant_min_lower_bound": 0, "quant_max_upper_bound": 127}
    elif case == "fixed_qparams":
        name = "x86"  # sigmoid/tanh need fixed qparams; a global MinMax qconfig breaks that
    elif case == "dtype_mismatch":
        act = {"dtype": torch.qint8}
        name = "fbgemm"
    else:
        act = {"quant_min": 0, "quant_max": 127, "eps": 2**-12}
        bound = {"quant_min_lower_bound": 0, "quant_max_upper_bound": 255}

    def backend(mod: Any) -> Any:
        if name != "constrained":
            if mod is aobc:
                ao_module = importlib.import_module(f"torch.ao.quantization.backend_config.{name}")
                return getattr(ao_module, f"get_{name}_backend_config")()
            return get_backend_config(name)
        q8 = mod.DTypeWithConstraints(dtype=torch.quint8, **bound)
        dc = mod.DTypeConfig(
            input_dtype=q8, output_dtype=q8, weight_dtype=torch.qint8, bias_dtype=torch.float
        )
        return mod.BackendConfig("constrained").set_backend_pattern_config(
            mod.BackendPatternConfig(nn.Linear)
            .add_dtype_config(dc)
            .set_root_module(nn.Linear)
            .set_reference_quantized_module(
                nnqr.Linear if mod is not aobc else torch.ao.nn.quantized.reference.Linear
            )
        )

    ao_qconfig = aoq.QConfig(
        activation=aoq.MinMaxObserver.with_args(**act), weight=aoq.default_weight_observer
    )
    qconfig = QConfig(activation=MinMaxObserver.with_args(**act), weight=default_weight_observer)
    torch.manual_seed(0)
    model = Mixed()
    theirs = _ao_ignoring(copy.deepcopy(model), ao_qconfig, backend(aobc), x)
    ours = _prepare_warnings(model, QConfigMapping().set_global(qconfig), backend(qbq), x)
    assert theirs == {"satisfied": False, "dtype_mismatch": False}.get(case, True)
    assert bool(ours) == theirs
    assert len(ours) <= 1


# -- convert_fx: what it returns without a lowering ----------------------------------------------


def _convert_warnings(name: str, times: int = 1) -> list[str]:
    bc = get_native_backend_config().set_name(name) if name != "-" else get_native_backend_config()
    messages: list[str] = []
    for _ in range(times):
        torch.manual_seed(0)
        prepared = prepare_fx(MyModel().eval(), get_default_qconfig_mapping(), X, backend_config=bc)
        prepared(*X)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            converted = convert_fx(prepared, backend_config=bc)
        messages += [str(w.message) for w in caught if "reference model" in str(w.message)]
        if not name or get_lowering(name) is None:
            assert isinstance(converted.linear, nnqr.Linear)
    return messages


@pytest.mark.parametrize("name", ["qnnpack", "executorch", "tensorrt"])
def test_configs_quantbridge_cannot_lower_warn_what_was_returned_and_how_to_go_fast(
    name: str,
) -> None:
    assert get_lowering(name) is None
    (message,) = _convert_warnings(name)
    assert "returned the reference model (dequantize -> float op -> quantize" in message
    assert f"for backend {name!r}" in message
    assert "get_backend('numba')" in message
    assert "backend_config=backend.backend_config" in message


def test_unlowered_name_warns_once_per_process_and_name() -> None:
    assert len(_convert_warnings("porting_unlowered", times=3)) == 1
    (message,) = _convert_warnings("porting_unlowered_2", times=2)
    assert "register_lowering('porting_unlowered_2', fn)" in message
    (message,) = _convert_warnings("", times=2)
    assert "has no name" in message


def test_torch_ao_cpu_config_without_quantbridge_lowering_warns_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # as if quantbridge-lowering were not installed: nothing registered, no entry points
    built_in = {
        name: registry.BackendEntry(name, config=factory, origin="built in")
        for name, factory in registry.BUILTIN_BACKEND_CONFIGS.items()
    }
    monkeypatch.setattr(registry.backend_registry, "_entries", built_in)
    monkeypatch.setattr(registry.backend_registry, "_entry_points_loaded", True)
    for name in registry.TORCH_AO_CPU_CONFIGS:
        (message,) = _convert_warnings(name)
        assert f"torch.ao lowered {name!r} to its quantized CPU engine" in message
        assert "install quantbridge-lowering" in message


def test_a_registered_lowering_is_used_without_warning() -> None:
    register_lowering("porting_lowered", lambda m: m)
    try:
        assert _convert_warnings("porting_lowered") == []
    finally:
        unregister_lowering("porting_lowered")


# -- entry points: loaded completely, a broken plugin reported once -------------------------------


class _EntryPoint:
    def __init__(self, name: str, load: Any) -> None:
        self.name = name
        self.value = f"plugin_{name}:lowering"
        self._load = load
        self.dist = None

    def load(self) -> Any:
        return self._load()


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch) -> list[_EntryPoint]:
    eps: list[_EntryPoint] = []
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda group: list(eps))
    reg = registry.backend_registry
    monkeypatch.setattr(reg, "_entry_points_loaded", False)
    monkeypatch.setattr(reg, "_entries", dict(reg._entries))
    monkeypatch.setattr(reg, "_failures", {})
    return eps


def test_a_failing_plugin_is_reported_once_and_the_others_still_load(
    plugins: list[_EntryPoint],
) -> None:
    good = lambda m: m  # noqa: E731

    def broken() -> Any:
        # registers itself while importing, then fails: must not stay half-loaded
        register_lowering("porting_broken", lambda m: m)
        raise ImportError("needs quantbridge-kernels 9")

    plugins += [_EntryPoint("porting_broken", broken), _EntryPoint("porting_good", lambda: good)]
    with pytest.warns(RuntimeWarning) as caught:
        assert get_lowering("porting_good") is good  # loaded after the broken one
    (message,) = [str(w.message) for w in caught]
    assert "plugin 'porting_broken'" in message
    assert "ImportError: needs quantbridge-kernels 9" in message
    assert "plugin_porting_broken:lowering" in message
    assert get_lowering("porting_broken") is None  # not half-loaded
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert get_lowering("porting_broken") is None  # reported once
        assert get_lowering("porting_unknown") is None
    (convert_message,) = _convert_warnings("porting_broken")
    assert "failed to load: ImportError: needs quantbridge-kernels 9" in convert_message


def test_loaded_flag_is_set_only_after_loading(plugins: list[_EntryPoint]) -> None:
    states: list[bool] = []

    def probe() -> Any:
        states.append(registry.backend_registry._entry_points_loaded)
        return lambda m: m

    plugins.append(_EntryPoint("porting_probe", probe))
    assert get_lowering("porting_probe") is not None
    assert states == [False]
    assert registry.backend_registry._entry_points_loaded
    origin = registry.backend_registry.entry("porting_probe").origin  # type: ignore[union-attr]
    assert origin == "entry point porting_probe = plugin_porting_probe:lowering"


# -- explain after convert and lowering -----------------------------------------------------------


def test_explain_works_on_prepared_reference_and_lowered_models() -> None:
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="ignored the qconfig"):
        prepared = prepare_fx(
            MyModel(use_bn=True).eval(),
            get_default_qconfig_mapping(),
            X,
            backend_config=quantbridge_tutorial_backend(),
        )
    before = explain(prepared)
    prepared(*X)
    reference = convert_to_reference_fx(copy.deepcopy(prepared))
    # a lowering that copies the GraphModule, as quantbridge.lowering's numba backends do
    register_lowering("porting_tutorial", lambda m: copy.deepcopy(m))
    try:
        lowered = convert_fx(copy.deepcopy(prepared))
    finally:
        unregister_lowering("porting_tutorial")
    for model in (reference, lowered):
        report = explain(model)
        assert report.backend == "porting_tutorial"
        assert [(r.node, r.status, r.reason) for r in report] == [
            (r.node, r.status, r.reason) for r in before
        ]
        assert str(report) == str(before)
        assert report["linear"].candidates == [
            ("in=uint8 out=uint8 w=int8 b=float32", "activation eps 1.19e-07 below backend "
             "scale_min 2**-12")
        ]  # fmt: skip
    with pytest.raises(FxQuantError, match="convert_fx / convert_to_reference_fx"):
        explain(MyModel())


# -- dynamic LSTM (the torch.ao-named configs quantize it) -----------------------------------------


class LSTMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 8, batch_first=True)
        self.cell = nn.GRUCell(8, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.fc(self.cell(out[:, -1]))


def test_dynamic_lstm_and_cells_convert_like_torch_ao() -> None:
    pytest.importorskip("torch.ao.quantization.backend_config.utils")
    import torch.ao.quantization as aoq
    from torch.ao.quantization import quantize_fx as ao_fx
    from torch.ao.quantization.backend_config.x86 import get_x86_backend_config

    x = (torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(3)),)
    torch.manual_seed(0)
    model = LSTMNet().eval()
    ours_p = prepare_fx(
        copy.deepcopy(model),
        QConfigMapping().set_global(default_dynamic_qconfig),
        x,
        backend_config=get_backend_config("x86"),
    )
    ours = convert_to_reference_fx(ours_p)
    assert type(ours.lstm) is nnqr.LSTM
    assert type(ours.cell) is nnqr.GRUCell
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs_p = ao_fx.prepare_fx(
            copy.deepcopy(model),
            aoq.QConfigMapping().set_global(aoq.default_dynamic_qconfig),
            x,
            backend_config=get_x86_backend_config(),
        )
        theirs = ao_fx.convert_to_reference_fx(theirs_p, backend_config=get_x86_backend_config())
        want = theirs(*x)
    torch.testing.assert_close(ours(*x), want, rtol=0, atol=0)
