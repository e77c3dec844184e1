"""JSON for the configuration types: qualified names out, registry-checked names in.

A document is ``{"format": "quantbridge.qconfig", "format_version": 1, "type": <class name>,
"data": <the encoded to_dict()>}``. Values encode as follows; a tagged value is a JSON object
with exactly one key starting with ``$``:

================================  ========================================================
Python value                      JSON
================================  ========================================================
None, bool, int, str              themselves (so method-name patterns stay plain strings)
finite float                      a number (Python writes the shortest exact repr)
inf / -inf / nan                  ``{"$float": "inf"}`` (bare NaN/Infinity are refused)
list                              an array
tuple                             ``{"$tuple": [...]}``
dict with str keys                an object (``{"$dict": [[k, v], ...]}`` when a key could
                                  be mistaken for a tag or is not a str)
torch.dtype                       ``{"$dtype": "torch.uint8"}``
QScheme / torch qscheme           ``{"$qscheme": "per_tensor_affine"}`` (loads as QScheme)
ObservationType                   ``{"$observation_type": "OUTPUT_SHARE_OBSERVER_WITH_INPUT"}``
DTypeWithConstraints              ``{"$dtype_with_constraints": {field: value, ...}}``
QConfig                           ``{"$qconfig": {"activation": ..., "weight": ...}}``
``Obs.with_args(**kw)`` factory   ``{"$with_args": {"class": "<name>", "kwargs": {...}}}``
functools.partial                 ``{"$partial": {"func": "<name>", "args": [], "kwargs": {}}}``
class, function, op               ``{"$ref": "torch.nn.Linear"}``
================================  ========================================================

A file is untrusted input, so loading distinguishes two kinds of names:

* names quantbridge will *call* (observer factories, fuser methods, node getters, and
  anything inside a factory's arguments) must be registered with
  :func:`~quantbridge.qconfig.register_config_callables`, or be a function or class defined
  in one of the caller's ``allowed_prefixes`` modules;
* names used as *data* (the classes, functions and operators of patterns and object types,
  and the module classes of a backend pattern config) are only compared with the model's
  modules and graph nodes, never called by loading; they resolve under ``torch``,
  ``operator``, ``quantbridge`` and the caller's prefixes, and must be a class, function or
  operator (an ``nn.Module`` subclass where a module class is expected).

Everything is checked while loading, with the JSON path of the offending value in the error;
the document's size, nesting depth, numbers and names are bounded (the ``MAX_*`` below).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import math
import re
import reprlib
import sys
import types
from collections.abc import Callable
from dataclasses import fields
from itertools import accumulate
from pathlib import Path
from typing import IO, Any, TypeVar

import torch

from quantbridge.qconfig._backend_config import DTypeWithConstraints, ObservationType
from quantbridge.qconfig._config_callables import (
    CONSTRUCTIBLE,
    PROTECTED_ROOTS,
    is_registered,
    root_of,
)
from quantbridge.qconfig._dtypes import _ALIASES, QScheme, canonical_qscheme
from quantbridge.qconfig._errors import QConfigError
from quantbridge.qconfig._factory import PartialWrapper
from quantbridge.qconfig._fake_quantize import FakeQuantizeBase
from quantbridge.qconfig._observer_base import ObserverBase
from quantbridge.qconfig._qconfig import QConfig

_T = TypeVar("_T")

FORMAT = "quantbridge.qconfig"
FORMAT_VERSION = 1
#: Where names used as data (patterns, module classes) may come from, besides the caller's.
DATA_PREFIXES: tuple[str, ...] = ("torch", "operator", "quantbridge")

#: Largest document from_json reads, in characters (the built-in configs are ~200 kB).
MAX_DOCUMENT_CHARS = 8 * 1024 * 1024
#: Deepest nesting of JSON arrays and objects (the built-in configs need ~12).
MAX_DEPTH = 64
#: Longest dotted name, in characters and in dot-separated parts.
MAX_NAME_CHARS = 256
MAX_NAME_PARTS = 16
#: Most digits in a JSON integer (int64 needs 19).
MAX_INT_DIGITS = 20

# Modules whose objects report a private implementation module as __module__.
_PUBLIC_MODULE_ALIASES = {"_operator": "operator"}
# Where builtins that report an unhelpful __module__ (torch._C._nn, None) are exported.
_FALLBACK_NAMESPACES = ("torch", "torch.nn.functional", "operator", "torch.Tensor")
_DOTTED_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Tags that only wrap a container: transparent in JSON paths ($.object_type[0][1].activation).
_TRANSPARENT_TAGS = ("$tuple", "$dict", "$qconfig", "$dtype_with_constraints")

# What loading does with a name, by where it stands in the document.
_CALL = "call"  # quantbridge may call it: registry or the caller's own code only
_PATTERN = "pattern"  # compared with graph nodes and module types, never called
_MODULE_CLASS = "module class"  # an nn.Module subclass the flow converts modules to/from

# Where module classes (qat_module, fused_module, ...) may be defined, besides the caller's.
_MODULE_CLASS_PREFIXES = ("torch.nn", "torch.ao.nn", "quantbridge")
# BackendPatternConfig keys holding data names; every other key is _CALL.
_PATTERN_CONFIG_KINDS = {
    "pattern": _PATTERN,
    "pattern_complex_format": _PATTERN,
    "root_module": _MODULE_CLASS,
    "qat_module": _MODULE_CLASS,
    "reference_quantized_module_for_root": _MODULE_CLASS,
    "fused_module": _MODULE_CLASS,
}
# QConfigMapping keys whose entries start with an object type (a pattern).
_QCONFIG_MAPPING_KINDS = {"object_type": _PATTERN, "module_name_object_type_order": _PATTERN}

_PATTERN_TYPES: tuple[type, ...] = (
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.ClassMethodDescriptorType,
    torch._ops.OpOverload,
    torch._ops.OpOverloadPacket,
)


def _at(path: str) -> str:
    return path or "$"


def _join(path: str, key: str) -> str:
    if _IDENTIFIER.match(key) or (key.startswith("$") and _IDENTIFIER.match(key[1:])):
        return f"{path or '$'}.{key}"
    shown = key if len(key) <= 60 else key[:60] + "..."
    return f"{path or '$'}[{json.dumps(shown)}]"  # e.g. QConfigMapping's global entry $[""]


# -- names -------------------------------------------------------------------------------------


def _is_under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _check_prefixes(allowed_prefixes: object) -> tuple[str, ...]:
    """The caller's prefixes, validated: dotted module names outside the protected roots."""
    if isinstance(allowed_prefixes, str):
        raise QConfigError(
            f"allowed_prefixes must be a tuple of module prefixes, got the string "
            f"{allowed_prefixes!r}; write ({allowed_prefixes!r},)"
        )
    if not isinstance(allowed_prefixes, (tuple, list)):
        raise QConfigError(
            f"allowed_prefixes must be a tuple of module prefixes such as ('my_backend',), "
            f"got {allowed_prefixes!r}"
        )
    for p in allowed_prefixes:
        if not isinstance(p, str) or len(p) > MAX_NAME_CHARS or not _DOTTED_NAME.match(p):
            raise QConfigError(
                f"allowed_prefixes: {p!r} is not a dotted module name such as 'my_backend'"
            )
        if root_of(p) in PROTECTED_ROOTS:
            raise QConfigError(
                f"allowed_prefixes: {p!r} lies under {root_of(p)!r}; a prefix admits every "
                "function and class its modules define, and those of the standard library, "
                "torch, numpy and quantbridge include file loaders and code runners. Name "
                "your own package here, or register single functions with "
                "quantbridge.qconfig.register_config_callables"
            )
    return tuple(allowed_prefixes)


