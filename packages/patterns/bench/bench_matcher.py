"""Side-by-side timing: quantbridge.patterns.find_matches vs torch.ao's matcher.

Both match the same large graph against torch.ao's full native pattern set (complex format,
~190 patterns), in one process, alternating runs (heap collected before and the collector
paused during each run); the table reports the best and the median of each and their ratio.
It first checks that both assign every node to the same pattern.

    python packages/patterns/bench/bench_matcher.py [--nodes 20000] [--repeat 5] [--json]
    python packages/patterns/bench/bench_matcher.py --scaling 2500,5000,10000,20000,40000
"""

from __future__ import annotations

import argparse
import gc
import json
import operator
import platform
import statistics
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Graph, GraphModule

from quantbridge.patterns import MatchAllNode, Nested, find_matches


def build_graph(target_nodes: int) -> GraphModule:
    """A long graph mixing module, functional, method and binary nodes (~20 per block)."""
    graph = Graph()
    root = nn.Module()
    x = graph.placeholder("x")
    i = 0
    while len(graph.nodes) < target_nodes:
        names = {}
        for kind, cls in (
            ("c", nn.Conv2d),
            ("b", nn.BatchNorm2d),
            ("r", nn.ReLU),
            ("l", nn.Linear),
            ("s", nn.Sigmoid),
        ):
            name = f"{kind}{i}"
            root.add_module(
                name,
                cls(2, 2, 1)
                if cls is nn.Conv2d
                else cls(2)
                if cls is nn.BatchNorm2d
                else cls(2, 2)
                if cls is nn.Linear
                else cls(),
            )
            names[kind] = name
        skip = x
        x = graph.call_module(names["c"], (x,))
        x = graph.call_module(names["b"], (x,))
        x = graph.call_module(names["r"], (x,))
        x = graph.call_function(torch.add, (x, skip))
        x = graph.call_function(F.relu, (x,))
        y = graph.call_module(names["l"], (x,))
        y = graph.call_function(F.relu, (y,))
        y = graph.call_method("sigmoid", (y,))
        y = graph.call_function(operator.mul, (y, 0.5))
        y = graph.call_method("flatten", (y,))
        y = graph.call_method("reshape", (y, -1))
        y = graph.call_function(torch.mean, (y,))
        x = graph.call_function(operator.add, (x, y))
        x = graph.call_method("relu", (x,))
        x = graph.call_module(names["s"], (x,))
        z = graph.call_method("view", (x, -1))
        z = graph.call_method("contiguous", (z,))
        x = graph.call_function(torch.sub, (x, graph.call_function(torch.mean, (z,))))
        x = graph.call_function(F.hardtanh, (x,))
        x = graph.call_function(torch.clamp, (x, -1.0, 1.0))
        i += 1
    graph.output(x)
    return GraphModule(root, graph)


def native_patterns() -> tuple[list[Any], list[Any]]:
    """(torch.ao-form, quantbridge-form) native patterns in registration order."""
    import torch.ao.quantization.backend_config.utils  # noqa: F401  (2.13: must come first)
    from torch.ao.quantization.backend_config import get_native_backend_config
    from torch.ao.quantization.utils import MatchAllNode as AoMatchAllNode

    def ours(p: Any) -> Any:
        if isinstance(p, tuple):
            return tuple(ours(q) for q in p)
        return MatchAllNode if p is AoMatchAllNode else p

    ao = list(get_native_backend_config()._pattern_complex_format_to_config)
    # find_matches refuses bare tuples (ambiguous order): torch.ao's are root-first
    return ao, [Nested.from_tuple(ours(p)) if isinstance(p, tuple) else ours(p) for p in ao]


class _Handler:
    def __init__(self, node_pattern: Any, modules: Any, root_node_getter: Any = None) -> None:
        self.node_pattern = node_pattern


def run_ao(gm: GraphModule, ao_patterns: list[Any]) -> dict[str, tuple[str, Any]]:
    from torch.ao.quantization.fx.match_utils import _find_matches
    from torch.ao.quantization.fx.pattern_utils import _sorted_patterns_dict

    table = _sorted_patterns_dict(dict.fromkeys(ao_patterns, _Handler))
    result = _find_matches(gm.graph, dict(gm.named_modules()), table, {})
    return {name: (v[0].name, v[2]) for name, v in result.items()}


def run_ours(gm: GraphModule, patterns: list[Any]) -> dict[str, tuple[str, Any]]:
    out: dict[str, tuple[str, Any]] = {}
    for m in find_matches(gm, patterns):
        for n in m.claimed:
            out[n.name] = (m.anchor.name, m.pattern)
    return out


def _timed(fn: Any, *fn_args: Any) -> float:
    # Same conditions for every run: a clean heap and no collector pauses inside the run.
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn(*fn_args)
        return time.perf_counter() - t0
    finally:
        gc.enable()


def scaling(patterns: list[Any], sizes: list[int], repeat: int) -> None:
    print("| nodes | best (ms) | best per node (us) |")
    print("| ---: | ---: | ---: |")
    for size in sizes:
        gm = build_graph(size)
        best = min(_timed(run_ours, gm, patterns) for _ in range(repeat))
        n = len(gm.graph.nodes)
        print(f"| {n} | {best * 1e3:.1f} | {best / n * 1e6:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--scaling",
        default="",
        help="comma-separated graph sizes: time quantbridge alone at each (linear cost check)",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    ao_patterns, patterns = native_patterns()
    if args.scaling:
        scaling(patterns, [int(n) for n in args.scaling.split(",")], args.repeat)
        return

    gm = build_graph(args.nodes)
    index = {id(p): q for p, q in zip(ao_patterns, patterns, strict=True)}
    # Same decisions first: a speed ratio between different answers means nothing.
    ao_map = {k: (a, index[id(p)]) for k, (a, p) in run_ao(gm, ao_patterns).items()}
    if ao_map != run_ours(gm, patterns):
        raise SystemExit("the two matchers disagree on this graph; no timing reported")

    times: dict[str, list[float]] = {"quantbridge": [], "torch.ao": []}
    for _ in range(args.repeat):
        for name, fn, pats in (
            ("torch.ao", run_ao, ao_patterns),
            ("quantbridge", run_ours, patterns),
        ):
            times[name].append(_timed(fn, gm, pats))

    best = {k: min(v) for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "nodes": len(gm.graph.nodes),
        "patterns": len(patterns),
        "matched_nodes": len(ao_map),
        "repeat": args.repeat,
        "best_s": best,
        "median_s": median,
        "speedup_best": best["torch.ao"] / best["quantbridge"],
        "speedup_median": median["torch.ao"] / median["quantbridge"],
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"graph: {result['nodes']} nodes, {result['patterns']} native patterns, "
        f"{result['matched_nodes']} nodes matched (identical assignment in both)"
    )
    print("| matcher | best (ms) | median (ms) |")
    print("| --- | ---: | ---: |")
    for name in ("torch.ao", "quantbridge"):
        print(f"| {name} | {best[name] * 1e3:.1f} | {median[name] * 1e3:.1f} |")
    print(
        f"speedup (torch.ao / quantbridge): best {result['speedup_best']:.1f}x, "
        f"median {result['speedup_median']:.1f}x"
    )


if __name__ == "__main__":
    main()
