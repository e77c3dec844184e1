"""The test zoo's exported files in ONNX Runtime and OpenVINO, against the reference model.

Run by ``nox -s bench_onnx -- --zoo [NAME ...]`` (OpenVINO is installed in the bench sessions only):
every model of the tests' zoo (the torchvision-style CNNs, the BERT encoder with outlier
channels, the lowering zoo's cases: LSTM, dynamic transformer, embeddings, ...) is quantized
as ``tests/quantized_zoo.py`` quantizes it, exported with ``export_onnx`` and run by ONNX
Runtime (optimizations off: the file's ops as written; and on: its integer kernels) and by
OpenVINO. Prints, per model and runtime, the max distance from the reference model's output
in steps of its coarsest activation scale (for dynamic and weight-only cases: relative to the
output's largest magnitude) and the SQNR against it.

Exits 1 if a runtime fails, or:
- the file as written (ONNX Runtime without optimizations: the QDQ ops, in float) is more than
  one step away (two for a model that multiplies two activations,
  ``quantized_zoo.runtime_tolerance_steps``);
- ONNX Runtime's optimized graph or OpenVINO, which run static models on integer kernels that
  requantize by their own rounding (so a deep network's output may drift past a step), stays
  below MIN_SQNR_DB of the reference, as in tests/test_onnx_zoo.py; on dynamic and
  weight-only models they compute in float and are held to the step tolerance.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT / "tests")]
import onnx_sessions  # noqa: E402
import quantized_zoo  # noqa: E402
from bench_onnx_export import coarsest_activation_scale  # noqa: E402
from bench_peers import sqnr  # noqa: E402

import quantbridge.fx_quant as fq  # noqa: E402
import quantbridge.kernels as qk  # noqa: E402

# float32 slack on a runtime's distance from the reference, in steps
SLACK = 1.0 + 1e-5
# the least SQNR against the reference of a runtime that requantizes in integer kernels
MIN_SQNR_DB = 20.0


def _first(out: Any) -> np.ndarray:
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.detach().numpy() if isinstance(out, torch.Tensor) else np.asarray(out)


def _runtimes(path: Path) -> dict[str, Callable[[tuple[torch.Tensor, ...]], np.ndarray]]:
    import openvino as ov

    def ort_session(optimized: bool) -> Callable[[tuple[torch.Tensor, ...]], np.ndarray]:
        session = onnx_sessions.session(path, optimized)
        return lambda xs: onnx_sessions.run(session, xs).numpy()

    def openvino() -> Callable[[tuple[torch.Tensor, ...]], np.ndarray]:
        # f32: OpenVINO's default on CPUs with AVX-512 BF16 runs the float ops in bfloat16;
        # group size 0: no quantizing of a MatMul's float input by OpenVINO itself, which it
        # does where int8 weights meet the dynamic models' dequantized activations
        config = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
        compiled = ov.Core().compile_model(str(path), "CPU", config)
        return lambda xs: _first(list(compiled([x.numpy() for x in xs]).values()))

    return {
        "ORT as written": ort_session(False),
        "ORT optimized": ort_session(True),
        "OpenVINO": openvino(),
    }


def main(names: list[str]) -> int:
    print(f"kernel target {qk.best_target()}", flush=True)
    rows, failed = [], False
    for model in quantized_zoo.zoo_models():
        name, static = model.name, model.static
        if names and name not in names:
            continue
        reference, inputs = model.build()
        with torch.no_grad():
            want = _first(reference(*inputs))
        step = coarsest_activation_scale(reference) if static else 1e-5 * float(np.abs(want).max())
        tolerance = (quantized_zoo.runtime_tolerance_steps(reference) if static else 1.0) * SLACK
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "model.onnx"
            cells = []
            try:
                fq.export_onnx(reference, inputs, path)
                runtimes = _runtimes(path)
            except Exception as e:
                print(f"{name}: export or load failed: {type(e).__name__}: {e}", flush=True)
                rows.append(f"| {name} | failed | | | |")
                failed = True
                continue
            for runtime, run in runtimes.items():
                try:
                    got = run(inputs)
                    steps = float(np.abs(got - want).max()) / step
                    fidelity = sqnr(want, got)
                    if static and runtime != "ORT as written":
                        failed |= fidelity < MIN_SQNR_DB
                    else:
                        failed |= steps > tolerance
                    cells.append(f"{steps:.3f} ({fidelity:.1f} dB)")
                except Exception as e:
                    print(f"{name}, {runtime}: {type(e).__name__}: {e}", flush=True)
                    cells.append("failed")
                    failed = True
        rows.append(f"| {name} | {' | '.join(cells)} | {tolerance:.0f} |")
        print(rows[-1], flush=True)
    print(
        "\n| model | steps (SQNR vs reference): ORT as written | ORT optimized | OpenVINO "
        "| step tolerance |"
        "\n| --- | --- | --- | --- | --- |"
    )
    print("\n".join(rows))
    print("\nbeyond tolerance or failed" if failed else "\nall within tolerance")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
