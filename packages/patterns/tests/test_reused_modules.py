"""A module reachable under two paths (torchvision's ReLU, called inside a fused conv-bn-relu
and again after the residual add) is found by the matcher and the rewriter under both."""

from __future__ import annotations

import operator

import pytest
import torch
from _complex import find_complex, typed
from torch import nn
from torch.fx import Graph, GraphModule, symbolic_trace

from quantbridge.patterns import (
    MatchAllNode,
    PatternError,
    ReplacementPattern,
    replace_pattern,
)


class FusedConvReLU(nn.Sequential):
    """Stands for a fused module that took the block's ReLU object as its member."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 2, 1)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv2(self.relu(self.conv1(x)))
        return self.relu(out + x)


def _fused_block() -> GraphModule:
    """The block after a fusion: conv1 became (conv1, relu); ``relu`` is still called once."""
    gm = symbolic_trace(Block())
    fused = FusedConvReLU(gm.conv1, gm.relu)
    gm.conv1 = fused
    relu_calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "relu"]
    first = relu_calls[0]
    first.replace_all_uses_with(first.args[0])
    gm.graph.erase_node(first)
    gm.recompile()
    # the shared ReLU is now listed once, under conv1.1; "relu" is its second path
    assert "relu" not in dict(gm.named_modules())
    assert gm.get_submodule("relu") is gm.get_submodule("conv1.1")
    return gm


def test_matcher_resolves_a_module_under_its_second_path() -> None:
    gm = _fused_block()
    add_relu = (nn.ReLU, (operator.add, MatchAllNode, MatchAllNode))
    matches = find_complex(gm, [add_relu, nn.Conv2d], mode="fuse")
    assert [(m.pattern, [n.name for n in m.nodes]) for m in matches] == [
        (add_relu, ["relu_1", "add"]),
        (nn.Conv2d, ["conv2"]),
    ]
    matches = find_complex(gm, [nn.ReLU, FusedConvReLU])
    assert sorted(m.anchor.name for m in matches) == ["conv1", "relu_1"]
    assert {m.anchor.name: m.pattern for m in matches} == {
        "relu_1": nn.ReLU,
        "conv1": FusedConvReLU,
    }


def test_out_of_sync_only_when_no_path_has_the_module() -> None:
    gm = _fused_block()
    find_complex(gm, [nn.ReLU])  # reachable under conv1.1 and relu: in sync
    del gm.relu  # now only conv1.1 holds it, and the graph still calls "relu"
    with pytest.raises(PatternError, match=r"'relu'.*out of sync"):
        find_complex(gm, [nn.ReLU])


def test_rewriter_matches_and_traces_modules_under_a_second_path() -> None:
    gm = _fused_block()
    x = torch.randn(1, 2, 3, 3)
    expected = gm(x)
    rule = ReplacementPattern(
        pattern=typed((nn.ReLU, MatchAllNode)), replacement=lambda v: torch.clamp(v, min=0.0)
    )
    matches = replace_pattern(gm, rule)
    assert [m.anchor.name for m in matches] == ["relu_1"]
    torch.testing.assert_close(gm(x), expected, rtol=0, atol=0)

    # a traced pattern whose own module tree lists the called module under another path
    target = _fused_block()
    expected = target(x)
    relu_pattern = _pattern_calling_second_path()
    assert "relu" not in dict(relu_pattern.named_modules())
    rewrite = ReplacementPattern(pattern_fn=relu_pattern, replacement=lambda v: v.clamp(min=0.0))
    matches = replace_pattern(target, rewrite)
    assert [m.anchor.name for m in matches] == ["relu_1"]
    torch.testing.assert_close(target(x), expected, rtol=0, atol=0)


def _pattern_calling_second_path() -> GraphModule:
    """relu(x) as a graph calling "relu", a ReLU its module also holds as "first.0"."""
    graph = Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_module("relu", (x,)))
    gm = GraphModule({"relu": nn.ReLU()}, graph)
    relu = gm.relu
    del gm.relu  # re-register after "first", so named_modules() lists only "first.0"
    gm.first = nn.Sequential(relu)
    gm.relu = relu
    return gm
