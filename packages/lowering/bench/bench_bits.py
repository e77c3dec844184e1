"""Weight and activation bits of the numba backend: precision and speed side by side.

For each network (torchvision architectures written in the repository's ``tests/real_models.py``,
seeded weights, settled BatchNorm statistics, batch 1, 3x224x224) this builds, from the same
calibration images, quantbridge's lowered model for each ``qconfig_mapping(weight_bits=,
activation_bits=)`` choice and torch.ao's x86 ``convert_fx`` model, then reports:

* SQNR of the logits against fp32 on held-out random images;
* the median forward time, every column timed once per round, columns interleaved.

    python packages/lowering/bench/bench_bits.py [--models resnet18 resnet50 ...]
        [--rounds 12] [--threads 1] [--calibration 8] [--held-out 8]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantbridge.fx_quant import calibrate, prepare_fx
from quantbridge.lowering import get_backend

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "asv_bench" / "benchmarks"))
from _peers import torch_ao_x86

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
import real_models

CHOICES: dict[str, dict[str, int | None]] = {
    "default": {},
    "w8 a8": {"weight_bits": 8, "activation_bits": 8},
    "w7 a8": {"weight_bits": 7, "activation_bits": 8},
}
MODELS = ("resnet18", "mobilenet_v2", "resnet50", "efficientnet_b0", "mobilenet_v3_small")


def _sqnr(ref: np.ndarray[Any, Any], out: np.ndarray[Any, Any]) -> float:
    return float(10 * np.log10((ref**2).sum() / ((ref - out) ** 2).sum()))


def run(name: str, rounds: int, n_calib: int, n_held: int) -> None:
    model = real_models.build(name, full_size=True).eval()
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(1, 3, 224, 224, generator=g) for _ in range(n_calib)]
    held = [torch.randn(1, 3, 224, 224, generator=g) for _ in range(n_held)]
    backend = get_backend("numba")
    columns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for label, options in CHOICES.items():
        prepared = prepare_fx(
            copy.deepcopy(model),
            backend.qconfig_mapping(**options),  # type: ignore[arg-type]
            (held[0],),
            backend_config=backend.backend_config,
        )
        calibrate(prepared, [(c,) for c in calib], progress=False)
        columns[f"quantbridge {label}"] = backend.convert(prepared)
    columns["torch.ao x86"] = torch_ao_x86(model, "static", (held[0],), [(c,) for c in calib])
    with torch.no_grad():
        ref = np.concatenate([model(h).numpy() for h in held])
        for label, f in columns.items():
            out = np.concatenate([f(h).numpy() for h in held])
            print(f"{name:20} {label:22} SQNR {_sqnr(ref, out):5.1f} dB", flush=True)
        x = held[0]
        for f in columns.values():
            f(x)
        times: dict[str, list[float]] = {k: [] for k in columns}
        for _ in range(rounds):
            for label, f in columns.items():
                t = time.perf_counter()
                f(x)
                times[label].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ao = med["torch.ao x86"]
    cells = ", ".join(f"{k} {v:.2f} ms ({ao / v:.2f}x torch.ao)" for k, v in med.items())
    print(f"{name:20} {cells}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calibration", type=int, default=8)
    parser.add_argument("--held-out", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"numba target {get_backend('numba').target}, {args.threads} thread(s)")
    for name in args.models:
        run(name, args.rounds, args.calibration, args.held_out)


if __name__ == "__main__":
    main()
