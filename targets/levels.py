"""The x86 levels of the target matrix, and which of them this host can run.

A level is a CPU numba compiles for, forced through ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``
(numba hands both to LLVM), and the kernel target quantbridge must pick for it. The psABI
levels (``x86-64``, ``x86-64-v3``, ``x86-64-v4``) pin every feature LLVM may use, so code
compiled for a level runs on any CPU that has the level's features, whatever the host's
model name.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import llvmlite.binding as llvm

# LLVM feature names of the psABI levels (what LLVM enables for those CPU names)
_V2 = frozenset({"cx16", "sahf", "popcnt", "sse3", "sse4.1", "sse4.2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi", "bmi2", "f16c", "fma", "lzcnt", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Level:
    name: str
    cpu: str  # NUMBA_CPU_NAME
    features: str  # NUMBA_CPU_FEATURES
    target: str  # the kernel target quantbridge must choose there
    needs: frozenset[str]  # host features its code may use

    def env(self) -> dict[str, str]:
        """This process's environment, with numba compiling for this level."""
        env = {k: v for k, v in os.environ.items() if k != "QUANTBRIDGE_KERNEL_TARGET"}
        env.update(NUMBA_CPU_NAME=self.cpu, NUMBA_CPU_FEATURES=self.features)
        return env


LEVELS = (
    Level("generic", "x86-64", "", "generic", frozenset()),
    Level("avx2", "x86-64-v3", "", "avx2", _V3),
    # AVX2 with AVX-VNNI and no AVX-512: Intel's Alder Lake and later client cores
    Level("avx_vnni", "x86-64-v3", "+avxvnni", "avx_vnni", _V3 | {"avxvnni"}),
    Level("avx512_vnni", "x86-64-v4", "+avx512vnni", "avx512_vnni", _V4 | {"avx512vnni"}),
    # the same target with VBMI, which the lookup-table pass uses where the CPU has it
    Level(
        "avx512_vnni_vbmi",
        "x86-64-v4",
        "+avx512vnni,+avx512vbmi",
        "avx512_vnni",
        _V4 | {"avx512vnni", "avx512vbmi"},
    ),
)
BY_NAME = {level.name: level for level in LEVELS}
# The level a compile-only check runs its dry run on: every x86 server CPU of the last decade
# has it, and every level above it is compiled from there.
DRY_RUN_LEVEL = BY_NAME["avx2"]


@functools.cache
def host_features() -> frozenset[str]:
    """The host CPU's features (LLVM names)."""
    return frozenset(f for f, on in llvm.get_host_cpu_features().items() if on)


def runs_here(level: Level) -> bool:
    """Whether this host can run code compiled for ``level``."""
    return level.needs <= host_features()
