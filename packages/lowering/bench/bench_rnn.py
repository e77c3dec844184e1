"""Dynamic int8 LSTM / GRU: the numba backend against torch.ao's quantize_dynamic, side by side.

    python packages/lowering/bench/bench_rnn.py [--threads 1] [--rounds 15]

One process, interleaved rounds (fp32, torch.ao dynamic, quantbridge numba), the same thread
count for all; prints the median ms per forward and the ratios, with the load average.
Shape: 2 layers, input and hidden 512, sequence 64, batch 8 (batch_first=False).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

import quantbridge.lowering as L
from quantbridge.fx_quant import prepare_fx


class _Model(nn.Module):
    def __init__(self, cls: type[nn.Module]) -> None:
        super().__init__()
        self.rnn = cls(512, 512, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.rnn(x)[0]
        return out


def _torch_ao(model: nn.Module) -> nn.Module:
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized: nn.Module = quantize_dynamic(model, {nn.LSTM, nn.GRU}, dtype=torch.qint8)
    return quantized


def _quantbridge(model: nn.Module, x: torch.Tensor) -> nn.Module:
    backend = L.get_backend("numba")
    mapping = backend.qconfig_mapping(dynamic=True)  # per-channel weights, 7-bit on avx2
    prepared = prepare_fx(model, mapping, (x,), backend_config=backend.backend_config)
    prepared(x)
    return backend.convert(prepared)


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads={args.threads}, load average {os.getloadavg()}")
    print(
        "| model | fp32 ms | torch.ao dynamic ms | quantbridge ms | vs torch.ao | vs fp32 "
        "| max abs diff vs fp32 (torch.ao / quantbridge) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for cls in (nn.LSTM, nn.GRU):
        torch.manual_seed(0)
        model = _Model(cls).eval()
        x = torch.randn(64, 8, 512)
        variants = {"fp32": model, "torch.ao": _torch_ao(model), "qb": _quantbridge(model, x)}
        times: dict[str, list[float]] = {k: [] for k in variants}
        outs = {}
        with torch.no_grad():
            for name, m in variants.items():
                outs[name] = m(x)  # warm up (numba compiles on first call)
            for _ in range(args.rounds):
                for name, m in variants.items():
                    times[name].append(_time(lambda m=m, x=x: m(x)))
        med = {k: statistics.median(v) for k, v in times.items()}
        err_ao = float((outs["torch.ao"] - outs["fp32"]).abs().max())
        err_qb = float((outs["qb"] - outs["fp32"]).abs().max())
        print(
            f"| {cls.__name__} | {med['fp32']:.1f} | {med['torch.ao']:.1f} | {med['qb']:.1f} | "
            f"{med['torch.ao'] / med['qb']:.2f}x | {med['fp32'] / med['qb']:.2f}x | "
            f"{err_ao:.4f} / {err_qb:.4f} |"
        )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
