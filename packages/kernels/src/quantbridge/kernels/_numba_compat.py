"""Every use of numba's internals, in one place: the cache locators and cache files below, and
the compiled entry point of a dispatcher (``compiled_entry_point``). ``check_numba`` runs at
import: a numba release outside ``TESTED_NUMBA`` is warned about, and one that lacks an
internal this module relies on is refused with the attribute's name, before any kernel runs.

Keep numba's on-disk cache (``cache=True``) from ever loading machine code built from old source.

numba stamps a cached function with a hash of *its own* source file only. Kernels here inline
code from other modules (``_vnni.py``/``_fma.py`` intrinsics into the GEMM drivers, helpers
from ``_quantize.py``), so after editing an intrinsic the drivers' stale machine code would
still load -- wrong results at best, out-of-bounds access when a layout changed. The locators
below stamp every function of this package with a hash of *all* of the package's ``.py``
files (and the numba/llvmlite versions): any source change invalidates every cache entry of the
package, and numba's own stamp check then treats the old entries as absent and overwrites them.

They must be registered before the first ``@njit(cache=True)`` of the package runs, because
numba picks the locator at decoration time: the package ``__init__`` imports this module first.

A damaged cache (garbage, truncated or empty files, an index numba cannot read) would make numba
raise on every call until someone deleted the folder. ``KeyNamedCacheFile`` treats any entry it
cannot read as absent (one ``KernelCacheWarning`` per folder and process), so numba recompiles
and rewrites it; data files carry a checksum, so damage inside the machine code is caught too.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
import warnings
from typing import Any

import llvmlite
import numba
from numba.core import caching, config
from numba.core.dispatcher import Dispatcher
from numba.core.extending import _Intrinsic

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

# numba (major, minor) releases these internals were tested with: [first, last]
TESTED_NUMBA = ((0, 68), (0, 68))


class NumbaVersionWarning(RuntimeWarning):
    """numba is a release quantbridge.kernels was not tested with."""


def _internals() -> list[tuple[str, bool]]:
    """(what, present) for each numba internal this module uses."""
    probe = numba.njit(lambda: None)  # a dispatcher, never compiled
    return [
        ("numba.core.caching.CacheImpl._locator_classes (a list)",
         isinstance(getattr(caching.CacheImpl, "_locator_classes", None), list)),
        *(
            (f"numba.core.caching.IndexDataCacheFile.{m}",
             callable(getattr(caching.IndexDataCacheFile, m, None)))
            for m in ("_load_index", "_save_index", "_dump", "_open_for_write", "_data_path")
        ),
        *(
            (f"numba.core.caching.{name}", isinstance(getattr(caching, name, None), type))
            for name in ("UserProvidedCacheLocator", "InTreeCacheLocator",
                         "UserWideCacheLocator", "IndexDataCacheFile")
        ),
        ("numba.core.caching.FunctionCache._index_key",
         callable(getattr(caching.FunctionCache, "_index_key", None))),
        ("numba.core.extending._Intrinsic._name", isinstance(getattr(
            numba.core.extending.intrinsic(lambda typingctx: None), "_name", None), str)),
        ("numba.core.dispatcher.Dispatcher.overloads (a mapping)",
         callable(getattr(getattr(probe, "overloads", None), "get", None))),
    ]  # fmt: skip


def check_numba(version: str = numba.__version__) -> None:
    """Refuse a numba without the internals used here; warn outside ``TESTED_NUMBA``."""
    missing = [what for what, present in _internals() if not present]
    tested = ".".join(map(str, TESTED_NUMBA[0])) + " to " + ".".join(map(str, TESTED_NUMBA[1]))
    if missing:
        raise ImportError(
            f"quantbridge.kernels: numba {version} lacks {', '.join(missing)}, which the "
            f"kernels' cache and call paths use (tested with numba {tested}); install a "
            f"tested numba, e.g. pip install 'numba=={TESTED_NUMBA[1][0]}.{TESTED_NUMBA[1][1]}.*'"
        )
    try:
        release = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        release = ()
    if not (len(release) == 2 and TESTED_NUMBA[0] <= release <= TESTED_NUMBA[1]):
        warnings.warn(
            f"quantbridge.kernels was tested with numba {tested}, not {version}; its internals "
            "are present, but if kernels fail to compile or load, install a tested numba",
            NumbaVersionWarning,
            stacklevel=2,
        )


def compiled_entry_point(dispatcher: Any, args: tuple[Any, ...]) -> Any:
    """The machine-code entry of ``dispatcher`` for ``args``' exact types (compiled by a call
    before), or None: calling it skips numba's per-call type dispatch."""
    entry = dispatcher.overloads.get(tuple(numba.typeof(v) for v in args))  # type: ignore[no-untyped-call]
    return None if entry is None else entry.entry_point


