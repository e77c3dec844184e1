"""Side-by-side throughput of the GEMM-family kernels against torch's quantized x86 engine.

For each shape and target this times our kernel and, when torch with its x86 quantized
engine is importable, torch's prepacked quantized linear/conv on the same inputs, interleaved
in one process with the same thread count; each figure is the fastest single call seen in
``--repeat`` interleaved rounds (the machine is shared: the fastest call is the least
disturbed one). ``ratio`` is ours divided by torch's from the same run.
Rows ``linear_w7`` and ``conv2d_cl_w7`` (``avx2`` only) repeat the shapes with 7-bit weights,
which AVX2's byte kernels run without any check; rows ``linear_a7`` and ``conv2d_cl_a7``
(``avx2`` only) keep 8-bit weights with activation codes in [0, 127], torch.ao's x86
``reduce_range`` codes, where the byte kernels' pair check finds nothing to redo (torch gets
the same inputs).
``percent_of_peak`` compares with a vpdpbusd peak that is measured here (register-only
vpdpbusd loop on every thread), not taken from a datasheet.

torch is only a comparison baseline of this script, which is not part of the kernels package
(run it with a virtualenv's python where quantbridge-kernels is installed; torch optional);
torch is imported lazily with ``importlib.import_module``. The asv suite
(``asv_bench/benchmarks/ops.py``) imports the shape tables and ``measure_peak_gops`` from here,
so importing this file compiles and runs nothing.

    python packages/kernels/bench/bench_kernels.py [--threads 1] [--repeat 5] [--min-time 0.05]
        [--targets avx512_vnni,avx2] [--json] [--quick] [--crossover]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from quantbridge.kernels._conv import PackedConvWeight, conv2d
from quantbridge.kernels._linear import PackedLinearWeight, linear
from quantbridge.kernels._targets import (
    available_targets,
    needs_features,
    target_features,
    target_supported,
)
from quantbridge.kernels._threads import apply_num_threads, max_threads
from quantbridge.kernels._vnni import vpdpbusd_peak_loop

GEMM_SHAPES: tuple[tuple[int, int, int], ...] = (
    (1, 768, 768),
    (32, 768, 3072),
    (128, 1024, 1024),
    (512, 512, 512),
)
CONV_SHAPE = (1, 64, 56, 56, 64, 3)  # batch, C, H, W, OC, kernel
# batch, C, H = W, OC, kernel, stride: MobileNetV2's 144-channel depthwise at 56x56
DEPTHWISE_SHAPES = ((1, 144, 56, 144, 3, 1), (1, 144, 56, 144, 3, 2), (1, 240, 28, 240, 5, 1))
# ImageNet stems: ResNet's 7x7 and MobileNet's 3x3, both stride 2 on a 224x224 RGB image
STEM_SHAPES = ((1, 3, 224, 64, 7, 2), (1, 3, 224, 32, 3, 2))


@numba.njit(nogil=True)
def _peak_one(iters: int) -> int:
    return vpdpbusd_peak_loop(iters)  # type: ignore[call-arg]


@numba.njit(nogil=True, parallel=True)
def _peak_many(iters: int, workers: int) -> int:
    acc = np.zeros(workers, np.int64)
    for t in numba.prange(workers):
        acc[t] = vpdpbusd_peak_loop(iters)  # type: ignore[call-arg]
    return int(acc.sum())


needs_features(target_features("avx512_vnni"), _peak_one)
needs_features(target_features("avx512_vnni"), _peak_many)


def measure_peak_gops(threads: int, seconds: float = 0.5) -> float | None:
    """Per-machine vpdpbusd peak for ``threads`` threads (None without AVX-512 VNNI).

    Measured as the best single-thread rate of a register-only vpdpbusd loop (16 independent
    accumulators) times ``threads``: on a shared machine a multi-threaded probe mostly
    measures the neighbours, while one core's best run is stable. The two-thread probe is
    kept as ``_peak_many`` for checking scaling by hand.
    """
    if not target_supported("avx512_vnni"):
        return None
    ops_per_iter = 16 * 64 * 2  # 16 instructions x 64 multiply-adds x 2 ops
    iters = 100_000
    _peak_one(1)  # compile outside the timing
    best = 0.0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or best == 0.0:
        t0 = time.perf_counter()
        _peak_one(iters)
        dt = time.perf_counter() - t0
        best = max(best, ops_per_iter * iters / dt / 1e9)
    return best * threads


def _best_time(fn: Callable[[], object], repeat: int, min_time: float) -> float:
    """Fastest single call (seconds) seen in ``repeat`` rounds of at least ``min_time`` each.

    The machine is shared: the fastest call is the one least disturbed by other processes,
    and both sides of a comparison are measured the same way, interleaved.
    """
    fn()
    best = float("inf")
    clock = time.perf_counter
    for _ in range(repeat):
        end = clock() + min_time
        while True:
            t0 = clock()
            fn()
            t1 = clock()
            best = min(best, t1 - t0)
            if t1 >= end:
                break
    return best


def _torch() -> Any | None:
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return None
    engines = torch.backends.quantized.supported_engines
    if "x86" not in engines or not hasattr(torch.ops, "quantized"):
        return None
    torch.backends.quantized.engine = "x86"
    return torch


def _torch_linear(torch: Any, a: Any, w: Any, bias: Any, scales: tuple[float, ...]) -> Any:
    a_s, a_zp, w_s, o_s, o_zp = scales
    qops = torch.ops.quantized
    aq = torch._make_per_tensor_quantized_tensor(torch.from_numpy(a), a_s, int(a_zp))
    wq = torch._make_per_tensor_quantized_tensor(torch.from_numpy(w), w_s, 0)
    packed = qops.linear_prepack(wq, torch.from_numpy(bias))
    return lambda: qops.linear(aq, packed, o_s, int(o_zp))


def _torch_conv(
    torch: Any,
    x: Any,
    w: Any,
    bias: Any,
    scales: tuple[float, ...],
    channels_last: bool,
    stride: int = 1,
    padding: int = 1,
    groups: int = 1,
    w_scales: Any = None,
) -> Any:
    """torch's x86 quantized conv; ``w_scales`` (an array) makes the weights per-channel."""
    a_s, a_zp, w_s, o_s, o_zp = scales
    qops = torch.ops.quantized
    xq = torch._make_per_tensor_quantized_tensor(torch.from_numpy(x), a_s, int(a_zp))
    if channels_last:
        xq = xq.contiguous(memory_format=torch.channels_last)
    if w_scales is not None:  # per-channel weights, zero points 0
        zeros = torch.zeros(w.shape[0], dtype=torch.int64)
        wq = torch._make_per_channel_quantized_tensor(
            torch.from_numpy(w), torch.from_numpy(np.asarray(w_scales, np.float64)), zeros, 0
        )
    else:
        wq = torch._make_per_tensor_quantized_tensor(torch.from_numpy(w), w_s, 0)
    packed = qops.conv2d_prepack(
        wq, torch.from_numpy(bias), [stride] * 2, [padding] * 2, [1, 1], groups
    )
    return lambda: qops.conv2d(xq, packed, o_s, int(o_zp))


