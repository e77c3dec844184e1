"""Peer runtimes as runnable columns: torch.ao x86, ONNX Runtime int8, OpenVINO int8 (NNCF).

Shared by the asv suite (reference rows beside every backend in ``models.Models``) and by
``packages/lowering/bench/bench_peers.py``, so both quantize the peers the same way:

* ``torch_ao_x86``: torch.ao's ``prepare_fx``/``convert_fx`` with the x86 engine and its
  default qconfig mapping (dynamic: ``default_dynamic_qconfig`` on Linear);
* ``onnxruntime_int8``: ``torch.onnx.export`` (fixed shapes), then ``quantize_static`` (QDQ,
  per-channel int8 weights, uint8 activations, after ORT's ``quant_pre_process``) or
  ``quantize_dynamic``; sessions with ``intra_op_num_threads`` set and spin-waiting off;
* ``openvino_int8``: ``openvino.convert_model`` of the torch model, ``nncf.quantize`` (with
  ``ModelType.TRANSFORMER`` for transformer models), compiled with ``INFERENCE_NUM_THREADS``,
  the latency hint and one stream.

Every peer is imported lazily (asv's forkserver imports this module before forking: no thread
may start at import) and is optional: a missing one raises ``NotImplementedError``, which asv
shows as a skipped (n/a) combination.
"""

from __future__ import annotations

import copy
import importlib
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import nn

PEERS = ["torch_ao_x86", "onnxruntime_int8", "openvino_int8"]
# A runner calls the model once on its bound input and returns the output as numpy.
Runner = Callable[[], np.ndarray]


def require(module: str) -> ModuleType:
    """Import a peer, or NotImplementedError (asv: skipped) when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise NotImplementedError(f"{module} is not installed ({e})") from e


def to_numpy(out: Any) -> np.ndarray:
    """The first tensor of a model output (tensor, tuple, ModelOutput, dict) as float32 numpy."""
    if hasattr(out, "last_hidden_state"):
        out = out.last_hidden_state
    elif isinstance(out, dict):
        out = next(iter(out.values()))
    while isinstance(out, tuple | list):
        out = out[0]
    if isinstance(out, torch.Tensor):
        return np.asarray(out.detach().float().numpy())
    return np.asarray(out, dtype=np.float32)


# --- torch.ao ---------------------------------------------------------------------------------


def quiet_torch_ao() -> None:
    """Silence torch.ao's own deprecation notices (they would drown a results table)."""
    for message in (
        ".*torch.ao.quantization is deprecated",
        ".*reduce_range will be deprecated",
        ".*quantized tensor creation functions",
        ".*torch.quantize_per_tensor",
    ):
        warnings.filterwarnings("ignore", message=message)


def torch_ao_x86(
    model: nn.Module, mode: str, example: tuple[Any, ...], calib: Sequence[tuple[Any, ...]]
) -> nn.Module:
    """torch.ao's ``convert_fx`` model on the x86 engine (``mode``: static, dynamic,
    static_linear), calibrated on ``calib``; NotImplementedError when torch lacks torch.ao."""
    require("torch.ao.quantization.backend_config.utils")  # 2.13: import order quirk
    ao_fx = require("torch.ao.quantization.quantize_fx")
    ao_q = require("torch.ao.quantization")
    ao_x86 = require("torch.ao.quantization.backend_config.x86")
    quiet_torch_ao()
    torch.backends.quantized.engine = "x86"
    default = ao_q.get_default_qconfig_mapping("x86")
    if mode == "static":
        mapping = default
    elif mode == "dynamic":
        mapping = ao_q.QConfigMapping().set_object_type(nn.Linear, ao_q.default_dynamic_qconfig)
    else:
        mapping = ao_q.QConfigMapping().set_object_type(nn.Linear, default.global_qconfig)
    config = ao_x86.get_x86_backend_config()
    prepared = ao_fx.prepare_fx(copy.deepcopy(model), mapping, example, backend_config=config)
    with torch.no_grad():
        for args in calib:
            prepared(*args)
    converted: nn.Module = ao_fx.convert_fx(prepared, backend_config=config)
    return converted


# --- ONNX Runtime -----------------------------------------------------------------------------


def onnx_export(
    model: nn.Module, args: tuple[torch.Tensor, ...], names: Sequence[str], path: Path
) -> Path:
    """``torch.onnx.export`` with the shapes of ``args`` fixed (one file per input size)."""
    require("onnxscript")  # torch.onnx's exporter
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, args, str(path), input_names=list(names), output_names=["output"], dynamo=True
        )
    return path


def ort_quantize_static(
    fp32: Path,
    calib: Sequence[dict[str, np.ndarray]],
    out: Path,
    op_types: Sequence[str] | None = None,
) -> Path:
    """ORT ``quantize_static``: QDQ, per-channel int8 weights, uint8 activations."""
    q = require("onnxruntime.quantization")
    source = fp32
    try:  # ORT's recommended pre-processing (shape inference, graph optimization)
        pre = out.with_suffix(".pre.onnx")
        q.shape_inference.quant_pre_process(str(fp32), str(pre))
        source = pre
    except Exception as e:  # optional: quantize the exported model as it is
        warnings.warn(f"ORT quant_pre_process skipped: {type(e).__name__}: {e}", stacklevel=2)

    class Reader(q.CalibrationDataReader):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            self.feeds = iter(calib)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.feeds, None)

    q.quantize_static(
        str(source),
        str(out),
        Reader(),
        quant_format=q.QuantFormat.QDQ,
        per_channel=True,
        activation_type=q.QuantType.QUInt8,
        weight_type=q.QuantType.QInt8,
        op_types_to_quantize=list(op_types) if op_types else None,
    )
    return out


