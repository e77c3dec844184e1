"""Input-weight equalization: differential against torch.ao 2.13 (same model, same data: the
equalized weights, the input observers' ranges and the reference model's outputs, bitwise),
plus behaviour and bad input."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantbridge.fx_quant import FxQuantError, convert_to_reference_fx, prepare_fx
from quantbridge.qconfig import (
    EqualizationQConfig,
    InputEqualizationObserver,
    QConfigMapping,
    calculate_equalization_scale,
    default_equalization_qconfig,
    default_qconfig,
    get_default_qconfig_mapping,
)


class TwoLinear(nn.Module):
    """linear1 -> relu -> linear2 (connected layers), then a lone linear3 after an add."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear1 = nn.Linear(6, 8)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(8, 5)
        self.linear3 = nn.Linear(5, 4)
        with torch.no_grad():  # uneven columns, so equalization has something to do
            self.linear1.weight.mul_(torch.tensor([0.1, 3.0, 1.0, 0.5, 2.0, 0.05]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear2(self.relu(self.linear1(x)))
        return self.linear3(y + 1.0)


class Functional(nn.Module):
    """Weights as buffers: torch.ao's equalization cannot reassign functional Parameters. The
    biases have "bias" in their names: torch.ao finds a functional bias only by that name."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.register_buffer("w1", torch.randn(7, 4) * torch.tensor([0.2, 1.0, 4.0, 0.5]))
        self.register_buffer("bias1", torch.randn(7))
        self.register_buffer("w2", torch.randn(3, 7))
        self.register_buffer("bias2", torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.w1, self.bias1)
        return F.linear(y, self.w2, self.bias2)


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.conv = nn.Conv2d(3, 4, 3)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.relu(self.conv(x)))


def _data(model: nn.Module) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    scale = torch.tensor([5.0, 0.1, 1.0, 2.0, 0.3, 8.0])
    if isinstance(model, Conv):
        return [
            torch.randn(2, 3, 6, 6, generator=g) * torch.tensor([4.0, 0.2, 1.0]).view(1, 3, 1, 1)
            for _ in range(3)
        ]
    if isinstance(model, Functional):
        return [torch.randn(5, 4, generator=g) * scale[:4] for _ in range(3)]
    return [torch.randn(5, 6, generator=g) * scale for _ in range(3)]


MODELS = {"two_linear": TwoLinear, "functional": Functional, "conv": Conv}


def _ours(model: nn.Module, backend: str) -> Any:
    mapping = get_default_qconfig_mapping(backend)
    eq = QConfigMapping().set_global(default_equalization_qconfig)
    data = _data(model)
    prepared = prepare_fx(copy.deepcopy(model).eval(), mapping, (data[0],), _equalization_config=eq)
    for x in data:
        prepared(x)
    return prepared, data


def _theirs(model: nn.Module, backend: str) -> Any:
    ao = pytest.importorskip("torch.ao.quantization")
    from torch.ao.quantization import quantize_fx as ao_fx
    from torch.ao.quantization.fx._equalize import default_equalization_qconfig as ao_eq

    mapping = ao.get_default_qconfig_mapping(backend)
    eq = ao.QConfigMapping().set_global(ao_eq)
    data = _data(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = ao_fx.prepare_fx(
            copy.deepcopy(model).eval(), mapping, (data[0],), _equalization_config=eq
        )
        for x in data:
            prepared(x)
    return prepared, ao_fx


def _named_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight and bias by owner path, reference modules and plain attributes alike."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        for attr in ("weight", "bias", "w1", "bias1", "w2", "bias2"):
            value = getattr(module, attr, None)
            if isinstance(value, torch.Tensor):
                out[f"{name}.{attr}".lstrip(".")] = value.detach()
    return out


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_matches_torch_ao(name: str, backend: str) -> None:
    model = MODELS[name]()
    ours, data = _ours(model, backend)
    theirs, ao_fx = _theirs(model, backend)
    eq_ours = sorted(n.name for n in ours.graph.nodes if "equalization_process" in str(n.target))
    eq_theirs = sorted(
        n.name for n in theirs.graph.nodes if "equalization_process" in str(n.target)
    )
    assert len(eq_ours) == len(eq_theirs) > 0
    ref_ours = convert_to_reference_fx(ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_theirs = ao_fx.convert_to_reference_fx(theirs)
    p_ours, p_theirs = _named_params(ref_ours), _named_params(ref_theirs)
    assert p_ours.keys() == p_theirs.keys()
    for key in p_ours:
        assert torch.equal(p_ours[key], p_theirs[key]), key
    probe = torch.cat(data) * 1.3
    assert torch.equal(ref_ours(probe), ref_theirs(probe))
    muls_ours = [n for n in ref_ours.graph.nodes if n.target is torch.mul]
    muls_theirs = [n for n in ref_theirs.graph.nodes if n.target is torch.mul]
    assert len(muls_ours) == len(muls_theirs)


def test_weights_really_change_and_output_stays_close() -> None:
    model = TwoLinear().eval()
    ours, data = _ours(model, "fbgemm")
    before = model.linear1.weight.detach().clone()
    ref = convert_to_reference_fx(ours)
    assert not torch.equal(
        ref.linear1[0].weight if isinstance(ref.linear1, nn.Sequential) else ref.linear1.weight,
        before,
    )
    x = torch.cat(data)
    err = (ref(x) - model(x)).abs().max().item()
    assert err < 0.5 * model(x).abs().max().item()


def test_scale_formula() -> None:
    from quantbridge.qconfig import WeightEqualizationObserver

    x_obs = InputEqualizationObserver()
    w_obs = WeightEqualizationObserver()
    x_obs(torch.tensor([[0.0, -1.0, 5.0], [4.0, 1.0, 5.0]]))
    w_obs(torch.tensor([[1.0, 0.0, 2.0], [-1.0, 0.5, 2.0]]))
    scale = calculate_equalization_scale(x_obs, w_obs)
    # sqrt(2/4), sqrt(0.5/2), and the constant input column's inf -> 1
    assert torch.equal(scale, torch.sqrt(torch.tensor([2 / 4, 0.5 / 2, 1.0])))


def test_bad_mapping_entry_is_refused() -> None:
    eq = QConfigMapping().set_global(default_qconfig)
    with pytest.raises(FxQuantError, match="EqualizationQConfig"):
        prepare_fx(
            TwoLinear().eval(),
            get_default_qconfig_mapping(),
            (torch.randn(2, 6),),
            _equalization_config=eq,
        )


def test_bad_inputs_are_refused() -> None:
    eq = QConfigMapping().set_global(default_equalization_qconfig)
    prepared = prepare_fx(
        TwoLinear().eval(),
        get_default_qconfig_mapping(),
        (torch.randn(2, 6),),
        _equalization_config=eq,
    )
    with pytest.raises(Exception, match="2- to 5-dim"):
        prepared(torch.randn(6))
    prepared(torch.randn(3, 4, 6))  # a Linear on (batch, tokens, features)
    with pytest.raises(FxQuantError, match="2-dim \\(batch, features\\) inputs"):
        convert_to_reference_fx(prepared)


def test_none_entries_leave_layers_alone() -> None:
    eq = QConfigMapping().set_global(default_equalization_qconfig).set_module_name("linear3", None)
    prepared = prepare_fx(
        TwoLinear().eval(),
        get_default_qconfig_mapping(),
        (torch.randn(2, 6),),
        _equalization_config=eq,
    )
    users = {
        u.name
        for n in prepared.graph.nodes
        if "equalization_process" in str(n.target)
        for u in n.users
    }
    assert "linear3" not in users
    assert isinstance(EqualizationQConfig(), EqualizationQConfig)


@pytest.mark.parametrize(
    ("eq_qconfig", "message"),
    [
        (
            EqualizationQConfig(input_activation=nn.Identity, weight=nn.Identity),
            "node 'linear': the equalization qconfig's input_activation built a Identity, "
            "not an InputEqualizationObserver",
        ),
        (
            EqualizationQConfig(
                input_activation=default_equalization_qconfig.activation, weight=nn.Identity
            ),
            "node 'linear': the equalization qconfig's weight built a Identity, "
            "not a WeightEqualizationObserver",
        ),
    ],
)
def test_constructors_building_other_modules_are_refused(
    eq_qconfig: EqualizationQConfig, message: str
) -> None:
    eq = QConfigMapping().set_global(eq_qconfig)
    with pytest.raises(FxQuantError) as info:
        prepare_fx(
            Functional().eval(),
            get_default_qconfig_mapping(),
            (torch.randn(2, 4),),
            _equalization_config=eq,
        )
    assert str(info.value) == message
