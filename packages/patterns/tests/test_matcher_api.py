"""find_matches: API details, hooks and errors."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from _complex import find_complex
from _patterns_zoo import parametrized_model
from torch import nn
from torch.fx import Graph, GraphModule, symbolic_trace

from quantbridge.patterns import (
    MatchAllNode,
    Nested,
    PatternError,
    find_matches,
    sequential_to_complex,
    sort_patterns,
)


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.bn = nn.BatchNorm2d(2)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn(self.conv(x)))
        return torch.sigmoid(y).view(-1) + 1


def _names(matches: list) -> list[tuple[str, ...]]:  # type: ignore[type-arg]
    return [tuple(n.name for n in m.nodes) for m in matches]


def test_longer_patterns_win_and_nodes_are_in_pattern_order() -> None:
    gm = symbolic_trace(Chain())
    patterns = [
        nn.ReLU,
        sequential_to_complex((nn.BatchNorm2d, nn.ReLU)),
        sequential_to_complex((nn.Conv2d, nn.BatchNorm2d, nn.ReLU)),
        nn.Conv2d,
    ]
    matches = find_complex(gm, patterns)
    assert _names(matches) == [("relu", "bn", "conv")]
    m = matches[0]
    assert m.anchor.name == "relu"
    assert m.root.name == "conv"  # default root: the first op of the chain
    assert m.inputs == ()
    assert m.node_pattern == [m.nodes[0], (m.nodes[1], m.nodes[2])]


def test_sequential_patterns_longer_than_three() -> None:
    gm = symbolic_trace(Chain())
    four = sequential_to_complex((nn.Conv2d, nn.BatchNorm2d, nn.ReLU, torch.sigmoid))
    five = sequential_to_complex((nn.Conv2d, nn.BatchNorm2d, nn.ReLU, torch.sigmoid, "view"))
    matches = find_complex(gm, [four, five, operator.add])
    # view is called as view(sigmoid, -1): two positional args, so the 5-chain cannot match
    assert _names(matches) == [("add",), ("sigmoid", "relu", "bn", "conv")]
    with_input = (("view", four, MatchAllNode), operator.add)
    matches = find_complex(gm, list(with_input))
    assert _names(matches) == [("add",), ("view", "sigmoid", "relu", "bn", "conv")]
    assert matches[1].inputs == (-1,)


def test_registration_order_breaks_ties() -> None:
    gm = symbolic_trace(Chain())
    a = Nested(nn.ReLU, nn.BatchNorm2d)
    b = Nested(nn.ReLU, MatchAllNode)
    assert find_matches(gm, [a, b])[0].pattern == a
    assert find_matches(gm, [b, a])[0].pattern == b
    longest = Nested(nn.ReLU, Nested(nn.BatchNorm2d, nn.Conv2d))
    assert sort_patterns([nn.ReLU, a, longest]) == [longest, a, nn.ReLU]


def test_match_all_node_binds_constants_and_multi_user_nodes() -> None:
    gm = symbolic_trace(Chain())
    matches = find_complex(gm, [(operator.add, "view", MatchAllNode)])
    assert len(matches) == 1
    assert matches[0].inputs == (1,)
    assert matches[0].claimed == matches[0].nodes


def test_prepare_mode_claims_match_all_inputs_fuse_mode_does_not() -> None:
    gm = symbolic_trace(Chain())
    patterns = [(torch.sigmoid, MatchAllNode), nn.ReLU]
    prepare = find_complex(gm, patterns)
    fuse = find_complex(gm, patterns, mode="fuse")
    assert _names(prepare) == [("sigmoid",)]
    assert _names(fuse) == [("sigmoid",), ("relu",)]


def test_parametrized_modules_match_their_original_type() -> None:
    gm = symbolic_trace(parametrized_model())
    matches = find_complex(gm, [(nn.ReLU, nn.Conv2d), nn.Linear])
    assert _names(matches) == [("lin",), ("relu", "conv")]


def test_is_ignored_hook() -> None:
    gm = symbolic_trace(Chain())
    seq = sequential_to_complex((nn.Conv2d, nn.BatchNorm2d, nn.ReLU))
    matches = find_complex(gm, [seq, nn.Conv2d, nn.ReLU], is_ignored=lambda n: n.name == "bn")
    assert _names(matches) == [("relu",), ("conv",)]


def test_root_node_getter_hook() -> None:
    gm = symbolic_trace(Chain())
    seq = sequential_to_complex((nn.Conv2d, nn.BatchNorm2d, nn.ReLU))
    matches = find_complex(gm, [seq], root_node_getters={seq: lambda np: np[0]})
    assert matches[0].root.name == "relu"


def test_getattr_pattern() -> None:
    graph = Graph()
    x = graph.placeholder("x")
    shape = graph.call_function(getattr, (x, "shape"))
    dtype = graph.call_function(getattr, (x, "dtype"))
    graph.output((shape, dtype))
    gm = GraphModule(nn.Module(), graph)
    matches = find_complex(gm, [(getattr, "dtype")])
    assert _names(matches) == [(dtype.name,)]


def test_each_node_is_tried_only_against_its_anchor_patterns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The index: patterns whose anchor never occurs in the graph are never tried."""
    from quantbridge.patterns import _matcher

    tried: list[object] = []
    real = _matcher._matches

    def counting(resolver: object, value: object, c: object, inner: bool) -> bool:
        if not inner:
            tried.append(value)
        return real(resolver, value, c, inner)  # type: ignore[arg-type]

    monkeypatch.setattr(_matcher, "_matches", counting)

    def make(i: int) -> object:
        def never_called(x: object) -> object:
            return x

        never_called.__name__ = f"f{i}"
        return never_called

    decoys = [(make(i), MatchAllNode) for i in range(200)]
    gm = symbolic_trace(Chain())
    assert _names(find_complex(gm, [*decoys, nn.ReLU])) == [("relu",)]
    # one candidate (nn.ReLU) for the relu node, none for the other nodes
    assert len(tried) == 1


