"""Typed patterns: Chain (execution order) and Nested (root first); bare tuples are refused."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn
from torch.fx import GraphModule, symbolic_trace

from quantbridge.patterns import (
    Chain,
    MatchAllNode,
    Nested,
    PatternError,
    ReplacementPattern,
    as_complex,
    find_matches,
    find_rewrite_matches,
)


class BothOrders(nn.Module):
    """conv -> relu, then relu -> conv: one of each order."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 2, 1)
        self.relu1 = nn.ReLU()
        self.relu2 = nn.ReLU()
        self.conv2 = nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.relu2(self.relu1(self.conv1(x))))


def _traced() -> GraphModule:
    return symbolic_trace(BothOrders())


def test_chain_reads_in_execution_order_and_nested_root_first() -> None:
    gm = _traced()
    (forward,) = find_matches(gm, [Chain(nn.Conv2d, nn.ReLU)])
    assert [n.name for n in forward.nodes] == ["relu1", "conv1"]  # anchor (relu) first
    (nested,) = find_matches(gm, [Nested(nn.Conv2d, nn.ReLU)])
    assert [n.name for n in nested.nodes] == ["conv2", "relu2"]
    assert forward.pattern == Chain(nn.Conv2d, nn.ReLU)  # the object passed, as given


@pytest.mark.parametrize(
    "call",
    [
        lambda: find_matches(_traced(), [(nn.Conv2d, nn.ReLU)]),
        lambda: find_rewrite_matches(
            _traced(), ReplacementPattern(pattern=(nn.Conv2d, nn.ReLU), replacement=lambda v: v)
        ),
        lambda: as_complex((nn.Conv2d, nn.ReLU)),
    ],
)
def test_a_bare_tuple_is_refused_naming_both_constructors(call: object) -> None:
    with pytest.raises(PatternError, match=r"bare tuple.*ambiguous.*Chain\(.*Nested\("):
        call()  # type: ignore[operator]


def test_conversions_round_trip_and_compare_by_value() -> None:
    chain = Chain(nn.Conv2d, nn.BatchNorm2d, nn.ReLU)
    nested = Nested(nn.ReLU, Nested(nn.BatchNorm2d, nn.Conv2d))
    assert chain.to_nested() == nested
    assert nested.to_chain() == chain
    assert hash(chain.to_nested()) == hash(nested)
    assert nested.to_tuple() == (nn.ReLU, (nn.BatchNorm2d, nn.Conv2d))
    assert Nested.from_tuple(nested.to_tuple()) == nested
    assert as_complex(chain) == as_complex(nested) == nested.to_tuple()
    assert Chain(nn.ReLU).to_nested() is nn.ReLU
    assert Nested.from_tuple(nn.ReLU) is nn.ReLU
    assert chain != nested  # different types, even for the same graph shape
    assert repr(chain) == "Chain(Conv2d, BatchNorm2d, ReLU)"


def test_constructor_errors_say_what_to_write() -> None:
    with pytest.raises(PatternError, match="at least one"):
        Chain()
    with pytest.raises(PatternError, match=r"MatchAllNode.*chain"):
        Chain(nn.Conv2d, MatchAllNode)
    with pytest.raises(PatternError, match=r"tuple.*Nested\("):
        Nested(nn.ReLU, (nn.BatchNorm2d, nn.Conv2d))
    with pytest.raises(PatternError, match="instance"):
        Chain(nn.ReLU())
    with pytest.raises(PatternError, match="takes no argument patterns"):
        Nested(MatchAllNode, nn.ReLU)
    with pytest.raises(PatternError, match="not a chain"):
        Nested(operator.add, nn.Conv2d, MatchAllNode).to_chain()
    with pytest.raises(AttributeError):
        Chain(nn.ReLU).ops = ()  # type: ignore[misc]


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv(x) + x)


def _never_called(match: object, graph: object) -> object:
    raise AssertionError("only finding is tested")


def test_matcher_and_rewriter_pick_the_same_winner_from_the_same_list() -> None:
    # given smallest first: both engines still prefer the larger pattern, then list order
    small = nn.ReLU
    large = Nested(nn.ReLU, Nested(operator.add, nn.Conv2d, MatchAllNode))
    tie_a = Nested(nn.ReLU, Nested(operator.add, MatchAllNode, MatchAllNode))
    for order in ([small, tie_a, large], [small, large, tie_a]):
        gm = symbolic_trace(Residual())
        matched = find_matches(gm, order)
        rules = [ReplacementPattern(pattern=p, build=_never_called) for p in order]
        rewritten = find_rewrite_matches(gm, rules)
        assert [m.pattern for m in matched] == [r.rule.pattern for r in rewritten]
    # equal sizes: the given order decides, in both engines
    tie_b = Nested(nn.ReLU, Nested(operator.add, nn.Conv2d, MatchAllNode))
    twin = Nested(nn.ReLU, Nested(operator.add, nn.Conv2d, nn.Conv2d))  # cannot match here
    for order in ([tie_b, tie_a], [tie_a, tie_b]):
        gm = symbolic_trace(Residual())
        assert find_matches(gm, [twin, *order])[0].pattern == order[0]
        rules = [ReplacementPattern(pattern=p, build=_never_called) for p in order]
        assert find_rewrite_matches(gm, rules)[0].rule.pattern == order[0]
