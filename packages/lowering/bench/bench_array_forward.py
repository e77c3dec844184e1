"""A lowered model's array forward against its generated forward, side by side.

For each network (torchvision architectures written in the repository's
``tests/real_models.py``, seeded weights, settled BatchNorm statistics, batch 1, 3x224x224)
this lowers one model with the numba backend and times, interleaved in one process:

* ``generated``: the GraphModule's generated forward (``type(model).forward``), which calls
  every lowered module as a torch module on tensors;
* ``arrays``: the model itself, whose forward passes numpy arrays between kernel modules
  (``quantbridge.lowering.use_array_forward``).

It checks that both give the same output bit for bit and prints median and best ms.

    python packages/lowering/bench/bench_array_forward.py [--models resnet18 ...]
        [--rounds 40] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.fx import GraphModule

from quantbridge.fx_quant import calibrate, prepare_fx
from quantbridge.lowering import get_backend

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
import real_models

MODELS = ("mobilenet_v3_small", "efficientnet_b0", "mobilenet_v2", "resnet18")


def lowered_cnn(name: str) -> tuple[GraphModule, torch.Tensor]:
    """``name`` (seeded weights) lowered with the numba backend, and a batch-1 input."""
    model = real_models.build(name, full_size=True).eval()
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(1, 3, 224, 224, generator=g) for _ in range(4)]
    x = torch.randn(1, 3, 224, 224, generator=g)
    backend = get_backend("numba")
    prepared = prepare_fx(
        copy.deepcopy(model), backend.qconfig_mapping(), (x,), backend_config=backend.backend_config
    )
    calibrate(prepared, [(c,) for c in calib], progress=False)
    return backend.convert(prepared), x


def run(name: str, rounds: int) -> None:
    lowered, x = lowered_cnn(name)
    columns = {
        "generated": lambda: type(lowered).forward(lowered, x),
        "arrays": lambda: lowered(x),
    }
    with torch.no_grad():
        outs = {label: fn() for label, fn in columns.items()}
        if not torch.equal(outs["generated"], outs["arrays"]):
            raise SystemExit(f"{name}: the two forwards disagree")
        times: dict[str, list[float]] = {label: [] for label in columns}
        for _ in range(rounds):
            for label, fn in columns.items():
                t0 = time.perf_counter()
                fn()
                times[label].append((time.perf_counter() - t0) * 1e3)
    med = {label: statistics.median(ts) for label, ts in times.items()}
    parts = [f"{label} {med[label]:.2f} ms (best {min(times[label]):.2f})" for label in columns]
    change = (med["arrays"] / med["generated"] - 1) * 100
    print(f"{name:20} {' | '.join(parts)} | {change:+.0f} %")


def main(run: Callable[[str, int], None] = run, description: str = __doc__) -> None:
    """``--models``, ``--rounds`` and ``--threads``, then ``run(model, rounds)`` per model."""
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=real_models.MODELS)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.models:
        run(name, args.rounds)


if __name__ == "__main__":
    main()
