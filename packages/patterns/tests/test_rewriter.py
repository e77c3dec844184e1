"""The subgraph rewriter: matching, argument constraints, replacement, meta, dead code."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _complex import typed
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.fx import Graph, GraphModule, Node, symbolic_trace

from quantbridge.patterns import (
    ArgConstraint,
    MatchAllNode,
    Nested,
    PatternError,
    ReplacementPattern,
    RewriteMatch,
    find_rewrite_matches,
    replace_pattern,
)


# Stand-ins for the quantize/dequantize ops of a reference model: leaf functions for FX.
@torch.fx.wrap
def dequantize(x: torch.Tensor, scale: float, zero_point: int, dtype: torch.dtype) -> torch.Tensor:
    return (x.to(torch.float32) - zero_point) * scale


@torch.fx.wrap
def quantize(x: torch.Tensor, scale: float, zero_point: int, dtype: torch.dtype) -> torch.Tensor:
    info = torch.iinfo(dtype)
    return torch.clamp(torch.round(x / scale) + zero_point, info.min, info.max).to(dtype)


@torch.fx.wrap
def dequant_relu_u8(x: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """What a backend would call instead of dequantize(uint8) -> relu."""
    return torch.clamp(x.to(torch.float32) - zero_point, min=0) * scale


class Reference(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x = torch.relu(dequantize(a, 0.5, 3, torch.uint8))
        y = torch.relu(dequantize(b, 0.25, 0, dtype=torch.int8))
        z = torch.relu(dequantize(a, 0.125, 7, dtype=torch.uint8))
        return quantize(x + y + z, 0.1, 2, torch.uint8)


DEQUANT_RELU = (torch.relu, (dequantize, MatchAllNode, MatchAllNode, MatchAllNode))
UINT8 = ArgConstraint(op=1, position=3, keyword="dtype", equals=torch.uint8)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (4, 5), generator=g, dtype=torch.int32).to(torch.uint8)
    b = torch.randint(-128, 128, (4, 5), generator=g, dtype=torch.int32).to(torch.int8)
    return a, b


def _build_dequant_relu(match: RewriteMatch, graph: Graph) -> Node:
    deq = match.nodes[1]
    x, scale, zero_point = deq.args[:3]
    return graph.call_function(dequant_relu_u8, (x, scale, zero_point))


def test_constraint_selects_uint8_dequantize_and_callback_builds_nodes() -> None:
    gm = symbolic_trace(Reference())
    a, b = _inputs()
    expected = gm(a, b)
    # dequantize has 4 positional args in the first call but 3 + dtype= in the third:
    # the complex pattern needs exactly 3 positional args, so only the kwarg forms match.
    rule = ReplacementPattern(
        pattern=typed(DEQUANT_RELU), build=_build_dequant_relu, constraints=[UINT8]
    )
    matches = replace_pattern(gm, rule)
    assert [m.anchor.name for m in matches] == ["relu_2"]  # the int8 one is refused
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(dequant_relu_u8) == 1
    assert targets.count(dequantize) == 2
    gm.graph.lint()
    torch.testing.assert_close(gm(a, b), expected, rtol=0, atol=0)


def test_constraint_by_position_and_predicate() -> None:
    gm = symbolic_trace(Reference())
    pattern = (torch.relu, (dequantize, MatchAllNode, MatchAllNode, MatchAllNode, MatchAllNode))
    rule = ReplacementPattern(
        pattern=typed(pattern),
        build=_build_dequant_relu,
        constraints=[
            ArgConstraint(op=1, position=3, predicate=lambda d: d in (torch.uint8,)),
            ArgConstraint(op=1, position=1, predicate=lambda s: s > 0.25),
        ],
    )
    assert [m.anchor.name for m in find_rewrite_matches(gm, rule)] == ["relu"]


def test_traced_function_pattern_with_literal_dtype() -> None:
    """A traced pattern: its literal dtype must be equal in the graph, its parameters bind."""

    def pattern(x: torch.Tensor, s: float, z: int) -> torch.Tensor:
        return torch.relu(dequantize(x, s, z, dtype=torch.uint8))

    def replacement(x: torch.Tensor, s: float, z: int) -> torch.Tensor:
        return dequant_relu_u8(x, s, z)

    gm = symbolic_trace(Reference())
    a, b = _inputs()
    expected = gm(a, b)
    matches = replace_pattern(gm, ReplacementPattern(pattern_fn=pattern, replacement=replacement))
    assert [m.anchor.name for m in matches] == ["relu_2"]
    assert matches[0].inputs[1:] == (0.125, 7)
    torch.testing.assert_close(gm(a, b), expected, rtol=0, atol=0)


def test_same_parameter_twice_must_bind_the_same_value() -> None:
    graph = Graph()
    x = graph.placeholder("x")
    y = graph.placeholder("y")
    same = graph.call_function(operator.add, (x, x))
    other = graph.call_function(operator.add, (x, y))
    graph.output(graph.call_function(operator.mul, (same, other)))
    gm = GraphModule(nn.Module(), graph)
    rule = ReplacementPattern(pattern_fn=lambda v: v + v, replacement=lambda v: v * 2)
    matches = replace_pattern(gm, rule)
    assert [m.anchor.name for m in matches] == ["add"]
    t = torch.randn(3)
    u = torch.randn(3)
    torch.testing.assert_close(gm(t, u), (t + t) * (t + u), rtol=0, atol=0)


def test_inner_node_with_outside_user_blocks_the_match() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            s = x + 1
            return F.relu(s), s * 2

    gm = symbolic_trace(M())
    rule = ReplacementPattern(
        pattern=typed((F.relu, (operator.add, MatchAllNode, MatchAllNode))),
        replacement=lambda x, c: torch.clamp(x + c, min=0),
    )
    assert replace_pattern(gm, rule) == []


def test_meta_is_preserved_and_dead_nodes_removed() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("k", torch.tensor(3.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.relu(torch.mul(x, self.k)) - 1

    gm = symbolic_trace(M())
    relu = next(n for n in gm.graph.nodes if n.target is F.relu)
    sub = next(n for n in gm.graph.nodes if n.target is operator.sub)
    relu.meta.update({"stack_trace": "model.py:7", "val": "relu-value", "tag": 1})
    sub.meta["tag"] = 2
    rule = ReplacementPattern(
        pattern=typed((F.relu, (torch.mul, MatchAllNode, MatchAllNode))),
        # drops the buffer input: its get_attr node becomes dead and must go
        replacement=lambda x, k: torch.clamp(x * 3.0, min=0.0).neg().neg(),
    )
    x = torch.randn(5)
    expected = gm(x)
    replace_pattern(gm, rule)
    ops = [n.op for n in gm.graph.nodes]
    assert "get_attr" not in ops
    assert not any(n.target in (F.relu, torch.mul) for n in gm.graph.nodes)
    result = next(iter(sub.args))
    assert isinstance(result, Node)
    assert result.meta == {"stack_trace": "model.py:7", "val": "relu-value", "tag": 1}
    inner = result.args[0]
    assert isinstance(inner, Node)
    # intermediate nodes get the anchor's non-value meta only
    assert inner.meta == {"stack_trace": "model.py:7", "tag": 1}
    assert sub.meta["tag"] == 2
    torch.testing.assert_close(gm(x), expected)


def test_chained_matches_feed_each_other() -> None:
    """One match's anchor is the next match's input; both get replaced."""
    graph = Graph()
    x = graph.placeholder("x")
    for _ in range(3):
        x = graph.call_function(torch.relu, (graph.call_function(torch.add, (x, 1.0)),))
    graph.output(x)
    gm = GraphModule(nn.Module(), graph)
    t = torch.randn(6)
    expected = gm(t)
    rule = ReplacementPattern(
        pattern=typed((torch.relu, (torch.add, MatchAllNode, MatchAllNode))),
        replacement=lambda a, b: torch.clamp(torch.add(a, b), min=0),
    )
    assert len(replace_pattern(gm, rule)) == 3
    assert not any(n.target is torch.relu for n in gm.graph.nodes)
    torch.testing.assert_close(gm(t), expected, rtol=0, atol=0)


UNARY = [torch.relu, torch.sigmoid, torch.tanh]


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "mul", *range(3)]), st.integers(0, 50)),
        min_size=1,
        max_size=20,
    ),
    seed=st.integers(0, 2**16),
)
def test_random_graphs_keep_outputs(ops: list[tuple[Any, int]], seed: int) -> None:
    """relu(add(a, b)) -> clamp(a + b, min=0) and sigmoid(x) -> 1/(1+exp(-x)) never change
    the outputs, on random graphs with fan-out."""
    graph = Graph()
    values: list[Node] = [graph.placeholder("x"), graph.placeholder("y")]
    for op, pick in ops:
        a = values[-1]
        b = values[pick % len(values)]
        if op == "add":
            values.append(graph.call_function(torch.add, (a, b)))
        elif op == "mul":
            values.append(graph.call_function(torch.mul, (a, b)))
        else:
            values.append(graph.call_function(UNARY[int(op)], (a,)))
    graph.output(tuple(values[2:]))
    gm = GraphModule(nn.Module(), graph)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(7, generator=g), torch.randn(7, generator=g)
    expected = gm(x, y)
    rules = [
        ReplacementPattern(
            pattern=typed((torch.relu, (torch.add, MatchAllNode, MatchAllNode))),
            replacement=lambda a, b: torch.clamp(torch.add(a, b), min=0),
        ),
        ReplacementPattern(pattern=typed(torch.sigmoid), build=_sigmoid_by_hand),
    ]
    n_relu_add = sum(
        1
        for n in graph.nodes
        if n.target is torch.relu
        and isinstance(n.args[0], Node)
        and n.args[0].target is torch.add
        and len(n.args[0].users) == 1
    )
    n_sigmoid = sum(1 for n in graph.nodes if n.target is torch.sigmoid)
    matches = replace_pattern(gm, rules)
    assert len(matches) == n_relu_add + n_sigmoid
    gm.graph.lint()
    got = gm(x, y)
    assert len(got) == len(expected)
    for g_out, e_out in zip(got, expected, strict=True):
        torch.testing.assert_close(g_out, e_out, rtol=1e-6, atol=1e-6)


def _sigmoid_by_hand(match: RewriteMatch, graph: Graph) -> Node:
    (x,) = match.anchor.args
    e = graph.call_function(torch.exp, (graph.call_function(torch.neg, (x,)),))
    return graph.call_function(torch.reciprocal, (graph.call_function(torch.add, (e, 1.0)),))


def test_errors() -> None:
    with pytest.raises(PatternError, match="exactly one of pattern"):
        ReplacementPattern(replacement=lambda x: x)
    with pytest.raises(PatternError, match="exactly one of replacement"):
        ReplacementPattern(pattern=typed(torch.relu))
    with pytest.raises(PatternError, match=r"args\[0\].*not a pattern element"):
        ReplacementPattern(pattern=Nested(torch.relu, 3), replacement=lambda: None)
    with pytest.raises(PatternError, match=r"bare tuple.*ambiguous.*Chain\(.*Nested\("):
        ReplacementPattern(pattern=(torch.relu, MatchAllNode), replacement=lambda v: v)
    with pytest.raises(PatternError, match=r"takes 2 input.*binds 1"):
        ReplacementPattern(
            pattern=typed((torch.relu, MatchAllNode)), replacement=lambda a, b: torch.add(a, b)
        )
    with pytest.raises(PatternError, match="op=2 but the pattern has 2"):
        ReplacementPattern(
            pattern=typed(DEQUANT_RELU),
            build=_build_dequant_relu,
            constraints=[ArgConstraint(op=2, position=0, equals=1)],
        )
    with pytest.raises(PatternError, match="position= or keyword="):
        ArgConstraint(equals=1)
    with pytest.raises(PatternError, match="exactly one of equals"):
        ArgConstraint(position=0)
    with pytest.raises(PatternError, match="call_module"):
        ReplacementPattern(
            pattern=typed((torch.relu, MatchAllNode)),
            replacement=symbolic_trace(nn.Sequential(nn.ReLU())),
        )
    rule = ReplacementPattern(pattern=typed(torch.relu), build=_sigmoid_by_hand)
    with pytest.raises(PatternError, match="GraphModule"):
        replace_pattern(nn.ReLU(), rule)  # type: ignore[arg-type]
    with pytest.raises(PatternError, match=r"single output|one operation"):
        ReplacementPattern(pattern_fn=lambda x: x, replacement=lambda x: x)
    gm = symbolic_trace(Reference())
    bad = ReplacementPattern(pattern=typed(torch.relu), build=lambda m, g: 3)
    with pytest.raises(PatternError, match="not a graph node"):
        replace_pattern(gm, bad)


def test_keyword_default_and_missing_argument() -> None:
    graph = Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(F.hardtanh, (x,)))
    gm = GraphModule(nn.Module(), graph)
    found = ArgConstraint(position=1, keyword="min_val", default=-1.0, equals=-1.0)
    missing = ArgConstraint(position=1, keyword="min_val", equals=-1.0)
    rule = ReplacementPattern(
        pattern=typed(F.hardtanh), build=_sigmoid_by_hand, constraints=[found]
    )
    assert len(find_rewrite_matches(gm, rule)) == 1
    rule = ReplacementPattern(
        pattern=typed(F.hardtanh), build=_sigmoid_by_hand, constraints=[missing]
    )
    assert find_rewrite_matches(gm, rule) == []


# --- first-argument index ------------------------------------------------------------------


class _ReluOverMany(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.bn = nn.BatchNorm2d(2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.relu(self.conv(x)), torch.relu(self.bn(x)), torch.relu(x)


def _rule(pattern: Any, name: str) -> ReplacementPattern:
    return ReplacementPattern(pattern=typed(pattern), build=lambda m, g: m.anchor, name=name)


def test_rules_sharing_an_anchor_keep_their_order_across_first_argument_operators() -> None:
    gm = symbolic_trace(_ReluOverMany())
    rules = [
        _rule((torch.relu, nn.Conv2d), "relu(conv)"),
        _rule((torch.relu, MatchAllNode), "relu(any)"),
        _rule((torch.relu, nn.BatchNorm2d), "relu(bn)"),
    ]
    found = {m.anchor.name: m.rule.name for m in find_rewrite_matches(gm, rules)}
    # relu(bn) comes after relu(any) in the list, so relu(any) takes the bn node's relu
    assert found == {"relu": "relu(conv)", "relu_1": "relu(any)", "relu_2": "relu(any)"}
    found = {m.anchor.name: m.rule.name for m in find_rewrite_matches(gm, rules[::-1])}
    assert found == {"relu": "relu(any)", "relu_1": "relu(bn)", "relu_2": "relu(any)"}


def test_a_node_is_only_tried_against_rules_whose_first_argument_operator_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from quantbridge.patterns import _rewriter

    gm = symbolic_trace(_ReluOverMany())
    fillers = [torch.sigmoid, torch.tanh, F.gelu, F.silu, torch.exp, torch.neg, torch.abs]
    rules = [_rule((torch.relu, f), f"relu({f.__name__})") for f in fillers]
    rules.append(_rule((torch.relu, nn.Conv2d), "relu(conv)"))
    tried: list[str] = []
    original = _rewriter._try

    def counting(rule: ReplacementPattern, node: Node, resolver: Any) -> RewriteMatch | None:
        tried.append(f"{rule.name}@{node.name}")
        return original(rule, node, resolver)

    monkeypatch.setattr(_rewriter, "_try", counting)
    found = find_rewrite_matches(gm, rules)
    assert [(m.anchor.name, m.rule.name) for m in found] == [("relu", "relu(conv)")]
    # the relus over bn and over the placeholder have no candidate rule at all
    assert tried == ["relu(conv)@relu"]
