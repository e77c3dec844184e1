"""The ``reference`` backend: no lowering, the reference model runs as is."""

from __future__ import annotations

from quantbridge.fx_quant import get_native_backend_config
from quantbridge.lowering._backend import Backend

__all__ = ["ReferenceBackend", "reference_backend"]


class ReferenceBackend(Backend):
    """Returns the reference model unchanged (plain float + integer tensors, runs anywhere).

    Its BackendConfig is fx_quant's native config renamed ``"reference"``, so ``convert_fx``
    with it returns the reference model.
    """

    def __init__(self) -> None:
        super().__init__(
            "reference",
            get_native_backend_config().set_name("reference"),
            description="no lowering: the reference model (dequantize -> float op -> quantize)",
        )


reference_backend = ReferenceBackend()
