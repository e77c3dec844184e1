"""find_matches against torch.ao's own matchers (prepare-time and fusion-time) on a graph zoo."""

from __future__ import annotations

from typing import Any

import pytest
from _complex import find_complex

pytest.importorskip("torch.ao.quantization")

from _patterns_oracle import (
    ao_fuse_map,
    ao_prepare_full,
    ao_prepare_map,
    native_patterns,
    onednn_patterns,
    our_fuse_map,
    our_prepare_map,
)
from _patterns_zoo import chain_model, zoo
from torch.fx import GraphModule

from quantbridge.patterns import default_root_node_getter

GRAPHS = {**zoo(), "chain": chain_model(4)}


def _pattern_sets() -> dict[str, tuple[list[Any], dict[Any, Any]]]:
    onednn, getters = onednn_patterns()
    return {"native": (native_patterns(), {}), "onednn": (onednn, getters)}


PATTERN_SETS = _pattern_sets()


@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
@pytest.mark.parametrize("set_name", sorted(PATTERN_SETS))
def test_prepare_mode_assigns_like_torch_ao(graph_name: str, set_name: str) -> None:
    gm = GRAPHS[graph_name]
    patterns, getters = PATTERN_SETS[set_name]
    expected = ao_prepare_map(gm, patterns, getters)
    got = our_prepare_map(find_complex(gm, patterns, root_node_getters=getters))
    assert expected, "the oracle matched nothing: the zoo graph is useless"
    assert got == expected


@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
@pytest.mark.parametrize("set_name", sorted(PATTERN_SETS))
def test_prepare_mode_node_pattern_like_torch_ao(graph_name: str, set_name: str) -> None:
    gm = GRAPHS[graph_name]
    patterns, getters = PATTERN_SETS[set_name]
    expected = ao_prepare_full(gm, patterns, getters)
    for match in find_complex(gm, patterns, root_node_getters=getters):
        anchor, node_pattern, pattern = expected[match.anchor.name]
        assert anchor is match.anchor
        assert pattern == match.pattern
        assert node_pattern == match.node_pattern
        if match.pattern not in getters:
            # torch.ao's QuantizeHandler default root, computed from its own record
            from torch.ao.quantization.fx.quantize_handler import _default_root_node_getter

            assert match.root is _default_root_node_getter(node_pattern)


@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
@pytest.mark.parametrize("set_name", sorted(PATTERN_SETS))
def test_fuse_mode_like_torch_ao_fuser(graph_name: str, set_name: str) -> None:
    gm = GRAPHS[graph_name]
    patterns, getters = PATTERN_SETS[set_name]
    expected = ao_fuse_map(gm, patterns)
    matches = find_complex(gm, patterns, mode="fuse", root_node_getters=getters)
    assert our_fuse_map(matches) == {k: (v[0], v[1]) for k, v in expected.items()}
    for match in matches:
        _, _, nested = expected[match.anchor.name]
        assert nested == match.nested_node_pattern
        # torch.ao's fuser computes the root the same way from the same structure
        getter = getters.get(match.pattern, default_root_node_getter)
        assert match.root is getter(nested)


def test_onednn_conv_add_records_match_all_input_and_root() -> None:
    gm = GRAPHS["conv_add"]
    patterns, getters = PATTERN_SETS["onednn"]
    matches = {m.anchor.name: m for m in find_complex(gm, patterns, root_node_getters=getters)}
    relu = matches["relu"]
    # relu(conv3(b) + a): the add's second input is bound by MatchAllNode
    assert [n.name for n in relu.nodes] == ["relu", "add_2", "conv3"]
    assert [n.name for n in relu.inputs] == ["add"]
    assert relu.root.name == "conv3"
    # torch.ao claims the MatchAllNode input: "add" is not matched on its own
    assert "add" not in matches


def test_zoo_exercises_the_cases_the_brief_lists() -> None:
    """Guard against a zoo that silently stops covering a case."""
    patterns, getters = PATTERN_SETS["onednn"]
    native = PATTERN_SETS["native"][0]
    seen_sizes = set()
    for gm in GRAPHS.values():
        for m in find_complex(gm, native):
            seen_sizes.add(len(m.nodes))
    assert {1, 2, 3} <= seen_sizes
    with_inputs = [
        m
        for gm in GRAPHS.values()
        for m in find_complex(gm, patterns, root_node_getters=getters)
        if m.inputs
    ]
    assert len(with_inputs) >= 2
    gm: GraphModule = GRAPHS["several_users"]
    names = {n.name: m.pattern for m in find_complex(gm, native) for n in m.nodes}
    # conv and bn each have two users, so conv-bn-relu cannot swallow them
    assert names["conv"] is not names["relu"]


def test_match_all_node_bound_to_a_list_claims_the_nodes_inside() -> None:
    """torch.ao records the nodes inside a list bound by MatchAllNode (e.g. torch.cat's)."""
    import torch
    from torch import nn
    from torch.fx import Graph

    from quantbridge.patterns import MatchAllNode

    graph = Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.relu, (x,))
    b = graph.call_function(torch.sigmoid, (x,))
    graph.output(graph.call_function(torch.cat, ([a, b],)))
    gm = GraphModule(nn.Module(), graph)
    patterns = [(torch.cat, MatchAllNode), torch.relu, torch.sigmoid]
    expected = ao_prepare_map(gm, patterns)
    matches = find_complex(gm, patterns)
    assert our_prepare_map(matches) == expected
    assert [m.anchor.name for m in matches] == ["cat"]
    assert set(expected) == {"cat", "relu", "sigmoid"}
    fuse = find_complex(gm, patterns, mode="fuse")
    assert [m.anchor.name for m in fuse] == ["cat", "sigmoid", "relu"]
