"""PerGroupMinMaxObserver and group_weight_only_qconfig: qparams per group of a weight row.

The oracle is torch.ao's PerChannelMinMaxObserver on the weight cut into its groups (one
"channel" per group): per-group qparams are per-channel qparams of that view.
"""

from __future__ import annotations

import pytest
import torch
from torch.ao.quantization import observer as ao

from quantbridge.qconfig import (
    BackendConfig,
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    FakeQuantize,
    MinMaxObserver,
    PerGroupGPTQObserver,
    PerGroupMinMaxObserver,
    QConfig,
    QConfigError,
    QConfigMapping,
    QScheme,
    group_weight_only_qconfig,
)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_qparams_are_torch_ao_per_channel_qparams_of_the_groups(
    bits: int, symmetric: bool, group_size: int
) -> None:
    g = torch.Generator().manual_seed(bits * group_size)
    weight = torch.randn(24, 256, generator=g) * torch.rand(24, 1, generator=g)
    weight[3, 40:80] = 0.0  # an all-zero group where group_size is 32
    obs = group_weight_only_qconfig(bits, group_size, symmetric=symmetric).weight()
    obs(weight)
    obs(weight * 0.5)  # a second batch inside the first's range changes nothing
    scale, zero_point = obs.calculate_qparams()

    qmin, qmax = obs.quant_min, obs.quant_max
    oracle = ao.PerChannelMinMaxObserver(
        ch_axis=0,
        dtype=torch.qint8 if symmetric else torch.quint8,
        qscheme=torch.per_channel_symmetric if symmetric else torch.per_channel_affine,
        quant_min=qmin,
        quant_max=qmax,
    )
    oracle(weight.reshape(-1, group_size))
    want_scale, want_zp = oracle.calculate_qparams()
    groups = 256 // group_size
    assert scale.shape == zero_point.shape == (24, groups)
    assert torch.equal(scale, want_scale.reshape(24, groups))
    assert torch.equal(zero_point.to(torch.int64), want_zp.reshape(24, groups).to(torch.int64))
    ranges = {(4, True): (-8, 7), (4, False): (0, 15), (8, True): (-127, 127), (8, False): (0, 255)}
    assert (qmin, qmax) == ranges[(bits, symmetric)]


def test_running_range_grows_and_state_dict_loads() -> None:
    obs = PerGroupMinMaxObserver(group_size=32)
    obs(torch.full((2, 64), 1.0))
    obs(torch.full((2, 64), -3.0))
    assert torch.equal(obs.min_val, torch.full((2, 2), -3.0))
    assert torch.equal(obs.max_val, torch.full((2, 2), 1.0))
    fresh = PerGroupMinMaxObserver(group_size=32)
    fresh.load_state_dict(obs.state_dict())
    assert torch.equal(fresh.calculate_qparams()[0], obs.calculate_qparams()[0])


def test_bad_shapes_and_settings_are_named() -> None:
    obs = PerGroupMinMaxObserver(group_size=64)
    divides = r"in_features 96 .* not a multiple of group_size 64; group_size \[32\]"
    with pytest.raises(QConfigError, match=divides):
        obs(torch.randn(4, 96))
    with pytest.raises(QConfigError, match="expects a weight"):
        obs(torch.randn(64))
    obs(torch.randn(4, 128))
    with pytest.raises(QConfigError, match="reset_min_max_vals"):
        obs(torch.randn(8, 128))
    with pytest.raises(QConfigError, match=r"group_size must be one of \[32, 64, 128\], got 48"):
        PerGroupMinMaxObserver(group_size=48)
    with pytest.raises(QConfigError, match="not supported; use one of"):
        PerGroupMinMaxObserver(qscheme=QScheme.PER_CHANNEL_SYMMETRIC)
    with pytest.raises(QConfigError, match="per_group_symmetric is not supported"):
        MinMaxObserver(qscheme="per_group_symmetric")
    with pytest.raises(QConfigError, match="bits must be 4 or 8, got 3"):
        group_weight_only_qconfig(3)
    with pytest.raises(QConfigError, match="no fake quantize"):
        FakeQuantize(observer=PerGroupMinMaxObserver)


def test_configs_round_trip_through_json() -> None:
    mapping = (
        QConfigMapping()
        .set_object_type(torch.nn.Linear, group_weight_only_qconfig(4, 64, symmetric=False))
        .set_module_name("lm_head", None)
    )
    text = mapping.to_json()
    again = QConfigMapping.from_json(text)
    assert again.to_json() == text
    obs = again.object_type_qconfigs[torch.nn.Linear].weight()
    assert isinstance(obs, PerGroupMinMaxObserver)
    assert (obs.group_size, obs.qscheme, obs.quant_min, obs.quant_max) == (
        64, QScheme.PER_GROUP_AFFINE, 0, 15
    )  # fmt: skip

    weight = DTypeWithConstraints(
        dtype=torch.int8, quant_min_lower_bound=-8, quant_max_upper_bound=7, group_sizes=[64, 32]
    )
    assert weight.group_sizes == (32, 64)
    config = BackendConfig("grouped").set_backend_pattern_config(
        BackendPatternConfig(torch.nn.Linear).add_dtype_config(
            DTypeConfig(input_dtype=torch.float32, output_dtype=torch.float32, weight_dtype=weight)
        )
    )
    text = config.to_json()
    loaded = BackendConfig.from_json(text)
    assert loaded.to_json() == text
    assert loaded.configs[0].dtype_configs[0].weight_dtype_with_constraints.group_sizes == (32, 64)


