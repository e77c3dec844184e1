"""quantbridge.patterns: the pattern language of BackendConfig, an FX matcher and a rewriter.

Pattern forms (single operator, sequential tuple, reverse-nested complex form with
``MatchAllNode``) and their conversions are here now; ``find_matches`` and the subgraph
rewriter arrive with the patterns issue.
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

__all__ = [
    "MatchAllNode",
    "Pattern",
    "PatternError",
    "check_complex_pattern",
    "check_sequential_pattern",
    "complex_to_sequential",
    "describe_pattern_element",
    "is_pattern_element",
    "pattern_operators",
    "sequential_to_complex",
]
