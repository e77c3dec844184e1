"""Side-by-side model benchmark: every backend on the same prepared model, at 1 and 2 threads.

Models:

* ``mlp``: batch 32, Linear 768->3072, ReLU, Linear 3072->768;
* ``cnn``: batch 1, 3x56x56 input, a 3x3 stem to 64 channels and two 64-channel 3x3 residual
  blocks (conv-BN-ReLU, conv-BN, add, ReLU), then global average pooling and a classifier;
* ``resnet18`` / ``mobilenet_v2``: torchvision's architectures at full size (batch 1,
  3x224x224, 1000 classes), written the torchvision way (one ReLU module reused per block) in
  the repository's ``tests/real_models.py``, with seeded weights and settled BN statistics;
* ``transformer_dynamic`` / ``transformer_static``: one post-norm transformer encoder layer
  (hidden 384, 12 heads, sequence 128, batch 1, FFN 1536) with every Linear quantized
  dynamically / statically (attention matmuls, softmax and LayerNorm stay float).

Columns: fp32 eager; torch.ao's own ``prepare_fx``/``convert_fx`` on the x86 engine (when torch
still ships torch.ao; imported lazily here: this is a tool, not runtime code); then one
quantbridge prepared model (calibrated once, with the numba backends' qconfig mapping) converted
to the reference model and lowered by ``torch_native`` and by every ``numba_*`` target.

Timing: one forward pass per column per round, columns interleaved in each round (so load
from other processes hits all columns alike), median over rounds (and the minimum, which is
steadier on a loaded machine). Ratios are taken within one run: numba (the ``numba`` alias's
target) vs torch.ao x86, and numba vs fp32 eager, from the medians and from the minima.

Threads: each ``--threads`` count is set with ``torch.set_num_threads`` only, as a user would;
the lowered models follow it (quantbridge.kernels' own setting stays unset). A final table per
model shows the thread counts side by side; the run fails if a forward changed torch's or
numba's thread count.

    python packages/lowering/bench/bench_models.py [--rounds 20] [--threads 1 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba
import torch
from torch import nn

from quantbridge.fx_quant import calibrate, convert_to_reference_fx, prepare_fx
from quantbridge.lowering import available_backends, get_backend
from quantbridge.qconfig import QConfigMapping, default_dynamic_qconfig

# Performance targets (numba vs torch.ao x86, numba vs fp32 eager); None = no target.
TARGETS: dict[str, tuple[float | None, float | None]] = {
    "mlp": (1.2, 3.0),
    "cnn": (1.2, 3.0),
    "resnet18": (None, None),
    "mobilenet_v2": (None, None),
    "transformer_dynamic": (None, 1.5),
    "transformer_static": (None, 1.5),
}


# The model builders live with the asv suite (importable there); both benches time the same models.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "asv_bench" / "benchmarks"))
from _models import MLP, EncoderLayer, ResNetish  # noqa: E402
from _peers import torch_ao_x86  # noqa: E402  (the torch.ao column bench_peers.py times too)

# torchvision-style networks (torchvision itself does not import under the pinned torch)
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
import real_models  # noqa: E402


def _models() -> dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], str]]:
    return {
        "mlp": (MLP, (32, 768), "static"),
        "cnn": (ResNetish, (1, 3, 56, 56), "static"),
        "resnet18": (
            lambda: real_models.build("resnet18", full_size=True),
            (1, 3, 224, 224),
            "static",
        ),
        "mobilenet_v2": (
            lambda: real_models.build("mobilenet_v2", full_size=True),
            (1, 3, 224, 224),
            "static",
        ),
        "transformer_dynamic": (EncoderLayer, (1, 128, 384), "dynamic"),
        "transformer_static": (EncoderLayer, (1, 128, 384), "static_linear"),
    }


def _mapping(base: QConfigMapping, mode: str) -> QConfigMapping:
    if mode == "static":
        return base
    if mode == "dynamic":
        return QConfigMapping().set_object_type(nn.Linear, default_dynamic_qconfig)
    # static, Linear only: the backend's global qconfig on Linear modules
    return QConfigMapping().set_object_type(nn.Linear, base.global_qconfig)


def _torch_ao_model(
    model: nn.Module, mode: str, example: torch.Tensor, calib: list[torch.Tensor]
) -> nn.Module | str:
    """torch.ao's convert_fx model on the x86 engine, or why there is none."""
    try:
        return torch_ao_x86(model, mode, (example,), [(x,) for x in calib])
    except NotImplementedError as e:
        return f"torch.ao unavailable ({e})"


