"""Backend objects, the registry (shared with fx_quant's lowering registry), entry points."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

if str(Path(__file__).parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))
import lowering_zoo as zoo

import quantbridge.lowering as L
from quantbridge import kernels as K
from quantbridge.fx_quant import (
    LoweringRegistryError,
    backend_registry,
    convert_fx,
    convert_to_reference_fx,
    get_backend_config,
    get_lowering,
    get_native_backend_config,
    prepare_fx,
    registered_lowerings,
)
from quantbridge.lowering import _numba_backend
from quantbridge.lowering._rules import backend_config_from_rules
from quantbridge.qconfig import FIXED_QPARAMS_OP_TO_OBSERVER

BUILTINS = [
    "numba",
    "numba_avx2",
    "numba_avx512_vnni",
    "numba_avx_vnni",
    "numba_generic",
    "reference",
]


def test_builtins_are_available_where_the_cpu_runs_them() -> None:
    names = L.available_backends()
    assert names == sorted(names)
    assert {"numba", "numba_generic", "reference"} <= set(names)
    for target in K.TARGETS:
        assert (f"numba_{target}" in names) == K.target_supported(target)
    assert L.get_backend("numba").target == K.best_target()  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", BUILTINS)
def test_builtins_are_fx_quant_lowerings(name: str) -> None:
    backend = L.get_backend(name) if name in L.available_backends() else None
    if backend is None:
        pytest.skip(f"{name}: this CPU lacks its kernel target")
    assert backend.name == name
    assert backend.backend_config.name == name
    assert get_lowering(name) is backend
    assert name in registered_lowerings()


def test_unknown_backend_error_names_the_choices() -> None:
    with pytest.raises(L.LoweringError, match=r"no backend named 'numbaa'.*available backends"):
        L.get_backend("numbaa")
    with pytest.raises(L.LoweringError, match="non-empty string"):
        L.get_backend("")


def test_unavailable_target_is_absent_and_get_backend_explains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = K.target_supported
    monkeypatch.setattr(
        _numba_backend.K, "target_supported", lambda t: t != "avx512_vnni" and real(t)
    )
    assert "numba_avx512_vnni" not in L.available_backends()
    with pytest.raises(L.BackendUnavailableError, match=r"lacks the features.*avx512_vnni"):
        L.get_backend("numba_avx512_vnni")
    reference = zoo.reference_model(zoo.STATIC_CASES[0], L.get_backend("numba_generic"))
    with pytest.raises(L.BackendUnavailableError, match="cannot run on this machine"):
        L.numba_avx512_vnni_backend.lower(reference)


def test_register_backend_conflicts_and_replace() -> None:
    first = L.Backend("test_dummy_backend", L.get_backend("reference").backend_config)
    second = L.Backend("test_dummy_backend", L.get_backend("reference").backend_config)
    try:
        assert L.register_backend(first) is first
        assert L.register_backend(first) is first  # same object twice: fine
        with pytest.raises(L.LoweringError, match="already registered"):
            L.register_backend(second)
        L.register_backend(second, replace=True)
        assert L.get_backend("test_dummy_backend") is second
        assert get_lowering("test_dummy_backend") is second
    finally:
        L.unregister_backend("test_dummy_backend")
    assert "test_dummy_backend" not in L.available_backends()
    with pytest.raises(L.LoweringError, match="Backend instance"):
        L.register_backend(lambda gm: gm)  # type: ignore[arg-type]


def test_backend_rejects_bad_construction_and_input() -> None:
    with pytest.raises(L.LoweringError, match="BackendConfig"):
        L.Backend("x", object())  # type: ignore[arg-type]
    with pytest.raises(L.LoweringError, match="convert_to_reference_fx"):
        L.get_backend("numba").lower(nn.Linear(2, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("target", ["avx2", "avx512_vnni", "generic"])
def test_numba_qconfig_mapping_activations_are_torch_ao_x86_on_avx2(target: str) -> None:
    # avx2: torch.ao's x86 activations (7 bits); elsewhere 8. Weights: 8 bits, narrow range
    backend = _numba_backend.NumbaBackend(f"numba_{target}", target)
    for qat in (False, True):
        qconfig = backend.qconfig_mapping(qat=qat).global_qconfig
        assert qconfig is not None
        act = qconfig.activation()
        observer = act.activation_post_process if qat else act
        assert observer.reduce_range is (target == "avx2")
        weight = qconfig.weight()
        assert weight.dtype == torch.qint8 or weight.dtype == torch.int8
        assert (weight.quant_min, weight.quant_max) == (-127, 127)
        # transformer mappings keep 8-bit activations on every target
        transformer = backend.qconfig_mapping(qat=qat, transformer=True).global_qconfig
        assert transformer is not None
        act = transformer.activation()
        assert (act.activation_post_process if qat else act).reduce_range is False


@pytest.mark.parametrize("qat", [False, True])
@pytest.mark.parametrize(
    ("target", "bits", "act_bits", "weight_range", "reduce_range"),
    [("avx2", None, None, (-127, 127), True), ("avx2", 7, None, (-63, 63), False),
     ("avx2", 8, 8, (-127, 127), False), ("avx2", 7, 7, (-63, 63), True),
     ("generic", None, None, (-127, 127), False), ("generic", 7, None, (-63, 63), False),
     ("generic", None, 7, (-127, 127), True)],
)  # fmt: skip
def test_numba_weight_and_activation_bits(
    target: str,
    bits: int | None,
    act_bits: int | None,
    weight_range: tuple[int, int],
    reduce_range: bool,
    qat: bool,
) -> None:
    backend = _numba_backend.NumbaBackend(f"numba_{target}", target)
    mapping = backend.qconfig_mapping(qat=qat, weight_bits=bits, activation_bits=act_bits)
    # the object-type entries too, except fixed-qparams ops (sigmoid...: no weights)
    qconfigs = [mapping.global_qconfig] + [
        q for k, q in mapping.object_type_qconfigs.items() if k not in FIXED_QPARAMS_OP_TO_OBSERVER
    ]
    assert len(qconfigs) > 5
    for qconfig in qconfigs:
        if qconfig is None or qconfig.weight is None:
            continue
        weight = qconfig.weight()
        assert (weight.quant_min, weight.quant_max) == weight_range
        act = qconfig.activation()
        assert (act.activation_post_process if qat else act).reduce_range is reduce_range
    if K.target_supported(target):  # the lowered weights pick the kernel family from it
        model = zoo.LinearReLUMLP().eval()
        x = torch.randn(4, 16)
        prepared = prepare_fx(model, mapping, (x,), backend_config=backend.backend_config)
        prepared(x)
        reference = convert_to_reference_fx(copy.deepcopy(prepared))
        lowered = backend.convert(prepared)
        packs = [m._packed for m in lowered.modules() if hasattr(m, "_packed")]
        assert packs
        for packed in packs:
            assert weight_range[0] <= packed.weight.min() <= packed.weight.max() <= weight_range[1]
            assert (packed.kernel == "avx2_byte") == (target == "avx2")
            assert packed.guarded == (target == "avx2" and weight_range == (-127, 127))
        # 3x past the calibrated range: codes above 127 on every layer; every target runs the
        # same integer rule, so the avx2 byte kernels must match the generic ones exactly
        generic = _numba_backend.NumbaBackend("numba_generic", "generic").lower(reference)
        with torch.no_grad():
            big = 3 * torch.randn(64, 16)
            assert torch.equal(lowered(big), generic(big))


def test_numba_dynamic_mapping_and_bad_options() -> None:
    backend = L.get_backend("numba")
    mapping = backend.qconfig_mapping(dynamic=True, weight_bits=7)
    assert mapping.global_qconfig is None
    for module in (nn.Linear, nn.LSTM, nn.GRU):
        qconfig = mapping.object_type_qconfigs[module]
        assert qconfig.activation().is_dynamic
        assert (qconfig.weight().quant_min, qconfig.weight().quant_max) == (-63, 63)
    for name in ("weight_bits", "activation_bits"):
        with pytest.raises(ValueError, match=f"{name} must be 7, 8 or None"):
            backend.qconfig_mapping(**{name: 4})
        with pytest.raises(ValueError, match=f"{name} must be 7, 8 or None"):
            backend.qconfig_mapping(**{name: True})
    with pytest.raises(ValueError, match="dynamic=True cannot be combined"):
        backend.qconfig_mapping(dynamic=True, qat=True)
    with pytest.raises(ValueError, match="activation_bits applies to static and QAT"):
        backend.qconfig_mapping(dynamic=True, activation_bits=7)


def test_numba_backend_config_leaves_out_what_kernels_do_not_run() -> None:
    patterns = {str(c.pattern) for c in L.get_backend("numba").backend_config.configs if c.pattern}
    assert any("Linear" in p for p in patterns)
    assert any("Conv2d" in p for p in patterns)
    assert not any("Conv3d" in p or "LayerNorm" in p or "LSTMCell" in p for p in patterns)
    for cfg in L.get_backend("numba").backend_config.configs:
        for dc in cfg.dtype_configs:
            assert dc.input_dtype != torch.float16
        if cfg.pattern in (nn.LSTM, nn.GRU):  # lowered in their dynamic int8 form only
            assert cfg.dtype_configs
            assert all(dc.is_dynamic for dc in cfg.dtype_configs), cfg.dtype_configs
    assert {nn.LSTM, nn.GRU} <= {c.pattern for c in L.get_backend("numba").backend_config.configs}


def test_convert_uses_backend_config_and_lowers() -> None:
    backend = L.get_backend("numba")
    model = zoo.LinearReLUMLP().eval()
    x = torch.randn(4, 16)
    prepared = prepare_fx(
        model, backend.qconfig_mapping(), (x,), backend_config=backend.backend_config
    )
    prepared(x)
    via_backend = backend.convert(copy.deepcopy(prepared))
    via_convert_fx = convert_fx(copy.deepcopy(prepared), backend_config=backend.backend_config)
    for lowered in (via_backend, via_convert_fx):
        kinds = {type(m).__name__ for m in lowered.modules()}
        assert "QuantizedLinear" in kinds
    with torch.no_grad():
        assert torch.equal(via_backend(x), via_convert_fx(x))
    assert backend(via_backend) is not via_backend  # __call__ is lower (a new model)


def test_print_shows_what_each_node_runs_on() -> None:
    backend = L.get_backend("numba_generic")
    case = next(c for c in zoo.STATIC_CASES if c.name == "conv_bn_cnn")
    lowered = backend.lower(zoo.reference_model(case, backend))
    text = str(lowered)
    assert "kernel=kernels.conv2d" in text
    assert "target=generic" in text
    assert "kernel=kernels.max_pool2d" in text
    assert "kernel=kernels.linear" in text
    report = str(L.lowering_report(lowered))
    assert "kernels.conv2d (generic)" in report


def test_support_table_lists_ops_and_modes() -> None:
    table = L.get_backend("numba").support_table()
    for word in ("kernels.linear", "kernels.linear_dynamic", "dynamic", "weight_only", "static"):
        assert word in table
    ref_rows = L.get_backend("reference").supported_ops()
    assert any(r.op == "nn.Linear" and "dynamic" in r.modes for r in ref_rows)


def test_numba_config_follows_the_rule_table() -> None:
    # a config entry is allowed exactly when the table's rules cover every operator in it
    table = L.default_lowering_rules()
    full = L.get_backend("numba").backend_config
    without_pools = [r for r in table if "pool" not in r.name]

    reduced = backend_config_from_rules("x", without_pools, get_native_backend_config())
    pools = {nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d}
    assert any(c.pattern in pools for c in full.configs)
    assert not any(c.pattern in pools for c in reduced.configs)
    assert len(reduced.configs) < len(full.configs)
    # BatchNorm only folded into a conv: conv-bn is allowed, BatchNorm alone is not
    patterns = [c.complex_pattern for c in full.configs]
    assert (nn.BatchNorm2d, nn.Conv2d) in patterns
    assert nn.BatchNorm2d not in patterns
    assert (nn.ReLU, nn.BatchNorm2d) not in patterns


def test_one_name_space_for_configs_lowerings_and_backends() -> None:
    numba = L.get_backend("numba")
    assert get_backend_config("numba").to_dict() == numba.backend_config.to_dict()
    assert get_lowering("numba") is numba
    entry = backend_registry.entry("numba")
    assert entry is not None
    assert entry.backend is numba
    assert "quantbridge.lowering" in entry.origin
    # no module attribute shadows the numba library or fx_quant.nn.reference
    assert not hasattr(L, "numba")
    assert not hasattr(L, "reference")
    assert L.numba_backend is numba


def test_configs_handed_out_are_copies() -> None:
    numba = L.get_backend("numba")
    before = len(numba.backend_config.configs)
    mine = numba.backend_config
    mine.set_name("mine").set_backend_pattern_config(
        L.get_backend("reference").backend_config.configs[0]
    )
    other = get_backend_config("numba")
    other.set_name("other")
    assert numba.backend_config.name == "numba"
    assert len(numba.backend_config.configs) == before
    assert get_backend_config("numba").name == "numba"


def test_convert_fx_takes_a_backend_object_or_name() -> None:
    backend = L.get_backend("numba")
    model = zoo.ConvBnCNN().eval()
    x = torch.randn(2, 3, 16, 16)
    prepared = prepare_fx(
        model, backend.qconfig_mapping(), (x,), backend_config=backend.backend_config
    )
    prepared(x)
    want = backend.convert(copy.deepcopy(prepared))(x)
    by_object = convert_fx(copy.deepcopy(prepared), backend=backend)(x)
    by_name = convert_fx(copy.deepcopy(prepared), backend="numba")(x)
    assert torch.equal(by_object, want)
    assert torch.equal(by_name, want)
    with pytest.raises(LoweringRegistryError, match="drop one"):
        convert_fx(
            copy.deepcopy(prepared),
            backend=backend,
            backend_config=L.get_backend("reference").backend_config,
        )
    with pytest.raises(LoweringRegistryError, match="no backend object is registered"):
        convert_fx(copy.deepcopy(prepared), backend="qnnpack")


def test_convert_fx_finds_builtin_through_entry_point_without_importing_lowering() -> None:
    code = textwrap.dedent(
        """
        import sys, torch
        from torch import nn
        from quantbridge.fx_quant import prepare_fx, convert_fx, get_native_backend_config
        from quantbridge.qconfig import get_default_qconfig_mapping
        bc = get_native_backend_config().set_name("numba_generic")
        m = nn.Sequential(nn.Linear(4, 4)).eval()
        x = torch.randn(2, 4)
        p = prepare_fx(m, get_default_qconfig_mapping("x86"), (x,), backend_config=bc)
        p(x)
        assert "quantbridge.lowering" not in sys.modules
        out = convert_fx(p, backend_config=bc)
        print(sorted({type(mod).__name__ for mod in out.modules()}))
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert res.returncode == 0, res.stderr
    assert "QuantizedLinear" in res.stdout


