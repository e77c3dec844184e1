"""The registry of what a configuration file may call.

A JSON config names callables (observer classes, fuser methods, root-node getters, ...) that
quantbridge later calls with arguments from the file. Only objects registered here, plus the
caller's own functions and classes admitted by ``allowed_prefixes``, can be named in those
places. quantbridge.qconfig registers its observers, fake-quantize classes and default
factories below; packages above it (fx_quant, backends) register theirs when imported.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

from quantbridge.qconfig import (
    _calibration_observers,
    _default_factories,
    _fake_quantize,
    _histogram,
    _minmax,
    _passthrough,
    _per_channel,
    _per_group,
)
from quantbridge.qconfig._errors import QConfigError
from quantbridge.qconfig._factory import PartialWrapper
from quantbridge.qconfig._fake_quantize import FakeQuantizeBase
from quantbridge.qconfig._observer_base import ObserverBase

# Top-level packages whose callables no config may reach by name: the standard library
# (os, subprocess, builtins, pickle, importlib, ...) and the big libraries quantbridge runs
# on, whose public functions include file loaders and code generators (torch.load,
# torch.utils.cpp_extension.load_inline, numpy.load, ...). quantbridge itself is listed:
# its callables are admitted one by one through the registry, never by prefix.
PROTECTED_ROOTS: frozenset[str] = frozenset(sys.stdlib_module_names) | {
    "torch",
    "torchvision",
    "torchaudio",
    "functorch",
    "numpy",
    "numba",
    "llvmlite",
    "scipy",
    "sklearn",
    "pandas",
    "sympy",
    "triton",
    "networkx",
    "jinja2",
    "fsspec",
    "filelock",
    "yaml",
    "dill",
    "cloudpickle",
    "joblib",
    "setuptools",
    "pkg_resources",
    "pip",
    "_pytest",
    "pytest",
    "hypothesis",
    "IPython",
    "quantbridge",
}

# Observer and fake-quantize classes of this package (the concrete ones its observer and
# fake-quantize modules define): side-effect free to construct, so from_json builds each
# configured factory once (on the meta device) to check its arguments.
_CLASS_MODULES = (
    _minmax,
    _per_channel,
    _per_group,
    _histogram,
    _calibration_observers,
    _passthrough,
    _fake_quantize,
)
CONSTRUCTIBLE: frozenset[type] = frozenset(
    obj
    for module in _CLASS_MODULES
    for obj in vars(module).values()
    if isinstance(obj, type)
    and issubclass(obj, (ObserverBase, FakeQuantizeBase))
    and obj.__module__ == module.__name__
    and not inspect.isabstract(obj)
)

_registered: dict[int, object] = {}  # id -> object (the value keeps the object alive)


def root_of(module_name: str) -> str:
    return module_name.split(".", 1)[0]


def _check_registrable(obj: object) -> None:
    if isinstance(obj, types.ModuleType) or not callable(obj):
        raise QConfigError(
            f"register_config_callables: {obj!r} is not a function or class; register the "
            "functions and classes a config may name, one by one"
        )
    if not isinstance(obj, (types.FunctionType, type)):
        raise QConfigError(
            f"register_config_callables: {obj!r} (a {type(obj).__name__}) is not a plain "
            "function or class defined in Python; partials, bound methods and builtins cannot "
            "be registered"
        )
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", "")
    if not isinstance(module, str) or "<" in qualname:
        raise QConfigError(
            f"register_config_callables: {obj!r} has no importable name (a lambda or a local "
            "function); define it at module level"
        )
    root = root_of(module)
    if root in PROTECTED_ROOTS and root != "quantbridge":
        raise QConfigError(
            f"register_config_callables: {module}.{qualname} is defined in {root!r}, whose "
            "functions a config file must never call; register your own wrapper instead"
        )


def register_config_callables(*callables: Callable[..., Any]) -> None:
    """Allow configuration files (``from_json``) to name these functions and classes where
    quantbridge calls what the file names: observer factories, fuser methods, root-node and
    extra-inputs getters.

    Register only functions and classes that are safe to call with any arguments a file can
    supply: they must not read or write files, import modules, start processes or evaluate
    code. Each must be a module-level function or class outside the standard library, torch
    and numpy. quantbridge's packages and backends call this when they are imported.
    """
    for obj in callables:
        _check_registrable(obj)
    for obj in callables:
        _registered[id(obj)] = obj


def is_registered(obj: object) -> bool:
    return _registered.get(id(obj)) is obj


def _register_own() -> None:
    register_config_callables(*CONSTRUCTIBLE)
    # The ready-made factories (default_observer, ...) over the classes above.
    for value in vars(_default_factories).values():
        if isinstance(value, PartialWrapper) and is_registered(value.p.func):
            _registered[id(value)] = value


_register_own()
