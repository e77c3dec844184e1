"""The flow's API contract: errors, custom configs, lowering registry, export and state_dict,
and the all-None property."""

from __future__ import annotations

import copy
import io
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from quantbridge.fx_quant import (
    ConvertCustomConfig,
    ExampleInputsError,
    FuseCustomConfig,
    FusionQConfigError,
    FxQuantError,
    LoweringRegistryError,
    NotPreparedError,
    PrepareCustomConfig,
    QuantizationTracer,
    TraceError,
    convert_fx,
    convert_to_reference_fx,
    explain,
    fuse_fx,
    get_lowering,
    get_native_backend_config,
    prepare_fx,
    prepare_qat_fx,
    register_lowering,
    unregister_lowering,
)
from quantbridge.fx_quant import _registry as registry
from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.fx_quant.nn import reference as nnqr
from quantbridge.qconfig import (
    QConfigMapping,
    default_qconfig,
    get_default_qat_qconfig_mapping,
    get_default_qconfig_mapping,
)

if str(Path(__file__).parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))
import flow_zoo as zoo


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # not symbolically traceable
            return self.fc(x)
        return x


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.branchy = DataDependent()
        self.post = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.branchy(self.pre(x)))


X4 = (torch.randn(2, 4, generator=torch.Generator().manual_seed(0)),)


# -- errors ------------------------------------------


def test_untraceable_model_names_module_line_and_fix() -> None:
    with pytest.raises(TraceError) as info:
        prepare_fx(Outer().eval(), get_default_qconfig_mapping(), X4)
    message = str(info.value)
    assert "submodule 'branchy' (DataDependent)" in message
    assert "if x.sum() > 0" in message
    assert "set_non_traceable_module_names(['branchy'])" in message
    assert isinstance(info.value, FxQuantError)


def test_non_traceable_module_stays_float() -> None:
    config = PrepareCustomConfig().set_non_traceable_module_names(["branchy"])
    prepared = prepare_fx(Outer().eval(), get_default_qconfig_mapping(), X4, config)
    prepared(*X4)
    converted = convert_to_reference_fx(prepared)
    assert type(converted.branchy) is DataDependent
    assert type(converted.branchy.fc) is nn.Linear
    assert isinstance(converted.pre, nnqr.Linear)
    assert isinstance(converted.post, nnqr.Linear)
    by_class = PrepareCustomConfig().set_non_traceable_module_classes([DataDependent])
    prepared = prepare_fx(Outer().eval(), get_default_qconfig_mapping(), X4, by_class)
    assert "branchy" in dict(prepared.named_children())


@pytest.mark.parametrize(
    ("inputs", "expected"),
    [
        ((), "example_inputs has 0 values but the model's forward takes 1 (x)"),
        ((X4[0], X4[0]), "example_inputs has 2 values"),
        ((torch.randn(2, 5),), "the model fails on example_inputs (Tensor(2, 5) float32)"),
    ],
)
def test_example_inputs_that_do_not_fit(inputs: tuple[Any, ...], expected: str) -> None:
    with pytest.raises(ExampleInputsError, match=None) as info:
        prepare_fx(zoo.MLP().eval(), get_default_qconfig_mapping(), inputs)
    assert expected in str(info.value)


def test_example_inputs_must_be_a_tuple() -> None:
    with pytest.raises(ExampleInputsError, match=r"must be a tuple.*\(x,\)"):
        prepare_fx(zoo.MLP().eval(), get_default_qconfig_mapping(), X4[0])  # type: ignore[arg-type]


def test_convert_on_unprepared_model() -> None:
    traced = torch.fx.symbolic_trace(zoo.MLP())
    with pytest.raises(NotPreparedError, match="prepare_fx or prepare_qat_fx"):
        convert_to_reference_fx(traced)
    with pytest.raises(NotPreparedError):
        convert_fx(traced)
    prepared = prepare_fx(zoo.MLP().eval(), get_default_qconfig_mapping(), (torch.randn(2, 16),))
    prepared(torch.randn(2, 16))
    convert_to_reference_fx(prepared)
    with pytest.raises(NotPreparedError, match="already converted"):
        convert_to_reference_fx(prepared)