def _torch_conv_fp32(
    torch: Any, x: Any, w: Any, stride: int, padding: int, groups: int
) -> Callable[[], object]:
    """float32 torch conv on channels-last input (its faster layout for depthwise here)."""
    xf = torch.from_numpy(x.astype(np.float32)).contiguous(memory_format=torch.channels_last)
    wf = torch.from_numpy(w.astype(np.float32))
    conv = torch.nn.functional.conv2d

    def run() -> object:
        with torch.no_grad():
            return conv(xf, wf, None, stride, padding, 1, groups)

    return run


def run(
    threads: int, repeat: int, min_time: float, targets: list[str], quick: bool = False
) -> list[dict[str, Any]]:
    """Measure every (op, shape, target); rows as documented in the module docstring."""
    apply_num_threads(threads, "bench")
    torch = _torch()
    if torch is not None:
        torch.set_num_threads(threads)
    peak = measure_peak_gops(threads)
    rng = np.random.default_rng(0)
    scales = (0.05, 3.0, 0.01, 2.0, 5.0)
    rows: list[dict[str, Any]] = []
    shapes = (*GEMM_SHAPES[:1], (16, 64, 64)) if quick else GEMM_SHAPES
    for m, k, n in shapes:
        a = rng.integers(0, 256, (m, k), dtype=np.uint8)
        w8 = rng.integers(-128, 128, (n, k), dtype=np.int8)
        bias = rng.normal(0, 1, n).astype(np.float32)
        for op, w, codes in (("linear", w8, a), ("linear_w7", w8 >> 1, a),
                             ("linear_a7", w8, a >> 1)):  # fmt: skip
            # 7-bit weights or codes change only avx2's kernels (the byte family): rows there only
            row_targets = [t for t in targets if op == "linear" or t == "avx2"]
            if not row_targets:
                continue
            base = _torch_linear(torch, codes, w, bias, scales) if torch is not None else None
            for target in row_targets:
                packed = PackedLinearWeight(w, scales[2], 0, bias, target=target)

                def ours(
                    packed: PackedLinearWeight = packed, a: np.ndarray[Any, Any] = codes
                ) -> object:
                    return linear(a, packed, 0.05, 3, 2.0, 5, num_threads=threads)

                rows.append(
                    _row(op, f"{m}x{k}x{n}", 2.0 * m * k * n, target, threads, ours, base,
                         repeat, min_time, peak)
                )  # fmt: skip
    bn, c, h, wd, oc, ks = (1, 8, 12, 12, 8, 3) if quick else CONV_SHAPE
    x = rng.integers(0, 256, (bn, c, h, wd), dtype=np.uint8)
    wc = rng.integers(-128, 128, (oc, c, ks, ks), dtype=np.int8)
    bias = rng.normal(0, 1, oc).astype(np.float32)
    # torch's quantized conv returns channels-last data; ours does too with channels_last=True.
    # Row "conv2d": NCHW input (both sides transpose it); "conv2d_cl": channels-last input, as
    # between two convs of a lowered model.
    x_cl = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    ops = 2.0 * bn * oc * h * wd * c * ks * ks
    shape = f"{bn}x{c}x{h}x{wd}->{oc},k{ks}"
    plans = (("conv2d", x, wc), ("conv2d_cl", x_cl, wc), ("conv2d_cl_w7", x_cl, wc >> 1),
             ("conv2d_cl_a7", x_cl >> 1, wc))  # fmt: skip
    for op, xin, wk in plans:
        row_targets = [t for t in targets if not op.endswith(("_w7", "_a7")) or t == "avx2"]
        if not row_targets:
            continue
        x_nchw = np.ascontiguousarray(xin)
        base = (
            _torch_conv(torch, x_nchw, wk, bias, scales, op != "conv2d")
            if torch is not None
            else None
        )
        for target in row_targets:
            cp = PackedConvWeight(wk, scales[2], 0, bias, padding=1, target=target)

            def ours_conv(cp: PackedConvWeight = cp, xin: np.ndarray[Any, Any] = xin) -> object:
                return conv2d(xin, cp, 0.05, 3, 2.0, 5, num_threads=threads, channels_last=True)

            rows.append(
                _row(op, shape, ops, target, threads, ours_conv, base, repeat, min_time, peak)
            )
    rows += _depthwise_and_stem_rows(torch, rng, scales, threads, repeat, min_time, targets,
                                     quick, peak, rows)  # fmt: skip
    return rows


