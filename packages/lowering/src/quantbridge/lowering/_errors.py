"""The one exception family of quantbridge.lowering."""


class LoweringError(ValueError):
    """A reference model, backend name or lowering request that cannot be served."""
