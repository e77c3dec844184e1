"""Flow costs: prepare_fx, convert to the reference model, lowering, and cold start."""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import ClassVar

from quantbridge.fx_quant import convert_to_reference_fx

from ._common import (
    LOWERING_BACKENDS,
    lowered,
    prepare,
    reference_model,
    require_backend,
    single_thread,
    source_backend,
)
from ._models import MODELS

# quantbridge's flow per lowering backend; the peers are compared at run time (models.Models)
QUANT_BACKENDS = LOWERING_BACKENDS


class Prepare:
    """prepare_fx + a two-batch calibration, and convert_to_reference_fx, per model."""

    params: ClassVar[list[list[str]]] = [list(MODELS)]
    param_names: ClassVar[list[str]] = ["model"]
    timeout = 300

    def setup(self, model: str) -> None:
        single_thread()
        self.prepared = prepare(model)

    def time_prepare_fx_and_calibrate(self, model: str) -> None:
        prepare(model)

    def time_convert_to_reference(self, model: str) -> None:
        convert_to_reference_fx(
            copy.deepcopy(self.prepared), backend_config=source_backend().backend_config
        )


class Lower:
    """Backend.lower on the reference model (weight packing included)."""

    params: ClassVar[list[list[str]]] = [QUANT_BACKENDS, list(MODELS)]
    param_names: ClassVar[list[str]] = ["backend", "model"]
    timeout = 300

    def setup(self, backend: str, model: str) -> None:
        require_backend(backend)
        single_thread()
        self.reference = reference_model(model)
        lowered(backend, model, self.reference)  # warm the JIT / caches once

    def time_lower(self, backend: str, model: str) -> None:
        lowered(backend, model, self.reference)


_COLD_START = """
import torch
from quantbridge.fx_quant import calibrate, convert_to_reference_fx, prepare_fx
from quantbridge.lowering import get_backend
from benchmarks._models import DigitsCNN
torch.manual_seed(0)
backend = get_backend({backend!r})
x = torch.randn(64, 1, 8, 8)
prepared = prepare_fx(DigitsCNN().eval(), backend.qconfig_mapping(), (x,),
                      backend_config=backend.backend_config)
calibrate(prepared, [x], progress=False)
reference = convert_to_reference_fx(prepared, backend_config=backend.backend_config)
with torch.no_grad():
    backend.lower(reference)(x)
"""


class ColdStart:
    """A fresh interpreter: import, quantize and lower the digits CNN, one forward pass.

    numba's on-disk cache is warmed in setup, so this is the start-up cost a user sees on the
    second run of a program (imports, cached-kernel loading, packing), not JIT compilation.
    """

    params: ClassVar[list[list[str]]] = [QUANT_BACKENDS]
    param_names: ClassVar[list[str]] = ["backend"]
    timeout = 300
    number = 1
    repeat = (1, 3, 60.0)
    warmup_time = 0.0

    def setup(self, backend: str) -> None:
        require_backend(backend)
        self.code = _COLD_START.format(backend=backend)
        self._run()  # warm numba's cache

    def _run(self) -> None:
        # benchmarks/ must be importable in the child for the model builder
        import os

        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
        subprocess.run([sys.executable, "-c", self.code], check=True, env=env)

    def time_cold_start(self, backend: str) -> None:
        self._run()