def test_fused_members_with_different_qconfigs_are_named() -> None:
    mapping = QConfigMapping().set_object_type(nn.Conv2d, default_qconfig)
    mapping.set_object_type(nn.ReLU, None)
    with pytest.raises(FusionQConfigError) as info:
        prepare_fx(zoo.build("cnn").eval(), mapping, zoo.example_inputs("cnn"))
    message = str(info.value)
    assert "'conv1' (ConvReLU2d)" in message
    assert "Conv2d" in message
    assert "ReLU -> None" in message


def test_mode_checks() -> None:
    with pytest.raises(FxQuantError, match="eval mode"):
        prepare_fx(zoo.MLP().train(), get_default_qconfig_mapping(), (torch.randn(2, 16),))
    with pytest.raises(FxQuantError, match="training mode"):
        prepare_qat_fx(zoo.MLP().eval(), get_default_qat_qconfig_mapping(), (torch.randn(2, 16),))


def test_explain_needs_a_prepared_model() -> None:
    with pytest.raises(FxQuantError, match="explain needs"):
        explain(zoo.MLP())


# -- tracer and fusion ------------------------------------------


def test_tracer_leaf_rules() -> None:
    tracer = QuantizationTracer(["skip_me"], [DataDependent])
    assert tracer.is_leaf_module(nn.Conv2d(1, 1, 1), "c")
    assert not tracer.is_leaf_module(nn.Sequential(), "s")
    assert tracer.is_leaf_module(nni.ConvReLU2d(nn.Conv2d(1, 1, 1), nn.ReLU()), "f")
    assert tracer.is_leaf_module(DataDependent(), "any")
    assert tracer.is_leaf_module(Outer(), "skip_me")
    assert not tracer.is_leaf_module(Outer(), "other")


def test_fuse_fx_folds_bn_and_preserves_attributes() -> None:
    model = zoo.build("cnn").eval()
    model.keep_me = 42  # type: ignore[assignment]
    fused = fuse_fx(model, FuseCustomConfig().set_preserved_attributes(["keep_me"]))
    assert isinstance(fused.conv1, nni.ConvReLU2d)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in fused.modules())
    assert fused.keep_me == 42
    x = zoo.example_inputs("cnn")[0]
    torch.testing.assert_close(fused(x), model(x), rtol=1e-5, atol=1e-5)


# -- custom configs ------------------------------------------


def test_custom_config_dicts_round_trip() -> None:
    prepare = (
        PrepareCustomConfig()
        .set_non_traceable_module_names(["a"])
        .set_non_traceable_module_classes([DataDependent])
        .set_input_quantized_indexes([0])
        .set_output_quantized_indexes([0])
        .set_preserved_attributes(["attr"])
    )
    d = prepare.to_dict()
    assert d == {
        "non_traceable_module_name": ["a"],
        "non_traceable_module_class": [DataDependent],
        "input_quantized_idxs": [0],
        "output_quantized_idxs": [0],
        "preserved_attributes": ["attr"],
    }
    assert PrepareCustomConfig.from_dict(d).to_dict() == d
    assert ConvertCustomConfig.from_dict({"preserved_attributes": ["b"]}).to_dict() == {
        "preserved_attributes": ["b"]
    }
    with pytest.raises(FxQuantError, match="unknown key 'bogus'"):
        PrepareCustomConfig.from_dict({"bogus": 1})
    with pytest.raises(FxQuantError, match="pass the class"):
        PrepareCustomConfig().set_non_traceable_module_classes([DataDependent()])  # type: ignore[list-item]


def test_custom_config_keys_match_torch_ao() -> None:
    ao_cc = pytest.importorskip("torch.ao.quantization.fx.custom_config")
    theirs = (
        ao_cc.PrepareCustomConfig()
        .set_non_traceable_module_names(["a"])
        .set_input_quantized_indexes([0])
        .set_preserved_attributes(["attr"])
    )
    ours = PrepareCustomConfig.from_dict(theirs.to_dict())
    assert ours.to_dict() == theirs.to_dict()


class FloatCustom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) * 2


class ObservedCustom(FloatCustom):
    @classmethod
    def from_float(cls, mod: nn.Module) -> ObservedCustom:
        new = cls()
        new.load_state_dict(mod.state_dict())
        return new


