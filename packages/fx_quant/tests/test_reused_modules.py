"""A module called more than once (torchvision's one ReLU per block) against torch.ao 2.13:
the same fused modules, observers, qparams, quantized nodes and reference outputs, whether the
repeated call comes after the fused conv-bn-relu that absorbs the module or before it."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

if str(Path(__file__).parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))

from quantbridge.fx_quant import convert_to_reference_fx, fuse_fx, prepare_fx, prepare_qat_fx
from quantbridge.qconfig import get_default_qat_qconfig_mapping, get_default_qconfig_mapping


class SharedAfterFused(nn.Module):
    """torchvision's BasicBlock: ``relu`` follows bn1 (fused) and the residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.stem(x)
        out = self.relu(self.bn1(self.conv1(identity)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class SharedBeforeFused(nn.Module):
    """``relu`` runs alone first (after an add), then inside a conv-bn-relu, then alone again."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        a = self.relu(y + 0.5)
        b = self.relu(self.bn(self.conv(a)))
        return self.relu(b * a)


MODELS = {"after": SharedAfterFused, "before": SharedBeforeFused}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):  # non-trivial statistics, so folding shows
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    return model


def _inputs(seed: int) -> torch.Tensor:
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def _ao() -> tuple[Any, Any, Any]:
    """torch.ao, its quantize_fx and the differential tests' helper module (torch.ao only)."""
    ao = pytest.importorskip("torch.ao.quantization")
    pytest.importorskip("torch.ao.quantization.backend_config.utils")  # torch 2.13 quirk
    import test_flow_differential as diff
    from torch.ao.quantization import quantize_fx as ao_fx

    return ao, ao_fx, diff


@pytest.mark.parametrize("name", MODELS)
def test_fuse_keeps_the_reused_module_like_torch_ao(name: str) -> None:
    _, ao_fx, _ = _ao()
    model = _build(name).eval()
    ours = fuse_fx(copy.deepcopy(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = ao_fx.fuse_fx(copy.deepcopy(model))
    calls_ours = [str(n.target) for n in ours.graph.nodes if n.op == "call_module"]
    calls_theirs = [str(n.target) for n in theirs.graph.nodes if n.op == "call_module"]
    assert calls_ours == calls_theirs
    assert "relu" in calls_ours  # a call of the ReLU outlived its fusion
    kinds = {n: type(m).__name__ for n, m in ours.named_modules(remove_duplicate=False) if n}
    assert kinds == {
        n: type(m).__name__ for n, m in theirs.named_modules(remove_duplicate=False) if n
    }
    x = _inputs(3)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["fbgemm", "x86", "qnnpack"])
@pytest.mark.parametrize("name", MODELS)
def test_prepare_and_convert_match_torch_ao(name: str, backend: str) -> None:
    ao, ao_fx, diff = _ao()
    model = _build(name).eval()
    example = (_inputs(0),)
    config = diff._ao_backend_config(backend)
    from quantbridge.fx_quant import get_backend_config

    ours = prepare_fx(
        copy.deepcopy(model),
        get_default_qconfig_mapping(backend),
        example,
        backend_config=get_backend_config(backend),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = ao_fx.prepare_fx(
            copy.deepcopy(model), ao.get_default_qconfig_mapping(backend), example,
            backend_config=config,
        )  # fmt: skip
    for seed in (1, 2):
        ours(_inputs(seed))
        theirs(_inputs(seed))
    table = diff.observer_table(ours)
    assert table == diff.observer_table(theirs)
    assert diff.shared_groups(ours) == diff.shared_groups(theirs)
    # the ReLU call outside the fused module is observed like any other op
    relu_calls = [n.name for n in ours.graph.nodes if n.op == "call_module" and n.target == "relu"]
    assert relu_calls
    assert any(observed in relu_calls for observed, *_ in table.values())

    ref_ours = convert_to_reference_fx(ours, backend_config=get_backend_config(backend))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_theirs = ao_fx.convert_to_reference_fx(theirs, backend_config=config)
    ops = torch.ops.quantbridge

    def quantized(gm: torch.fx.GraphModule, targets: tuple[Any, ...]) -> list[str]:
        return sorted(n.args[0].name for n in gm.graph.nodes if n.target in targets)

    assert quantized(
        ref_ours, (ops.quantize_per_tensor.tensor, ops.quantize_per_channel.default)
    ) == quantized(ref_theirs, (torch.quantize_per_tensor, torch.quantize_per_channel))
    for seed in (7, 8):
        x = _inputs(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = ref_theirs(x)
        torch.testing.assert_close(ref_ours(x), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", MODELS)
def test_qat_prepare_and_convert_match_torch_ao(name: str) -> None:
    ao, ao_fx, diff = _ao()
    model = _build(name).train()
    example = (_inputs(0),)
    ours = prepare_qat_fx(copy.deepcopy(model), get_default_qat_qconfig_mapping("fbgemm"), example)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = ao_fx.prepare_qat_fx(
            copy.deepcopy(model), ao.get_default_qat_qconfig_mapping("fbgemm"), example
        )
    for seed in (1, 2):
        torch.testing.assert_close(ours(_inputs(seed)), theirs(_inputs(seed)), rtol=0, atol=0)
    assert diff.observer_table(ours) == diff.observer_table(theirs)
    ours.eval()
    theirs.eval()
    ref_ours = convert_to_reference_fx(ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_theirs = ao_fx.convert_to_reference_fx(theirs)
        expected = ref_theirs(_inputs(9))
    torch.testing.assert_close(ref_ours(_inputs(9)), expected, rtol=0, atol=0)