def ort_quantize_dynamic(fp32: Path, out: Path) -> Path:
    """ORT ``quantize_dynamic`` with int8 weights."""
    q = require("onnxruntime.quantization")
    q.quantize_dynamic(str(fp32), str(out), weight_type=q.QuantType.QInt8)
    return out


def ort_runner(path: Path, feeds: dict[str, np.ndarray], threads: int) -> Runner:
    """An ORT session on ``threads`` intra-op threads running the bound ``feeds``."""
    ort = require("onnxruntime")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # an idle session must not spin on the core the next measured column needs
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    bound = {k: v for k, v in feeds.items() if k in names}
    return lambda: np.asarray(session.run(None, bound)[0])


# --- OpenVINO ---------------------------------------------------------------------------------


def openvino_int8(
    model: nn.Module,
    example: dict[str, torch.Tensor] | torch.Tensor | tuple[torch.Tensor, ...],
    calib: Sequence[Any],
    transformer: bool = False,
) -> Any:
    """``nncf.quantize`` of ``openvino.convert_model(model)``, calibrated on ``calib`` (numpy
    feeds, one per batch): the int8 OpenVINO model."""
    ov = require("openvino")
    nncf = require("nncf")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ov_model = ov.convert_model(model, example_input=example)
    extra = {"model_type": nncf.ModelType.TRANSFORMER} if transformer else {}
    return nncf.quantize(ov_model, nncf.Dataset(list(calib)), subset_size=len(calib), **extra)


def _openvino_request(
    ov_model: Any, feeds: dict[str, np.ndarray], threads: int, perf_count: bool = False
) -> tuple[Any, list[np.ndarray]]:
    """An infer request of ``ov_model`` compiled for the CPU on ``threads`` threads (latency
    hint, one stream; ``perf_count``: with per-layer counters), and ``feeds`` in its input
    order."""
    ov = require("openvino")
    config: dict[str, Any] = {
        "INFERENCE_NUM_THREADS": threads,
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": 1,
    }
    if perf_count:
        config["PERF_COUNT"] = True
    compiled = ov.Core().compile_model(ov_model, "CPU", config)
    names = [p.get_any_name() for p in compiled.inputs]
    # by name when the converted model kept the torch argument names, else in order
    bound = [feeds[n] for n in names] if set(names) <= set(feeds) else list(feeds.values())
    return compiled.create_infer_request(), bound


def openvino_runner(ov_model: Any, feeds: dict[str, np.ndarray], threads: int) -> Runner:
    """``ov_model`` compiled for the CPU on ``threads`` threads, running the bound ``feeds``."""
    request, bound = _openvino_request(ov_model, feeds, threads)

    def run() -> np.ndarray:
        request.infer(bound)
        return np.array(request.get_output_tensor(0).data, dtype=np.float32)

    return run


def openvino_layer_times(
    ov_model: Any, feeds: dict[str, np.ndarray], threads: int
) -> Callable[[], dict[str, float]]:
    """Each call runs one inference with OpenVINO's per-layer counters and returns µs per
    layer kind (``node type (kernel)``), the rest of the call ("outside the layers") and
    ``"total"``: the call's wall time."""
    request, bound = _openvino_request(ov_model, feeds, threads, perf_count=True)

    def run() -> dict[str, float]:
        start = time.perf_counter()
        request.infer(bound)
        total = (time.perf_counter() - start) * 1e6
        parts: dict[str, float] = {}
        for layer in request.get_profiling_info():
            key = f"{layer.node_type} ({layer.exec_type})"
            parts[key] = parts.get(key, 0.0) + layer.real_time.total_seconds() * 1e6
        parts["outside the layers"] = total - sum(parts.values())
        parts["total"] = total
        return parts

    return run


# --- the asv suite's entry points ---------------------------------------------------------------

# Peers whose int8 model is a file, built once per asv run in ``Models.setup_cache``.
FILE_PEERS = ["onnxruntime_int8", "openvino_int8"]


def build_file(
    peer: str,
    model: nn.Module,
    mode: str,
    x: torch.Tensor,
    calib: Sequence[torch.Tensor],
    workdir: Path,
) -> Path:
    """Quantize ``model`` with ``peer`` (``mode`` as in ``_models.MODELS``); the int8 file.

    Transformer-shaped models (``mode`` dynamic or static_linear) quantize their Linear/MatMul
    layers only: ORT ``quantize_dynamic`` / ``quantize_static`` on MatMul and Gemm, NNCF in
    transformer mode.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    if peer == "onnxruntime_int8":
        fp32 = onnx_export(model, (x,), ["input"], workdir / "model.onnx")
        if mode == "dynamic":
            return ort_quantize_dynamic(fp32, workdir / "model.int8.onnx")
        return ort_quantize_static(
            fp32,
            [{"input": c.numpy()} for c in calib],
            workdir / "model.int8.onnx",
            op_types=None if mode == "static" else ("MatMul", "Gemm"),
        )
    if peer == "openvino_int8":
        ov = require("openvino")
        ov_model = openvino_int8(model, x, [c.numpy() for c in calib], transformer=mode != "static")
        path = workdir / "model.int8.xml"
        ov.save_model(ov_model, str(path), compress_to_fp16=False)
        return path
    raise ValueError(f"unknown file peer {peer!r}; choose from {FILE_PEERS}")


def file_runner(peer: str, path: Path, x: torch.Tensor, threads: int = 1) -> Runner:
    """A runner of the int8 file ``build_file`` wrote, bound to ``x``."""
    feeds = {"input": x.numpy()}
    if peer == "onnxruntime_int8":
        return ort_runner(path, feeds, threads)
    return openvino_runner(str(path), feeds, threads)
