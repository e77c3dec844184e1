"""End-to-end models, one forward pass per column: fp32 eager, every lowering backend, peers.

The reference model is built in ``setup`` (prepare_fx, two calibration batches, convert: about
0.3-0.8 s per model here) rather than in ``setup_cache``: asv pickles ``setup_cache`` results,
and torch.fx cannot pickle graphs that call the ``torch.ops.quantbridge`` custom ops.

The peers (``_peers.PEERS``) are reference rows on the same pages, calibrated on the same
batches. The file-based ones (ONNX Runtime and OpenVINO int8) are exported and quantized once
per run in ``setup_cache`` (files in asv's cache directory, the benchmarks' working directory);
a peer that is not installed, or fails to quantize or run a model on this machine, is skipped
(n/a) in ``setup``, the reason in the run's output (``asv: skipped: ...``, with the traceback).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch

from ._common import (
    MODEL_BACKENDS,
    example_input,
    fp32_model,
    interleaved_ratio,
    lowered,
    reference_model,
    require_backend,
    single_thread,
)
from ._models import MODELS
from ._peers import FILE_PEERS, PEERS, build_file, file_runner, torch_ao_x86

CALIB_SEEDS = (1, 2)  # the calibration batches of _common.prepare, for every peer too


def build_peer_files() -> dict[str, str]:
    """Every file peer's int8 model of every model: ``"peer/model"`` -> path, or why not."""
    single_thread()
    files: dict[str, str] = {}
    for peer in FILE_PEERS:
        for name, (_, _, mode) in MODELS.items():
            key = f"{peer}/{name}"
            try:
                path = build_file(
                    peer,
                    fp32_model(name),
                    mode,
                    example_input(name),
                    [example_input(name, s) for s in CALIB_SEEDS],
                    Path("peers") / peer / name,
                )
                files[key] = str(path.resolve())
            except NotImplementedError as e:
                files[key] = f"skip: {e}"
            except Exception as e:  # reported in setup; the other columns still run
                traceback.print_exc()
                files[key] = f"failed: {type(e).__name__}: {e}"
    return files


class Models:
    params: ClassVar[list[list[str]]] = [MODEL_BACKENDS, list(MODELS)]
    param_names: ClassVar[list[str]] = ["backend", "model"]
    timeout = 300

    def setup_cache(self) -> dict[str, str]:
        return build_peer_files()

    setup_cache.timeout = 1200  # type: ignore[attr-defined]

    def setup(self, peer_files: dict[str, str], backend: str, model: str) -> None:
        require_backend(backend)
        single_thread()
        torch.set_grad_enabled(False)
        self.x = example_input(model)
        if backend in PEERS:
            self.run = self._peer(peer_files, backend, model)
        else:
            reference = None if backend == "fp32" else reference_model(model)
            self.run = lowered(backend, model, reference)
            self.run(self.x)  # JIT / first-call costs outside the timing

    def _peer(self, peer_files: dict[str, str], peer: str, model: str) -> Callable[..., Any]:
        """The peer's int8 model, called once; NotImplementedError (skipped) when the peer is
        missing or cannot quantize, compile or run ``model`` here. Seen: OpenVINO 2026.4.1's
        CPU plugin refuses to compile the int8 digits CNN ("No suitable implementations") in
        its default inference precision on an AVX-512 BF16 EPYC, bf16 (f32 compiles)."""
        try:
            run = self._build_peer(peer_files, peer, model)
            run(self.x)  # first-call costs outside the timing
        except NotImplementedError:
            raise
        except Exception as e:
            traceback.print_exc()
            reason = f"{peer} fails on {model} here: {type(e).__name__}: {' '.join(str(e).split())}"
            raise NotImplementedError(reason) from e
        return run

    def _build_peer(self, peer_files: dict[str, str], peer: str, model: str) -> Callable[..., Any]:
        if peer in FILE_PEERS:
            built = peer_files[f"{peer}/{model}"]
            if built.startswith(("skip: ", "failed: ")):
                raise NotImplementedError(f"{peer} on {model}: {built}")
            run = file_runner(peer, Path(built), self.x)
            return lambda x: run()  # bound to self.x, the input every column gets
        mode = MODELS[model][2]
        calib = [(example_input(model, s),) for s in CALIB_SEEDS]
        return torch_ao_x86(fp32_model(model), mode, (self.x,), calib)

    def time_forward(self, peer_files: dict[str, str], backend: str, model: str) -> None:
        self.run(self.x)

    def peakmem_forward(self, peer_files: dict[str, str], backend: str, model: str) -> None:
        self.run(self.x)

    def track_speedup_vs_fp32(self, peer_files: dict[str, str], backend: str, model: str) -> float:
        baseline = fp32_model(model)
        x, run = self.x, self.run
        baseline(x)
        return interleaved_ratio(lambda: baseline(x), lambda: run(x), rounds=3)

    track_speedup_vs_fp32.unit = "x"  # type: ignore[attr-defined]
