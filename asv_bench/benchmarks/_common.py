"""Backend lists, model preparation and timing helpers shared by the benchmark modules.

Everything runs on one thread (torch and the numba kernels): the machine is shared and
one-thread numbers are the steadier ones to track across commits.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from quantbridge import kernels
from quantbridge.fx_quant import calibrate, convert_to_reference_fx, prepare_fx
from quantbridge.lowering import available_backends, get_backend
from quantbridge.qconfig import QConfigMapping, default_dynamic_qconfig

from ._models import MODELS
from ._peers import PEERS

# Kernel targets, fixed so the parameter grid is the same on every machine; a target this
# CPU lacks is skipped in setup (asv shows it as n/a).
NUMBA_BACKENDS = [f"numba_{t}" for t in kernels.TARGETS]
# quantbridge's lowering backends (plugins and the ``numba`` alias are left out: the alias is
# one of the numba_* targets): the columns of the flow benchmarks, which time quantbridge's
# own steps (a peer has no ``get_backend`` name, nor a lowering step of its own).
LOWERING_BACKENDS = ["reference", *NUMBA_BACKENDS, "torch_native"]
# Model-level columns: fp32 eager baseline, the lowering backends, then the peers as reference
# rows (torch.ao x86, ONNX Runtime int8, OpenVINO int8; see _peers.py).
MODEL_BACKENDS = ["fp32", *LOWERING_BACKENDS, *PEERS]
# Op-level columns: fp32 torch op, the reference decomposition (dequantize, fp32 op,
# quantize, on plain tensors), each numba target.
OP_BACKENDS = ["fp32", "reference", *NUMBA_BACKENDS]


def single_thread() -> None:
    torch.set_num_threads(1)
    kernels.set_num_threads(1)


def kernel_target(backend: str) -> str:
    """``numba_avx2`` -> ``avx2``; NotImplementedError (asv: skipped) when the CPU lacks it."""
    target = backend.removeprefix("numba_")
    if not kernels.target_supported(target):
        raise NotImplementedError(f"{backend}: this CPU lacks the {target} target")
    return target


def require_backend(backend: str) -> None:
    if backend in PEERS:
        return  # checked when the peer's model is built
    if backend.startswith("numba_"):
        kernel_target(backend)  # first: its reason names the target this CPU lacks
    if backend != "fp32" and backend not in available_backends():
        raise NotImplementedError(f"{backend}: not available here")


def _mapping(base: QConfigMapping, mode: str) -> QConfigMapping:
    if mode == "static":
        return base
    if mode == "dynamic":
        return QConfigMapping().set_object_type(nn.Linear, default_dynamic_qconfig)
    return QConfigMapping().set_object_type(nn.Linear, base.global_qconfig)


def source_backend() -> Any:
    """The backend whose qconfig mapping and BackendConfig every model is prepared with."""
    names = available_backends()
    return get_backend(next((b for b in NUMBA_BACKENDS if b in names), "reference"))


def example_input(model_name: str, seed: int = 0) -> torch.Tensor:
    shape = MODELS[model_name][1]
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def fp32_model(model_name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[model_name][0]().eval()


def prepare(model_name: str, calib_batches: int = 2) -> nn.Module:
    """prepare_fx + calibration on random batches (observers filled, not yet converted)."""
    _, _, mode = MODELS[model_name]
    source = source_backend()
    model = fp32_model(model_name)
    mapping = _mapping(source.qconfig_mapping(), mode)
    prepared = prepare_fx(
        model, mapping, (example_input(model_name),), backend_config=source.backend_config
    )
    calibrate(
        prepared, [example_input(model_name, s + 1) for s in range(calib_batches)], progress=False
    )
    return prepared


def reference_model(model_name: str) -> nn.Module:
    prepared = prepare(model_name)
    return convert_to_reference_fx(prepared, backend_config=source_backend().backend_config)


def lowered(backend: str, model_name: str, reference: nn.Module | None) -> Callable[..., Any]:
    """The model as one column runs it: fp32 eager, or the reference model lowered by a backend."""
    require_backend(backend)
    if backend == "fp32":
        return fp32_model(model_name)
    if reference is None:
        raise ValueError(f"{backend}: needs the reference model")
    result: Callable[..., Any] = get_backend(backend).lower(copy.deepcopy(reference))
    return result


def best_seconds(fn: Callable[[], object], min_time: float = 0.2, max_calls: int = 200) -> float:
    """Fastest single call seen in ``min_time`` seconds (the least disturbed one)."""
    best = float("inf")
    end = time.perf_counter() + min_time
    for _ in range(max_calls):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        best = min(best, t1 - t0)
        if t1 >= end:
            break
    return best


def interleaved_ratio(
    baseline: Callable[[], object], candidate: Callable[[], object], rounds: int = 5
) -> float:
    """baseline time / candidate time, both best-of, measured alternately in one process."""
    t_base = t_cand = float("inf")
    for _ in range(rounds):
        t_base = min(t_base, best_seconds(baseline, 0.05, 50))
        t_cand = min(t_cand, best_seconds(candidate, 0.05, 50))
    return t_base / t_cand
