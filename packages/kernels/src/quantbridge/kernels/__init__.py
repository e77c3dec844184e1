"""quantbridge.kernels: numba-JIT int8 CPU kernels on numpy arrays, one implementation per target.

Depends on numpy and numba only. Target selection is here now; the kernels themselves
(GEMM, conv, elementwise, pools, lookup tables, embedding_bag) arrive with the kernels issue.
"""

from quantbridge.kernels._errors import KernelError, TargetUnavailableError
from quantbridge.kernels._targets import (
    ENV_VAR,
    TARGETS,
    available_targets,
    best_target,
    cpu_features,
    resolve_target,
    target_supported,
)

__all__ = [
    "ENV_VAR",
    "TARGETS",
    "KernelError",
    "TargetUnavailableError",
    "available_targets",
    "best_target",
    "cpu_features",
    "resolve_target",
    "target_supported",
]
