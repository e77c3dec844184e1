"""The numba compatibility module: its version check, the compiled entry point, and the
on-disk cache that never hands back machine code built from older package source."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numba
import numpy as np
import pytest

import quantbridge.kernels as qk
from quantbridge.kernels import _numba_compat

SCRIPT = """
import json, sys
import numpy as np
import quantbridge.kernels as qk
assert qk.__file__.startswith(sys.argv[1]), qk.__file__
rng = np.random.default_rng(0)
w = rng.integers(-128, 128, (40, 24), dtype=np.int8)
x = rng.standard_normal((5, 24)).astype(np.float32)
y = qk.linear_dynamic(x, qk.PackedLinearWeight(w, 0.01, target="generic"), num_threads=1)
print(json.dumps(y.ravel().tolist()))
"""

# the edit a developer might make to an intrinsic: _fma.py's fma32, inlined into _gemm.py
OLD_IR = "        return builder.call(fn, values)\n"
NEW_IR = "        return builder.fadd(builder.call(fn, values), ir.Constant(f32, 1.0))\n"


def _run(root: Path) -> np.ndarray:
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("NUMBA_CACHE_DIR", None)  # cache in the copy's __pycache__
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root)],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,  # the copy, never whatever package the current directory holds
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return np.array(json.loads(proc.stdout), dtype=np.float32)


def test_editing_an_intrinsic_invalidates_cached_callers(tmp_path: Path) -> None:
    pkg = tmp_path / "quantbridge" / "kernels"
    shutil.copytree(Path(qk.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    before = _run(tmp_path)
    # num_threads=1 runs the serial generic driver (the prange one only runs on 2+ threads)
    cached = list((pkg / "__pycache__").glob("_gemm.serial_generic-*.nbi"))
    assert cached, "the first run should have written the driver's cache index"
    fma = pkg / "_fma.py"
    src = fma.read_text()
    assert src.count(OLD_IR) == 1
    fma.write_text(src.replace(OLD_IR, NEW_IR))
    after = _run(tmp_path)  # warm cache; _gemm.py itself is unchanged
    shutil.rmtree(pkg / "__pycache__")
    fresh = _run(tmp_path)  # cold cache: what the edited source really computes
    # fma32 also quantizes the activations, so the edit changes more than "+1.0"
    assert not np.array_equal(fresh, before)
    np.testing.assert_array_equal(after, fresh)


def test_package_stamp_covers_every_module(tmp_path: Path) -> None:
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("ignored\n")
    first = _numba_compat.package_stamp(str(tmp_path))
    (tmp_path / "notes.txt").write_text("still ignored\n")
    assert _numba_compat.package_stamp(str(tmp_path)) == first
    (tmp_path / "b.py").write_text("x = 2\n")
    second = _numba_compat.package_stamp(str(tmp_path))
    assert second != first
    (tmp_path / "c.py").write_text("")
    assert _numba_compat.package_stamp(str(tmp_path)) not in (first, second)


def test_every_cached_kernel_uses_the_package_stamp() -> None:
    dispatchers = _numba_compat.package_dispatchers(_numba_compat.package_modules())
    cached = [d for d in dispatchers if hasattr(d._cache, "_cache_file")]
    assert len(cached) >= 40
    stamps = set()
    for d in cached:
        assert isinstance(_numba_compat.locator_of(d), _numba_compat.LOCATORS), d
        assert type(d._cache._cache_file) is _numba_compat.KeyNamedCacheFile, d
        stamps.add(d._cache._cache_file._source_stamp[1])
    # one whole-package hash for all (taken at import; the sources may change after that)
    assert len(stamps) == 1
    assert len(stamps.pop()) == 64
    # kernels a factory made and a module keeps in a dict are found too
    from quantbridge.kernels import _sequence

    assert all(any(loop is d for d in cached) for loop in _sequence._LOOPS.values())


def test_concurrent_writers_of_different_keys_keep_both(tmp_path: Path) -> None:
    # two "processes" with the same stamp, each unaware of the other's entry
    one = _numba_compat.KeyNamedCacheFile(str(tmp_path), "f-1.py311", "stamp")
    two = _numba_compat.KeyNamedCacheFile(str(tmp_path), "f-1.py311", "stamp")
    one.save(("sig_a",), {"code": "A"})
    two.save(("sig_b",), {"code": "B"})
    reader = _numba_compat.KeyNamedCacheFile(str(tmp_path), "f-1.py311", "stamp")
    assert reader.load(("sig_a",)) == {"code": "A"}
    assert reader.load(("sig_b",)) == {"code": "B"}
    assert len(list(tmp_path.glob("*.nbc"))) == 2
    stale = _numba_compat.KeyNamedCacheFile(str(tmp_path), "f-1.py311", "other stamp")
    assert stale.load(("sig_a",)) is None


def test_writers_of_different_source_versions_never_share_a_data_file(tmp_path: Path) -> None:
    # same key (only a dependency changed, so the function's own bytecode did not)
    new = _numba_compat.KeyNamedCacheFile(str(tmp_path), "f-1.py311", "new stamp")
    old = _numba_compat.KeyNamedCacheFile(str(tmp_path), "f-1.py311", "old stamp")
    new.save(("sig",), {"code": "NEW"})
    (new_file,) = tmp_path.glob("*.nbc")
    old.save(("sig",), {"code": "OLD"})  # a process still running the older source
    files = sorted(tmp_path.glob("*.nbc"))
    assert len(files) == 2
    assert new._load_data(new_file.name) == {"code": "NEW"}
    assert new.load(("sig",)) is None  # the index now has the old stamp: a miss, not OLD code
    new.save(("sig",), {"code": "NEW"})
    assert new.load(("sig",)) == {"code": "NEW"}
    assert old.load(("sig",)) is None


# ---- the numba version check ------------------------------------------------------------


def test_the_installed_numba_is_a_tested_release_with_every_internal():
    missing = [what for what, present in _numba_compat._internals() if not present]
    assert missing == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _numba_compat.check_numba()  # neither raises nor warns


@pytest.mark.parametrize("version", ["0.67.1", "0.69.0", "1.0.0", "0.70.0rc1", "dev"])
def test_an_untested_numba_release_is_warned_about(version):
    with pytest.warns(_numba_compat.NumbaVersionWarning, match=f"not {version}"):
        _numba_compat.check_numba(version)


def test_a_numba_without_an_internal_is_refused_by_name(monkeypatch):
    from numba.core import caching

    monkeypatch.delattr(caching.CacheImpl, "_locator_classes")
    with pytest.raises(
        ImportError, match=r"lacks numba\.core\.caching\.CacheImpl\._locator_classes"
    ):
        _numba_compat.check_numba("0.99.0")


def test_the_compiled_entry_point_runs_the_same_code():
    @numba.njit
    def twice(x):
        return 2 * x

    assert _numba_compat.compiled_entry_point(twice, (3,)) is None  # not compiled yet
    assert twice(3) == 6
    entry = _numba_compat.compiled_entry_point(twice, (3,))
    assert entry is not None
    assert entry(21) == 42


CLOSURE_SCRIPT = """
import json
import numpy as np
import quantbridge.kernels as qk
from quantbridge.kernels import _depthwise
x = np.zeros((1, 16, 8, 8), np.uint8)
packed = qk.PackedConvWeight(np.ones((16, 1, 3, 3), np.int8), 0.1, groups=16, padding=1,
                             target="generic")
qk.conv2d(x, packed, 0.1, 0, 0.1, 0, num_threads=1)
driver = _depthwise.DRIVERS["generic"][0]
print(json.dumps([sum(driver.stats.cache_hits.values()), sum(driver.stats.cache_misses.values())]))
"""


def test_a_kernel_closing_over_kernels_loads_from_the_cache_in_a_new_process(tmp_path):
    # the depthwise drivers close over their row kernels; numba keyed such entries by the
    # pickled cells, which hold a per-process uuid, so every process compiled them again
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", CLOSURE_SCRIPT], env=env, check=True,
                capture_output=True, text=True,
            ).stdout.splitlines()[-1]
        )
        for _ in range(2)
    ]  # fmt: skip
    assert runs[0] == [0, 1]  # compiled and saved
    assert runs[1] == [1, 0]  # loaded
