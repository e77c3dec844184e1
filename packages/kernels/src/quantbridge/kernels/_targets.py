"""CPU feature detection and kernel target selection.

Targets, best first: ``avx512_vnni`` (vpdpbusd), ``avx2`` (vpmaddubsw + vpmaddwd), ``generic``
(portable numba loops). Selection order: an explicit ``target=`` argument, then the
``QUANTBRIDGE_KERNEL_TARGET`` environment variable, then the best target this CPU runs.
"""

from __future__ import annotations

import functools
import os

import llvmlite.binding as llvm

from quantbridge.kernels._errors import KernelError, TargetUnavailableError

TARGETS: tuple[str, ...] = ("avx512_vnni", "avx2", "generic")
ENV_VAR = "QUANTBRIDGE_KERNEL_TARGET"

# CPU features (LLVM names) each target's compiled code uses.
_REQUIRED_FEATURES: dict[str, tuple[str, ...]] = {
    "avx512_vnni": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "avx2", "fma"),
    "avx2": ("avx2", "fma"),
    "generic": (),
}


@functools.cache
def cpu_features() -> frozenset[str]:
    """The host CPU's features as LLVM names them (``avx2``, ``avx512vnni``, ...)."""
    return frozenset(name for name, present in llvm.get_host_cpu_features().items() if present)


def target_supported(target: str) -> bool:
    """True if ``target`` is a known target and this CPU has every feature it needs."""
    if target not in _REQUIRED_FEATURES:
        return False
    return all(feature in cpu_features() for feature in _REQUIRED_FEATURES[target])


def available_targets() -> list[str]:
    """Targets this CPU can run, best first; ``generic`` is always last and always present."""
    return [t for t in TARGETS if target_supported(t)]


def best_target() -> str:
    """The fastest target this CPU runs."""
    return available_targets()[0]


def resolve_target(target: str | None = None) -> str:
    """The target to use: the argument, else ``$QUANTBRIDGE_KERNEL_TARGET``, else the best.

    Raises TargetUnavailableError for an unknown name or one this CPU cannot run, so no
    compiled code ever meets an illegal instruction.
    """
    source = "target argument"
    if target is None:
        target = os.environ.get(ENV_VAR) or None
        source = f"environment variable {ENV_VAR}"
    if target is None:
        return best_target()
    if target not in _REQUIRED_FEATURES:
        raise KernelError(
            f"unknown kernel target {target!r} (from the {source}); choose one of {list(TARGETS)}"
        )
    if not target_supported(target):
        missing = [f for f in _REQUIRED_FEATURES[target] if f not in cpu_features()]
        raise TargetUnavailableError(
            f"kernel target {target!r} (from the {source}) needs CPU features {missing} that "
            f"this CPU lacks; available targets: {available_targets()}"
        )
    return target


_VALIDATED: set[tuple[str, frozenset[str]]] = set()


def check_target(target: str | None = None) -> None:
    """Validate ``target`` exactly like resolve_target, cheaply enough for per-call use.

    For kernels with one implementation for every target: nothing to select, but a bad or
    unavailable target (argument or environment variable) must still raise. Names already
    validated on this CPU are remembered, so the common path costs a dict lookup.
    """
    name = target if target is not None else (os.environ.get(ENV_VAR) or None)
    if name is None:
        return
    key = (name, cpu_features())
    if key not in _VALIDATED:
        resolve_target(target)
        _VALIDATED.add(key)