class QuantizedCustom(FloatCustom):
    @classmethod
    def from_observed(cls, mod: nn.Module) -> QuantizedCustom:
        new = cls()
        new.load_state_dict(mod.state_dict())
        return new


class WithCustom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.custom = FloatCustom()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.custom(self.pre(x))


def test_custom_module_swapped_at_prepare_and_convert() -> None:
    pcc = PrepareCustomConfig().set_float_to_observed_mapping(FloatCustom, ObservedCustom)
    model = WithCustom().eval()
    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping(), X4, pcc)
    assert type(prepared.custom) is ObservedCustom
    assert explain(prepared)["custom"].status == "custom module"
    prepared(*X4)
    ccc = ConvertCustomConfig().set_observed_to_quantized_mapping(ObservedCustom, QuantizedCustom)
    converted = convert_to_reference_fx(prepared, ccc)
    assert type(converted.custom) is QuantizedCustom
    torch.testing.assert_close(converted(*X4), model(*X4), rtol=0.1, atol=0.1)


def test_standalone_module_prepared_on_its_own() -> None:
    mapping = get_default_qconfig_mapping()
    pcc = PrepareCustomConfig().set_standalone_module_name("post", None, X4, None, None)
    model = Outer()
    model.branchy = nn.Identity()  # type: ignore[assignment]
    model.eval()
    prepared = prepare_fx(copy.deepcopy(model), mapping, X4, pcc)
    assert isinstance(prepared.post, torch.fx.GraphModule)
    assert explain(prepared)["post"].status == "standalone module"
    inner = [n for n, _ in prepared.post.named_modules() if "activation_post_process" in n]
    assert inner  # observers live inside the standalone module
    prepared(*X4)
    converted = convert_to_reference_fx(prepared)
    assert isinstance(converted.post, torch.fx.GraphModule)
    # The standalone Linear was traced as F.linear: its weight and activations get q/dq ops.
    ops = torch.ops.quantbridge
    targets = [n.target for n in converted.post.graph.nodes]
    assert ops.quantize_per_tensor.tensor in targets
    assert ops.quantize_per_channel.default in targets
    torch.testing.assert_close(converted(*X4), model(*X4), rtol=0.1, atol=0.1)


def test_preserved_attributes_survive_prepare_and_convert() -> None:
    model = zoo.MLP().eval()
    model.meta_info = {"v": 1}  # type: ignore[assignment]
    pcc = PrepareCustomConfig().set_preserved_attributes(["meta_info"])
    prepared = prepare_fx(model, get_default_qconfig_mapping(), (torch.randn(2, 16),), pcc)
    assert prepared.meta_info == {"v": 1}
    prepared(torch.randn(2, 16))
    converted = convert_to_reference_fx(prepared)
    assert converted.meta_info == {"v": 1}


def test_quantized_output_index_returns_integers() -> None:
    pcc = PrepareCustomConfig().set_output_quantized_indexes([0])
    prepared = prepare_fx(
        zoo.MLP().eval(), get_default_qconfig_mapping(), (torch.randn(2, 16),), pcc
    )
    prepared(torch.randn(2, 16))
    out = convert_to_reference_fx(prepared)(torch.randn(2, 16))
    assert out.dtype == torch.uint8


# -- lowering registry ------------------------------------------


def test_convert_fx_uses_the_registered_lowering() -> None:
    bc = copy.deepcopy(get_native_backend_config()).set_name("flow_test_backend")
    seen: list[torch.fx.GraphModule] = []

    def lower(reference: torch.fx.GraphModule) -> torch.fx.GraphModule:
        seen.append(reference)
        reference.lowered_by_test = True  # type: ignore[assignment]
        return reference

    register_lowering("flow_test_backend", lower)
    try:
        assert get_lowering("flow_test_backend") is lower
        prepared = prepare_fx(
            zoo.MLP().eval(),
            get_default_qconfig_mapping(),
            (torch.randn(2, 16),),
            backend_config=bc,
        )
        prepared(torch.randn(2, 16))
        lowered = convert_fx(prepared, backend_config=bc)
        assert lowered.lowered_by_test is True
        assert len(seen) == 1
        with pytest.raises(LoweringRegistryError, match="already registered"):
            register_lowering("flow_test_backend", lambda m: m)
    finally:
        unregister_lowering("flow_test_backend")
    assert get_lowering("flow_test_backend") is None