def _resolve_for_writing(name: str) -> Any:
    """The object ``name`` refers to, importing what it needs (writing only: names come from
    the objects being written, never from a file)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise QConfigError(f"no importable module in {name!r}")


def _module_prefixes(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def qualified_name(obj: object, where: str) -> str:
    """A dotted name that resolves back to ``obj`` itself, preferring short public names
    (``torch.nn.Linear`` over ``torch.nn.modules.linear.Linear``)."""
    if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        candidates = [f"torch.ops.{obj}"]  # str() gives "aten.add.Tensor" / "aten.add"
    else:
        module = getattr(obj, "__module__", None)
        attrs = []
        qualname = getattr(obj, "__qualname__", None)
        if isinstance(qualname, str) and "<" not in qualname:
            attrs.append(qualname)
        simple = getattr(obj, "__name__", None)
        if isinstance(simple, str) and simple not in attrs:
            attrs.append(simple)
        namespaces = []
        if isinstance(module, str):
            namespaces += _module_prefixes(_PUBLIC_MODULE_ALIASES.get(module, module))
            if module in _PUBLIC_MODULE_ALIASES:
                namespaces += _module_prefixes(module)
        namespaces += [n for n in _FALLBACK_NAMESPACES if n not in namespaces]
        candidates = [f"{ns}.{attr}" for ns in namespaces for attr in attrs]
    found: list[str] = []
    for candidate in candidates:
        if not candidate or not _DOTTED_NAME.match(candidate):
            continue
        try:
            if _resolve_for_writing(candidate) is obj:
                found.append(candidate)
        except Exception:  # any failure means: not this name
            continue
    if not found:
        raise QConfigError(
            f"{_at(where)}: {obj!r} has no importable qualified name, so it cannot be written "
            "to JSON; lambdas, local functions and objects created at run time cannot be "
            "loaded back. Define it at module level in an importable module"
        )

    def rank(name: str) -> tuple[bool, int]:
        private = any(part.startswith("_") for part in name.split("."))
        return (private, name.count("."))

    return min(found, key=rank)


# -- encoding ----------------------------------------------------------------------------------


def _encode_kwargs(kwargs: dict[str, Any], path: str) -> dict[str, Any]:
    return {k: encode(v, _join(path, k)) for k, v in kwargs.items()}


def _encode_constructor(value: Any, path: str) -> Any:
    if value is None:
        return None
    partial = getattr(value, "p", None)
    if isinstance(partial, functools.partial):
        callable_args = getattr(value, "callable_args", None)
        if callable_args:
            raise QConfigError(
                f"{_at(path)}: the observer factory has callable_args "
                f"{sorted(callable_args)}, which are computed at run time and cannot be "
                "written to JSON; pass plain values with with_args(...) instead"
            )
        if partial.args:
            raise QConfigError(
                f"{_at(path)}: the observer factory has positional arguments "
                f"{partial.args!r}; JSON keeps keyword arguments only"
            )
        return {
            "$with_args": {
                "class": qualified_name(partial.func, _join(path, "class")),
                "kwargs": _encode_kwargs(partial.keywords, _join(path, "kwargs")),
            }
        }
    if isinstance(value, functools.partial):
        return {
            "$partial": {
                "func": qualified_name(value.func, _join(path, "func")),
                "args": [
                    encode(a, _index(_join(path, "args"), i)) for i, a in enumerate(value.args)
                ],
                "kwargs": _encode_kwargs(value.keywords, _join(path, "kwargs")),
            }
        }
    return {"$ref": qualified_name(value, path)}


def encode(value: Any, path: str) -> Any:
    """The JSON-ready form of ``value``; ``path`` names it in errors."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, QScheme):  # before str: QScheme is a str enum
        return {"$qscheme": value.value}
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value)}
    if type(value).__name__ == "qscheme":  # torch's qscheme objects, e.g. per_tensor_affine
        return {"$qscheme": canonical_qscheme(value, path).value}
    if isinstance(value, ObservationType):
        return {"$observation_type": value.name}
    if isinstance(value, DTypeWithConstraints):
        return {
            "$dtype_with_constraints": {
                f.name: encode(getattr(value, f.name), _join(path, f.name))
                for f in fields(value)
                if getattr(value, f.name) is not None
            }
        }
    if isinstance(value, QConfig):
        return {
            "$qconfig": {
                "activation": _encode_constructor(value.activation, _join(path, "activation")),
                "weight": _encode_constructor(value.weight, _join(path, "weight")),
            }
        }
    if isinstance(value, list):
        return [encode(v, _index(path, i)) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, _index(path, i)) for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v, _join(path, k)) for k, v in value.items()}
        return {
            "$dict": [
                [encode(k, f"{_at(path)}[{k!r}]"), encode(v, f"{_at(path)}[{k!r}]")]
                for k, v in value.items()
            ]
        }
    if isinstance(value, torch.Tensor):
        raise QConfigError(
            f"{_at(path)}: tensors cannot be written to JSON; pass a float or int instead"
        )
    if callable(value):
        return _encode_constructor(value, path)
    raise QConfigError(
        f"{_at(path)}: cannot write {value!r} (a {type(value).__name__}) to JSON; supported are "
        "None, bool, int, float, str, lists, tuples, dicts, dtypes, qschemes, and importable "
        "classes, functions and observer factories"
    )


