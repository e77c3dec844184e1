"""BackendConfigs of the numba backends: exactly what the lowering pass sends to the kernels.

Built from fx_quant's native building blocks, keeping only the patterns whose every op the
pass lowers (see ``_lower``) and only the dtype modes the kernels run: static uint8
activations with int8 weights, dynamic int8 linear, 8-bit and 4-bit weight-only embeddings.
Conv3d, transposed convs, standalone BatchNorm, LayerNorm/GroupNorm/InstanceNorm, 1-d pools,
RNN modules and float16 modes are left out, so ``prepare_fx`` keeps them in float instead of
producing reference ops the backend would run slowly.
"""

from __future__ import annotations

from typing import Any

import torch

from quantbridge.fx_quant import get_native_backend_config
from quantbridge.qconfig import BackendConfig, BackendPatternConfig, DTypeConfig

__all__ = ["numba_backend_config"]

# op names (class, function or method) the pass does not lower, exactly or as a substring
_EXCLUDED_NAMES = {"mean", "floordiv", "stack", "resize_", "shape", "size", "interpolate"}
_EXCLUDED_PARTS = (
    "3d", "transpose1d", "transpose2d", "Transpose", "BNReLU", "LayerNorm", "layer_norm",
    "group_norm", "GroupNorm", "instance_norm", "InstanceNorm", "LSTM", "GRU", "RNN", "PReLU",
    "Softmax", "pool1d", "Pool1d",
)  # fmt: skip


def _leaf_names(pattern: Any) -> list[str]:
    if isinstance(pattern, tuple):
        return [n for p in pattern for n in _leaf_names(p)]
    if isinstance(pattern, str):
        return [pattern]
    return [getattr(pattern, "__name__", str(pattern))]


def _pattern_ok(cfg: BackendPatternConfig) -> bool:
    pattern = cfg.pattern if cfg.pattern is not None else cfg.complex_pattern
    names = _leaf_names(pattern)
    if names and names[0].startswith("BatchNorm"):
        return False  # standalone BN (conv-bn is folded at convert and keeps its conv root)
    return not any(n in _EXCLUDED_NAMES or any(p in n for p in _EXCLUDED_PARTS) for n in names)


def _dtype_ok(dc: DTypeConfig) -> bool:
    # 4-bit weight-only embeddings are uint8 codes in [0, 15]: the 8-bit embedding path runs
    # them exactly (one code per byte), so they stay
    return dc.input_dtype != torch.float16 and dc.weight_dtype != torch.float16


def numba_backend_config(name: str) -> BackendConfig:
    """The BackendConfig named ``name`` describing what the numba kernels run."""
    config = BackendConfig(name)
    for cfg in get_native_backend_config().configs:
        if not _pattern_ok(cfg):
            continue
        kept = [dc for dc in cfg.dtype_configs if _dtype_ok(dc)]
        if not kept:
            continue
        cfg.set_dtype_configs(kept)
        config.set_backend_pattern_config(cfg)
    return config
