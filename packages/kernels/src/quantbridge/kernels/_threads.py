"""How many of numba's threads the kernels use, without changing anyone else's thread setting.

The count for a call, first that applies: the call's ``num_threads`` argument (GEMM family),
the setting from ``set_num_threads``, the default source from ``set_num_threads_source``
(``quantbridge.lowering`` installs ``torch.get_num_threads``; read at every call, clamped to
numba's pool), else all of numba's threads (``NUMBA_NUM_THREADS``, by default the core count).

numba's own count (``numba.set_num_threads``) is per calling thread: a parallel kernel sets it
for its own run and puts back the caller's value. numba's OpenMP layer calls
``omp_set_num_threads`` when its pool starts, and shares libgomp with torch, so the pool is
started here, at import, keeping the importing thread's OpenMP count (torch's intra-op count).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, TypeVar

import numba

from quantbridge.kernels._errors import KernelError

_F = TypeVar("_F", bound=Callable[..., Any])

_setting: int | None = None
_source: Callable[[], int] | None = None


def max_threads() -> int:
    """Threads numba's pool was started with (the upper bound for any setting)."""
    return int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]


def set_num_threads(n: int | None) -> None:
    """Module-wide thread count for kernels (wins over the source); ``None`` removes it."""
    global _setting
    _setting = None if n is None else _check(n, "set_num_threads")


def set_num_threads_source(source: Callable[[], int] | None) -> None:
    """Where calls without a setting get their count, asked at every call (``None``: all).

    A count above numba's pool is clamped to the pool, not refused: the source describes
    the caller's wish (e.g. ``torch.get_num_threads``), the pool what numba can do.
    """
    global _source
    if source is not None and not callable(source):
        raise KernelError(
            f"set_num_threads_source: expected a callable returning a thread count or None, "
            f"got {type(source).__name__}"
        )
    _source = source


def get_num_threads() -> int:
    """The thread count a kernel call without ``num_threads=`` uses, now."""
    if _setting is not None:
        return _setting
    source = _source
    if source is None:
        return max_threads()
    n = source()
    if type(n) is int and 0 < n <= max_threads():
        return n
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise KernelError(
            f"thread count source {source!r} returned {n!r}, not a positive int; fix it or "
            "remove it with quantbridge.kernels.set_num_threads_source(None)"
        )
    return max_threads()


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
    """Validate ``n`` (or take the default): the thread count of this call."""
    return get_num_threads() if n is None else _check(n, where)


@numba.njit  # not cached: numba's thread functions are ctypes pointers, which it cannot cache
def _swap(n):  # type: ignore[no-untyped-def]
    # numba's count on the calling thread: set to n, the previous value returned
    old = numba.get_num_threads()
    if old != n:
        numba.set_num_threads(n)
    return old


def with_threads(kernel: _F, threads: int) -> _F:
    """``kernel`` (a parallel numba function) run on ``threads`` threads.

    Sets numba's count on the calling thread for the call only: afterwards
    ``numba.get_num_threads()`` is again what the caller had.
    """

    def run(*args: Any) -> Any:
        old = _swap(threads)
        try:
            return kernel(*args)
        finally:
            if old != threads:
                _swap(old)

    return run  # type: ignore[return-value]


def _numba_openmp() -> Any:
    """The OpenMP runtime numba's OpenMP layer calls, or None without that layer.

    Looked up as the dynamic linker binds the layer's calls: the process-wide scope first
    (where torch puts its libgomp), then the layer's own dependencies.
    """
    try:
        from numba.np.ufunc import omppool  # type: ignore[attr-defined]
    except ImportError:
        return None
    for lib in (None, omppool.__file__):
        try:
            found = ctypes.CDLL(lib)
        except OSError:
            continue
        if hasattr(found, "omp_get_max_threads"):
            return found
    return None


def _start_pool() -> None:
    """Start numba's pool now, putting back this thread's OpenMP thread count if it moved."""
    omp = _numba_openmp()
    before = None if omp is None else int(omp.omp_get_max_threads())
    numba.get_num_threads()  # starts the pool (numba does this once per process)
    if before is not None and omp.omp_get_max_threads() != before:
        omp.omp_set_num_threads(before)


_start_pool()