def package_stamp(package_dir: str = PACKAGE_DIR) -> str:
    """sha256 over every ``.py`` file of ``package_dir`` (names and bytes) and tool versions."""
    return _stamp(package_dir, _file_states(package_dir))


def _file_states(package_dir: str) -> tuple[tuple[str, int, int], ...]:
    names = sorted(n for n in os.listdir(package_dir) if n.endswith(".py"))
    states = []
    for name in names:
        st = os.stat(os.path.join(package_dir, name))
        states.append((name, st.st_mtime_ns, st.st_size))
    return tuple(states)


@functools.lru_cache(maxsize=8)
def _stamp(package_dir: str, states: tuple[tuple[str, int, int], ...]) -> str:
    # keyed on (mtime, size) so an edit while the process runs is re-hashed, as numba does
    h = hashlib.sha256()
    h.update(f"numba {numba.__version__} llvmlite {llvmlite.__version__}\n".encode())
    for name, _, _ in states:
        with open(os.path.join(package_dir, name), "rb") as f:
            data = f.read()
        h.update(f"{name} {len(data)}\n".encode())
        h.update(data)
    return h.hexdigest()


def _in_package(py_file: str) -> bool:
    return os.path.dirname(os.path.abspath(py_file)) == PACKAGE_DIR


class _PackageStampMixin:
    """Claims only this package's functions; stamps them with the whole-package hash."""

    def get_source_stamp(self) -> Any:
        return (super().get_source_stamp(), package_stamp())  # type: ignore[misc]

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> Any:
        if not _in_package(py_file):
            return None
        return super().from_function(py_func, py_file)  # type: ignore[misc]


# Same three places numba itself would use ($NUMBA_CACHE_DIR, __pycache__, user-wide), in order.
class PackageUserProvidedLocator(_PackageStampMixin, caching.UserProvidedCacheLocator):
    pass


class PackageInTreeLocator(_PackageStampMixin, caching.InTreeCacheLocator):
    pass


class PackageUserWideLocator(_PackageStampMixin, caching.UserWideCacheLocator):
    pass


LOCATORS: tuple[type, ...] = (
    PackageUserProvidedLocator,
    PackageInTreeLocator,
    PackageUserWideLocator,
)


def register() -> None:
    """Put the package locators first in numba's list (idempotent)."""
    classes: list[Any] = caching.CacheImpl._locator_classes
    for cls in reversed(LOCATORS):
        if cls not in classes:
            classes.insert(0, cls)
    if getattr(config, "CACHE_LOCATOR_CLASSES", None):
        # an explicit locator list bypasses ours: say so rather than risk stale machine code
        warnings.warn(
            "NUMBA_CACHE_LOCATOR_CLASSES is set, so quantbridge.kernels cannot stamp its numba "
            "cache with the package hash; after editing the package, clear the cache "
            "(or unset the variable).",
            RuntimeWarning,
            stacklevel=2,
        )


class KernelCacheWarning(RuntimeWarning):
    """A damaged numba cache file of quantbridge.kernels was ignored and the kernel recompiled."""


_warned: set[tuple[str, str]] = set()  # (folder, what was done)


