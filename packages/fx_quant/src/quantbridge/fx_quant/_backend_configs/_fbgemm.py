"""The FBGEMM backend (x86 server CPUs, torch.ao's fbgemm engine)."""

from __future__ import annotations

from quantbridge.fx_quant._backend_configs._native import native_family
from quantbridge.qconfig import BackendConfig


def get_fbgemm_backend_config() -> BackendConfig:
    """The BackendConfig of the FBGEMM backend: native's patterns without layer norm."""
    return native_family("fbgemm", layer_norm=False)