def _columns(
    name: str, calib_batches: int, seed: int
) -> tuple[dict[str, Callable[[torch.Tensor], torch.Tensor]], dict[str, str], torch.Tensor]:
    factory, shape, mode = _models()[name]
    torch.manual_seed(seed)
    model = factory().eval()
    example = torch.randn(*shape)
    calib = [torch.randn(*shape) for _ in range(calib_batches)]
    columns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"fp32": model}
    errors: dict[str, str] = {}

    ao = _torch_ao_model(model, mode, example, calib)
    if isinstance(ao, str):
        errors["torch.ao_x86"] = ao
    else:
        columns["torch.ao_x86"] = ao

    backends = available_backends()
    numba_targets = [b for b in backends if b.startswith("numba_")]
    # one prepared model for all our columns: the numba backends' mapping and config
    source = get_backend(numba_targets[0] if numba_targets else "reference")
    base, config = source.qconfig_mapping(), source.backend_config
    prepared = prepare_fx(
        copy.deepcopy(model), _mapping(base, mode), (example,), backend_config=config
    )
    calibrate(prepared, calib, progress=False)
    reference = convert_to_reference_fx(prepared, backend_config=config)
    for backend_name in ["torch_native", "reference", *numba_targets]:
        if backend_name not in backends:
            errors[backend_name] = "not available here"
            continue
        try:
            lowered = get_backend(backend_name).lower(copy.deepcopy(reference))
            with torch.no_grad():
                lowered(example)  # JIT compile / first-call costs outside the timing
            columns[backend_name] = lowered
        except Exception as e:  # a broken backend is a result to report, not a crash
            errors[backend_name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            traceback.print_exc(limit=3, file=sys.stderr)
    return columns, errors, example


def _time(
    columns: dict[str, Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, rounds: int
) -> tuple[dict[str, float], dict[str, float]]:
    samples: dict[str, list[float]] = {k: [] for k in columns}
    with torch.no_grad():
        for fn in columns.values():  # warm-up
            fn(x)
        for _ in range(rounds):
            for key, fn in columns.items():
                start = time.perf_counter()
                fn(x)
                samples[key].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in samples.items()}, {
        k: min(v) * 1e3 for k, v in samples.items()
    }


def _ratios(times: dict[str, float], best: str | None) -> dict[str, float | None]:
    ratios: dict[str, float | None] = {"numba_vs_torch_ao_x86": None, "numba_vs_fp32": None}
    if best is not None and best in times:
        if "torch.ao_x86" in times:
            ratios["numba_vs_torch_ao_x86"] = times["torch.ao_x86"] / times[best]
        ratios["numba_vs_fp32"] = times["fp32"] / times[best]
    return ratios


def _best_numba(times: dict[str, float]) -> str | None:
    """The column of the target the ``numba`` alias picks on this CPU (never the fastest run)."""
    if "numba" not in available_backends():
        return None
    target = getattr(get_backend("numba"), "target", None)
    name = f"numba_{target}"
    return name if name in times else None


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(_models()))
    parser.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calib-batches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    unknown = set(args.models) - set(_models())
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {list(_models())}")

    results: list[dict[str, Any]] = []
    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average {load[0]:.1f} at start, "
        f"backends: {', '.join(available_backends())}"
    )
    numba_threads = numba.get_num_threads()
    for name in args.models:
        columns, errors, example = _columns(name, args.calib_batches, args.seed)
        for threads in args.threads:
            torch.set_num_threads(threads)
            times, fastest = _time(columns, example, args.rounds)
            after = (torch.get_num_threads(), numba.get_num_threads())
            if after != (threads, numba_threads):
                raise SystemExit(
                    f"{name}: the forwards changed (torch, numba) thread counts from "
                    f"{(threads, numba_threads)} to {after}"
                )
            load = os.getloadavg()
            best = _best_numba(times)
            ratios = _ratios(times, best)
            results.append(
                {
                    "model": name,
                    "threads": threads,
                    "ms": times,
                    "min_ms": fastest,
                    "load_average_1min": load[0],
                    "errors": errors,
                    "numba": best,
                    "ratios": ratios,
                    "ratios_of_min": _ratios(fastest, best),
                    "targets": dict(
                        zip(("numba_vs_torch_ao_x86", "numba_vs_fp32"), TARGETS[name], strict=True)
                    ),
                }
            )
            _print_row(results[-1])
        _print_side_by_side([r for r in results if r["model"] == name])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "results": results}, f, indent=2)
    return 0


def _print_row(r: dict[str, Any]) -> None:
    times: dict[str, float] = r["ms"]
    width = max(len(k) for k in times)
    print(
        f"\n{r['model']}, {r['threads']} thread(s), load average "
        f"{r['load_average_1min']:.1f}: ms per forward, median (min)"
    )
    for k, v in times.items():
        print(f"  {k:<{width}} {v:>10.3f} ({r['min_ms'][k]:.3f})")
    for k, why in r["errors"].items():
        print(f"  {k}: {why}")
    for key, value in r["ratios"].items():
        target = r["targets"][key]
        of_min = r["ratios_of_min"][key]
        if value is None:
            print(f"  {key} ({r['numba']}): n/a")
            continue
        verdict = "" if target is None else (" MET" if value >= target else " MISSED")
        goal = "" if target is None else f" (target >= {target}x){verdict}"
        print(f"  {key} ({r['numba']}): {value:.2f}x{goal}; of the minima: {of_min:.2f}x")


def _print_side_by_side(rows: list[dict[str, Any]]) -> None:
    """One model's medians (ms) and ratio to fp32, one column pair per thread count."""
    if len(rows) < 2:
        return
    names = list(rows[0]["ms"])
    width = max(len(k) for k in names)
    head = "".join(f"{str(r['threads']) + ' thread(s)':>24}" for r in rows)
    print(f"\n{rows[0]['model']}: median ms (fp32 / column) per torch thread setting")
    print(f"  {'':<{width}}{head}")
    for k in names:
        cells = ""
        for r in rows:
            ms, fp32 = r["ms"].get(k), r["ms"].get("fp32")
            ratio = f"{fp32 / ms:.2f}x" if ms and fp32 else "n/a"
            cells += f"{ms:>14.3f} ({ratio:>6})" if ms is not None else f"{'n/a':>24}"
        print(f"  {k:<{width}}{cells}")


if __name__ == "__main__":
    sys.exit(main())