def _warn_damaged(
    path: str, problem: str, done: str = "compiled the kernel again, which rewrites the entry"
) -> None:
    """Warn once per cache folder and outcome (a damaged folder often has many damaged files)."""
    folder = os.path.dirname(path)
    if (folder, done) in _warned:
        return
    _warned.add((folder, done))
    warnings.warn(
        f"quantbridge.kernels: numba cache folder {folder}: {os.path.basename(path)} {problem}; "
        f"{done}. Other damaged entries in this folder are handled the same way without another "
        "warning; deleting the folder is always safe (it only costs a recompile).",
        KernelCacheWarning,
        stacklevel=2,
    )


# data files: this header, the sha256 of the pickled payload, the payload
_DATA_MAGIC = b"quantbridge.kernels numba cache 1\n"
_DIGEST = 32


class KeyNamedCacheFile(caching.IndexDataCacheFile):
    """numba's index/data files, but each data file is named by a hash of its index key.

    numba numbers data files ``1, 2, ...`` from the index it just read: two processes saving
    *different* signatures of one function at once can both pick ``.1.nbc``, and the index of
    one can end up pointing at the other's machine code (a wrong-signature load); likewise a
    process still running older source rewrites ``.1.nbc`` under a fresher index. Named by
    (source stamp, key), two writers share a file only when they write the same code; files
    are still written to a temporary name and ``os.replace``d (atomic), and a lost index update
    only costs a recompile.
    """

    def _name_for(self, key: Any) -> str:
        # the stamp is part of the name: a process still running older source (same key when
        # only a dependency changed) writes its own file and never overwrites ours
        tag = hashlib.sha256(repr((self._source_stamp, key)).encode()).hexdigest()[:20]
        return str(self._data_name_pattern.replace("{number:d}", tag))

    def save(self, key: Any, data: Any) -> None:
        overloads = self._load_index()
        name = self._name_for(key)
        try:
            # data before index: the index never names a missing file
            self._save_data(name, data)
            if overloads.get(key) != name:
                # re-read: keep what other processes saved meanwhile
                overloads = self._load_index()
                overloads[key] = name
                self._save_index(overloads)  # type: ignore[no-untyped-call]
        except OSError as exc:  # e.g. a directory where a cache file belongs
            _warn_damaged(
                self._index_path,
                f"could not be written ({exc})",
                "the kernel runs, and compiles again in the next process",
            )

    def load(self, key: Any) -> Any:
        """The cached entry, or None to recompile: missing, stale or damaged (warned)."""
        name = self._load_index().get(key)
        if name is None:
            return None
        if name != self._name_for(key):
            _warn_damaged(self._index_path, "names a data file that does not belong to its entry")
            return None
        try:
            return self._load_data(name)
        except FileNotFoundError:
            return None  # removed since the index was written: a plain miss, as in numba
        except Exception as exc:  # any damage means "recompile"
            path = self._data_path(name)  # type: ignore[no-untyped-call]
            _warn_damaged(path, f"is unreadable ({type(exc).__name__}: {exc})")
            return None

    def _load_index(self) -> dict[Any, str]:
        """numba's index format, but damage means an empty index (warned), not an exception."""
        try:
            with open(self._index_path, "rb") as f:
                version = pickle.load(f)
                data = f.read()
        except FileNotFoundError:
            return {}
        except Exception as exc:  # garbage, truncated or empty file
            _warn_damaged(self._index_path, f"is unreadable ({type(exc).__name__}: {exc})")
            return {}
        if isinstance(version, str) and version != self._version:
            return {}  # written by another numba version: stale, replaced on the next save
        try:
            if version != self._version:
                raise ValueError(f"version header {version!r} is not a numba version")
            stamp, overloads = pickle.loads(data)
            if not isinstance(overloads, dict):
                raise TypeError(f"holds a {type(overloads).__name__}, not a dict")
        except Exception as exc:
            _warn_damaged(self._index_path, f"is unreadable ({type(exc).__name__}: {exc})")
            return {}
        return overloads if stamp == self._source_stamp else {}

    def _save_data(self, name: str, data: Any) -> None:
        payload = self._dump(data)  # type: ignore[no-untyped-call]
        with self._open_for_write(self._data_path(name)) as f:  # type: ignore[no-untyped-call]
            f.write(_DATA_MAGIC + hashlib.sha256(payload).digest() + payload)

    def _load_data(self, name: str) -> Any:
        with open(self._data_path(name), "rb") as f:  # type: ignore[no-untyped-call]
            raw = f.read()
        head = len(_DATA_MAGIC) + _DIGEST
        payload = raw[head:]
        if raw[: len(_DATA_MAGIC)] != _DATA_MAGIC:
            raise ValueError("no quantbridge.kernels header (garbage or an older format)")
        if len(raw) < head or hashlib.sha256(payload).digest() != raw[len(_DATA_MAGIC) : head]:
            raise ValueError("checksum mismatch (truncated or overwritten)")
        return pickle.loads(payload)


