"""Properties of find_matches on random graphs and random pattern sets (hypothesis)."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from _complex import find_complex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.fx import Graph, GraphModule, Node

from quantbridge.patterns import MatchAllNode, pattern_operators

UNARY: list[Any] = [nn.ReLU, nn.Identity, nn.Tanh, F.relu, torch.sigmoid, "relu", "sigmoid"]
BINARY: list[Any] = [torch.add, operator.add, torch.mul]
ALL_OPS = UNARY + BINARY


@st.composite
def graphs(draw: st.DrawFn) -> GraphModule:
    """A random DAG: unary and binary ops over earlier values, some values used many times."""
    root = nn.Module()
    graph = Graph()
    values: list[Node] = [graph.placeholder("x")]
    for i in range(draw(st.integers(1, 25))):
        op = draw(st.sampled_from(ALL_OPS))
        # Prefer the latest value so chains form, sometimes reach back for fan-out.
        a = values[-1] if draw(st.booleans()) else draw(st.sampled_from(values))
        if op in BINARY:
            b = draw(st.sampled_from(values))
            node = graph.call_function(op, (a, b))
        elif isinstance(op, str):
            node = graph.call_method(op, (a,))
        elif isinstance(op, type):
            name = f"m{i}"
            root.add_module(name, op())
            node = graph.call_module(name, (a,))
        else:
            node = graph.call_function(op, (a,))
        values.append(node)
    graph.output(values[-1])
    return GraphModule(root, graph)


def _pattern(draw: st.DrawFn, depth: int) -> Any:
    op = draw(st.sampled_from(ALL_OPS))
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        return op
    if op in BINARY:
        args = tuple(
            MatchAllNode if draw(st.booleans()) else _pattern(draw, depth - 1) for _ in range(2)
        )
        return (op, *args)
    return (op, _pattern(draw, depth - 1))


@st.composite
def pattern_sets(draw: st.DrawFn) -> list[Any]:
    n = draw(st.integers(1, 12))
    patterns: list[Any] = []
    for _ in range(n):
        p = _pattern(draw, 3)
        if p not in patterns:
            patterns.append(p)
    return patterns


# An independent, naive reading of the matching rules, used as the specification.
def _fits(gm: GraphModule, value: object, pattern: Any, inner: bool) -> bool:
    op = pattern[0] if isinstance(pattern, tuple) else pattern
    if op is MatchAllNode:
        return True
    if not isinstance(value, Node):
        return False
    if inner and len(value.users) != 1:
        return False
    if isinstance(op, type):
        if value.op != "call_module" or type(gm.get_submodule(str(value.target))) is not op:
            return False
    elif isinstance(op, str):
        if value.op != "call_method" or value.target != op:
            return False
    elif value.op != "call_function" or value.target is not op:
        return False
    if not isinstance(pattern, tuple):
        return True
    subs = pattern[1:]
    return len(subs) == len(value.args) and all(
        _fits(gm, a, s, True) for a, s in zip(value.args, subs, strict=True)
    )


def _size(p: Any) -> int:
    return sum(_size(x) for x in p) if isinstance(p, tuple) else 1


def _priority_order(patterns: list[Any]) -> list[Any]:
    tuples = [p for p in patterns if isinstance(p, tuple)]
    singles = [p for p in patterns if not isinstance(p, tuple)]
    # largest first; among equal sizes, registration order
    return sorted(tuples, key=lambda p: (-_size(p), patterns.index(p))) + singles


def _walk(pattern: Any, value: Any, ops: list[Any], inputs: list[Any]) -> None:
    op = pattern[0] if isinstance(pattern, tuple) else pattern
    if op is MatchAllNode:
        inputs.append(value)
        return
    ops.append(value)
    if isinstance(pattern, tuple):
        for sub, arg in zip(pattern[1:], value.args, strict=True):
            _walk(sub, arg, ops, inputs)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gm=graphs(), patterns=pattern_sets(), mode=st.sampled_from(["prepare", "fuse"]))
def test_matches_are_real_disjoint_and_prioritized(
    gm: GraphModule, patterns: list[Any], mode: Any
) -> None:
    matches = find_complex(gm, patterns, mode=mode)
    order = _priority_order(patterns)
    operator_nodes: set[Node] = set()
    claimed: set[Node] = set()
    for m in matches:
        # a real subgraph: the pattern fits at the anchor, nodes and inputs are where it says
        assert _fits(gm, m.anchor, m.pattern, False)
        ops: list[Any] = []
        inputs: list[Any] = []
        _walk(m.pattern, m.anchor, ops, inputs)
        assert list(m.nodes) == ops
        assert list(m.inputs) == inputs
        assert len(m.nodes) == len(pattern_operators(m.pattern))
        assert m.anchor is m.nodes[0]
        # never overlapping
        assert not operator_nodes & set(m.nodes)
        assert m.anchor not in claimed
        operator_nodes.update(m.nodes)
        claimed.update(m.nodes)
        if mode == "prepare":
            claimed.update(n for n in m.inputs if isinstance(n, Node))
        # priority: no pattern ranked higher fits at this anchor
        rank = order.index(m.pattern)
        assert not any(_fits(gm, m.anchor, p, False) for p in order[:rank])
    # nothing left out: a node no match claimed fits no pattern (else it would be an anchor)
    for node in gm.graph.nodes:
        if node not in claimed:
            assert not any(_fits(gm, node, p, False) for p in patterns), node.format_node()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gm=graphs(), patterns=pattern_sets())
def test_random_graphs_agree_with_torch_ao(gm: GraphModule, patterns: list[Any]) -> None:
    import pytest

    pytest.importorskip("torch.ao.quantization")
    from _patterns_oracle import ao_fuse_map, ao_prepare_map, our_fuse_map, our_prepare_map

    assert our_prepare_map(find_complex(gm, patterns)) == ao_prepare_map(gm, patterns)
    fused = ao_fuse_map(gm, patterns)
    assert our_fuse_map(find_complex(gm, patterns, mode="fuse")) == {
        k: (v[0], v[1]) for k, v in fused.items()
    }


@settings(max_examples=60, deadline=None)
@given(gm=graphs(), patterns=pattern_sets())
def test_deterministic(gm: GraphModule, patterns: list[Any]) -> None:
    first = [(m.anchor.name, m.pattern) for m in find_complex(gm, patterns)]
    second = [(m.anchor.name, m.pattern) for m in find_complex(gm, patterns)]
    assert first == second
