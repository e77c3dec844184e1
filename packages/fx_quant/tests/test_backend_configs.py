"""The built-in BackendConfigs without torch.ao: JSON, canonical dtypes, registry, errors."""

from __future__ import annotations

import operator
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantbridge.fx_quant as fxq
import quantbridge.qconfig as qb
from quantbridge.fx_quant import FxQuantError
from quantbridge.fx_quant import _backend_configs as bc
from quantbridge.fx_quant._backend_configs import _common, _fusers
from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.fx_quant.nn import reference as nnqr
from quantbridge.patterns import MatchAllNode

NAMES = ["native", "fbgemm", "x86", "qnnpack", "onednn", "executorch", "tensorrt"]
GETTERS: dict[str, Callable[[], qb.BackendConfig]] = {
    "native": fxq.get_native_backend_config,
    "fbgemm": fxq.get_fbgemm_backend_config,
    "x86": fxq.get_x86_backend_config,
    "qnnpack": fxq.get_qnnpack_backend_config,
    "onednn": fxq.get_onednn_backend_config,
    "executorch": fxq.get_executorch_backend_config,
    "tensorrt": fxq.get_tensorrt_backend_config,
}
# Fixed by the brief (torch.ao 2.13's numbers of distinct patterns).
COUNTS = {
    "native": 194,
    "fbgemm": 192,
    "x86": 192,
    "qnnpack": 190,
    "onednn": 221,
    "executorch": 84,
    "tensorrt": 149,
}
CANONICAL = {torch.uint8, torch.int8, torch.int32, torch.float16, torch.float32}


@pytest.mark.parametrize("name", NAMES)
def test_getter_and_registry_agree(name: str) -> None:
    config = fxq.get_backend_config(name)
    direct = GETTERS[name]()
    assert config.name == direct.name == name
    assert len(config.configs) == len(direct.configs) == COUNTS[name]
    assert config.to_dict() == direct.to_dict()


@pytest.mark.parametrize("name", NAMES)
def test_round_trips_through_json_unchanged(name: str) -> None:
    config = GETTERS[name]()
    text = config.to_json()
    loaded = qb.BackendConfig.from_json(text)  # default allow-list only
    assert loaded.name == config.name
    assert list(loaded._pattern_complex_format_to_config) == list(
        config._pattern_complex_format_to_config
    )
    assert loaded.to_dict() == config.to_dict()
    assert loaded.to_json() == text


@pytest.mark.parametrize("name", NAMES)
def test_dtypes_are_canonical(name: str) -> None:
    for pc in GETTERS[name]().configs:
        for dc in pc.dtype_configs:
            for dtype in (dc.input_dtype, dc.output_dtype, dc.weight_dtype, dc.bias_dtype):
                assert dtype is None or dtype in CANONICAL, (pc.pattern, dtype)


@pytest.mark.parametrize("name", NAMES)
def test_every_named_object_is_ours_or_plain_torch(name: str) -> None:
    for pc in GETTERS[name]().configs:
        named = [
            pc.root_module,
            pc.qat_module,
            pc.reference_quantized_module,
            pc.fused_module,
            pc.fuser_method,
            pc._root_node_getter,
            pc._extra_inputs_getter,
        ]
        for obj in named:
            if obj is None:
                continue
            module = obj.__module__
            assert module.startswith(("quantbridge.", "torch.nn.")), (pc.pattern, obj)
            assert not module.startswith("torch.ao"), (pc.pattern, obj)
            assert "<locals>" not in obj.__qualname__, (pc.pattern, obj)


def test_each_call_returns_a_new_config() -> None:
    first = fxq.get_backend_config("native")
    linear = next(pc for pc in first.configs if pc.pattern is nn.Linear)
    linear.dtype_configs[0].input_dtype_with_constraints.quant_max_upper_bound = 127
    linear.set_root_module(None)
    again = next(pc for pc in fxq.get_native_backend_config().configs if pc.pattern is nn.Linear)
    assert again.root_module is nn.Linear
    assert again.dtype_configs[0].input_dtype_with_constraints.quant_max_upper_bound is None


