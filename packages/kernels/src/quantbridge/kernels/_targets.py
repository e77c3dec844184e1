"""CPU feature detection and kernel target selection.

Targets, best first: ``avx512_vnni`` (vpdpbusd on zmm), ``avx_vnni`` (VEX vpdpbusd on ymm: AVX2
CPUs with AVX-VNNI, such as Intel's Alder Lake and later client cores), ``avx2`` (vpmaddubsw +
vpmaddwd); on Arm64 ``aarch64_i8mm`` (``usdot``: Armv8.6 int8 matrix multiply, as Graviton 3
and 4, Neoverse V1/V2/N2, Apple M2 and later) and ``aarch64_dotprod`` (``sdot``: Armv8.2 dot
product, as Graviton 2, Neoverse N1, Apple M1); ``generic`` (portable numba loops) everywhere.
Selection order: an explicit ``target=`` argument, then the ``QUANTBRIDGE_KERNEL_TARGET``
environment variable, then the best target this CPU runs.

"This CPU" is the CPU numba compiles for, not only the host: numba's ``NUMBA_CPU_NAME`` and
``NUMBA_CPU_FEATURES`` (set, for instance, to build a cache that travels between machines)
decide which instructions LLVM may select, and LLVM aborts the process, rather than raising,
when asked for one it may not. So the features are those numba hands LLVM: the host's, unless
``NUMBA_CPU_FEATURES`` is set, in which case they are the named CPU's defaults changed by that
list (LLVM's rule).
"""

from __future__ import annotations

import functools
import os
import platform
from typing import Any, TypeVar

import llvmlite.binding as llvm
from numba.core import config

from quantbridge.kernels._errors import KernelError, TargetUnavailableError

_K = TypeVar("_K")

TARGETS: tuple[str, ...] = (
    "avx512_vnni", "avx_vnni", "avx2", "aarch64_i8mm", "aarch64_dotprod", "generic",
)  # fmt: skip
ENV_VAR = "QUANTBRIDGE_KERNEL_TARGET"

# CPU features (LLVM names) each target's compiled code uses.
_REQUIRED_FEATURES: dict[str, tuple[str, ...]] = {
    "avx512_vnni": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "avx2", "fma"),
    "avx_vnni": ("avx2", "fma", "avxvnni"),
    "avx2": ("avx2", "fma"),
    "aarch64_i8mm": ("neon", "dotprod", "i8mm"),
    "aarch64_dotprod": ("neon", "dotprod"),
    "generic": (),
}
# the targets whose compiled code is AArch64's (the others but generic are x86's)
ARM_TARGETS = frozenset({"aarch64_i8mm", "aarch64_dotprod"})

# The features the kernels care about that LLVM enables by default for a named x86 CPU (its
# X86.td processor definitions). A name not listed counts as having none of them: a target
# chosen too low is slower, one chosen too high aborts the process.
_AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
_AVX_VNNI = _AVX2 | {"avxvnni"}
_AVX512 = _AVX2 | {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
_CANNONLAKE = _AVX512 | {"avx512vbmi", "avx512ifma"}
_CASCADELAKE = _AVX512 | {"avx512vnni"}
_ICELAKE = _CANNONLAKE | {"avx512vnni", "avx512vbmi2", "avx512bitalg", "avx512vpopcntdq"}
_SAPPHIRERAPIDS = _ICELAKE | {"avx512bf16", "avx512fp16", "avxvnni", "amx-tile", "amx-int8"}
_ZNVER4 = _ICELAKE | {"avx512bf16"}
# Arm CPUs by the int8 instructions LLVM gives them (the dot product, then also i8mm)
_DOTPROD_CPUS = (
    "neoverse-n1", "neoverse-e1", "cortex-a76", "cortex-a77", "cortex-a78", "cortex-x1",
    "apple-m1", "apple-a14",
)  # fmt: skip
_I8MM_CPUS = (
    "neoverse-v1", "neoverse-n2", "neoverse-v2", "neoverse-n3", "neoverse-v3", "cortex-a710",
    "cortex-x2", "cortex-x3", "cortex-x4", "apple-m2", "apple-m3", "apple-m4", "apple-a15",
    "apple-a16", "apple-a17", "ampere1", "ampere1a", "ampere1b", "grace",
)  # fmt: skip
_CPU_DEFAULTS: dict[str, frozenset[str]] = {
    **dict.fromkeys(("sandybridge", "ivybridge"), frozenset({"avx"})),
    **dict.fromkeys(
        ("x86-64-v3", "haswell", "broadwell", "skylake", "znver1", "znver2", "znver3"), _AVX2
    ),
    **dict.fromkeys(
        (
            "alderlake",
            "raptorlake",
            "meteorlake",
            "arrowlake",
            "arrowlake-s",
            "lunarlake",
            "gracemont",
            "sierraforest",
            "grandridge",
            "clearwaterforest",
            "pantherlake",
        ),
        _AVX_VNNI,
    ),
    **dict.fromkeys(("x86-64-v4", "skylake-avx512"), _AVX512),
    "cannonlake": _CANNONLAKE,
    **dict.fromkeys(("cascadelake", "cooperlake"), _CASCADELAKE),
    **dict.fromkeys(("icelake-client", "icelake-server", "tigerlake", "rocketlake"), _ICELAKE),
    **dict.fromkeys(
        ("sapphirerapids", "emeraldrapids", "graniterapids", "graniterapids-d"), _SAPPHIRERAPIDS
    ),
    "znver4": _ZNVER4,
    "znver5": _ZNVER4 | {"avxvnni"},
    # AArch64 (LLVM's AArch64Processors.td); "generic" there has NEON, and x86's none of these
    **dict.fromkeys(_DOTPROD_CPUS, frozenset({"neon", "dotprod"})),
    **dict.fromkeys(_I8MM_CPUS, frozenset({"neon", "dotprod", "i8mm"})),
}
# feature -> the features it needs (LLVM turns these on with it, and it off with any of them)
_NEEDS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx",),
    "fma": ("avx",),
    "f16c": ("avx",),
    "avxvnni": ("avx2",),
    "avx512f": ("avx2", "fma", "f16c"),
    **{
        f: ("avx512f",)
        for f in (
            "avx512cd",
            "avx512bw",
            "avx512dq",
            "avx512vl",
            "avx512vnni",
            "avx512ifma",
            "avx512vpopcntdq",
        )
    },
    **{f: ("avx512bw",) for f in ("avx512vbmi", "avx512vbmi2", "avx512bitalg", "avx512bf16")},
    "avx512fp16": ("avx512bw", "avx512dq", "avx512vl"),
    "amx-int8": ("amx-tile",),
    "dotprod": ("neon",),
    "i8mm": ("neon",),
}


