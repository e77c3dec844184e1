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
    PerGroupMinMaxObserver,
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
