"""torch.ao's matchers as an oracle (only imported by tests that importorskip torch.ao)."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule

from quantbridge.patterns import Match, MatchAllNode


def to_ours(pattern: Any) -> Any:
    """Swap torch.ao's MatchAllNode class for ours, everywhere in a complex pattern."""
    from torch.ao.quantization.utils import MatchAllNode as AoMatchAllNode

    if isinstance(pattern, tuple):
        return tuple(to_ours(p) for p in pattern)
    return MatchAllNode if pattern is AoMatchAllNode else pattern


def to_ao(pattern: Any) -> Any:
    """Swap our MatchAllNode for torch.ao's."""
    from torch.ao.quantization.utils import MatchAllNode as AoMatchAllNode

    if isinstance(pattern, tuple):
        return tuple(to_ao(p) for p in pattern)
    return AoMatchAllNode if pattern is MatchAllNode else pattern


def native_patterns() -> list[Any]:
    """torch.ao's native BackendConfig patterns in complex format, registration order."""
    import torch.ao.quantization.backend_config.utils  # noqa: F401  (2.13: must come first)
    from torch.ao.quantization.backend_config import get_native_backend_config

    config = get_native_backend_config()
    return [to_ours(p) for p in config._pattern_complex_format_to_config]


def onednn_patterns() -> tuple[list[Any], dict[Any, Any]]:
    """onednn patterns (they include MatchAllNode) and their root node getters."""
    import torch.ao.quantization.backend_config.utils  # noqa: F401
    from torch.ao.quantization.backend_config import get_onednn_backend_config
    from torch.ao.quantization.backend_config.utils import (
        get_fusion_pattern_to_root_node_getter,
    )

    config = get_onednn_backend_config()
    getters = get_fusion_pattern_to_root_node_getter(config)
    return (
        [to_ours(p) for p in config._pattern_complex_format_to_config],
        {to_ours(p): g for p, g in getters.items()},
    )


class _Handler:
    """Stands in for a QuantizeHandler: records what the matcher hands it."""

    def __init__(self, node_pattern: Any, modules: Any, root_node_getter: Any = None) -> None:
        self.node_pattern = node_pattern
        self.root = None


def ao_prepare_map(
    gm: GraphModule, patterns: list[Any], getters: dict[Any, Any] | None = None
) -> dict[str, tuple[str, Any]]:
    """torch.ao's prepare-time matcher: node name -> (anchor name, pattern)."""
    from torch.ao.quantization.fx.match_utils import _find_matches
    from torch.ao.quantization.fx.pattern_utils import _sorted_patterns_dict

    table = _sorted_patterns_dict(dict.fromkeys([to_ao(p) for p in patterns], _Handler))
    ao_getters = {to_ao(p): g for p, g in (getters or {}).items()}
    result = _find_matches(gm.graph, dict(gm.named_modules()), table, ao_getters)
    return {name: (value[0].name, to_ours(value[2])) for name, value in result.items()}


def ao_prepare_full(
    gm: GraphModule, patterns: list[Any], getters: dict[Any, Any] | None = None
) -> dict[str, Any]:
    """torch.ao's prepare-time matcher, raw: node name -> (anchor, node_pattern, pattern)."""
    from torch.ao.quantization.fx.match_utils import _find_matches
    from torch.ao.quantization.fx.pattern_utils import _sorted_patterns_dict

    table = _sorted_patterns_dict(dict.fromkeys([to_ao(p) for p in patterns], _Handler))
    ao_getters = {to_ao(p): g for p, g in (getters or {}).items()}
    result = _find_matches(gm.graph, dict(gm.named_modules()), table, ao_getters)
    return {name: (v[0], v[1], to_ours(v[2])) for name, v in result.items()}


def ao_fuse_map(gm: GraphModule, patterns: list[Any]) -> dict[str, tuple[str, Any, Any]]:
    """torch.ao's fusion matcher: node name -> (anchor name, pattern, node pattern)."""
    from torch.ao.quantization.fx.fuse import _find_matches
    from torch.ao.quantization.fx.pattern_utils import _sorted_patterns_dict

    table = _sorted_patterns_dict(dict.fromkeys([to_ao(p) for p in patterns], lambda node: None))
    result = _find_matches(gm, gm.graph, table)
    return {name: (v[0].name, to_ours(v[1]), v[2]) for name, v in result.items()}


def our_prepare_map(matches: list[Match]) -> dict[str, tuple[str, Any]]:
    """Rebuild torch.ao's node-name map from our matches, the way the docstring says."""
    out: dict[str, tuple[str, Any]] = {}
    for m in matches:
        for node in m.claimed:
            out[node.name] = (m.anchor.name, m.pattern)
    return out


def our_fuse_map(matches: list[Match]) -> dict[str, tuple[str, Any]]:
    out: dict[str, tuple[str, Any]] = {}
    for m in matches:
        for node in m.nodes:
            out[node.name] = (m.anchor.name, m.pattern)
    return out


__all__ = [
    "MatchAllNode",
    "ao_fuse_map",
    "ao_prepare_full",
    "ao_prepare_map",
    "native_patterns",
    "onednn_patterns",
    "our_fuse_map",
    "our_prepare_map",
    "torch",
]
