"""The model zoo through export_onnx and ONNX Runtime.

Every zoo model (``quantized_zoo``: torchvision-style CNNs, the BERT encoder with trained-like
outlier channels, a ViT, the lowering zoo's cases: LSTM, dynamic transformer, embeddings, ...)
is quantized as the numba backend quantizes it, exported, and run in ONNX Runtime:

- with ONNX Runtime's graph optimizations off, the file's own ops run as written: its outputs
  must stay within one quantization step (the model's coarsest) of the reference model;
- with them on, ONNX Runtime must fuse the quantized convs and matmuls into its integer
  kernels, and keep the reference model's outputs (its requantization rounds differently,
  so the check there is an SQNR).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.fx import GraphModule

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
import onnx_sessions
import quantized_zoo
from test_lowering_numerics import _coarsest_step

import quantbridge.fx_quant as fq

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

# ONNX Runtime's integer kernels: convs, GEMMs, matmuls (static and dynamic), attention
INTEGER_OPS = {
    "QLinearConv",
    "QGemm",
    "QLinearMatMul",
    "MatMulInteger",
    "MatMulIntegerToFloat",
    "DynamicQuantizeMatMul",
    "QAttention",
}
# float convs and weight GEMMs (a float MatMul of two activations, attention's, may remain)
FLOAT_KERNELS = {"Conv", "FusedConv", "Gemm", "FusedGemm"}


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _sqnr(got: torch.Tensor, want: torch.Tensor) -> float:
    noise = (got - want).pow(2).sum()
    return float(10 * torch.log10(want.pow(2).sum() / noise)) if noise > 0 else float("inf")


def _export_and_check(
    reference: GraphModule,
    inputs: tuple[torch.Tensor, ...],
    bound: float,
    tmp_path: Path,
) -> tuple[Counter[str], torch.Tensor, torch.Tensor]:
    """Export ``reference``; the file without optimizations within ``bound`` of it.
    Returns the optimized graph's op counts, its output and the reference output."""
    path = tmp_path / "model.onnx"
    fq.export_onnx(reference, inputs, path)
    with torch.no_grad():
        want = _first(reference(*inputs))
    as_written = onnx_sessions.run(onnx_sessions.session(path, optimized=False), inputs)
    assert (as_written - want).abs().max() <= bound * (1 + 1e-5)  # one step, in float32
    saved = tmp_path / "optimized.onnx"
    optimized = onnx_sessions.run(onnx_sessions.session(path, True, saved), inputs)
    ops = Counter(n.op_type for n in onnx.load(str(saved)).graph.node)
    return ops, optimized, want


@pytest.mark.parametrize("model", quantized_zoo.zoo_models(), ids=lambda m: m.name)
def test_zoo_model(model: quantized_zoo.ZooModel, tmp_path: Path) -> None:
    reference, inputs = model.build()
    # dynamic and weight-only cases have no static step; their float arithmetic is the
    # reference's up to float32 rounding
    if model.static:
        bound = _coarsest_step(reference) * quantized_zoo.runtime_tolerance_steps(reference)
    else:
        with torch.no_grad():
            bound = 1e-5 * float(_first(reference(*inputs)).abs().max())
    ops, optimized, want = _export_and_check(reference, inputs, bound, tmp_path)
    convs = sum(isinstance(m, (nn.Conv1d, nn.Conv2d)) for m in reference.modules())
    linears = sum(isinstance(m, nn.Linear) for m in reference.modules())
    if model.static:  # every conv and linear on ORT's integer kernels
        assert ops["QLinearConv"] == convs, ops
        assert sum(ops[op] for op in INTEGER_OPS) >= convs + linears, ops
        assert not FLOAT_KERNELS & set(ops), ops
    elif linears:  # dynamic quantization: integer matmuls with run-time activation qparams
        assert INTEGER_OPS & set(ops), ops
    assert _sqnr(optimized, want) >= 20
