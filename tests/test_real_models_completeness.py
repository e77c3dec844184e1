"""torchvision-style CNNs (tests/real_models.py) through the numba backend, static and dynamic:
every part of the reference model that carries quantization is lowered or listed in
``lowering_report(model).kept`` (the invariant of the lowering tests' completeness check)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# helpers, under --import-mode=importlib: the CNNs, and the lowering tests' invariant
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
if str(Path(__file__).parents[1] / "packages/lowering/tests") not in sys.path:
    sys.path.insert(0, str(Path(__file__).parents[1] / "packages/lowering/tests"))
import real_models as zoo
from test_lowering_completeness import _dynamic_mapping, _lower, unreported

from quantbridge.lowering import get_backend, lowering_report

_CASES = [(name, mode) for name in zoo.MODELS for mode in ("static", "dynamic")]


@pytest.mark.parametrize(("name", "mode"), _CASES, ids=[f"{n}-{m}" for n, m in _CASES])
def test_real_models_nothing_left_float_silently(name: str, mode: str) -> None:
    mapping = get_backend("numba").qconfig_mapping() if mode == "static" else _dynamic_mapping()
    data = [(zoo.example_input(seed),) for seed in range(1, 3)]
    reference, lowered = _lower(zoo.build(name), mapping, (zoo.example_input(0),), data)
    assert unreported(lowered) == [], str(lowering_report(lowered))
    # the check is about something: static lowers the convs, dynamic the classifier Linears
    kernel = "kernels.conv2d" if mode == "static" else "kernels.linear_dynamic"
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in zoo.build(name).modules())
    lowered_as = [what for _, what in lowering_report(lowered).lowered]
    if mode == "static":
        assert any(what.startswith(kernel) for what in lowered_as)
    else:
        assert sum(what.startswith(kernel) for what in lowered_as) == n_linear
    with torch.no_grad():
        x = zoo.example_input(5)
        assert lowered(x).shape == reference(x).shape