# -- decoding ----------------------------------------------------------------------------------
def _index(path: str, i: int) -> str:
    return f"{path or '$'}[{i}]"


# -- decoding ----------------------------------------------------------------------------------


class _Bare:
    """A JSON number or constant the format does not allow, kept until its path is known."""

    def __init__(self, text: str, why: str) -> None:
        self.text = text
        self.why = why


def _parse_int(text: str) -> int | _Bare:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        return _Bare(text[:40], f"integers have at most {MAX_INT_DIGITS} digits")
    return int(text)


def _parse_float(text: str) -> float | _Bare:
    value = float(text)
    if not math.isfinite(value):
        return _Bare(text[:40], 'it overflows a float; write {"$float": "inf"} for infinity')
    return value


def _parse_constant(text: str) -> _Bare:
    return _Bare(text, 'write {"$float": "nan"}, {"$float": "inf"} or {"$float": "-inf"}')


class _Loader:
    """Decodes one document's ``data``; remembers which objects came from the caller's code."""

    def __init__(self, caller_prefixes: tuple[str, ...]) -> None:
        self.caller = caller_prefixes
        self.callers_own: dict[int, object] = {}

    # names ---------------------------------------------------------------------------------

    def _name_parts(self, name: object, path: str) -> list[str]:
        if not isinstance(name, str):
            raise QConfigError(f"{_at(path)}: expected a dotted Python name, got {name!r}")
        if len(name) > MAX_NAME_CHARS or name.count(".") >= MAX_NAME_PARTS:
            raise QConfigError(
                f"{_at(path)}: the name {name[:60]!r}... is too long (at most {MAX_NAME_CHARS} "
                f"characters and {MAX_NAME_PARTS} dotted parts)"
            )
        if not _DOTTED_NAME.match(name):
            raise QConfigError(f"{_at(path)}: {name!r} is not a dotted Python name")
        parts = name.split(".")
        if any(p.startswith("__") and p.endswith("__") for p in parts):
            # __globals__, __builtins__, __subclasses__, ... lead anywhere.
            raise QConfigError(
                f"{_at(path)}: refusing to load {name!r}: names with dunder components are "
                "not resolved"
            )
        return parts

    def _walk(
        self,
        name: str,
        parts: list[str],
        importable: Callable[[str], bool],
        passable: tuple[str, ...],
        path: str,
    ) -> Any:
        """Import the longest importable module of ``name``, then getattr the rest, refusing
        to pass through a module outside ``passable``."""
        obj: Any = None
        found = 0
        for i in range(len(parts), 0, -1):
            module_name = ".".join(parts[:i])
            if module_name in sys.modules and _is_under(module_name, passable):
                obj, found = sys.modules[module_name], i
                break
            if not importable(module_name):
                continue
            try:
                obj, found = importlib.import_module(module_name), i
                break
            except ModuleNotFoundError as e:
                if e.name is not None and (
                    e.name == module_name or module_name.startswith(e.name + ".")
                ):
                    continue
                raise QConfigError(f"{_at(path)}: importing {name!r} failed: {e}") from None
            except Exception as e:  # a broken module under the caller's prefix
                raise QConfigError(f"{_at(path)}: importing {name!r} failed: {e}") from None
        if not found:
            raise QConfigError(f"{_at(path)}: no importable module in {name!r}")
        for i in range(found, len(parts)):
            try:
                obj = getattr(obj, parts[i])
            except AttributeError:
                raise QConfigError(
                    f"{_at(path)}: {name!r} does not exist: {'.'.join(parts[:i])!r} has no "
                    f"attribute {parts[i]!r}"
                ) from None
            if isinstance(obj, types.ModuleType) and not _is_under(obj.__name__, passable):
                raise QConfigError(
                    f"{_at(path)}: refusing to load {name!r}: it passes through module "
                    f"{obj.__name__!r}, outside {list(passable)}"
                )
        return obj

    def resolve_callable(self, name: object, path: str, what: str) -> Any:
        """A registered callable, or a function or class of the caller's own modules."""
        parts = self._name_parts(name, path)
        assert isinstance(name, str)
        how_to = (
            "a config file may only call the observers, fake-quantize classes and functions "
            "registered with quantbridge.qconfig.register_config_callables (quantbridge's own "
            "and those of installed backends); if it is your own code, pass its package in "
            "allowed_prefixes=(...) or register it"
        )
        own = _is_under(name, self.caller)
        if own:
            obj = self._walk(name, parts, lambda m: _is_under(m, self.caller), self.caller, path)
        elif parts[0] == "quantbridge" and len(parts) > 2:
            package = ".".join(parts[:2])  # importing a package registers its callables
            obj = self._walk(name, parts, lambda m: m == package, ("quantbridge",), path)
        elif parts[0] not in PROTECTED_ROOTS and parts[0] in sys.modules:
            # A backend that registered callables has been imported; import nothing more.
            obj = self._walk(name, parts, lambda m: False, (parts[0],), path)
        else:
            raise QConfigError(f"{_at(path)}: refusing to call {name!r} as {what}: {how_to}")
        if is_registered(obj):
            return obj
        if own and isinstance(obj, (types.FunctionType, type)):
            defined_in = getattr(obj, "__module__", None)
            if isinstance(defined_in, str) and _is_under(defined_in, self.caller):
                self.callers_own[id(obj)] = obj
                return obj
            raise QConfigError(
                f"{_at(path)}: refusing to call {name!r} as {what}: it is defined in "
                f"{defined_in!r}, not in your allowed_prefixes {list(self.caller)}"
            )
        raise QConfigError(
            f"{_at(path)}: refusing to call {name!r} as {what}: {type(obj).__name__} "
            f"{obj!r} is not registered; {how_to}"
        )

    def resolve_data(self, name: object, path: str, kind: str) -> Any:
        """A class, function or operator named as data (a pattern or a module class)."""
        parts = self._name_parts(name, path)
        assert isinstance(name, str)
        prefixes = DATA_PREFIXES + self.caller
        if not _is_under(name, prefixes):
            raise QConfigError(
                f"{_at(path)}: refusing to load {name!r}: a {kind} comes from {list(prefixes)}; "
                "if it is your own, pass its package in allowed_prefixes=(...)"
            )

        def importable(module: str) -> bool:
            # torch's module trees of layers, quantbridge's packages, the caller's modules.
            return (
                _is_under(module, ("torch.nn", "torch.ao.nn", *self.caller))
                or (module.startswith("quantbridge.") and module.count(".") == 1)
                or module in ("torch", "operator")
            )

        obj = self._walk(name, parts, importable, prefixes, path)
        defined_in = getattr(obj, "__module__", None)
        if isinstance(defined_in, str):
            public = _PUBLIC_MODULE_ALIASES.get(defined_in, defined_in)
            if not _is_under(public, prefixes):
                raise QConfigError(
                    f"{_at(path)}: refusing to load {name!r}: its defining module "
                    f"{defined_in!r} is outside {list(prefixes)}"
                )
        if kind == _MODULE_CLASS:
            if not (isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
                raise QConfigError(
                    f"{_at(path)}: {name!r} is not an nn.Module subclass (a "
                    f"{type(obj).__name__}); a module class is expected here"
                )
            # The flow calls these classes' from_float/to_float: only layer classes qualify.
            layers = (*_MODULE_CLASS_PREFIXES, *self.caller)
            if not _is_under(obj.__module__, layers):
                raise QConfigError(
                    f"{_at(path)}: refusing to load {name!r}: it is defined in "
                    f"{obj.__module__!r}; module classes come from {list(layers)}"
                )
        elif not isinstance(obj, _PATTERN_TYPES):
            raise QConfigError(
                f"{_at(path)}: {name!r} is a {type(obj).__name__}; a pattern names a module "
                "class, a function, a Tensor method or an operator"
            )
        return obj

    # values --------------------------------------------------------------------------------

    def decode(self, value: Any, path: str, kind: str) -> Any:
        if isinstance(value, _Bare):
            raise QConfigError(f"{_at(path)}: {value.text!r} is not allowed here: {value.why}")
        if isinstance(value, list):
            return [self.decode(v, _index(path, i), kind) for i, v in enumerate(value)]
        if isinstance(value, dict):
            if len(value) == 1:
                (key,) = value
                if key.startswith("$"):
                    return self._tagged(key, value[key], path, kind)
            return {k: self.decode(v, _join(path, k), kind) for k, v in value.items()}
        return value

    def decode_fields(self, value: Any, path: str, kinds: dict[str, str]) -> Any:
        """An object whose keys say what kind of names their values hold."""
        if not isinstance(value, dict) or (len(value) == 1 and next(iter(value)).startswith("$")):
            return self.decode(value, path, _CALL)
        return {k: self.decode(v, _join(path, k), kinds.get(k, _CALL)) for k, v in value.items()}

    def _kwargs(self, value: Any, path: str) -> dict[str, Any]:
        _expect(value, dict, "an object of keyword arguments", path)
        for key in value:
            if not _IDENTIFIER.match(key) or len(key) > MAX_NAME_CHARS:
                raise QConfigError(f"{_at(path)}: {_short(key)} is not a keyword argument name")
        return {k: self.decode(v, _join(path, k), _CALL) for k, v in value.items()}

    def _tagged(self, tag: str, body: Any, path: str, kind: str) -> Any:
        where = path if tag in _TRANSPARENT_TAGS else _join(path, tag)
        if tag == "$ref":
            if kind == _CALL:
                return self.resolve_callable(body, path, "a function or class")
            return self.resolve_data(body, path, kind)
        if tag == "$tuple":
            _expect(body, list, "an array", where)
            return tuple(self.decode(v, _index(path, i), kind) for i, v in enumerate(body))
        if tag == "$dict":
            _expect(body, list, "an array of [key, value] pairs", where)
            out: dict[Any, Any] = {}
            for i, pair in enumerate(body):
                item = _index(path, i)
                if not isinstance(pair, list) or len(pair) != 2:
                    raise QConfigError(f"{item}: expected a [key, value] pair, got {_short(pair)}")
                key = self.decode(pair[0], _index(item, 0), kind)
                value = self.decode(pair[1], _index(item, 1), kind)
                try:
                    out[key] = value
                except TypeError:
                    raise QConfigError(
                        f"{_index(item, 0)}: {_short(key)} cannot be a dict key (unhashable)"
                    ) from None
            return out
        if tag == "$float":
            if body not in ("inf", "-inf", "nan"):
                raise QConfigError(
                    f"{_at(path)}: expected 'inf', '-inf' or 'nan', got {_short(body)}"
                )
            return float(body)
        if tag == "$dtype":
            return _decode_dtype(body, path)
        if tag == "$qscheme":
            if not isinstance(body, str):
                raise QConfigError(f"{_at(path)}: expected a qscheme name, got {_short(body)}")
            return canonical_qscheme(body, _at(path))
        if tag == "$observation_type":
            try:
                return ObservationType[_expect(body, str, "an ObservationType name", path)]
            except KeyError:
                names = ", ".join(m.name for m in ObservationType)
                raise QConfigError(
                    f"{_at(path)}: {_short(body)} is not an ObservationType; use one of {names}"
                ) from None
        if tag == "$dtype_with_constraints":
            kwargs = self._kwargs(body, path)
            known = {f.name for f in fields(DTypeWithConstraints)}
            for key in kwargs:
                if key not in known:
                    raise QConfigError(
                        f"{_at(path)}: unknown DTypeWithConstraints field {_short(key)}; "
                        f"accepted are {', '.join(sorted(known))}"
                    )
            try:
                return DTypeWithConstraints(**kwargs)
            except QConfigError as e:
                raise QConfigError(f"{_at(path)}: {e}") from None
        if tag == "$qconfig":
            return self._qconfig(body, path)
        if kind != _CALL:
            raise QConfigError(
                f'{where}: a {kind} is a class, function or operator name ({{"$ref": ...}}), '
                f"not a {tag} factory"
            )
        if tag == "$with_args":
            _fields(body, ("class",), ("kwargs",), where)
            cls = self.resolve_callable(body["class"], _join(where, "class"), "an observer class")
            if not isinstance(cls, type) or not callable(getattr(cls, "with_args", None)):
                raise QConfigError(
                    f"{_join(where, 'class')}: {_short(body['class'])} is not a class with "
                    "with_args(); write it as a $partial instead"
                )
            kwargs = self._kwargs(body.get("kwargs", {}), _join(where, "kwargs"))
            self._check_arguments(cls, (), kwargs, where)
            try:
                return cls.with_args(**kwargs)  # type: ignore[attr-defined]
            except QConfigError as e:
                raise QConfigError(f"{where}: {e}") from None
        if tag == "$partial":
            _fields(body, ("func",), ("args", "kwargs"), where)
            func = self.resolve_callable(body["func"], _join(where, "func"), "a function")
            args_path = _join(where, "args")
            args = _expect(body.get("args", []), list, "an array", args_path)
            values = tuple(self.decode(a, _index(args_path, i), _CALL) for i, a in enumerate(args))
            kwargs = self._kwargs(body.get("kwargs", {}), _join(where, "kwargs"))
            self._check_arguments(func, values, kwargs, where)
            return functools.partial(func, *values, **kwargs)
        raise QConfigError(
            f"{_at(path)}: unknown tag {_short(tag)}; known tags are $ref, $tuple, $dict, $float, "
            "$dtype, $qscheme, $observation_type, $dtype_with_constraints, $qconfig, "
            "$with_args, $partial"
        )

    # factories -----------------------------------------------------------------------------

    def _check_arguments(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], where: str
    ) -> None:
        """Keyword names and argument count against ``func``'s signature."""
        try:
            signature = inspect.signature(func)
        except (TypeError, ValueError):  # pragma: no cover - every registrable object has one
            return
        params = signature.parameters
        named = {
            n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }
        open_ended = any(p.kind is p.VAR_KEYWORD for p in params.values())
        if open_ended and isinstance(func, type) and func in CONSTRUCTIBLE:
            if issubclass(func, ObserverBase):
                open_ended = False  # their **kwargs slot accepts nothing, as torch.ao's
            elif issubclass(func, FakeQuantizeBase):
                # The remaining keywords go to the observer: accept exactly its arguments.
                observer = kwargs.get("observer", params["observer"].default)
                observer_cls = observer.p.func if isinstance(observer, PartialWrapper) else observer
                if isinstance(observer_cls, type) and observer_cls in CONSTRUCTIBLE:
                    named |= set(inspect.signature(observer_cls).parameters) - {"kwargs"}
                    open_ended = False
        if not open_ended:
            for key in kwargs:
                if key not in named:
                    raise QConfigError(
                        f"{_join(_join(where, 'kwargs'), key)}: {_qualname(func)} has no "
                        f"argument {_short(key)}; it accepts {', '.join(sorted(named))}"
                    )
        try:
            signature.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in named})
        except TypeError as e:
            raise QConfigError(f"{where}: {_qualname(func)}: {e}") from None

    def _qconfig(self, body: Any, path: str) -> QConfig:
        _expect(body, dict, "an object with 'activation' and 'weight'", path)
        if set(body) != {"activation", "weight"}:
            raise QConfigError(
                f"{_at(path)}: a QConfig needs exactly the keys 'activation' and 'weight', "
                f"got {sorted(body)}"
            )
        ctors = {}
        for field in ("activation", "weight"):
            field_path = _join(path, field)
            ctor = self.decode(body[field], field_path, _CALL)
            self._check_builds(ctor, field_path)
            ctors[field] = ctor
        try:
            return QConfig(ctors["activation"], ctors["weight"])
        except QConfigError as e:
            raise QConfigError(f"{_at(path)}: {e}") from None

    def _buildable(self, ctor: Any, path: str) -> bool:
        """True if ``ctor`` builds only this package's observers (then it is built once to
        check its arguments); False if the caller's own code is involved (not run while
        loading). Other registered callables cannot build an observer: refused."""
        partial = ctor.p if isinstance(ctor, PartialWrapper) else ctor
        func = partial.func if isinstance(partial, functools.partial) else partial
        if func is None:
            return False
        if id(func) in self.callers_own:
            return False
        if not (isinstance(func, type) and func in CONSTRUCTIBLE):
            raise QConfigError(
                f"{_at(path)}: {_qualname(func)} does not build an observer; use an observer "
                "or fake-quantize class, or a factory over one"
            )
        if isinstance(partial, functools.partial):
            tag = _join(path, "$with_args" if isinstance(ctor, PartialWrapper) else "$partial")
            arguments = [(_index(_join(tag, "args"), i), v) for i, v in enumerate(partial.args)]
            arguments += [(_join(_join(tag, "kwargs"), k), v) for k, v in partial.keywords.items()]
            for where, value in arguments:
                if callable(value) and not self._buildable(value, where):
                    return False
        return True

    def _check_builds(self, ctor: Any, path: str) -> None:
        if ctor is None or not self._buildable(ctor, path):
            return
        try:
            with torch.device("meta"):  # buffers take no memory; nothing is computed
                ctor()
        except QConfigError as e:
            raise QConfigError(f"{_at(path)}: {e}") from None
        except Exception as e:  # any failure is a bad argument in the file
            raise QConfigError(
                f"{_at(path)}: these arguments do not build the observer: {type(e).__name__}: {e}"
            ) from None


