"""CNN epilogue fusion, side by side in one process: whole models and single kernels.

Models (batch 1, 3x224x224, torchvision sizes from the repository's ``tests/real_models.py``):
MobileNetV2, MobileNetV3-Small, EfficientNet-B0. Each is prepared with the numba backend,
calibrated once, converted to one reference model and lowered twice for the best target:
``fused`` (the default table: activations in the conv / linear epilogue) and ``unfused``
(the same table without the ``conv / linear + activation`` fusion rule: every activation a
separate lookup-table pass). Both columns give byte-identical outputs (checked).

Kernels: a conv alone vs the same conv with a table fused (``lut=``), and the old two-pass
form (conv, then ``apply_lut``), for MobileNet-like shapes; a real activation table
(hardswish) and a clamp table (relu6 with shared qparams, folded into the clamp range). Then
squeeze-excite: ``kernels.mul_channels`` vs ``kernels.mul`` on the materialized broadcast.

Timing: one call per column per round, columns interleaved in each round, median over rounds
(ratios from the medians). Threads: ``torch.set_num_threads`` and the kernels' own setting.

    python packages/lowering/bench/bench_cnn_fusion.py [--rounds 30] [--threads 1]
        [--models mobilenet_v2 ...] [--skip-models] [--skip-kernels]
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantbridge import kernels as K
from quantbridge.fx_quant import calibrate, convert_to_reference_fx, prepare_fx
from quantbridge.lowering import default_lowering_rules, get_backend, lower_to_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
import real_models

MODELS = ("mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0")
EPILOGUE_RULE = "conv / linear + activation"


def _interleaved(columns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median seconds per call of each column, columns interleaved in every round."""
    for fn in columns.values():  # warm-up (JIT, caches)
        fn()
        fn()
    times: dict[str, list[float]] = {k: [] for k in columns}
    for _ in range(rounds):
        for name, fn in columns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _load() -> str:
    return ", ".join(f"{v:.2f}" for v in os.getloadavg())


def bench_models(names: list[str], rounds: int) -> None:
    backend = get_backend("numba")
    unfused_rules = [r for r in default_lowering_rules() if r.name != EPILOGUE_RULE]
    print(f"\n## models (batch 1, 224x224, target {backend.target}), load {_load()}\n")
    print("| model | unfused ms | fused ms | fused / unfused | lookup-table passes left |")
    print("| --- | --- | --- | --- | --- |")
    for name in names:
        torch.manual_seed(0)
        model = real_models.build(name, full_size=True)
        x = torch.randn(1, 3, 224, 224)
        prepared = prepare_fx(
            model, backend.qconfig_mapping(), (x,), backend_config=backend.backend_config
        )
        calibrate(prepared, [torch.randn(1, 3, 224, 224) for _ in range(2)], progress=False)
        reference = convert_to_reference_fx(prepared, backend_config=backend.backend_config)
        fused = backend.lower(copy.deepcopy(reference))
        unfused = lower_to_kernels(copy.deepcopy(reference), backend.target, rules=unfused_rules)
        with torch.no_grad():
            if not torch.equal(fused(x), unfused(x)):
                raise SystemExit(f"{name}: fused and unfused outputs differ")

        def luts(gm: torch.fx.GraphModule) -> int:
            return sum(
                1
                for n in gm.graph.nodes
                if n.op == "call_module"
                and type(gm.get_submodule(str(n.target))).__name__ == "QuantizedLookupTable"
            )

        with torch.no_grad():
            t = _interleaved(
                {"unfused": functools.partial(unfused, x), "fused": functools.partial(fused, x)},
                rounds,
            )
        print(
            f"| {name} | {t['unfused'] * 1e3:.2f} | {t['fused'] * 1e3:.2f} | "
            f"{t['fused'] / t['unfused']:.3f} | {luts(unfused)} -> {luts(fused)} |"
        )


