"""Side-by-side wall time of prepare_fx + convert_to_reference_fx: quantbridge vs torch.ao.

Models: a 300-layer CNN (100 conv-bn-relu blocks) and a 12-layer transformer encoder built
from Linear/LayerNorm/matmul/softmax (traceable, so every op is visible to the flow). Both
flows get the same model, the default fbgemm qconfig mapping and their native
BackendConfig; one calibration batch runs between prepare and convert and is not timed.
Each measurement is the median of ``--repeat`` runs, alternating the two libraries.

    python packages/fx_quant/bench/bench_flow.py [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class DeepCNN(nn.Module):
    """100 conv-bn-relu blocks: 300 layers."""

    def __init__(self, blocks: int = 100, channels: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*(ConvBlock(channels) for _ in range(blocks)))
        self.head = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(torch.flatten(torch.mean(x, dim=(2, 3), keepdim=True), 1))


class EncoderLayer(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.ff1 = nn.Linear(dim, hidden)
        self.act = nn.ReLU()
        self.ff2 = nn.Linear(hidden, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.scale = 1.0 / math.sqrt(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        attn = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * self.scale, dim=-1)
        x = self.norm1(x + self.proj(torch.matmul(attn, v)))
        return self.norm2(x + self.ff2(self.act(self.ff1(x))))


class Encoder(nn.Module):
    def __init__(self, layers: int = 12) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(EncoderLayer() for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _quantbridge() -> tuple[Callable[..., Any], Callable[..., Any], Any]:
    from quantbridge.fx_quant import convert_to_reference_fx, prepare_fx
    from quantbridge.qconfig import get_default_qconfig_mapping

    return prepare_fx, convert_to_reference_fx, get_default_qconfig_mapping("fbgemm")


def _torch_ao() -> tuple[Callable[..., Any], Callable[..., Any], Any]:
    import torch.ao.quantization.backend_config.utils  # noqa: F401  (torch 2.13 getter quirk)
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_to_reference_fx, prepare_fx

    return prepare_fx, convert_to_reference_fx, get_default_qconfig_mapping("fbgemm")


def _time_once(
    flow: Callable[[], tuple[Any, Any, Any]], model: nn.Module, x: torch.Tensor
) -> tuple[float, float]:
    prepare, convert, mapping = flow()
    m = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        prepared = prepare(m, mapping, (x,))
        t1 = time.perf_counter()
        with torch.no_grad():
            prepared(x)
        t2 = time.perf_counter()
        convert(prepared)
        t3 = time.perf_counter()
    return t1 - t0, t3 - t2


def bench(name: str, model: nn.Module, x: torch.Tensor, repeat: int) -> dict[str, Any]:
    model.eval()
    results: dict[str, list[tuple[float, float]]] = {"quantbridge": [], "torch.ao": []}
    flows = {"quantbridge": _quantbridge, "torch.ao": _torch_ao}
    for flow in flows.values():  # warm-up (imports, caches)
        _time_once(flow, model, x)
    for _ in range(repeat):
        for label, flow in flows.items():
            results[label].append(_time_once(flow, model, x))
    row: dict[str, Any] = {"model": name}
    for label, runs in results.items():
        row[f"{label}_prepare_s"] = statistics.median(r[0] for r in runs)
        row[f"{label}_convert_s"] = statistics.median(r[1] for r in runs)
        row[f"{label}_total_s"] = statistics.median(r[0] + r[1] for r in runs)
    row["ratio"] = row["quantbridge_total_s"] / row["torch.ao_total_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both flows)")
    args = parser.parse_args()
    # One thread: the machine is shared, and contended intra-op threads add noise to both.
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [
        bench("cnn300", DeepCNN(), torch.randn(1, 3, 16, 16), args.repeat),
        bench("encoder12", Encoder(), torch.randn(2, 16, 32), args.repeat),
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        "| model | quantbridge prepare+convert (s) | torch.ao prepare+convert (s) | ratio |\n"
        "| --- | --- | --- | --- |"
    )
    for r in rows:
        print(
            f"| {r['model']} | {r['quantbridge_total_s']:.3f} "
            f"({r['quantbridge_prepare_s']:.3f} + {r['quantbridge_convert_s']:.3f}) | "
            f"{r['torch.ao_total_s']:.3f} ({r['torch.ao_prepare_s']:.3f} + "
            f"{r['torch.ao_convert_s']:.3f}) | {r['ratio']:.2f}x |"
        )


if __name__ == "__main__":
    main()