def _stable(value: Any) -> Any:
    """A closure cell's value as the same bytes in every process: a dispatcher or intrinsic
    by its name (numba pickles a dispatcher with a per-process uuid)."""
    if isinstance(value, Dispatcher):
        return ("dispatcher", value.py_func.__module__, value.py_func.__qualname__)
    if isinstance(value, _Intrinsic):
        return ("intrinsic", value._name)
    return value


class StableKeyFunctionCache(caching.FunctionCache):
    """numba's function cache, with an index key that is the same in every process.

    numba keys a closure's cache entry by the pickled contents of its cells. A kernel made
    by a factory closes over other kernels (the depthwise drivers over their row kernels),
    and a pickled dispatcher carries a uuid new in each process: such a kernel never found
    its entry, and every process compiled it again (about 9 s for the VNNI depthwise
    drivers). Here a dispatcher or intrinsic cell counts by its qualified name; the package
    stamp already invalidates every entry when any source of the package changes."""

    def _index_key(self, sig: Any, codegen: Any) -> Any:
        func = self._py_func
        cells = tuple(_stable(c.cell_contents) for c in func.__closure__ or ())
        digest = hashlib.sha256(pickle.dumps(cells)).hexdigest() if cells else ""
        code = hashlib.sha256(func.__code__.co_code).hexdigest()
        return (sig, codegen.magic_tuple(), (code, digest))


def harden(dispatchers: list[Any]) -> None:
    """Give each ``cache=True`` dispatcher key-named data files and an index key that is the
    same in every process; check it uses our locator."""
    for d in dispatchers:
        cache = getattr(d, "_cache", None)
        if cache is None or not hasattr(cache, "_cache_file"):
            continue  # not cached (NullCache)
        if not isinstance(cache._impl.locator, LOCATORS):
            # only with $NUMBA_CACHE_LOCATOR_CLASSES set (warned above): leave numba's default
            continue
        cache._cache_file.__class__ = KeyNamedCacheFile
        if type(cache) is caching.FunctionCache:
            cache.__class__ = StableKeyFunctionCache


def package_modules() -> list[Any]:
    """This package's modules imported so far."""
    prefix = __name__.rsplit(".", 1)[0] + "."
    return [m for name, m in list(sys.modules.items()) if name.startswith(prefix)]


def package_dispatchers(modules: list[Any]) -> list[Any]:
    """Every numba dispatcher defined in ``modules``, at module level or one level down in a
    module-level dict, list or tuple (kernels made by a factory, keyed by their variant)."""
    found: dict[int, Any] = {}  # by id: one entry per dispatcher, in the order first seen
    for mod in modules:
        for value in vars(mod).values():
            if isinstance(value, dict):
                items = list(value.values())
            else:
                items = list(value) if isinstance(value, (list, tuple)) else [value]
            for item in items:
                if isinstance(item, Dispatcher) and item.py_func.__module__ == mod.__name__:
                    found.setdefault(id(item), item)
    return list(found.values())


def locator_of(dispatcher: Any) -> Any:
    """The cache locator numba chose for a ``cache=True`` dispatcher (for tests)."""
    return dispatcher._cache._impl.locator


check_numba()
register()
