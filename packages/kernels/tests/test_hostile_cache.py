"""A damaged numba cache is survived: warned about once, recompiled, rewritten.

Before, garbage, truncated or empty cache files made every call of the kernel raise
``UnpicklingError``/``EOFError`` until someone deleted the cache folder. Each test damages the
real cache files of two cheap kernels (``dequantize_per_tensor``: its index files; ``relu``:
its data files) in a private ``$NUMBA_CACHE_DIR`` and runs them in a fresh process, so numba
really loads (or fails to load) them from disk.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest

from quantbridge.kernels import _numba_compat

SCRIPT = """
import json, warnings
import numpy as np
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")  # the package's own once-per-folder rule is under test
    import quantbridge.kernels as qk
    q = np.arange(256, dtype=np.uint8)
    deq = qk.dequantize_per_tensor(q, 0.125, 3)
    rel = qk.relu(q, 7)
print(json.dumps({
    "deq": deq.tolist(),
    "relu": rel.tolist(),
    "warnings": [str(w.message) for w in caught if issubclass(w.category, qk.KernelCacheWarning)],
}))
"""

Q = np.arange(256, dtype=np.uint8)
WANT_DEQ = np.float32(0.125) * (Q.astype(np.float32) - np.float32(3))  # exact in float32
WANT_RELU = np.maximum(Q, 7)


def _run(cache_dir: Path) -> dict[str, Any]:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir))
    env.pop("NUMBA_CACHE_LOCATOR_CLASSES", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    np.testing.assert_array_equal(np.array(out["deq"], np.float32), WANT_DEQ)
    np.testing.assert_array_equal(np.array(out["relu"], np.uint8), WANT_RELU)
    return out


def _folder(cache_dir: Path) -> Path:
    (folder,) = {p.parent for p in cache_dir.rglob("*.nbi")}
    return folder


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache_dir = tmp_path_factory.mktemp("warm")
    assert _run(cache_dir)["warnings"] == []
    folder = _folder(cache_dir)
    assert list(folder.glob("_quantize._dequantize_flat-*.nbi"))
    assert list(folder.glob("_activation._clamp-*.nbc"))
    return cache_dir


def _garbage(data: bytes) -> bytes:
    return np.random.default_rng(1).integers(0, 256, 300, dtype=np.uint8).tobytes()


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _empty(data: bytes) -> bytes:
    return b""


def _flipped(data: bytes) -> bytes:
    # one byte inside the pickled payload: still unpickles, so only the checksum can tell
    i = len(data) * 2 // 3
    return data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1 :]


def _valid_index(path: Path) -> bool:
    with open(path, "rb") as f:
        return bool(pickle.load(f) == numba.__version__)


def _valid_data(path: Path) -> bool:
    return path.read_bytes().startswith(_numba_compat._DATA_MAGIC)


@pytest.mark.parametrize("damage", [_garbage, _truncated, _empty, _flipped])
def test_damaged_files_are_warned_once_and_recompiled(
    damage: Callable[[bytes], bytes], warm_cache: Path, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    shutil.copytree(warm_cache, cache_dir)
    folder = _folder(cache_dir)
    damaged = [*folder.glob("_quantize.*.nbi"), *folder.glob("_activation.*.nbc")]
    assert len(damaged) >= 2
    for path in damaged:
        path.write_bytes(damage(path.read_bytes()))

    out = _run(cache_dir)  # correct numbers, checked inside

    # two kinds of damage (index and data files), one warning for the folder
    assert len(out["warnings"]) == 1, out["warnings"]
    message = out["warnings"][0]
    assert str(folder) in message
    assert "compiled the kernel again" in message
    # every damaged file was rewritten with a readable entry
    assert all(_valid_index(p) for p in folder.glob("*.nbi"))
    assert all(_valid_data(p) for p in folder.glob("*.nbc"))
    if damage is _garbage:
        assert _run(cache_dir)["warnings"] == []  # the next process loads the rewritten cache


def test_index_of_another_numba_version_is_replaced_silently(
    warm_cache: Path, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    shutil.copytree(warm_cache, cache_dir)
    folder = _folder(cache_dir)
    for path in folder.glob("*.nbi"):
        with open(path, "rb") as f:
            pickle.load(f)
            rest = f.read()
        path.write_bytes(pickle.dumps("0.1.0") + rest)  # numba's header, an old version

    # an upgrade, not damage: numba's own rule (a miss) and no warning
    assert _run(cache_dir)["warnings"] == []
    assert all(_valid_index(p) for p in folder.glob("*.nbi"))


def test_damaged_entries_are_misses_in_process(tmp_path: Path) -> None:
    # the same rules without a subprocess, on the file class itself
    cache = _numba_compat.KeyNamedCacheFile(str(tmp_path), "f-1.py311", "stamp")
    cache.save(("sig",), {"code": "A"})
    assert cache.load(("sig",)) == {"code": "A"}
    (data,) = tmp_path.glob("*.nbc")
    data.write_bytes(data.read_bytes()[:-1])
    _numba_compat._warned.clear()
    with pytest.warns(_numba_compat.KernelCacheWarning, match="checksum mismatch"):
        assert cache.load(("sig",)) is None
    cache.save(("sig",), {"code": "A"})  # what numba does after recompiling
    assert cache.load(("sig",)) == {"code": "A"}
    (index,) = tmp_path.glob("*.nbi")
    index.write_bytes(b"\x80\x05garbage")
    _numba_compat._warned.clear()
    with pytest.warns(_numba_compat.KernelCacheWarning, match="is unreadable"):
        assert cache.load(("sig",)) is None
    cache.save(("sig",), {"code": "B"})
    assert cache.load(("sig",)) == {"code": "B"}
    index.unlink()
    index.mkdir()  # a directory where the index belongs: unreadable and unwritable
    _numba_compat._warned.clear()
    with pytest.warns(_numba_compat.KernelCacheWarning, match="is unreadable"):
        assert cache.load(("sig",)) is None
    with pytest.warns(_numba_compat.KernelCacheWarning, match="could not be written"):
        cache.save(("sig",), {"code": "C"})  # warned, not raised: the kernel still runs