def _conv_case(
    shape: tuple[int, int, int], oc: int, k: int, stride: int, groups: int, rng: Any
) -> tuple[Any, Any]:
    c, h, w = shape
    x = np.ascontiguousarray(rng.integers(0, 256, (1, h, w, c), dtype=np.uint8)).transpose(
        0, 3, 1, 2
    )  # channels-last, as lowered CNNs keep activations
    wt = rng.integers(-100, 100, (oc, c // groups, k, k), dtype=np.int8)
    packed = K.PackedConvWeight(
        wt, rng.uniform(0.001, 0.01, oc), 0, rng.normal(0, 1, oc).astype(np.float32),
        stride=stride, padding=k // 2, groups=groups,
    )  # fmt: skip
    return x, packed


def bench_kernels(rounds: int) -> None:
    rng = np.random.default_rng(0)
    cases = [
        ("pointwise 1x1 24->144, 56x56", (24, 56, 56), 144, 1, 1, 1),
        ("pointwise 1x1 96->576, 14x14", (96, 14, 14), 576, 1, 1, 1),
        ("pointwise 1x1 320->1280, 7x7", (320, 7, 7), 1280, 1, 1, 1),
        ("dense 3x3 32->32, 56x56", (32, 56, 56), 32, 3, 1, 1),
        ("depthwise 3x3 144, 56x56", (144, 56, 56), 144, 3, 1, 144),
        ("depthwise 3x3 144, 56x56 s2", (144, 56, 56), 144, 3, 2, 144),
    ]
    tables = {
        "hardswish": K.build_lut("hardswish", 0.05, 128, 0.04, 10),
        "relu6 (clamp)": np.clip(np.arange(256), 128, 248).astype(np.uint8),
    }
    print(f"\n## kernels (target {K.best_target()}), load {_load()}\n")
    print(
        "| conv | table | conv alone us | conv + lut fused us | fused / alone | "
        "conv then apply_lut us | two-pass / alone |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, shape, oc, k, stride, groups in cases:
        x, packed = _conv_case(shape, oc, k, stride, groups, rng)
        for tname, table in tables.items():
            qp = (0.05, 3, 0.1, 128)
            alone = functools.partial(K.conv2d, x, packed, *qp, channels_last=True)
            fused = functools.partial(K.conv2d, x, packed, *qp, channels_last=True, lut=table)

            def two_pass(alone: Callable[[], Any] = alone, table: Any = table) -> Any:
                return K.apply_lut(alone(), table)

            assert np.array_equal(fused(), two_pass())
            t = _interleaved({"alone": alone, "fused": fused, "two": two_pass}, rounds)
            print(
                f"| {label} | {tname} | {t['alone'] * 1e6:.1f} | {t['fused'] * 1e6:.1f} | "
                f"{t['fused'] / t['alone']:.3f} | {t['two'] * 1e6:.1f} | "
                f"{t['two'] / t['alone']:.3f} |"
            )
    print(f"\n## squeeze-excite multiply (channels-last x, [1, C, 1, 1] scale), load {_load()}\n")
    qps = ((0.05, 3), (1 / 256, 0), (0.04, 9))
    print("| x | mul_channels us | broadcast + mul us | ratio |")
    print("| --- | --- | --- | --- |")
    for c, hw in ((96, 112), (144, 56), (240, 28), (672, 14), (1152, 7)):
        xq = np.ascontiguousarray(rng.integers(0, 256, (1, hw, hw, c), dtype=np.uint8)).transpose(
            0, 3, 1, 2
        )
        s = rng.integers(0, 256, (1, c, 1, 1), dtype=np.uint8)
        xt, st = torch.from_numpy(xq), torch.from_numpy(s)

        per_channel = functools.partial(K.mul_channels, xq, qps[0], s, qps[1], qps[2])

        def broadcast(xt: torch.Tensor = xt, st: torch.Tensor = st) -> Any:
            # what the lowered mul did before: broadcast, copy, mul
            a, b = torch.broadcast_tensors(xt, st)  # type: ignore[no-untyped-call]
            return K.mul(a.contiguous().numpy(), qps[0], b.contiguous().numpy(), qps[1], qps[2])

        assert np.array_equal(per_channel(), broadcast())
        t = _interleaved({"pc": per_channel, "bc": broadcast}, rounds)
        print(
            f"| 1x{c}x{hw}x{hw} | {t['pc'] * 1e6:.1f} | {t['bc'] * 1e6:.1f} | "
            f"{t['pc'] / t['bc']:.3f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    parser.add_argument("--skip-models", action="store_true")
    parser.add_argument("--skip-kernels", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    K.set_num_threads(args.threads)
    print(f"threads {args.threads}, rounds {args.rounds}, torch {torch.__version__}")
    if not args.skip_kernels:
        bench_kernels(args.rounds)
    if not args.skip_models:
        bench_models(args.models, max(5, args.rounds // 2))


if __name__ == "__main__":
    main()
