"""Matcher and rewriter compile patterns alike but read them differently where they differ.

find_matches keeps torch.ao's decisions: inner operator nodes have one user (checked against
torch.ao where it is installed), an operator without argument patterns takes any
arguments, ``(getattr, name)`` checks only the name. The rewriter matches arguments exactly
and lets inner nodes have several users as long as all of them are inside the match.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _complex import find_complex, typed
from torch import nn
from torch.fx import Graph, GraphModule, Node

from quantbridge.patterns import ReplacementPattern, find_rewrite_matches

SHAPE = (getattr, "shape")
RELU_FEEDS_ADD_TWICE = (torch.add, torch.relu, (torch.sigmoid, torch.relu))
SIGMOID_ANY_ARGS = (torch.sigmoid,)
PATTERNS = [SHAPE, RELU_FEEDS_ADD_TWICE, SIGMOID_ANY_ARGS]


def _graph() -> GraphModule:
    graph = Graph()
    x = graph.placeholder("x")
    shape = graph.call_function(getattr, (x, "shape", None))  # with a default argument
    relu = graph.call_function(torch.relu, (x,))
    sigmoid = graph.call_function(torch.sigmoid, (relu,))
    add = graph.call_function(torch.add, (relu, sigmoid))  # relu: two users, both inside
    graph.output((shape, add))
    return GraphModule(nn.Module(), graph)


def _names(nodes: tuple[Node, ...]) -> tuple[str, ...]:
    return tuple(n.name for n in nodes)


def test_find_matches_reads_patterns_as_torch_ao_does() -> None:
    found = find_complex(_graph(), PATTERNS)
    assert [(m.pattern, _names(m.nodes)) for m in found] == [
        (SIGMOID_ANY_ARGS, ("sigmoid",)),
        (SHAPE, ("getattr_1",)),
    ]


def test_find_matches_agrees_with_torch_ao_there() -> None:
    pytest.importorskip("torch.ao.quantization.fx.match_utils")
    from _patterns_oracle import ao_prepare_map, our_prepare_map

    # torch.ao matches (op,) and (getattr, name) but fails recording them (IndexError), so
    # only the one-user rule is compared; the single operators make the map non-empty.
    gm = _graph()
    patterns = [RELU_FEEDS_ADD_TWICE, torch.sigmoid, torch.relu]
    expected = ao_prepare_map(gm, patterns)
    assert set(expected) == {"sigmoid", "relu"}
    assert our_prepare_map(find_complex(gm, patterns)) == expected


def test_the_rewriter_reads_the_same_patterns_exactly() -> None:
    def keep(match: Any, graph: Graph) -> Any:
        return match.anchor

    rules = [ReplacementPattern(pattern=typed(p), build=keep, name=repr(p)) for p in PATTERNS]
    found = find_rewrite_matches(_graph(), rules)
    assert [(m.rule.name, _names(m.nodes)) for m in found] == [
        (repr(RELU_FEEDS_ADD_TWICE), ("add", "relu", "sigmoid", "relu")),
    ]