def test_native_spot_checks() -> None:
    """A few entries written out by hand from torch.ao 2.13's native config."""
    configs = fxq.get_native_backend_config()._pattern_complex_format_to_config
    linear = configs[nn.Linear]
    assert linear.qat_module is fxq.nn.qat.Linear
    assert linear.reference_quantized_module is nnqr.Linear
    assert [
        (d.input_dtype, d.output_dtype, d.weight_dtype, d.is_dynamic) for d in linear.dtype_configs
    ] == [
        (torch.uint8, torch.uint8, torch.int8, None),
        (torch.uint8, torch.float32, torch.int8, True),
        (torch.float16, torch.float32, torch.float16, True),
    ]
    sigmoid = configs[torch.sigmoid].dtype_configs[0].output_dtype_with_constraints
    assert (sigmoid.scale_exact_match, sigmoid.zero_point_exact_match) == (1.0 / 256.0, 0)
    tanh = configs["tanh"].dtype_configs[0].input_dtype_with_constraints
    assert (tanh.scale_exact_match, tanh.zero_point_exact_match) == (2.0 / 256.0, 128)
    assert (tanh.quant_min_lower_bound, tanh.quant_max_upper_bound) == (0, 255)
    # the fused conv-relu module is registered twice; the later entry (QAT module only) wins
    fused = configs[nni.ConvReLU2d]
    assert fused.qat_module is fxq.nn.intrinsic_qat.ConvReLU2d
    assert fused.root_module is None
    emb4 = configs[nn.Embedding].dtype_configs[1].weight_dtype_with_constraints
    assert (emb4.dtype, emb4.quant_min_lower_bound, emb4.quant_max_upper_bound) == (
        torch.uint8,
        0,
        15,
    )
    add = configs[operator.add]
    assert add._num_tensor_args_to_observation_type[1] is (
        qb.ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT
    )
    assert configs["shape"].observation_type is qb.ObservationType.INPUT_OUTPUT_NOT_OBSERVED
    assert configs[F.layer_norm]._input_type_to_index == {"weight": 2, "bias": 3}
    lstm = configs[nn.LSTM]
    assert (lstm.root_module, lstm.reference_quantized_module) == (nn.LSTM, nnqr.LSTM)
    assert [d.is_dynamic for d in lstm.dtype_configs] == [True, True]


def test_qnnpack_symmetric_constraints() -> None:
    conv = fxq.get_qnnpack_backend_config()._pattern_complex_format_to_config[nn.Conv2d]
    symmetric = conv.dtype_configs[0]
    assert symmetric.input_dtype_with_constraints == qb.DTypeWithConstraints(
        dtype=torch.int8, scale_min_lower_bound=2**-12
    )
    assert symmetric.weight_dtype_with_constraints == qb.DTypeWithConstraints(
        dtype=torch.int8,
        quant_min_lower_bound=-127,
        quant_max_upper_bound=127,
        scale_min_lower_bound=2**-12,
    )


def test_onednn_conv_add_patterns() -> None:
    configs = fxq.get_onednn_backend_config()._pattern_complex_format_to_config
    left = configs[(operator.add, nn.Conv2d, MatchAllNode)]
    assert left.fuser_method is _fusers.fuse_conv_add_left
    assert left.fused_module is nni.ConvAdd2d
    right_relu_bn = configs[(nn.ReLU, (torch.add, MatchAllNode, (nn.BatchNorm2d, nn.Conv2d)))]
    assert right_relu_bn.fuser_method is _fusers.fuse_conv_bn_add_relu_right
    assert right_relu_bn._root_node_getter is _fusers.conv_bn_add_relu_root_node_getter_right
    node_pattern = ("relu", ("add", "extra", ("bn", "conv")))
    assert right_relu_bn._root_node_getter(node_pattern) == "conv"
    assert right_relu_bn._extra_inputs_getter(node_pattern) == ["extra"]
    assert configs[nni.ConvAddReLU2d].reference_quantized_module is nnqr.Conv2d


def test_conv_add_fusers_build_working_modules() -> None:
    torch.manual_seed(0)
    conv, bn, relu = nn.Conv2d(3, 4, 1).eval(), nn.BatchNorm2d(4).eval(), nn.ReLU()
    x1, x2 = torch.randn(1, 3, 4, 4), torch.randn(1, 4, 4, 4)
    fused = _fusers.fuse_conv_add_relu_left(False, relu, (torch.add, conv, MatchAllNode))
    assert isinstance(fused, nni.ConvAddReLU2d)
    assert torch.equal(fused(x1, x2), torch.relu(conv(x1) + x2))
    folded = _fusers.fuse_conv_bn_add_right(False, operator.add, MatchAllNode, (bn, conv))
    assert isinstance(folded, nni.ConvAdd2d)
    torch.testing.assert_close(folded(x1, x2), bn(conv(x1)) + x2)


