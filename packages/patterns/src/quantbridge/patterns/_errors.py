"""The one exception family of quantbridge.patterns."""


class PatternError(ValueError):
    """A pattern, graph or rewrite request that the patterns package cannot accept."""
