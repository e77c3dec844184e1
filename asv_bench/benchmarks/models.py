"""End-to-end models, one forward pass per column: fp32 eager and every lowering backend.

The reference model is built in ``setup`` (prepare_fx, two calibration batches, convert: about
0.3-0.8 s per model here) rather than in ``setup_cache``: asv pickles ``setup_cache`` results,
and torch.fx cannot pickle graphs that call the ``torch.ops.quantbridge`` custom ops.
"""

from __future__ import annotations

from typing import ClassVar

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


class Models:
    params: ClassVar[list[list[str]]] = [MODEL_BACKENDS, list(MODELS)]
    param_names: ClassVar[list[str]] = ["backend", "model"]
    timeout = 300

    def setup(self, backend: str, model: str) -> None:
        require_backend(backend)
        single_thread()
        torch.set_grad_enabled(False)
        self.x = example_input(model)
        reference = None if backend == "fp32" else reference_model(model)
        self.run = lowered(backend, model, reference)
        self.run(self.x)  # JIT / first-call costs outside the timing

    def time_forward(self, backend: str, model: str) -> None:
        self.run(self.x)

    def peakmem_forward(self, backend: str, model: str) -> None:
        self.run(self.x)

    def track_speedup_vs_fp32(self, backend: str, model: str) -> float:
        baseline = fp32_model(model)
        x, run = self.x, self.run
        baseline(x)
        return interleaved_ratio(lambda: baseline(x), lambda: run(x), rounds=3)

    track_speedup_vs_fp32.unit = "x"  # type: ignore[attr-defined]