def test_convert_fx_without_lowering_returns_the_reference_model() -> None:
    # native lowers (quantbridge.lowering registers it); a name without a lowering does not
    bc = get_native_backend_config().set_name("flow_test_unlowered")
    prepared = prepare_fx(
        zoo.MLP().eval(), get_default_qconfig_mapping(), (torch.randn(2, 16),), backend_config=bc
    )
    prepared(torch.randn(2, 16))
    with pytest.warns(UserWarning, match="returned the reference model"):
        converted = convert_fx(prepared)
    assert isinstance(converted.fc3, nnqr.Linear)


def test_lowerings_load_lazily_from_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class FakeEntryPoint:
        name = "ep_backend"
        value = "pkg.module:lower"

        def load(self) -> Any:
            calls.append("load")
            return lambda m: m

    def entry_points(group: str) -> list[FakeEntryPoint]:
        calls.append(group)
        return [FakeEntryPoint()]

    monkeypatch.setattr(registry.importlib.metadata, "entry_points", entry_points)
    monkeypatch.setattr(registry.backend_registry, "_entry_points_loaded", False)
    monkeypatch.setattr(
        registry.backend_registry, "_entries", dict(registry.backend_registry._entries)
    )
    assert calls == []  # nothing read at import or setup
    assert get_lowering("ep_backend") is not None
    assert calls == ["quantbridge.backends", "load"]
    get_lowering("unknown_backend")
    assert calls == ["quantbridge.backends", "load"]  # read once


# -- export and state_dict ------------------------------------------


@pytest.mark.parametrize("name", ["cnn", "attention", "residual"])
def test_reference_model_state_dict_and_export(name: str) -> None:
    model = zoo.build(name).eval()
    example = zoo.example_inputs(name)

    def converted(seed: int) -> torch.fx.GraphModule:
        prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping(), example)
        prepared(*zoo.example_inputs(name, seed))
        return convert_to_reference_fx(prepared)

    first, second = converted(1), converted(2)
    x = zoo.example_inputs(name, 5)
    assert not torch.equal(first(*x), second(*x))  # different calibration, different qparams
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    second.load_state_dict(torch.load(buffer, weights_only=True))
    torch.testing.assert_close(second(*x), first(*x), rtol=0, atol=0)
    exported = torch.export.export(first, x)
    torch.testing.assert_close(exported.module()(*x), first(*x), rtol=0, atol=0)
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert any("quantbridge.quantize_per_tensor" in t for t in targets)


# -- property: no qconfig, no change ------------------------------------------


@settings(max_examples=8, deadline=None)
@given(name=st.sampled_from(zoo.PTQ_MODELS), seed=st.integers(0, 1000))
def test_all_none_qconfig_reproduces_the_float_model(name: str, seed: int) -> None:
    model = zoo.build(name, seed).eval()
    example = zoo.example_inputs(name, seed)
    prepared = prepare_fx(copy.deepcopy(model), QConfigMapping(), example)
    assert not any("activation_post_process" in n for n, _ in prepared.named_modules())
    prepared(*example)
    converted = convert_to_reference_fx(prepared)
    assert not any(str(n.target).startswith("quantbridge") for n in converted.graph.nodes)
    x = zoo.example_inputs(name, seed + 1)
    # Fusion still folds batch norm (as torch.ao does), so the result is bit-identical to the
    # fused float model, and equal to the original up to the folding's rounding.
    fused = fuse_fx(copy.deepcopy(model))
    torch.testing.assert_close(converted(*x), fused(*x), rtol=0, atol=0)
    torch.testing.assert_close(converted(*x), model(*x), rtol=1e-5, atol=1e-6)
    if not any(isinstance(m, nn.BatchNorm2d) for m in model.modules()):
        torch.testing.assert_close(converted(*x), model(*x), rtol=0, atol=0)