@pytest.mark.parametrize("sizes", [(), (0,), (32.0,), "32", (True,)])
def test_group_sizes_constraint_is_checked(sizes: object) -> None:
    with pytest.raises(QConfigError, match="group_sizes"):
        DTypeWithConstraints(dtype=torch.int8, group_sizes=sizes)  # type: ignore[arg-type]


def test_gptq_method_gives_the_data_aware_observer() -> None:
    obs = group_weight_only_qconfig(4, 128, symmetric=False, method="gptq").weight()
    assert type(obs) is PerGroupGPTQObserver
    assert isinstance(obs, PerGroupMinMaxObserver)
    assert PerGroupGPTQObserver.data_aware is True
    assert PerGroupMinMaxObserver.data_aware is False
    assert (obs.group_size, obs.qscheme, obs.quant_min, obs.quant_max) == (
        128, QScheme.PER_GROUP_AFFINE, 0, 15
    )  # fmt: skip
    assert (obs.damp, obs.act_order) == (0.01, False)
    default = group_weight_only_qconfig(4, 32).weight()
    assert type(default) is PerGroupMinMaxObserver
    assert type(group_weight_only_qconfig(8, 32, method="minmax").weight()) is type(default)
    for bad in ("GPTQ", "awq", None, ["gptq"]):
        with pytest.raises(ValueError, match=r"method must be one of \['minmax', 'gptq'\]"):
            group_weight_only_qconfig(4, 32, method=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_observer_alone_is_the_min_max_observer(bits: int, symmetric: bool) -> None:
    g = torch.Generator().manual_seed(bits + symmetric)
    weight = torch.randn(16, 128, generator=g) * torch.rand(16, 1, generator=g)
    weight[2, :32] = 0.0
    gptq = group_weight_only_qconfig(bits, 32, symmetric=symmetric, method="gptq").weight()
    minmax = group_weight_only_qconfig(bits, 32, symmetric=symmetric).weight()
    gptq(weight)
    minmax(weight)
    scale, zero_point = gptq.calculate_qparams()
    want_scale, want_zero_point = minmax.calculate_qparams()
    assert torch.equal(scale, want_scale)
    assert torch.equal(zero_point, want_zero_point)
    fresh = PerGroupGPTQObserver(group_size=32)
    fresh.load_state_dict(gptq.state_dict())
    assert torch.equal(fresh.min_val, gptq.min_val)


def test_gptq_observer_round_trips_through_json() -> None:
    base = group_weight_only_qconfig(4, 32, method="gptq")
    qconfig = QConfig(
        activation=base.activation, weight=base.weight.with_args(damp=0.05, act_order=True)
    )
    mapping = (
        QConfigMapping()
        .set_object_type(torch.nn.Linear, group_weight_only_qconfig(4, 128, method="gptq"))
        .set_module_name("model.layers.0.mlp.down_proj", qconfig)
    )
    text = mapping.to_json()
    assert "quantbridge.qconfig.PerGroupGPTQObserver" in text
    again = QConfigMapping.from_json(text)
    assert again.to_json() == text
    linear = again.object_type_qconfigs[torch.nn.Linear].weight()
    assert type(linear) is PerGroupGPTQObserver
    assert (linear.group_size, linear.damp, linear.act_order) == (128, 0.01, False)
    down = again.module_name_qconfigs["model.layers.0.mlp.down_proj"].weight()
    assert type(down) is PerGroupGPTQObserver
    assert (down.group_size, down.damp, down.act_order) == (32, 0.05, True)
    # a damaged file is refused when it is read, naming the bad value
    with pytest.raises(QConfigError, match=r"damp must be a number in \(0, 1\].*got -0.05"):
        QConfigMapping.from_json(text.replace('"damp": 0.05', '"damp": -0.05'))
    with pytest.raises(QConfigError, match="act_order must be True or False, got 1"):
        QConfigMapping.from_json(text.replace('"act_order": true', '"act_order": 1'))


@pytest.mark.parametrize("damp", [0, 0.0, -0.01, 1.5, float("nan"), float("inf"), True, "0.01"])
def test_gptq_observer_refuses_a_bad_damp(damp: object) -> None:
    with pytest.raises(QConfigError, match=rf"damp must be a number in \(0, 1\].*got {damp!r}"):
        PerGroupGPTQObserver(damp=damp)  # type: ignore[arg-type]
    with pytest.raises(QConfigError, match="act_order must be True or False, got 'yes'"):
        PerGroupGPTQObserver(act_order="yes")  # type: ignore[arg-type]
    assert PerGroupGPTQObserver(damp=1).damp == 1.0
    with pytest.raises(QConfigError, match="group_size must be one of"):
        PerGroupGPTQObserver(group_size=16)