def test_bn_folding_fusers_refuse_qat_and_training_mode() -> None:
    conv, bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)
    with pytest.raises(FxQuantError, match="post-training quantization only"):
        _fusers.fuse_conv_bn_add_left(True, torch.add, (bn, conv), MatchAllNode)
    with pytest.raises(FxQuantError, match=r"eval mode.*call \.eval\(\)"):
        _fusers.fuse_conv_bn_add_left(False, torch.add, (bn, conv), MatchAllNode)
    with pytest.raises(FxQuantError, match="all be in train or all in eval"):
        _fusers.fuse_linear_bn_leaky_relu(
            False, nn.Linear(2, 4).eval(), nn.BatchNorm1d(4), nn.LeakyReLU()
        )
    with pytest.raises(FxQuantError, match=r"expected an nn\.Linear"):
        _fusers.fuse_linear_bn_leaky_relu(
            False, nn.Conv1d(2, 4, 1).eval(), nn.BatchNorm1d(4).eval(), nn.LeakyReLU().eval()
        )


def test_fixed_qparams_refuse_scale_bounds() -> None:
    bounded = qb.DTypeConfig(
        input_dtype=qb.DTypeWithConstraints(dtype=torch.uint8, scale_min_lower_bound=1e-3),
        output_dtype=torch.uint8,
    )
    with pytest.raises(FxQuantError, match=r"dtype_configs\[0\]: scale_min_lower_bound is set"):
        _common.fixed_qparams_op_configs([bounded])
    # other dtypes pass through untouched, and the input is not modified
    int8 = qb.DTypeConfig(input_dtype=torch.int8, output_dtype=torch.int8)
    (out,) = _common.with_fixed_qparams([int8], _common._fixed_0to1())
    assert out.input_dtype_with_constraints.scale_exact_match is None
    plain = qb.DTypeConfig(input_dtype=torch.uint8, output_dtype=torch.uint8)
    (fixed,) = _common.with_fixed_qparams([plain], _common._fixed_neg1to1())
    assert fixed.output_dtype_with_constraints.zero_point_exact_match == 128
    assert plain.output_dtype_with_constraints.zero_point_exact_match is None


# -- registry --------------------------------------------------------------------------------


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(FxQuantError, match="unknown backend 'fbgem'") as info:
        fxq.get_backend_config("fbgem")
    for name in NAMES:
        assert repr(name) in str(info.value) or name in str(info.value)
    with pytest.raises(FxQuantError, match="must be a string"):
        fxq.get_backend_config(3)  # type: ignore[arg-type]


def test_register_and_replace(monkeypatch: pytest.MonkeyPatch) -> None:
    from quantbridge.fx_quant import backend_registry

    monkeypatch.setattr(backend_registry, "_entries", dict(backend_registry._entries))

    def mine() -> qb.BackendConfig:
        return qb.BackendConfig("mine").set_backend_pattern_config(
            qb.BackendPatternConfig(nn.Linear)
        )

    fxq.register_backend_config("mine", mine)
    assert fxq.get_backend_config("mine").name == "mine"
    assert "mine" in fxq.backend_config_names()
    with pytest.raises(FxQuantError, match=r"already registered under 'mine'.*pass replace=True"):
        fxq.register_backend_config("mine", mine)
    with pytest.raises(FxQuantError, match="already registered"):
        fxq.register_backend_config("native", mine)
    fxq.register_backend_config("native", mine, replace=True)
    assert fxq.get_backend_config("native").name == "mine"
    with pytest.raises(FxQuantError, match="not a valid backend name"):
        fxq.register_backend_config("", mine)
    with pytest.raises(FxQuantError, match="must be a function returning a BackendConfig"):
        fxq.register_backend_config("obj", mine())  # type: ignore[arg-type]
    fxq.register_backend_config("broken", lambda: {"name": "broken"})  # type: ignore[arg-type,return-value]
    with pytest.raises(
        FxQuantError, match=r"returned dict, not a quantbridge\.qconfig\.BackendConfig"
    ):
        fxq.get_backend_config("broken")


def test_registry_changes_do_not_leak() -> None:
    # the seven built-in names, plus those installed backends add (quantbridge-lowering's)
    assert set(NAMES) <= set(fxq.backend_config_names())
    assert "mine" not in fxq.backend_config_names()
    assert fxq.get_backend_config("native").name == "native"
    assert set(bc.BUILTIN_BACKEND_CONFIGS) == set(NAMES)


def test_dict_getters() -> None:
    d = fxq.get_native_backend_config_dict()
    assert d["name"] == "native"
    assert len(d["configs"]) == COUNTS["native"]
    assert qb.BackendConfig.from_dict(d).to_dict() == d
    assert fxq.get_tensorrt_backend_config_dict()["name"] == "tensorrt"