def _qualname(obj: object) -> str:
    return str(getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or obj)


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60


def _short(value: object) -> str:
    """``repr(value)``, abbreviated: file contents can be megabytes long."""
    return _SHORT.repr(value)


def _expect(value: Any, kind: type | tuple[type, ...], what: str, path: str) -> Any:
    if not isinstance(value, kind):
        raise QConfigError(f"{_at(path)}: expected {what}, got {_short(value)}")
    return value


def _fields(body: Any, required: tuple[str, ...], optional: tuple[str, ...], path: str) -> None:
    names = ", ".join(repr(k) for k in required + optional)
    _expect(body, dict, f"an object with the keys {names}", path)
    missing = [k for k in required if k not in body]
    unknown = sorted(set(body) - set(required) - set(optional))
    if missing or unknown:
        raise QConfigError(
            f"{_at(path)}: expected the keys {names}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unknown {unknown}" if unknown else "")
        )


def _decode_dtype(name: Any, path: str) -> torch.dtype:
    _expect(name, str, "a dtype name such as 'torch.uint8'", path)
    if name.startswith("torch.") and _IDENTIFIER.match(name.removeprefix("torch.")):
        short = name.removeprefix("torch.")
        value = getattr(torch, short, None)
        if isinstance(value, torch.dtype):
            return value
        if short in _ALIASES:  # an alias PyTorch has removed loads as its canonical dtype
            return _ALIASES[short][0]
    raise QConfigError(f"{_at(path)}: {name!r} is not a torch dtype name such as 'torch.uint8'")