def _depthwise_and_stem_rows(
    torch: Any,
    rng: np.random.Generator,
    scales: tuple[float, ...],
    threads: int,
    repeat: int,
    min_time: float,
    targets: list[str],
    quick: bool,
    peak: float | None,
    dense_rows: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Rows ``depthwise`` (per-channel weights, as the numba backend's default qconfig) and
    ``depthwise_pt`` (per-tensor weights): channels-last in and out, as in a lowered CNN; extra
    keys from medians of interleaved single calls: ``median_us``, ``median_ratio`` (torch x86
    time / ours), ``fp32_gops``/``fp32_ratio`` (torch float32 conv time / ours). ``stem``: NCHW
    image input; extra key ``percent_of_dense``: GOPS over this target's ``conv2d`` row."""
    rows: list[dict[str, Any]] = []
    dense = {r["target"]: r["gops"] for r in dense_rows if r["op"] == "conv2d"}
    plans = [("depthwise", s, True) for s in DEPTHWISE_SHAPES]  # per-channel weights
    plans += [("depthwise_pt", s, False) for s in DEPTHWISE_SHAPES[:2]]  # per-tensor weights
    plans += [("stem", s, False) for s in STEM_SHAPES]
    if quick:
        plans = [plans[0], plans[-1]]
    for op, (bn, c, hw, oc, ks, stride), per_channel in plans:
        if quick:
            hw = 12
        pad = ks // 2
        groups = 1 if op == "stem" else c
        x = rng.integers(0, 256, (bn, c, hw, hw), dtype=np.uint8)
        xin = x
        if groups > 1:
            xin = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
        w = rng.integers(-128, 128, (oc, c // groups, ks, ks), dtype=np.int8)
        bias = rng.normal(0, 1, oc).astype(np.float32)
        w_s = rng.uniform(0.005, 0.015, oc) if per_channel else scales[2]
        oh = (hw + 2 * pad - ks) // stride + 1
        ops = 2.0 * bn * oc * oh * oh * (c // groups) * ks * ks
        shape = f"{bn}x{c}x{hw}x{hw}->{oc},k{ks}s{stride}"
        base = fp32 = None
        if torch is not None:
            base = _torch_conv(torch, x, w, bias, scales, groups > 1, stride, pad, groups,
                               w_s if per_channel else None)  # fmt: skip
            fp32 = _torch_conv_fp32(torch, x, w, stride, pad, groups)
        for target in targets:
            cp = PackedConvWeight(w, w_s, 0, bias, stride=stride, padding=pad, groups=groups,
                                  target=target)  # fmt: skip

            def ours(cp: PackedConvWeight = cp, xin: np.ndarray[Any, Any] = xin) -> object:
                return conv2d(xin, cp, 0.05, 3, 2.0, 5, num_threads=threads, channels_last=True)

            row = _row(op, shape, ops, target, threads, ours, base, repeat, min_time, peak)
            if op == "stem":
                if dense.get(target):
                    row["percent_of_dense"] = round(100.0 * row["gops"] / dense[target], 1)
            elif fp32 is not None and base is not None:
                # medians of single calls, the three interleaved (the machine is shared)
                med = _interleaved_medians((ours, base, fp32), max(repeat, 1) * 20)
                row["fp32_gops"] = round(ops / med[2] / 1e9, 1)
                row["fp32_ratio"] = round(med[2] / med[0], 2)
                row["median_us"] = round(med[0] * 1e6, 1)
                row["median_ratio"] = round(med[1] / med[0], 2)
            rows.append(row)
    return rows


def _interleaved_medians(fns: tuple[Callable[[], object], ...], calls: int) -> list[float]:
    """Median seconds of single calls of each function, the functions called in turn."""
    times: list[list[float]] = [[] for _ in fns]
    clock = time.perf_counter
    for _ in range(calls):
        for i, fn in enumerate(fns):
            t0 = clock()
            fn()
            times[i].append(clock() - t0)
    return [float(np.median(t)) for t in times]


def _row(
    op: str,
    shape: str,
    ops: float,
    target: str,
    threads: int,
    ours: Callable[[], object],
    base: Callable[[], object] | None,
    repeat: int,
    min_time: float,
    peak: float | None,
) -> dict[str, Any]:
    t_ours = t_base = float("inf")
    ours()
    if base is not None:
        base()
    # interleave so both sides see the same machine load
    for _ in range(repeat):
        t_ours = min(t_ours, _best_time(ours, 1, min_time))
        if base is not None:
            t_base = min(t_base, _best_time(base, 1, min_time))
    gops = ops / t_ours / 1e9
    base_gops = ops / t_base / 1e9 if base is not None else None
    return {
        "op": op,
        "shape": shape,
        "target": target,
        "threads": threads,
        "gops": round(gops, 1),
        "percent_of_peak": round(100.0 * gops / peak, 1) if peak else None,
        "peak_gops": round(peak, 1) if peak else None,
        "baseline": "torch_x86" if base is not None else None,
        "baseline_gops": round(base_gops, 1) if base_gops is not None else None,
        "ratio": round(gops / base_gops, 2) if base_gops else None,
        "microseconds": round(t_ours * 1e6, 1),
    }


def crossover(repeat: int, target: str) -> list[dict[str, Any]]:
    """1 vs 2 threads for growing work, per kernel family, with the serial thresholds lifted.

    Families: ``conv1x1`` (the GEMM: pointwise conv C -> C over S x S, work = multiply-adds),
    ``depthwise`` (3x3 stride 1 over C x S x S, work = multiply-adds) and ``add`` (elementwise,
    the per-element streams' representative, work = elements). Each size times a call at 1 and
    at 2 threads interleaved, ``repeat`` rounds, medians; ``speedup`` = t1 / t2. The thresholds
    in ``_gemm_run.SERIAL_BELOW``, ``_depthwise.PARALLEL_MIN_MACS`` and
    ``_quantize.STREAM_MIN_WORK`` are where ``speedup`` crosses 1.
    """
    from quantbridge.kernels import _depthwise, _gemm_run, _quantize
    from quantbridge.kernels._elementwise import add

    saved = (dict(_gemm_run.SERIAL_BELOW), _depthwise.PARALLEL_MIN_MACS,
             _quantize.STREAM_MIN_WORK)  # fmt: skip
    _gemm_run.SERIAL_BELOW.update(dict.fromkeys(_gemm_run.SERIAL_BELOW, 0))
    _depthwise.PARALLEL_MIN_MACS, _quantize.STREAM_MIN_WORK = 0, 0
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    try:
        for family in ("conv1x1", "depthwise", "add"):
            for c, size in ((32, 7), (64, 7), (64, 14), (96, 14), (96, 28), (144, 28),
                            (144, 56), (96, 112)):  # fmt: skip
                x = rng.integers(0, 256, (1, size, size, c), np.uint8).transpose(0, 3, 1, 2)
                if family == "add":
                    work = x.size

                    def call_add(threads: int, x: Any = x) -> object:
                        from quantbridge.kernels._threads import set_num_threads

                        set_num_threads(threads)
                        return add(x, (0.1, 3), x, (0.1, 3), (0.2, 5))

                    call: Callable[[int], object] = call_add

                else:
                    groups, k = (c, 3) if family == "depthwise" else (1, 1)
                    w = rng.integers(-128, 128, (c, c // groups, k, k), dtype=np.int8)
                    cp = PackedConvWeight(w, 0.01, 0, None, padding=k // 2, groups=groups,
                                          target=target)  # fmt: skip
                    work = size * size * c * (c // groups) * k * k

                    def call_conv(threads: int, x: Any = x, cp: PackedConvWeight = cp) -> object:
                        return conv2d(x, cp, 0.05, 3, 2.0, 5, num_threads=threads,
                                      channels_last=True)  # fmt: skip

                    call = call_conv

                times: dict[int, list[float]] = {1: [], 2: []}
                call(1), call(2)
                for _ in range(repeat):
                    for threads in (1, 2):
                        t0 = time.perf_counter()
                        call(threads)
                        times[threads].append(time.perf_counter() - t0)
                t1, t2 = float(np.median(times[1])), float(np.median(times[2]))
                rows.append({"family": family, "shape": f"{c}x{size}x{size}", "work": work,
                             "t1_us": round(t1 * 1e6, 1), "t2_us": round(t2 * 1e6, 1),
                             "speedup": round(t1 / t2, 2)})  # fmt: skip
    finally:
        from quantbridge.kernels._threads import set_num_threads

        set_num_threads(None)
        _gemm_run.SERIAL_BELOW.update(saved[0])
        _depthwise.PARALLEL_MIN_MACS, _quantize.STREAM_MIN_WORK = saved[1], saved[2]
    return rows


_LOAD_PROBE = """
import time, numpy as np
from quantbridge.kernels import PackedLinearWeight, linear
w = np.ones((8, 8), np.int8)
times = []
for target in {targets!r}:
    p = PackedLinearWeight(w, 0.1, 0, None, target=target)
    t0 = time.perf_counter()
    linear(np.ones((2, 8), np.uint8), p, 0.1, 0, 0.5, 0, num_threads=1)
    times.append(round(time.perf_counter() - t0, 4))
print(times)
"""


def measure_cache_load(targets: list[str]) -> list[float] | None:
    """First-call seconds per target in a fresh process (kernels come from numba's cache).

    The probe runs twice; the second run is reported so the cache is warm. The first
    target's time includes numba's one-time setup on its first compiled call.
    """
    import subprocess

    out = None
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", _LOAD_PROBE.format(targets=targets)],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if proc.returncode != 0:
            return None
        out = proc.stdout.strip()
    return [float(t) for t in out.strip("[]").split(",")] if out else None


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'op':9} {'shape':22} {'target':12} {'thr':>3} {'GOPS':>7} {'%peak':>6} "
        f"{'torch':>7} {'ratio':>6} {'us':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        extra = ""
        if "fp32_ratio" in r:
            extra = (
                f"  medians: {r['median_us']} us, ours/torch {r['median_ratio']}, "
                f"ours/fp32 {r['fp32_ratio']}"
            )
        if "percent_of_dense" in r:
            extra = f"  {r['percent_of_dense']} % of this target's dense conv2d GOPS"
        lines.append(
            f"{r['op']:9} {r['shape']:22} {r['target']:12} {r['threads']:>3} {r['gops']:>7} "
            f"{r['percent_of_peak']!s:>6} {r['baseline_gops']!s:>7} "
            f"{r['ratio']!s:>6} {r['microseconds']:>9}{extra}"
        )
    if rows and rows[0]["peak_gops"]:
        lines.append(
            f"measured vpdpbusd peak on {rows[0]['threads']} thread(s): {rows[0]['peak_gops']} GOPS"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python packages/kernels/bench/bench_kernels.py", description=__doc__
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds per side")
    parser.add_argument("--min-time", type=float, default=0.05, help="seconds per round")
    parser.add_argument(
        "--targets",
        default=",".join(t for t in available_targets() if t != "generic"),
        help="comma-separated targets (generic is slow; add it explicitly)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument(
        "--crossover",
        action="store_true",
        help="1 vs 2 threads over growing work per kernel family (thresholds lifted); "
        "--repeat rounds, the first of --targets",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.threads <= max_threads():
        parser.error(f"--threads must be in [1, {max_threads()}]")
    targets = [t for t in args.targets.split(",") if t]
    unknown = [t for t in targets if t not in available_targets()]
    if unknown:
        parser.error(f"targets {unknown} cannot run here; available: {available_targets()}")
    if args.crossover:
        if max_threads() < 2:
            parser.error("--crossover needs numba's pool to have at least 2 threads")
        cross = crossover(args.repeat, targets[0])
        if args.json:
            print(json.dumps(cross, indent=1))
            return 0
        print(f"{'family':10} {'shape':12} {'work':>10} {'1 thread us':>12} {'2 threads us':>13} "
              f"{'speedup':>8}")  # fmt: skip
        for r in cross:
            print(f"{r['family']:10} {r['shape']:12} {r['work']:>10} {r['t1_us']:>12} "
                  f"{r['t2_us']:>13} {r['speedup']:>8}")  # fmt: skip
        return 0
    rows = run(args.threads, args.repeat, args.min_time, targets, args.quick)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(_table(rows))
    if not args.quick:
        loads = measure_cache_load(targets)
        if loads is not None:
            print(
                "first call in a fresh process (cached kernels), seconds per target "
                f"{targets}: {loads} (the first includes numba's one-time setup)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