def test_third_party_plugin_through_entry_point() -> None:
    """The test plugin (packages/lowering/tests/plugin, installed in the test session)."""
    code = textwrap.dedent(
        """
        import torch
        import quantbridge.lowering as L
        from quantbridge.fx_quant import prepare_fx, convert_fx
        assert "my_backend" in L.available_backends(), L.available_backends()
        b = L.get_backend("my_backend")
        assert type(b).__module__ == "qb_my_backend", type(b)

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(10, 10)
                self.conv = torch.nn.Conv2d(3, 3, 3)
                self.relu = torch.nn.ReLU()
                self.sigmoid = torch.nn.Sigmoid()
            def forward(self, x):
                return self.sigmoid(self.relu(self.conv(self.linear(x))))

        x = torch.rand(1, 3, 10, 10)
        p = prepare_fx(M().eval(), b.qconfig_mapping(), (x,), backend_config=b.backend_config)
        p(x)
        out = convert_fx(p, backend_config=b.backend_config)
        kinds = sorted({type(m).__name__ for m in out.modules()})
        print(kinds)
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert res.returncode == 0, (
        "the test plugin must be installed (pip install -e packages/lowering/tests/plugin):\n"
        + res.stderr
    )
    assert "QuantizedConv" in res.stdout
    assert "QuantizedLinear" in res.stdout
