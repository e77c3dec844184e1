"""The one exception family of quantbridge.fx_quant."""


class FxQuantError(ValueError):
    """A model, config or call that the FX quantization flow cannot accept."""
