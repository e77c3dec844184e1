"""Lowered convs through ``kernels.PreparedConv`` against the full ``kernels.conv2d`` call.

For each network (torchvision architectures written in the repository's
``tests/real_models.py``, seeded weights, batch 1, 3x224x224) this lowers one model with the
numba backend and times the whole model, interleaved round by round in one process, with its
conv modules (``QuantizedConv``) running:

* ``conv2d``: every call through ``kernels.conv2d`` (argument checks, plan lookup), as before
  ``PreparedConv``;
* ``prepared``: what the modules do now, ``PreparedConv`` (the plan of the module's one input
  layout, called directly).

It checks that both give the same output bit for bit and prints the best ms of each.

    python packages/lowering/bench/bench_prepared_conv.py [--models mobilenet_v2 ...]
        [--rounds 40] [--threads 1]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from quantbridge import kernels as K
from quantbridge.lowering._modules import QuantizedConv

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, however it is run
from bench_array_forward import lowered_cnn, main


def _through_conv2d(module: QuantizedConv) -> Callable[..., Any]:
    def forward_arrays(*arrays: Any) -> Any:
        return K.conv2d(
            arrays[0], module._packed, *module.input_qparams, *module.conv_qparams,
            relu=module.relu, channels_last=True, lut=module._act_table,
        )  # fmt: skip

    return forward_arrays


def run(name: str, rounds: int) -> None:
    lowered, x = lowered_cnn(name)
    convs = [m for m in lowered.modules() if type(m) is QuantizedConv]
    full = [_through_conv2d(m) for m in convs]

    def use(label: str) -> None:
        for module, forward_arrays in zip(convs, full, strict=True):
            if label == "conv2d":
                module.forward_arrays = forward_arrays  # type: ignore[method-assign]
            else:
                module.__dict__.pop("forward_arrays", None)

    best = {"conv2d": float("inf"), "prepared": float("inf")}
    with torch.no_grad():
        outs = {}
        for label in best:
            use(label)
            outs[label] = lowered(x)
        if not torch.equal(outs["conv2d"], outs["prepared"]):
            raise SystemExit(f"{name}: the two paths disagree")
        for _ in range(rounds):
            for label in best:
                use(label)
                lowered(x)  # the switch's first call re-plans nothing, but warms up
                t0 = time.perf_counter()
                lowered(x)
                best[label] = min(best[label], (time.perf_counter() - t0) * 1e3)
    change = (best["prepared"] / best["conv2d"] - 1) * 100
    print(
        f"{name:20} {len(convs)} convs | conv2d {best['conv2d']:.2f} ms | "
        f"prepared {best['prepared']:.2f} ms | {change:+.1f} %"
    )


if __name__ == "__main__":
    main(run, __doc__)
