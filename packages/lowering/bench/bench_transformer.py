"""BERT-shaped encoder benchmark: fp32 eager, torch.ao ``quantize_dynamic``, quantbridge dynamic
(per tensor and per token), 1 thread, plus the per-op kernel figures against torch.

Model: ``_bert.BertEncoder`` (6 layers, hidden 384, 12 heads, intermediate 1536; Hugging Face's
eager attention, additive padding mask), sequence 128, batch 1 and 16, random init (seeded).

Timing: one forward per column per round, columns interleaved in each round (load from other
processes hits all alike), ``--rounds`` rounds after one warm-up; medians (and minima) per
column, ratios taken from the medians of the same run. ``torch.set_num_threads(n)`` sets the
thread count for torch and, through it, for the lowered model's kernels.

    python packages/lowering/bench/bench_transformer.py [--rounds 10] [--batches 1 16]
        [--threads 1] [--ops-only | --models-only] [--json out.json]

torch.ao is imported lazily, only to build the ``quantize_dynamic`` column (a bench tool, not
runtime code); the column is skipped when torch no longer ships it.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bert import BertEncoder, encoder_inputs

import quantbridge.kernels as K
from quantbridge.fx_quant import convert_to_reference_fx, prepare_fx
from quantbridge.lowering import get_backend
from quantbridge.qconfig import QConfigMapping, default_dynamic_qconfig

Fn = Callable[[], Any]


def interleaved(columns: dict[str, Fn], rounds: int) -> dict[str, tuple[float, float]]:
    """``{name: (median ms, min ms)}`` over ``rounds`` interleaved rounds (one warm-up)."""
    times: dict[str, list[float]] = {k: [] for k in columns}
    for fn in columns.values():
        fn()
    for _ in range(rounds):
        for name, fn in columns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {k: (statistics.median(v), min(v)) for k, v in times.items()}


def _torch_ao_dynamic(model: nn.Module) -> nn.Module | None:
    try:
        from torch.ao.quantization import quantize_dynamic  # bench only
    except ImportError:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)


def _quantbridge(model: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> dict[str, nn.Module]:
    backend = get_backend("numba")
    mapping = QConfigMapping().set_global(default_dynamic_qconfig)
    prepared = prepare_fx(copy.deepcopy(model), mapping, (x, mask),
                          backend_config=backend.backend_config)  # fmt: skip
    prepared(x, mask)
    reference = convert_to_reference_fx(prepared)
    return {
        "quantbridge dynamic": backend.lower(reference),
        "quantbridge dynamic, per-token": backend.with_options(per_token_activations=True).lower(
            reference
        ),
    }


def _cosine(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean cosine of the mean-pooled (over real tokens) embeddings."""
    w = mask[..., None]
    pa = (a * w).sum(1) / w.sum(1)
    pb = (b * w).sum(1) / w.sum(1)
    return float(F.cosine_similarity(pa, pb, dim=-1).mean())


def _forwards(columns: dict[str, nn.Module], x: torch.Tensor, mask: torch.Tensor) -> dict[str, Fn]:
    return {name: functools.partial(model, x, mask) for name, model in columns.items()}


def bench_models(batches: list[int], rounds: int) -> list[dict[str, Any]]:
    rows = []
    torch.manual_seed(0)
    model = BertEncoder().eval()
    for batch in batches:
        x, mask = encoder_inputs(batch, seed=batch)
        columns: dict[str, nn.Module] = {"fp32 eager": model}
        ao = _torch_ao_dynamic(model)
        if ao is not None:
            columns["torch.ao quantize_dynamic"] = ao
        columns.update(_quantbridge(model, *encoder_inputs(4, seed=99)))
        with torch.no_grad():
            ref = model(x, mask)
            cos = {n: _cosine(m(x, mask), ref, mask) for n, m in columns.items()}
            timing = interleaved(_forwards(columns, x, mask), rounds)
        base = timing["fp32 eager"][0]
        ao_ms = timing.get("torch.ao quantize_dynamic", (math.nan,))[0]
        for name, (med, low) in timing.items():
            rows.append({
                "batch": batch, "variant": name, "median_ms": med, "min_ms": low,
                "vs_fp32": base / med, "vs_torch_ao": ao_ms / med, "mean_cos": cos[name],
            })  # fmt: skip
    return rows


