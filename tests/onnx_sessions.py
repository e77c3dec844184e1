"""ONNX Runtime sessions for the ONNX checks: the file's ops as written (graph optimizations
off) or ONNX Runtime's optimized graph, on the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def session(path: Path, optimized: bool, saved: Path | None = None) -> Any:
    """An InferenceSession of ``path``; ``saved``: where to write the optimized graph."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if optimized
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    if saved is not None:
        options.optimized_model_filepath = str(saved)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run(onnx_session: Any, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The session's first output on ``inputs``, fed in the file's input order."""
    names = [i.name for i in onnx_session.get_inputs()]
    feeds = {name: x.numpy() for name, x in zip(names, inputs, strict=True)}
    return torch.from_numpy(onnx_session.run(None, feeds)[0])
