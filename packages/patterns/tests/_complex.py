"""Test helpers: run the typed-pattern APIs on torch.ao-style complex-format tuples.

The differential tests compare with torch.ao, whose patterns are bare tuples in complex
format; these helpers convert them with ``Nested.from_tuple`` on the way in and give the
matches back keyed by the original tuples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from torch.fx import GraphModule

from quantbridge.patterns import Match, Nested, find_matches


def typed(pattern: Any) -> Any:
    """A complex-format tuple as ``Nested``; anything else unchanged."""
    return Nested.from_tuple(pattern) if isinstance(pattern, tuple) else pattern


def find_complex(
    gm: GraphModule,
    patterns: Iterable[Any] | Mapping[Any, Any],
    *,
    root_node_getters: Mapping[Any, Any] | None = None,
    **kwargs: Any,
) -> list[Match]:
    """``find_matches`` on complex-format patterns; ``Match.pattern`` is the tuple given."""
    given = list(patterns)
    back = {typed(p): p for p in reversed(given)}  # the first of equal patterns wins
    getters = {typed(k): v for k, v in (root_node_getters or {}).items()} or None
    found = find_matches(gm, [typed(p) for p in given], root_node_getters=getters, **kwargs)
    return [dataclasses.replace(m, pattern=back[m.pattern]) for m in found]
