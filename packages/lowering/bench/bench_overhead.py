"""Per-op Python overhead of lowered modules: module call vs. the bare kernel call.

For each lowered op kind, on a tiny input (so the kernel's own work is small), time
``module(x)`` and the kernel function it wraps called directly on preconverted numpy arrays,
side by side in one run; the difference is what the lowered module adds (tensor → numpy view,
qparam lookups, result wrapping, nn.Module call machinery). Prints a table of medians in µs.

    python packages/lowering/bench/bench_overhead.py [--repeat 2000] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from quantbridge import kernels as K
from quantbridge.lowering import _modules as lm


def _median_us(fn: Callable[[], Any], repeat: int) -> float:
    for _ in range(50):
        fn()
    samples = []
    batch = 20
    for _ in range(max(1, repeat // batch)):
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter_ns() - t0) / batch / 1000.0)
    return statistics.median(samples)


def _cases(target: str) -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    g = torch.Generator().manual_seed(0)
    x8 = torch.randint(0, 256, (1, 16), dtype=torch.uint8, generator=g)
    w = torch.randint(-127, 128, (16, 16), dtype=torch.int8, generator=g)
    ws, wz = torch.full((16,), 0.01, dtype=torch.float64), torch.zeros(16, dtype=torch.int64)
    bias = torch.zeros(16)
    lin = lm.QuantizedLinear(w, ws, wz, bias, target, (0.02, 128), (0.05, 100))
    xn = x8.numpy()
    packed = lin._packed

    img = torch.randint(0, 256, (1, 4, 6, 6), dtype=torch.uint8, generator=g)
    cw = torch.randint(-127, 128, (4, 4, 3, 3), dtype=torch.int8, generator=g)
    conv = lm.QuantizedConv(
        cw, torch.full((4,), 0.01, dtype=torch.float64), torch.zeros(4, dtype=torch.int64),
        torch.zeros(4), target, (0.02, 128), (0.05, 100), stride=(1, 1), padding=(1, 1),
        dilation=(1, 1), groups=1,
    )  # fmt: skip
    imgn = img.numpy()

    add = lm.QuantizedBinary("add", target, (0.02, 128), (0.03, 120), (0.05, 100))
    b8 = torch.randint(0, 256, (1, 16), dtype=torch.uint8, generator=g)
    bn = b8.numpy()

    table = torch.from_numpy(np.arange(256, dtype=np.uint8)[::-1].copy())
    lut = lm.QuantizedLookupTable(table, "test", target, (0.02, 128), (0.02, 128))
    tn = table.numpy()

    pool = lm.QuantizedMaxPool2d((2, 2), (2, 2), (0, 0), (1, 1), False, target)

    return [
        (
            "linear 1x16x16",
            lambda: lin(x8),
            lambda: K.linear(xn, packed, 0.02, 128, 0.05, 100),
        ),
        (
            "conv2d 1x4x6x6 k3",
            lambda: conv(img),
            lambda: K.conv2d(imgn, conv._packed, 0.02, 128, 0.05, 100, channels_last=True),
        ),
        (
            "add 1x16",
            lambda: add(x8, b8),
            lambda: K.add(xn, (0.02, 128), bn, (0.03, 120), (0.05, 100), target=target),
        ),
        ("lut 1x16", lambda: lut(x8), lambda: K.apply_lut(xn, tn, target=target)),
        (
            "max_pool2d 1x4x6x6",
            lambda: pool(img),
            lambda: K.max_pool2d(imgn, (2, 2), (2, 2), (0, 0), (1, 1), False, target=target),
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--target", default=None, help="kernel target (default: best)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    target = K.resolve_target(args.target)
    torch.set_num_threads(1)  # lowered modules and (lowering imported) kernels follow it
    rows = []
    with torch.no_grad():
        for name, module_call, kernel_call in _cases(target):
            mod_us = _median_us(module_call, args.repeat)
            ker_us = _median_us(kernel_call, args.repeat)
            rows.append({"op": name, "module_us": mod_us, "kernel_us": ker_us,
                         "overhead_us": mod_us - ker_us})  # fmt: skip
    if args.json:
        json.dump({"target": target, "rows": rows}, sys.stdout, indent=2)
        print()
        return 0
    print(f"per-op overhead of lowered modules (target={target}, 1 thread, median µs)")
    print(f"{'op':<22}{'module':>10}{'kernel':>10}{'overhead':>10}")
    for r in rows:
        print(f"{r['op']:<22}{r['module_us']:>10.2f}{r['kernel_us']:>10.2f}"
              f"{r['overhead_us']:>10.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
