"""quantbridge.patterns: the pattern language of BackendConfig, an FX matcher and a rewriter.

Pattern forms (single operator, sequential tuple, reverse-nested complex form with
``MatchAllNode``) and their conversions, ``find_matches`` (torch.ao's matching decisions with an
anchor-indexed pattern table) and a subgraph rewriter for lowering passes.
"""

from quantbridge.patterns._errors import PatternError
from quantbridge.patterns._forms import (
    MatchAllNode,
    Pattern,
    check_complex_pattern,
    check_sequential_pattern,
    complex_to_sequential,
    describe_pattern_element,
    is_pattern_element,
    pattern_operators,
    sequential_to_complex,
)
from quantbridge.patterns._matcher import (
    Match,
    MatchMode,
    NodePattern,
    RootNodeGetter,
    default_root_node_getter,
    find_matches,
    sort_patterns,
)
from quantbridge.patterns._rewriter import (
    ArgConstraint,
    BuildCallback,
    ReplacementPattern,
    RewriteMatch,
    find_rewrite_matches,
    replace_pattern,
)
from quantbridge.patterns._typed import Chain, Nested, TypedPattern, as_complex

__all__ = [
    "Chain",
    "Nested",
    "TypedPattern",
    "as_complex",
    "ArgConstraint",
    "BuildCallback",
    "ReplacementPattern",
    "RewriteMatch",
    "find_rewrite_matches",
    "replace_pattern",
    "Match",
    "MatchAllNode",
    "MatchMode",
    "NodePattern",
    "RootNodeGetter",
    "Pattern",
    "PatternError",
    "check_complex_pattern",
    "check_sequential_pattern",
    "complex_to_sequential",
    "default_root_node_getter",
    "describe_pattern_element",
    "find_matches",
    "is_pattern_element",
    "pattern_operators",
    "sequential_to_complex",
    "sort_patterns",
]