def test_quantized_input_index_takes_integers_with_settable_qparams() -> None:
    pcc = PrepareCustomConfig().set_input_quantized_indexes([0])
    model = zoo.MLP().eval()
    example = (torch.randn(2, 16),)
    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping(), example, pcc)
    # No observer on the input: it arrives quantized.
    placeholder = next(n for n in prepared.graph.nodes if n.op == "placeholder")
    assert [u.target for u in placeholder.users] == ["fc1"]
    prepared(*example)
    converted = convert_to_reference_fx(prepared)
    dq = next(iter(next(n for n in converted.graph.nodes if n.op == "placeholder").users))
    assert dq.target == torch.ops.quantbridge.dequantize_per_tensor.tensor
    assert [a.target for a in dq.args[1:3]] == ["x_input_scale_0", "x_input_zero_point_0"]
    q = torch.randint(0, 256, (2, 16), dtype=torch.uint8)
    converted.x_input_scale_0.fill_(0.02)
    converted.x_input_zero_point_0.fill_(128)
    first = converted(q)
    converted.x_input_scale_0.fill_(0.04)
    assert not torch.equal(converted(q), first)  # the buffers are the input's qparams


def test_convert_qconfig_mapping_can_only_keep_or_disable() -> None:
    model = zoo.MLP().eval()
    example = (torch.randn(2, 16),)

    def calibrated() -> torch.fx.GraphModule:
        prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping(), example)
        prepared(*example)
        return prepared

    disable_fc3 = get_default_qconfig_mapping().set_module_name("fc3", None)
    converted = convert_to_reference_fx(calibrated(), qconfig_mapping=disable_fc3)
    assert isinstance(converted.fc1, nni.LinearReLU)
    assert isinstance(converted.fc1[0], nnqr.Linear)
    assert type(converted.fc3) is nn.Linear  # disabled at convert: stays float
    changed = get_default_qconfig_mapping().set_module_name("fc3", default_qconfig)
    with pytest.raises(FxQuantError, match="can only be kept or set to None"):
        convert_to_reference_fx(calibrated(), qconfig_mapping=changed)


def test_dynamic_and_qat_reference_models_export() -> None:
    import quantbridge.qconfig as qb

    example = (torch.randn(2, 16),)
    dynamic = qb.default_dynamic_qconfig
    mapping = QConfigMapping().set_object_type(nn.Linear, dynamic).set_object_type(nn.ReLU, dynamic)
    prepared = prepare_fx(zoo.build("mlp").eval(), mapping, example)
    prepared(*example)
    reference = convert_to_reference_fx(prepared)
    exported = torch.export.export(reference, example)
    targets = [n.target for n in exported.graph.nodes]
    assert torch.ops.quantbridge.choose_qparams_per_tensor.default in targets
    torch.testing.assert_close(exported.module()(*example), reference(*example), rtol=0, atol=0)

    example = zoo.example_inputs("qat_conv_bn")
    prepared = prepare_qat_fx(
        zoo.build("qat_conv_bn").train(), get_default_qat_qconfig_mapping(), example
    )
    prepared(*example)
    prepared.eval()
    reference = convert_to_reference_fx(prepared)
    assert any(isinstance(m, nnqr.Conv2d) for m in reference.modules())
    exported = torch.export.export(reference, example)
    torch.testing.assert_close(exported.module()(*example), reference(*example), rtol=0, atol=0)


# -- reference models under autograd --------------------------------------------------------


@pytest.mark.parametrize("name", ["cnn", "mlp", "qat_conv_bn"])
def test_reference_model_runs_with_grad_enabled(name: str) -> None:
    # Regression: reference models failed inside the quantize ops when called without
    # torch.no_grad() on inputs that require grad (users evaluating, QAT -> convert flows).
    example = zoo.example_inputs(name)
    model = zoo.build(name)
    if name == "qat_conv_bn":
        prepared = prepare_qat_fx(model.train(), get_default_qat_qconfig_mapping("fbgemm"), example)
        prepared(*example)
        prepared.eval()
    else:
        prepared = prepare_fx(model.eval(), get_default_qconfig_mapping("fbgemm"), example)
        prepared(*example)
    converted = convert_to_reference_fx(prepared)
    with torch.no_grad():
        expected = converted(*example)
    x = example[0].clone().requires_grad_(True)
    with torch.enable_grad():
        got = converted(x)
    assert torch.equal(got.detach(), expected)
