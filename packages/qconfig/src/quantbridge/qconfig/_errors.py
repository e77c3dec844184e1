"""The one exception family of quantbridge.qconfig."""


class QConfigError(ValueError):
    """A configuration value, key or observer setting that quantbridge.qconfig rejects."""
