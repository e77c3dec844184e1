"""Weight-only group-quantized linear (``linear_weight_only``): decode GEMV bandwidth against a
streaming read, and prefill throughput.

Decode (M = 1) is a stream over the packed weight: each row reports the call's time, the
weight bytes it read per second (``PackedGroupWeight.nbytes``: codes, scales, zero points)
and, from the same run and thread count, a plain streaming read of a buffer of the same byte
count (64-byte vector loads summed into four accumulators, the prange split the kernel uses),
and their ratio. ``--cold`` rotates each side over copies filling 128 MB, so every call reads
from memory rather than from the last-level cache (a decoder's layers evict each other);
without it each side rereads one buffer (the smaller shapes then stream from L3). Each figure
is the fastest call over ``--repeat`` interleaved rounds (the machine is shared: the fastest
call is the least disturbed one).

Prefill (M = 512) reports GOPS (2 * M * N * K / time).

    python packages/kernels/bench/bench_weight_only.py [--threads 1,2] [--targets avx512_vnni]
        [--repeat 5] [--cold] [--json] [--quick]

Shapes: TinyLlama's (hidden 2048, MLP 5632, vocabulary 32000), group size 32.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from quantbridge.kernels import (
    available_targets,
    best_target,
    linear_weight_only,
    pack_group_weight,
    set_num_threads,
)
from quantbridge.kernels._threads import max_threads, with_threads

GEMV_SHAPES = ((2048, 2048), (5632, 2048), (2048, 5632), (32000, 2048))  # (N, K)
PREFILL_SHAPE = (512, 2048, 2048)  # (M, N, K)
QUICK_GEMV = ((256, 512),)
QUICK_PREFILL = (16, 256, 512)
GROUP = 32
COLD_BYTES = 128 << 20
_LOADS = 4  # 64-byte loads per step of the streaming read
_STEP = 64 * _LOADS


def _read_codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
    data = context.make_array(sig.args[0])(context, builder, args[0]).data
    lo, hi = args[1], args[2]
    i64 = ir.IntType(64)
    vt = ir.VectorType(ir.IntType(32), 16)
    accs = [cgutils.alloca_once_value(builder, ir.Constant(vt, [0] * 16)) for _ in range(_LOADS)]
    base = builder.gep(data, [lo])
    steps = builder.udiv(builder.sub(hi, lo), ir.Constant(i64, _STEP))
    with cgutils.for_range(builder, steps) as loop:
        at = builder.mul(loop.index, ir.Constant(i64, _STEP))
        for u, acc in enumerate(accs):
            ptr = builder.gep(base, [builder.add(at, ir.Constant(i64, 64 * u))])
            value = builder.load(builder.bitcast(ptr, vt.as_pointer()))
            value.align = 1
            builder.store(builder.add(builder.load(acc), value), acc)
    total = builder.load(accs[0])
    for acc in accs[1:]:
        total = builder.add(total, builder.load(acc))
    lane = builder.extract_element(total, ir.Constant(ir.IntType(32), 0))
    return builder.sext(lane, i64)


@intrinsic
def _read_sum(typingctx: Any, buf: Any, lo: Any, hi: Any) -> Any:
    """A lane of the int32 sum of ``buf[lo:hi]`` (uint8, whole 256-byte steps), read with
    64-byte vector loads: plain LLVM vector IR, no target-specific instruction."""
    return types.int64(buf, types.int64, types.int64), _read_codegen


@numba.njit(nogil=True, parallel=True)
def _stream(buf: Any, chunks: int) -> int:
    per = buf.size // chunks // _STEP * _STEP
    acc = np.zeros(chunks, np.int64)
    for c in numba.prange(chunks):
        acc[c] = _read_sum(buf, c * per, (c + 1) * per)  # type: ignore[call-arg]
    return int(acc.sum())


@numba.njit(nogil=True)
def _stream_one(buf: Any, chunks: int) -> int:
    return _read_sum(buf, 0, buf.size // _STEP * _STEP)  # type: ignore[call-arg,no-any-return]


def _fastest(fns: tuple[Callable[[], object], ...], repeat: int, calls: int) -> list[float]:
    """Fastest call of each function over ``repeat`` rounds of ``calls`` calls each, the
    functions taking turns round by round."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            fn()
            for _ in range(calls):
                start = time.perf_counter()
                fn()
                best[i] = min(best[i], time.perf_counter() - start)
    return best


def _codes(rng: np.random.Generator, n: int, k: int, bits: int) -> Any:
    top = 1 << (bits - 1)
    return rng.integers(-top, top, (n, k)).astype(np.int8)