# -- limits --------------------------------------------------------------------------------------

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET = re.compile(r"[\[\]{}]")
_DELTA = {"[": 1, "{": 1, "]": -1, "}": -1}
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|"|[\[\]{},:]')


def _check_depth(text: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH before json.loads (which recurses) sees it."""
    brackets = _BRACKET.findall(_STRING.sub("", text))
    if max(accumulate(map(_DELTA.__getitem__, brackets)), default=0) <= MAX_DEPTH:
        return
    # Too deep (or an unterminated string confused the count): find where, with its path.
    frames: list[list[Any]] = []  # [bracket, current key or index]
    last_string = ""
    for m in _TOKEN.finditer(text):
        token = m.group()
        if token == '"':
            return  # unterminated string: json.loads reports it
        if token[0] == '"':
            last_string = token
        elif token in "[{":
            if len(frames) == MAX_DEPTH:
                raise QConfigError(
                    f"{_frames_path(frames)}: nesting deeper than {MAX_DEPTH} arrays/objects "
                    f"(at character {m.start()}); configs never need that much"
                )
            frames.append([token, 0 if token == "[" else None])
        elif token in "]}":
            if frames:
                frames.pop()
        elif token == ":" and frames and frames[-1][0] == "{":
            frames[-1][1] = last_string
        elif token == "," and frames and frames[-1][0] == "[":
            frames[-1][1] += 1


def _frames_path(frames: list[list[Any]]) -> str:
    keys = [position for _bracket, position in frames]
    if keys and keys[0] == '"data"':
        path, keys = "$", keys[1:]
    else:
        path = "document"
    for key in keys:
        if isinstance(key, int):
            path = _index(path, key)
        elif key is not None:
            try:
                name = json.loads(key)
            except ValueError:
                name = key
            if name not in _TRANSPARENT_TAGS:
                path = _join(path, name)
    return path


# -- documents ---------------------------------------------------------------------------------


def dump_config(
    obj: object,
    kind: str,
    data: dict[str, Any],
    file: str | Path | IO[str] | None,
    indent: int | None,
) -> str:
    """The JSON document for ``data`` (``obj.to_dict()``); written to ``file`` if given."""
    document = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "type": kind,
        "data": encode(data, ""),
    }
    text = json.dumps(document, indent=indent, allow_nan=False)
    if file is not None:
        if isinstance(file, (str, Path)):
            Path(file).write_text(text + "\n", encoding="utf-8")
        else:
            file.write(text)
    return text


def _too_big(what: str) -> QConfigError:
    return QConfigError(
        f"from_json: {what} is larger than {MAX_DOCUMENT_CHARS} characters, the limit for a "
        "config document; configs are far smaller (the built-in ones are ~200 kB)"
    )


def _read_source(source: str | Path | IO[str]) -> str:
    if isinstance(source, Path):
        path = source
    elif isinstance(source, str):
        if source.lstrip().startswith("{"):
            if len(source) > MAX_DOCUMENT_CHARS:
                raise _too_big("the JSON text")
            return source
        if len(source) > 4096:
            raise QConfigError(
                "from_json: the text does not start with '{' and is too long to be a path; "
                "pass JSON text (starting with '{'), a path to a JSON file, or an open text file"
            )
        path = Path(source)
    else:
        text = source.read(MAX_DOCUMENT_CHARS + 1)
        if not isinstance(text, str):
            raise QConfigError("from_json: the file object must be opened in text mode")
        if len(text) > MAX_DOCUMENT_CHARS:
            raise _too_big("the file")
        return text
    try:
        with path.open(encoding="utf-8") as f:
            text = f.read(MAX_DOCUMENT_CHARS + 1)
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path, or not UTF-8
        raise QConfigError(
            f"from_json: cannot read {str(path)[:200]!r} ({getattr(e, 'strerror', None) or e}); "
            "pass JSON text (starting with '{'), a path to a JSON file, or an open text file"
        ) from None
    if len(text) > MAX_DOCUMENT_CHARS:
        raise _too_big(repr(str(path)))
    return text


def load_config(
    source: str | Path | IO[str], kind: str, allowed_prefixes: tuple[str, ...]
) -> dict[str, Any]:
    """The decoded ``data`` of a document of type ``kind``, ready for ``from_dict``."""
    loader = _Loader(_check_prefixes(allowed_prefixes))
    text = _read_source(source)
    _check_depth(text)
    try:
        document = json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except json.JSONDecodeError as e:
        raise QConfigError(f"from_json: not valid JSON: {e}") from None
    except (ValueError, RecursionError) as e:  # pragma: no cover - the checks above prevent it
        raise QConfigError(f"from_json: not valid JSON: {e}") from None
    if not isinstance(document, dict):
        raise QConfigError("from_json: the document must be a JSON object")
    version = document.get("format_version")
    if document.get("format") != FORMAT or version is None:
        raise QConfigError(
            f"from_json: not a {FORMAT} document (expected the keys 'format': {FORMAT!r}, "
            "'format_version', 'type' and 'data')"
        )
    if type(version) is not int or version != FORMAT_VERSION:
        raise QConfigError(
            f"from_json: format_version {str(version)[:40]} is not supported; this version of "
            f"quantbridge-qconfig reads format_version {FORMAT_VERSION}"
        )
    if document.get("type") != kind:
        shown = str(document.get("type"))[:60]
        raise QConfigError(
            f"from_json: the document holds a {shown!r}, not a {kind!r}; load it with the "
            "from_json of that type"
        )
    unknown = set(document) - {"format", "format_version", "type", "data"}
    if unknown:
        raise QConfigError(f"from_json: unknown top-level keys {sorted(unknown)[:10]}")
    data = document.get("data")
    if not isinstance(data, dict):
        raise QConfigError("from_json: 'data' must be an object")
    if kind == "BackendConfig":
        configs = data.get("configs")
        decoded = {
            k: loader.decode(v, _join("", k), _CALL) for k, v in data.items() if k != "configs"
        }
        if "configs" in data:
            if isinstance(configs, list):
                decoded["configs"] = [
                    loader.decode_fields(c, _index("$.configs", i), _PATTERN_CONFIG_KINDS)
                    for i, c in enumerate(configs)
                ]
            else:
                decoded["configs"] = loader.decode(configs, "$.configs", _CALL)
        return decoded
    if kind == "BackendPatternConfig":
        result: dict[str, Any] = loader.decode_fields(data, "", _PATTERN_CONFIG_KINDS)
        return result
    if kind == "QConfigMapping":
        result = loader.decode_fields(data, "", _QCONFIG_MAPPING_KINDS)
        return result
    result = loader.decode_fields(data, "", {})
    return result


def build_from_json(
    from_dict: Callable[[dict[str, Any]], _T],
    source: str | Path | IO[str],
    kind: str,
    allowed_prefixes: tuple[str, ...],
) -> _T:
    """``from_dict(load_config(...))``; whatever from_dict rejects is a QConfigError."""
    data = load_config(source, kind, allowed_prefixes)
    try:
        return from_dict(data)
    except QConfigError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise QConfigError(
            f"from_json: the document's data is not a valid {kind}: {type(e).__name__}: {e}"
        ) from None
