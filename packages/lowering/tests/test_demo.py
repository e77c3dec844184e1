"""Smoke runs of examples/demo.py (tiny epochs): the table prints and the accuracy check bites."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.fx import GraphModule

from quantbridge.lowering import Backend, get_backend, register_backend, unregister_backend

DEMO = Path(__file__).resolve().parents[3] / "examples" / "demo.py"
TINY = ["--epochs", "2", "--qat-epochs", "1", "--calib-batches", "1", "--repeats", "1"]

pytest.importorskip("sklearn")
if not DEMO.exists():
    pytest.skip(f"{DEMO} is not part of this checkout", allow_module_level=True)


def _demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("quantbridge_demo", DEMO)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_prints_a_row_per_backend_and_mode(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.argv", ["demo.py", *TINY, "--backends", "reference"])
    assert _demo().main() == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("fp32", "reference"))]
    assert [r[:2] for r in rows] == [["fp32", "eager"], ["reference", "PTQ"], ["reference", "QAT"]]
    assert all(r[-2].endswith("x") for r in rows)  # speedup column, then size


class _ZeroBackend(Backend):
    """A "numba" backend whose lowered model predicts class 0 for everything."""

    def lower(self, reference_model: GraphModule) -> GraphModule:
        self._check_lowerable(reference_model)
        graph = reference_model.graph
        out = next(n for n in graph.nodes if n.op == "output")
        with graph.inserting_before(out):
            zeros = graph.call_function(torch.zeros_like, (out.args[0],))
        out.args = (zeros,)
        reference_model.recompile()
        return reference_model


def test_demo_fails_when_a_numba_backend_loses_accuracy(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = get_backend("reference").backend_config
    backend = _ZeroBackend("numba_zero_for_test", config)
    register_backend(backend)
    try:
        monkeypatch.setattr("sys.argv", ["demo.py", *TINY, "--backends", "numba_zero_for_test"])
        assert _demo().main() == 1
    finally:
        unregister_backend(backend.name)
    assert "FAILED: accuracy drop over 1.0 pp: numba_zero_for_test PTQ loses" in (
        capsys.readouterr().out
    )
