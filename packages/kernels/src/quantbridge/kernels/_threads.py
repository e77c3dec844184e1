"""How many of numba's threads the GEMM-family kernels use.

A call's ``num_threads`` argument wins, then the module setting from ``set_num_threads``,
else all of numba's threads (``NUMBA_NUM_THREADS``, by default the core count).
"""

from __future__ import annotations

import numba

from quantbridge.kernels._errors import KernelError

_setting: int | None = None


def max_threads() -> int:
    """Threads numba's pool was started with (the upper bound for any setting)."""
    return int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]


def set_num_threads(n: int | None) -> None:
    """Module-wide default thread count for kernels; ``None`` restores all threads."""
    global _setting
    _setting = None if n is None else _check(n, "set_num_threads")


def get_num_threads() -> int:
    """The thread count a kernel call without ``num_threads=`` uses."""
    return max_threads() if _setting is None else _setting


def _check(n: object, where: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise KernelError(f"{where}: num_threads must be a positive int, got {n!r}")
    if n > max_threads():
        raise KernelError(
            f"{where}: num_threads={n} exceeds numba's pool of {max_threads()} threads "
            "(raise NUMBA_NUM_THREADS before importing numba)"
        )
    return n


def apply_num_threads(n: int | None, where: str) -> int:
    """Validate ``n`` (or take the default) and make numba's parallel loops use it."""
    value = get_num_threads() if n is None else _check(n, where)
    # one thread runs the serial drivers; numba's setting only matters for parallel ones
    if value > 1:
        numba.set_num_threads(value)
    return value
