"""The one exception family of quantbridge.qconfig."""

from quantbridge.patterns import PatternError


class QConfigError(ValueError):
    """A configuration value, key or observer setting that quantbridge.qconfig rejects."""


class QConfigPatternError(QConfigError, PatternError):
    """A pattern in a backend config that quantbridge.patterns rejects.

    Catchable as QConfigError (this package's errors) and as quantbridge.patterns.PatternError.
    """