def test_errors() -> None:
    with pytest.raises(PatternError, match=r"GraphModule.*symbolic_trace"):
        find_matches(Chain(), [nn.ReLU])  # type: ignore[arg-type]
    gm = symbolic_trace(Chain())
    with pytest.raises(PatternError, match=r"patterns\[1\].*not a pattern element"):
        find_matches(gm, [nn.ReLU, 42])
    with pytest.raises(PatternError, match=r"args\[0\].*not a pattern element"):
        find_matches(gm, [Nested(nn.ReLU, [nn.Conv2d])])
    with pytest.raises(PatternError, match=r"patterns\[0\].*bare tuple.*ambiguous"):
        find_matches(gm, [(nn.ReLU, nn.Conv2d)])
    with pytest.raises(PatternError, match="reads as one pattern"):
        find_matches(gm, (nn.ReLU, nn.Conv2d))
    with pytest.raises(PatternError, match="wrap a single pattern"):
        find_matches(gm, nn.ReLU)  # type: ignore[arg-type]
    with pytest.raises(PatternError, match="wrap a single pattern"):
        find_matches(gm, Nested(nn.ReLU, nn.Conv2d))  # type: ignore[arg-type]
    with pytest.raises(PatternError, match="mode"):
        find_matches(gm, [nn.ReLU], mode="train")  # type: ignore[arg-type]

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, x: object) -> object:
            return x

    with pytest.raises(PatternError, match=r"patterns\[0\].*not hashable"):
        find_matches(gm, [Nested(nn.ReLU, Unhashable())])
    with pytest.raises(PatternError, match="getattr"):
        find_matches(gm, [Nested(getattr, "a", "b")])
    del gm.relu  # the graph still calls it
    with pytest.raises(PatternError, match=r"'relu'.*out of sync"):
        find_complex(gm, [nn.ReLU])


def test_dict_patterns_use_keys_in_order() -> None:
    gm = symbolic_trace(Chain())
    table = {(nn.ReLU, MatchAllNode): "first", (nn.ReLU, nn.BatchNorm2d): "second"}
    assert find_complex(gm, table)[0].pattern == (nn.ReLU, MatchAllNode)
    assert F.relu not in table