def _op_pairs(batch: int, rng: np.random.Generator) -> dict[str, tuple[Fn, Fn]]:
    """(ours, torch) per op on BERT shapes: seq 128, hidden 384, 12 heads, intermediate 1536."""
    s, h, heads, inter = 128, 384, 12, 1536
    x = rng.normal(size=(batch, s, h)).astype(np.float32)
    r = rng.normal(size=(batch, s, h)).astype(np.float32)
    w, b = rng.normal(size=h).astype(np.float32), rng.normal(size=h).astype(np.float32)
    scores = rng.normal(size=(batch, heads, s, s)).astype(np.float32)
    m = np.zeros((batch, 1, 1, s), np.float32)
    m[..., s * 3 // 4 :] = np.finfo(np.float32).min
    g = rng.normal(size=(batch, s, inter)).astype(np.float32)
    tx, tr, tw, tb, ts, tm, tg = map(torch.from_numpy, (x, r, w, b, scores, m, g))
    qa = rng.integers(0, 256, (batch * heads, s, h // heads), dtype=np.uint8)
    qb = rng.integers(0, 256, (batch * heads, h // heads, s), dtype=np.uint8)
    qp = rng.integers(0, 256, (batch * heads, s, s), dtype=np.uint8)
    qv = rng.integers(0, 256, (batch * heads, s, h // heads), dtype=np.uint8)
    fa, fb = torch.from_numpy(qa.astype(np.float32)), torch.from_numpy(qb.astype(np.float32))
    fp, fv = torch.from_numpy(qp.astype(np.float32)), torch.from_numpy(qv.astype(np.float32))
    qp_ = (0.05, 128)
    out = (40.0, 128)
    return {
        "layer_norm(x + r)": (
            functools.partial(K.layer_norm, x, w, b, 1e-12, residual=r),
            lambda: F.layer_norm(tx + tr, (h,), tw, tb, 1e-12),
        ),
        "softmax(x / 8 + mask)": (
            functools.partial(K.softmax, scores, scale=0.125, mask=m),
            lambda: F.softmax(ts / 8.0 + tm, dim=-1),
        ),
        "gelu (erf)": (functools.partial(K.gelu, g), functools.partial(F.gelu, tg)),
        "gelu (tanh)": (
            functools.partial(K.gelu, g, "tanh"),
            functools.partial(F.gelu, tg, approximate="tanh"),
        ),
        "int8 q @ k^T (vs fp32 bmm)": (
            functools.partial(K.matmul, qa, qp_, qb, qp_, out),
            functools.partial(torch.bmm, fa, fb),
        ),
        "int8 p @ v (vs fp32 bmm)": (
            functools.partial(K.matmul, qp, qp_, qv, qp_, out),
            functools.partial(torch.bmm, fp, fv),
        ),
    }


def bench_ops(batches: list[int], rounds: int) -> list[dict[str, Any]]:
    """Per-op: our float kernels and batched int8 matmul vs torch (same inputs, one run)."""
    rng = np.random.default_rng(0)
    rows = []
    for batch in batches:
        for name, (ours, theirs) in _op_pairs(batch, rng).items():
            t = interleaved({"ours": ours, "torch": theirs}, rounds)
            rows.append({
                "batch": batch, "op": name, "ours_ms": t["ours"][0], "torch_ms": t["torch"][0],
                "speedup": t["torch"][0] / t["ours"][0],
            })  # fmt: skip
    return rows


def _per_head_loop(qa: np.ndarray, qb: np.ndarray) -> np.ndarray:
    """The former matmul: one packed weight and one ``linear`` call per (batch, head)."""
    outs = []
    for i in range(qa.shape[0]):
        wt = (qb[i].T.astype(np.int16) - 128).astype(np.int8)
        packed = K.PackedLinearWeight(np.ascontiguousarray(wt), 0.05, 0, None)
        outs.append(K.linear(qa[i], packed, 0.05, 128, 40.0, 128))
    return np.stack(outs)


def bench_matmul_loop(batches: list[int], rounds: int) -> list[dict[str, Any]]:
    """The batched matmul kernel against the former one-``linear``-per-(batch, head) loop."""
    rng = np.random.default_rng(1)
    rows = []
    for batch in batches:
        qa = rng.integers(0, 256, (batch * 12, 128, 32), dtype=np.uint8)
        qb = rng.integers(0, 256, (batch * 12, 32, 128), dtype=np.uint8)
        batched = functools.partial(K.matmul, qa, (0.05, 128), qb, (0.05, 128), (40.0, 128))
        t = interleaved({"batched": batched, "loop": functools.partial(_per_head_loop, qa, qb)},
                        rounds)  # fmt: skip
        rows.append({"batch": batch, "batched_ms": t["batched"][0], "loop_ms": t["loop"][0],
                     "speedup": t["loop"][0] / t["batched"][0]})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ops-only", action="store_true")
    parser.add_argument("--models-only", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with open("/proc/loadavg") as f:
        print(f"threads {args.threads}; load average at start: {f.read().split()[:3]}")
    out: dict[str, Any] = {}
    if not args.models_only:
        out["ops"] = bench_ops(args.batches, args.rounds)
        print("\n| batch | op | quantbridge ms | torch ms | torch / ours |")
        print("| --- | --- | --- | --- | --- |")
        for row in out["ops"]:
            print(f"| {row['batch']} | {row['op']} | {row['ours_ms']:.3f} | {row['torch_ms']:.3f} "
                  f"| {row['speedup']:.2f} |")  # fmt: skip
        out["matmul"] = bench_matmul_loop(args.batches, args.rounds)
        print("\n| batch | batched matmul ms | per-(batch, head) linear loop ms | loop / batched |")
        print("| --- | --- | --- | --- |")
        for row in out["matmul"]:
            print(f"| {row['batch']} | {row['batched_ms']:.2f} | {row['loop_ms']:.2f} | "
                  f"{row['speedup']:.2f} |")  # fmt: skip
    if not args.ops_only:
        out["models"] = bench_models(args.batches, args.rounds)
        print(
            "\n| batch | variant | median ms | min ms | fp32 / this | torch.ao / this | mean cos |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for row in out["models"]:
            print(f"| {row['batch']} | {row['variant']} | {row['median_ms']:.1f} | "
                  f"{row['min_ms']:.1f} | {row['vs_fp32']:.2f} | {row['vs_torch_ao']:.2f} | "
                  f"{row['mean_cos']:.6f} |")  # fmt: skip
    with open("/proc/loadavg") as f:
        print(f"load average at end: {f.read().split()[:3]}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