def gemv_rows(
    target: str, threads: int, repeat: int, cold: bool, shapes: tuple[tuple[int, int], ...]
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    rows = []
    stream = _stream_one if threads == 1 else with_threads(_stream, threads)
    for bits in (4, 8):
        for n, k in shapes:
            codes = _codes(rng, n, k, bits)
            scales = rng.uniform(0.001, 0.02, (n, k // GROUP)).astype(np.float32)
            first = pack_group_weight(codes, scales, bits=bits, group_size=GROUP, target=target)
            copies = max(2, -(-COLD_BYTES // first.nbytes)) if cold else 1
            weights = [first] + [
                pack_group_weight(codes, scales, bits=bits, group_size=GROUP, target=target)
                for _ in range(copies - 1)
            ]
            buffers = [np.ones(first.nbytes, np.uint8) for _ in range(copies)]
            x = rng.standard_normal((1, k)).astype(np.float32)
            turn = [0, 0]

            def kernel(weights: list[Any] = weights, x: Any = x, turn: list[int] = turn) -> object:
                turn[0] = (turn[0] + 1) % len(weights)
                return linear_weight_only(x, weights[turn[0]])

            def read(buffers: list[Any] = buffers, turn: list[int] = turn) -> object:
                turn[1] = (turn[1] + 1) % len(buffers)
                return stream(buffers[turn[1]], threads)

            t_kernel, t_read = _fastest((kernel, read), repeat, max(10, copies))
            rows.append(
                {
                    "op": "gemv",
                    "target": target,
                    "threads": threads,
                    "cache": "cold" if cold else "hot",
                    "bits": bits,
                    "shape": [1, n, k],
                    "weight_bytes": first.nbytes,
                    "us": t_kernel * 1e6,
                    "gbps": first.nbytes / t_kernel / 1e9,
                    "stream_us": t_read * 1e6,
                    "stream_gbps": first.nbytes / t_read / 1e9,
                    "ratio": t_read / t_kernel,
                }
            )
    return rows


def prefill_rows(
    target: str, threads: int, repeat: int, shape: tuple[int, int, int]
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    m, n, k = shape
    rows = []
    for bits in (4, 8):
        scales = rng.uniform(0.001, 0.02, (n, k // GROUP)).astype(np.float32)
        packed = pack_group_weight(_codes(rng, n, k, bits), scales, bits=bits, group_size=GROUP,
                                   target=target)  # fmt: skip
        x = rng.standard_normal((m, k)).astype(np.float32)
        (t,) = _fastest((lambda p=packed, x=x: linear_weight_only(x, p),), repeat, 2)
        rows.append(
            {
                "op": "prefill",
                "target": target,
                "threads": threads,
                "bits": bits,
                "shape": [m, n, k],
                "us": t * 1e6,
                "gops": 2 * m * n * k / t / 1e9,
            }
        )
    return rows


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| target | threads | cache | bits | N x K | us | weight GB/s | stream GB/s | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["op"] == "gemv":
            lines.append(
                f"| {r['target']} | {r['threads']} | {r['cache']} | {r['bits']} | "
                f"{r['shape'][1]} x {r['shape'][2]} | {r['us']:.1f} | {r['gbps']:.1f} | "
                f"{r['stream_gbps']:.1f} | {r['ratio']:.2f} |"
            )
    lines += ["", "| target | threads | bits | M x N x K | ms | GOPS |", "|" + " --- |" * 6]
    for r in rows:
        if r["op"] == "prefill":
            m, n, k = r["shape"]
            lines.append(
                f"| {r['target']} | {r['threads']} | {r['bits']} | {m} x {n} x {k} | "
                f"{r['us'] / 1e3:.2f} | {r['gops']:.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--targets", default=None, help="comma-separated (default: the best)")
    parser.add_argument("--repeat", type=int, default=5, help="interleaved rounds per figure")
    parser.add_argument("--cold", action="store_true", help="rotate over 128 MB of copies")
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    args = parser.parse_args(argv)
    targets = args.targets.split(",") if args.targets else [best_target()]
    for target in targets:
        if target not in available_targets():
            parser.error(f"target {target!r} is not available here: {available_targets()}")
    counts = [int(t) for t in args.threads.split(",")]
    if any(not 1 <= t <= max_threads() for t in counts):
        parser.error(f"thread counts must be in [1, {max_threads()}]")
    gemv = QUICK_GEMV if args.quick else GEMV_SHAPES
    prefill = QUICK_PREFILL if args.quick else PREFILL_SHAPE
    rows: list[dict[str, Any]] = []
    try:
        for target in targets:
            for threads in counts:
                set_num_threads(threads)
                rows += gemv_rows(target, threads, args.repeat, args.cold, gemv)
                rows += prefill_rows(target, threads, args.repeat, prefill)
    finally:
        set_num_threads(None)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{cpu_model()}; numba {numba.__version__}; group size {GROUP}")
        print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