def _with_needs(features: set[str], name: str) -> None:
    if name not in features:
        features.add(name)
        for need in _NEEDS.get(name, ()):
            _with_needs(features, need)


def _without_dependents(features: set[str], name: str) -> None:
    features.discard(name)
    for other, needs in _NEEDS.items():
        if name in needs and other in features:
            _without_dependents(features, other)


def apply_feature_string(defaults: frozenset[str], spec: str) -> frozenset[str]:
    """``defaults`` changed by an LLVM feature list such as ``"+avx2,-avx512f"``, with what
    each feature needs turned on with it and what needs it turned off with it."""
    features = set(defaults)
    for item in spec.split(","):
        item = item.strip().lower()
        if len(item) < 2 or item[0] not in "+-":
            continue  # LLVM ignores what it cannot parse, with a warning of its own
        if item[0] == "+":
            _with_needs(features, item[1:])
        else:
            _without_dependents(features, item[1:])
    return frozenset(features)


def compile_cpu() -> tuple[str, str | None]:
    """numba's CPU name and explicit feature list (None: the host's features)."""
    # numba sets its config attributes at run time, from the environment
    name = getattr(config, "CPU_NAME", None)
    if not name or name.lower() == "host":
        name = _host_cpu_name()
    features = getattr(config, "CPU_FEATURES", None)
    return str(name), None if features is None else str(features)


@functools.cache
def _host_cpu_name() -> str:
    return str(llvm.get_host_cpu_name())


def cpu_features() -> frozenset[str]:
    """The features (LLVM names: ``avx2``, ``avx512vnni``, ...) of the CPU numba compiles for:
    the host's, or those ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` give it."""
    name, spec = compile_cpu()
    return _features(name, spec, bool(getattr(config, "ENABLE_AVX", True)))


@functools.cache
def _features(name: str, spec: str | None, enable_avx: bool) -> frozenset[str]:
    if spec is None:
        found = llvm.get_host_cpu_features()
        features = frozenset(f for f, present in found.items() if present)
    else:
        defaults = _CPU_DEFAULTS.get(name.lower(), frozenset())
        if name.lower() == "generic" and platform.machine().lower() in ("aarch64", "arm64"):
            defaults = frozenset({"neon"})
        features = apply_feature_string(defaults, spec)
    if not enable_avx:  # NUMBA_ENABLE_AVX=0: numba turns off every avx* feature
        features = frozenset(f for f in features if not f.startswith("avx"))
    return features


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


def _cpu_description() -> str:
    name, spec = compile_cpu()
    if spec is None and not getattr(config, "CPU_NAME", None):
        return "this CPU"
    return f"the CPU numba compiles for (NUMBA_CPU_NAME={name!r}, NUMBA_CPU_FEATURES={spec!r})"


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
            f"{_cpu_description()} lacks; choose one of the available targets "
            f"{available_targets()}, or unset {ENV_VAR} to get the best of them"
        )
    return target


# Compiled kernels holding instructions past x86-64's baseline, by "module.qualname", with
# the CPU features they need. Python picks one of them only for a CPU that has those; the
# target matrix (``nox -s tests_targets``) compiles each one for such a CPU from any host.
FEATURE_KERNELS: dict[str, tuple[tuple[str, ...], Any]] = {}


def target_features(target: str) -> tuple[str, ...]:
    """The CPU features (LLVM names) the compiled code of ``target`` uses."""
    return _REQUIRED_FEATURES["avx2" if target == "avx2_byte" else target]


def needs_features(features: tuple[str, ...], kernel: _K) -> _K:
    """Record that compiled ``kernel`` (a numba dispatcher) holds instructions of
    ``features``; returns it."""
    func = kernel.py_func  # type: ignore[attr-defined]
    FEATURE_KERNELS[f"{func.__module__}.{func.__qualname__}"] = (features, kernel)
    return kernel


def check_unpickled_target(what: str, target: str) -> None:
    """Refuse weights packed elsewhere for a target this CPU cannot run (their layout is that
    target's: running them here would reach code LLVM cannot compile for this CPU)."""
    if not target_supported(target):
        raise TargetUnavailableError(
            f"{what}: packed for kernel target {target!r}, which {_cpu_description()} cannot "
            f"run (available: {available_targets()}); pack the weights again on this machine"
        )


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
