"""The target matrix: every x86 kernel level, forced through numba's CPU settings, from any host.

For each level this host runs (``levels.LEVELS``), in a subprocess with numba compiling for it:
the kernels suite (every kernel against its integer reference) and the model zoo's lowered
outputs (``zoo_outputs.py``), which must be the same bytes at every level and within their
bound of the reference model. For each level above ``levels.DRY_RUN_LEVEL``, whether or not the
host runs it: every kernel family compiled for that level's CPU and nothing run
(``dry_run.py``), so a kernel holding an instruction LLVM cannot select for a CPU fails here
on any host instead of aborting a user's process. A subprocess that crashes fails its test with
the test, kernel or model it was running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from levels import DRY_RUN_LEVEL, LEVELS, Level, runs_here  # noqa: E402

RUNNABLE = [level for level in LEVELS if runs_here(level)]
ABOVE_DRY_RUN = [level for level in LEVELS if not level.needs <= DRY_RUN_LEVEL.needs]
_ZOO: dict[str, Path] = {}  # level name -> its outputs, filled by test_zoo_outputs


def _run(what: str, cmd: list[str], env: dict[str, str], ok: tuple[int, ...] = (0,)) -> str:
    """Run ``cmd``; on an exit code outside ``ok`` fail with what it was doing when it ended."""
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", *cmd],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    output = proc.stdout + proc.stderr
    if proc.returncode not in ok:
        lines = output.splitlines()
        marks = ("Fatal Python error", "LLVM ERROR", "crashed while running", "FAILED", "Error")
        # and the crashed process's Python frames in our code (faulthandler's dump)
        ours = ("/quantbridge/", "/targets/", "/tests/")
        notable = [
            line
            for line in lines
            if any(m in line for m in marks)
            or (line.lstrip().startswith("File ") and "site-packages" not in line
                and any(o in line for o in ours))
        ][:40]  # fmt: skip
        progress = [line for line in lines if line.startswith(("compiling ", "cnn ", "case "))]
        raise AssertionError(
            f"{what}: exit code {proc.returncode}"
            + (f" (signal {-proc.returncode})" if proc.returncode < 0 else "")
            + ("\nlast step: " + progress[-1] if progress else "")
            + "\n"
            + "\n".join(notable)
            + "\n--- end of output ---\n"
            + "\n".join(lines[-40:])
        )
    return output


@pytest.mark.parametrize("level", RUNNABLE, ids=lambda level: level.name)
def test_kernels_suite(level: Level) -> None:
    env = level.env()
    env["QUANTBRIDGE_TEST_TARGETS"] = level.target  # lower targets ran at their own level
    _run(
        f"kernels suite at {level.name}",
        ["-m", "pytest", "packages/kernels/tests", "-n", "2", "-q", "-p", "no:cacheprovider"],
        env,
    )


@pytest.mark.parametrize("level", RUNNABLE, ids=lambda level: level.name)
def test_zoo_outputs(level: Level, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp(level.name) / "zoo.npz"
    output = _run(f"model zoo at {level.name}", [str(HERE / "zoo_outputs.py"), str(path)],
                  level.env())  # fmt: skip
    assert f"kernel target {level.target}" in output
    _ZOO[level.name] = path
    outputs = np.load(path)
    for key in sorted({name.rsplit("/", 1)[0] for name in outputs.files}):
        got, want = outputs[f"{key}/lowered"], outputs[f"{key}/reference"]
        assert got.shape == want.shape, key
        assert np.array_equal(np.isnan(got), np.isnan(want)), key
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        bound = float(outputs[f"{key}/bound"])
        assert not (diff > bound * (1 + 1e-5)).any(), (key, float(np.nanmax(diff)), bound)


def test_zoo_outputs_agree_across_levels() -> None:
    missing = [level.name for level in RUNNABLE if level.name not in _ZOO]
    assert not missing, f"no zoo outputs from {missing} (see their test_zoo_outputs)"
    first, *others = [np.load(_ZOO[level.name]) for level in RUNNABLE]
    keys = [name for name in first.files if name.endswith("/lowered")]
    assert keys
    for level, outputs in zip(RUNNABLE[1:], others, strict=True):
        for key in keys:
            assert np.array_equal(first[key], outputs[key], equal_nan=True), (
                f"{key}: {RUNNABLE[0].name} and {level.name} differ"
            )


@pytest.mark.parametrize("level", ABOVE_DRY_RUN, ids=lambda level: level.name)
def test_every_kernel_family_compiles(level: Level, tmp_path: Path) -> None:
    if not runs_here(DRY_RUN_LEVEL):
        pytest.skip(f"the dry run needs a host that runs {DRY_RUN_LEVEL.name}")
    env = level.env()
    # the kernels bench script's vpdpbusd peak probe (reach_kernels) is a feature kernel too
    paths = [str(HERE), str(ROOT / "packages" / "kernels" / "bench"), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    env["QB_DRY_RUN_RECORDS"] = str(tmp_path / "records")
    # step 1: the calls, with every kernel needing more than the dry-run level recorded
    _run(
        f"dry run for {level.name} (on {DRY_RUN_LEVEL.name} code)",
        ["-m", "pytest", "-p", "dry_run", "-q", "-p", "no:cacheprovider",
         str(HERE / "reach_kernels.py")],
        env,
        ok=(0, 1),  # its calls leave outputs unwritten, so some of them fail by design
    )  # fmt: skip
    # step 2: those kernels compiled for the level, nothing run, from a cold cache
    env.pop("QB_DRY_RUN_RECORDS")
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "cache")
    summary_path = tmp_path / "summary.json"
    _run(
        f"compiling for {level.name}",
        [str(HERE / "dry_run.py"), "compile", level.name, str(tmp_path / "records.*"),
         str(summary_path)],
        env,
    )  # fmt: skip
    summary = json.loads(summary_path.read_text())
    assert summary["compiled"], "no kernel was compiled"
    assert summary["not_compiled"] == [], "kernel families the dry run never reached"
    assert summary["missing_instructions"] == []
    assert summary["beyond_level"] == [], "calls reached kernels this level's CPU cannot run"


def test_byte_identity_harness_is_repeatable(tmp_path: Path) -> None:
    """``zoo_hashes.py`` (the harness refactors run before and after) gives the same hashes in
    a second process, and the numba targets this host runs agree on every model."""
    saved = tmp_path / "hashes.json"
    env = dict(os.environ)
    out = _run("zoo_hashes --out", [str(HERE / "zoo_hashes.py"), "--out", str(saved)], env)
    every = json.loads(saved.read_text())
    assert len(every["reference"]) >= 20
    assert f"agree on {len(every['reference'])} of {len(every['reference'])} models" in out
    out = _run("zoo_hashes --compare", [str(HERE / "zoo_hashes.py"), "--compare", str(saved)], env)
    assert "differs" not in out
