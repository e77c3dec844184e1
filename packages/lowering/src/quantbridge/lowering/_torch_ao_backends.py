"""``get_backend("x86")`` (and fbgemm, onednn, native): torch.ao's config, numba's kernels."""

from __future__ import annotations

from torch.fx import GraphModule

from quantbridge.fx_quant import get_backend_config
from quantbridge.lowering._backend import Backend, SupportedOp, _lookup, get_backend
from quantbridge.qconfig import (
    QConfigMapping,
    get_default_qat_qconfig_mapping,
    get_default_qconfig_mapping,
)

__all__ = ["TORCH_AO_CPU_CONFIGS", "TorchAoConfigBackend"]

# torch.ao lowered BackendConfigs of these names to its quantized CPU engines (fbgemm, onednn)
TORCH_AO_CPU_CONFIGS = ("x86", "fbgemm", "onednn", "native")


class TorchAoConfigBackend(Backend):
    """A torch.ao-named CPU config as a backend: torch.ao's BackendConfig and default
    qconfigs for that name, lowered by the ``numba`` backend (as torch.ao lowered these
    configs to its own engines). Ops the numba kernels do not run keep their reference form,
    listed in ``lowering_report``. ``available_backends()`` leaves these names out."""

    lowers_with = "numba"

    def __init__(self, name: str) -> None:
        super().__init__(
            name,
            get_backend_config(name),
            description=f"torch.ao's {name!r} config, lowered by the numba backend",
        )

    def _numba(self) -> Backend:
        return get_backend(self.lowers_with)

    def is_available(self) -> bool:
        numba = _lookup(self.lowers_with)
        return numba is not None and numba.is_available()

    def unavailable_reason(self) -> str:
        return "" if self.is_available() else f"the {self.lowers_with!r} backend cannot run here"

    def qconfig_mapping(self, qat: bool = False) -> QConfigMapping:
        """torch.ao's default mapping for this name (``native`` takes fbgemm's)."""
        name = "fbgemm" if self.name == "native" else self.name
        return get_default_qat_qconfig_mapping(name) if qat else get_default_qconfig_mapping(name)

    def lower(self, reference_model: GraphModule) -> GraphModule:
        self._check_lowerable(reference_model)
        return self._numba().lower(reference_model)

    def supported_ops(self) -> list[SupportedOp]:
        return self._numba().supported_ops()


x86_backend = TorchAoConfigBackend("x86")
fbgemm_backend = TorchAoConfigBackend("fbgemm")
onednn_backend = TorchAoConfigBackend("onednn")
native_backend = TorchAoConfigBackend("native")
