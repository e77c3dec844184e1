"""Lowered CNNs keep activations channels-last from conv to conv, with unchanged numbers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.fx import GraphModule, Interpreter

if str(Path(__file__).parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))
import lowering_zoo as zoo

import quantbridge.lowering as L
from quantbridge import kernels as K
from quantbridge.lowering._modules import QuantizedBinary, QuantizedConv

NUMBA = [f"numba_{t}" for t in K.available_targets()]
CASES = {c.name: c for c in zoo.STATIC_CASES}


def _module_outputs(gm: GraphModule, *args: torch.Tensor) -> list[tuple[object, torch.Tensor]]:
    """(module, output) of every call_module node, in execution order."""
    seen: list[tuple[object, torch.Tensor]] = []

    class Recorder(Interpreter):
        def call_module(self, target, args, kwargs):  # type: ignore[no-untyped-def]
            out = super().call_module(target, args, kwargs)
            seen.append((self.module.get_submodule(str(target)), out))
            return out

    Recorder(gm).run(*args)
    return seen


def _channels_last(t: torch.Tensor) -> bool:
    return t.movedim(1, -1).is_contiguous() and not t.is_contiguous()


def _lowered(case_name: str, backend_name: str) -> tuple[GraphModule, tuple[torch.Tensor, ...]]:
    case = CASES[case_name]
    backend = L.get_backend(backend_name)
    return backend.lower(zoo.reference_model(case, backend)), case.inputs(1)


@pytest.mark.parametrize("backend_name", NUMBA)
@pytest.mark.parametrize("case_name", ["residual_add_mul", "conv_bn_cnn", "depthwise"])
def test_conv_outputs_stay_channels_last_through_the_chain(case_name: str, backend_name: str):
    lowered, x = _lowered(case_name, backend_name)
    seen = _module_outputs(lowered, *x)
    convs = [out for mod, out in seen if isinstance(mod, QuantizedConv)]
    assert convs
    for out in convs:
        assert _channels_last(out), (case_name, out.shape, out.stride())
    binaries = [out for mod, out in seen if isinstance(mod, QuantizedBinary)]
    for out in binaries:
        assert _channels_last(out)  # add/mul of conv outputs: no transpose back
    assert binaries or case_name != "residual_add_mul"


@pytest.mark.parametrize("backend_name", NUMBA)
@pytest.mark.parametrize(
    "case_name", ["residual_add_mul", "conv_bn_cnn", "depthwise", "pools", "conv1d"]
)
def test_channels_last_chain_gives_the_numbers_of_nchw_convs(
    case_name: str, backend_name: str, monkeypatch: pytest.MonkeyPatch
):
    lowered, x = _lowered(case_name, backend_name)
    want = lowered(*x)
    convs = [m for m in lowered.modules() if isinstance(m, QuantizedConv)]
    assert convs
    calls: list[str] = []

    def nchw(name: str) -> Any:
        real = getattr(K, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **{**kwargs, "channels_last": False})

        return run

    for name in ("conv1d", "conv2d"):  # the same convs returning C-contiguous NCHW instead
        monkeypatch.setattr(K, name, nchw(name))

    class NchwPrepared(K.PreparedConv):  # what the conv modules call in a model
        __slots__ = ()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            calls.append("PreparedConv")
            super().__init__(*args, **{**kwargs, "channels_last": False})

    monkeypatch.setattr(K, "PreparedConv", NchwPrepared)
    for conv in convs:
        conv._sync()  # its op object made again, through the patched class
    got = lowered(*x)
    assert calls  # the lowered convs did run through the patched kernels
    torch.testing.assert_close(got, want, rtol=0, atol=0)


class ConvView(torch.nn.Module):
    """The classic ``x.view(x.size(0), -1)`` after a conv: NCHW-only on channels-last data."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8 * 6 * 6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.fc(y.view(y.size(0), -1))


@pytest.mark.parametrize("backend_name", NUMBA)
def test_view_after_conv_runs_as_reshape(backend_name: str):
    case = zoo.Case("conv_view", ConvView, zoo._randn(2, 3, 6, 6))
    backend = L.get_backend(backend_name)
    reference = zoo.reference_model(case, backend)
    lowered = backend.lower(reference)
    report = L.lowering_report(lowered)
    assert any("reshape on uint8 codes" in what for _, what in report.lowered)
    x = case.inputs(3)
    out_dq = next(n for n in reference.graph.nodes if n.op == "output").args[0]
    step = float(getattr(reference, str(out_dq.args[1].target)))  # the fc output's scale
    assert (lowered(*x) - reference(*x)).abs().max() <= step + 1e-6  # within one code


class ConvFeatures(torch.nn.Module):
    """A feature extractor: the model output is a conv output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


@pytest.mark.parametrize("backend_name", NUMBA)
def test_model_outputs_are_c_contiguous_like_the_reference(backend_name: str):
    case = zoo.Case("conv_features", ConvFeatures, zoo._randn(2, 3, 6, 6))
    backend = L.get_backend(backend_name)
    reference = zoo.reference_model(case, backend)
    lowered = backend.lower(reference)
    x = case.inputs(4)
    out, ref = lowered(*x), reference(*x)
    assert out.is_contiguous()
    assert out.view(2, -1).shape == ref.view(2, -1).shape  # user code may view an output
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
