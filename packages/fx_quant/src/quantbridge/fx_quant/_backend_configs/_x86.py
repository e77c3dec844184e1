"""The x86 backend (torch.ao's x86 engine: fbgemm plus onednn kernels)."""

from __future__ import annotations

from quantbridge.fx_quant._backend_configs._native import native_family
from quantbridge.qconfig import BackendConfig


def get_x86_backend_config() -> BackendConfig:
    """The BackendConfig of the x86 backend: fbgemm's patterns, with binary ops and
    fixed-qparams ops accepting the weighted-op dtype config as torch.ao has it."""
    return native_family("x86", layer_norm=False, weighted_binary_and_fixed=True)
