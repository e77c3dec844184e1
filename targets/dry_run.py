"""Compile, without running, the kernels of a level this host cannot run.

Two steps, each its own process:

1. ``record`` (this module as a pytest plugin, ``-p dry_run``, over the kernels suite):
   quantbridge chooses its targets for the level (numba's CPU settings name it), while numba
   really compiles for ``levels.DRY_RUN_LEVEL``, which the host runs. A call of a feature
   kernel (``quantbridge.kernels._targets.FEATURE_KERNELS``) needing more than that is
   recorded, with its argument types, instead of being compiled and run; everything else
   runs. The suite's assertions fail (those calls leave their outputs unwritten): only the
   records and the absence of a crash matter.
2. ``compile`` (``python dry_run.py compile LEVEL RECORDS...``): numba compiles for the level;
   each recorded kernel is compiled for each recorded signature and its assembly checked for
   the level's instructions. Nothing runs. A kernel holding an instruction LLVM cannot select
   for the level aborts this process, which the caller reports.
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import pickle
import sys
from typing import Any

from levels import BY_NAME, DRY_RUN_LEVEL

RECORDS_ENV = "QB_DRY_RUN_RECORDS"
# the instruction a kernel needing each feature must hold, most specific feature first
_INSTRUCTIONS = (
    ("avx512vbmi", ("vpermi2b", "vpermt2b")),
    ("avx512vnni", ("vpdpbusd",)),
    ("avxvnni", ("{vex}\tvpdpbusd", "{vex} vpdpbusd")),
    ("avx2", ("vpmaddwd", "vpmaddubsw")),
)


def _wanted(features: tuple[str, ...]) -> tuple[str, ...]:
    return next((ins for feature, ins in _INSTRUCTIONS if feature in features), ())


def _qualified(dispatcher: Any) -> str:
    func = dispatcher.py_func
    return f"{func.__module__}.{func.__qualname__}"


_records: dict[str, set[Any]] = {}


def _install() -> None:
    from numba.core import codegen
    from numba.core.registry import CPUDispatcher

    # numba compiles for the dry-run level; quantbridge still reads the level from the config
    codegen.CPUCodegen._get_host_cpu_name = lambda self: DRY_RUN_LEVEL.cpu
    codegen.CPUCodegen._get_host_cpu_features = lambda self: DRY_RUN_LEVEL.features
    run = CPUDispatcher.__call__

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        from quantbridge.kernels._targets import FEATURE_KERNELS

        name = _qualified(self)
        entry = FEATURE_KERNELS.get(name)
        if entry is not None and not set(entry[0]) <= DRY_RUN_LEVEL.needs:
            sig = tuple(self.typeof_pyval(a) for a in args)
            if sig not in _records.setdefault(name, set()):
                _records[name].add(sig)
                # written at once: pytest-xdist workers end without running exit handlers
                with open(f"{os.environ[RECORDS_ENV]}.{os.getpid()}", "ab") as f:
                    pickle.dump((name, sig), f)
            return None
        return run(self, *args, **kwargs)

    CPUDispatcher.__call__ = call


if RECORDS_ENV in os.environ:
    _install()


def compile_level(level_name: str, record_glob: str) -> dict[str, Any]:
    """Compile every recorded kernel for the level numba is set to; return a summary."""
    level = BY_NAME[level_name]
    import quantbridge.kernels as qk
    from quantbridge.kernels._targets import FEATURE_KERNELS

    if qk.resolve_target() != level.target:
        raise SystemExit(f"{level.name}: quantbridge chose {qk.resolve_target()}")
    records: dict[str, set[Any]] = {}
    for path in glob.glob(record_glob):
        with open(path, "rb") as f:
            while f.peek(1):
                name, sig = pickle.load(f)
                records.setdefault(name, set()).add(sig)
    for name in records:  # modules the package does not import itself (the bench script)
        importlib.import_module(name.rsplit(".", 1)[0])
    expected = {
        name
        for name, (features, _) in FEATURE_KERNELS.items()
        if set(features) <= level.needs and not set(features) <= DRY_RUN_LEVEL.needs
    }
    compiled: dict[str, int] = {}
    missing_instructions = []
    # a call reached a kernel of a better CPU than this level: compiling it would abort here,
    # and on a real CPU of this level the call would too
    beyond_level = sorted(n for n in records if not set(FEATURE_KERNELS[n][0]) <= level.needs)
    for name in sorted(set(records) - set(beyond_level)):
        features, dispatcher = FEATURE_KERNELS[name]
        for sig in sorted(records[name], key=str):
            print(f"compiling {name} for {level.name}: {sig}", flush=True)
            dispatcher.compile(sig)
            asm = dispatcher.inspect_asm(sig).lower()
            wanted = _wanted(features)
            if wanted and not any(ins in asm for ins in wanted):
                missing_instructions.append(f"{name}{sig}: none of {wanted}")
            compiled[name] = compiled.get(name, 0) + 1
    # a kernel called only from compiled code is compiled with its caller
    not_compiled = sorted(name for name in expected if not FEATURE_KERNELS[name][1].signatures)
    return {
        "level": level.name,
        "compiled": compiled,
        "not_compiled": not_compiled,
        "missing_instructions": missing_instructions,
        "beyond_level": beyond_level,
    }


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "compile":
        raise SystemExit("usage: dry_run.py compile LEVEL RECORD_GLOB SUMMARY_JSON")
    summary = compile_level(sys.argv[2], sys.argv[3])
    with open(sys.argv[4], "w") as f:
        json.dump(summary, f, indent=1)
