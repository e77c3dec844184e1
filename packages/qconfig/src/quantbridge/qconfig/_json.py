"""JSON for the configuration types: qualified names out, allow-listed name resolution in.

A document is ``{"format": "quantbridge.qconfig", "format_version": 1, "type": <class name>,
"data": <the encoded to_dict()>}``. Values encode as follows; a tagged value is a JSON object
with exactly one key starting with ``$``:

================================  ========================================================
Python value                      JSON
================================  ========================================================
None, bool, int, str              themselves (so method-name patterns stay plain strings)
finite float                      a number (Python writes the shortest exact repr)
inf / -inf / nan                  ``{"$float": "inf"}``
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

Loading resolves a name only when it lies under an allowed prefix (``torch``, ``operator``,
``quantbridge`` and the caller's ``allowed_prefixes``), imports only modules that themselves
lie under an allowed prefix, walks the rest with ``getattr``, and refuses to pass through a
module, or to return an object defined in a module, outside the allowed prefixes (so
``torch.os.system`` is refused too).
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import re
import sys
import types
from dataclasses import fields
from pathlib import Path
from typing import IO, Any

import torch

from quantbridge.qconfig._backend_config import DTypeWithConstraints, ObservationType
from quantbridge.qconfig._dtypes import _ALIASES, QScheme, canonical_qscheme
from quantbridge.qconfig._errors import QConfigError
from quantbridge.qconfig._qconfig import QConfig

FORMAT = "quantbridge.qconfig"
FORMAT_VERSION = 1
DEFAULT_ALLOWED_PREFIXES: tuple[str, ...] = ("torch", "operator", "quantbridge")

# Modules whose objects report a private implementation module as __module__.
_PUBLIC_MODULE_ALIASES = {"_operator": "operator"}
# Where builtins that report an unhelpful __module__ (torch._C._nn, None) are exported.
_FALLBACK_NAMESPACES = ("torch", "torch.nn.functional", "operator", "torch.Tensor")
_DOTTED_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _at(path: str) -> str:
    return path or "<top level>"


def _join(path: str, key: str) -> str:
    if not key:  # QConfigMapping's global entry has the key ""
        return f'{path}[""]'
    return f"{path}.{key}" if path else key


# -- names -------------------------------------------------------------------------------------


def _is_allowed(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _check_prefixes(allowed_prefixes: object) -> tuple[str, ...]:
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
        if not isinstance(p, str) or not _DOTTED_NAME.match(p):
            raise QConfigError(
                f"allowed_prefixes: {p!r} is not a dotted module name such as 'my_backend'"
            )
    return DEFAULT_ALLOWED_PREFIXES + tuple(allowed_prefixes)


def resolve_name(name: str, allowed_prefixes: tuple[str, ...] | None, where: str) -> Any:
    """The object a dotted name refers to.

    With ``allowed_prefixes`` (the full list, defaults included), refuses names, modules and
    defining modules outside them and imports nothing outside them. ``None`` (used when
    writing, to check that a name round-trips) allows everything.
    """
    if not isinstance(name, str) or not _DOTTED_NAME.match(name):
        raise QConfigError(f"{_at(where)}: {name!r} is not a dotted Python name")

    def refuse(what: str) -> QConfigError:
        assert allowed_prefixes is not None
        return QConfigError(
            f"{_at(where)}: refusing to load {name!r}: {what} is outside the allowed module "
            f"prefixes {list(allowed_prefixes)}; if you trust it, pass its top-level module in "
            "allowed_prefixes=(...)"
        )

    if allowed_prefixes is not None and not _is_allowed(name, allowed_prefixes):
        raise refuse("it")
    if allowed_prefixes is not None and any(
        part.startswith("__") and part.endswith("__") for part in name.split(".")
    ):
        # Dunder attributes (__globals__, __subclasses__, ...) lead out of the allowed modules.
        raise QConfigError(
            f"{_at(where)}: refusing to load {name!r}: names with dunder components are not "
            "resolved"
        )
    parts = name.split(".")
    obj: Any = None
    found = 0
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        if allowed_prefixes is not None and not _is_allowed(module_name, allowed_prefixes):
            continue  # never import a module outside the allow-list
        if module_name in sys.modules:
            obj, found = sys.modules[module_name], i
            break
        try:
            obj, found = importlib.import_module(module_name), i
            break
        except ModuleNotFoundError as e:
            if e.name is not None and (
                e.name == module_name or module_name.startswith(e.name + ".")
            ):
                continue
            raise QConfigError(f"{_at(where)}: importing {module_name!r} failed: {e}") from e
        except ImportError as e:
            raise QConfigError(f"{_at(where)}: importing {module_name!r} failed: {e}") from e
    if not found:
        raise QConfigError(f"{_at(where)}: no importable module in {name!r}")
    for i in range(found, len(parts)):
        try:
            obj = getattr(obj, parts[i])
        except AttributeError:
            raise QConfigError(
                f"{_at(where)}: {name!r} does not exist: {'.'.join(parts[:i])!r} has no "
                f"attribute {parts[i]!r}"
            ) from None
        if (
            allowed_prefixes is not None
            and isinstance(obj, types.ModuleType)
            and not _is_allowed(obj.__name__, allowed_prefixes)
        ):
            raise refuse(f"module {obj.__name__!r}")
    if allowed_prefixes is not None and not isinstance(obj, types.ModuleType):
        defined_in = getattr(obj, "__module__", None)
        if isinstance(defined_in, str):
            public = _PUBLIC_MODULE_ALIASES.get(defined_in, defined_in)
            if not _is_allowed(public, allowed_prefixes):
                raise refuse(f"its defining module {defined_in!r}")
    return obj


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
            if resolve_name(candidate, None, where) is obj:
                found.append(candidate)
        except QConfigError:
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
                "args": [encode(a, f"{path}.args[{i}]") for i, a in enumerate(value.args)],
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
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v, _join(path, k)) for k, v in value.items()}
        return {
            "$dict": [
                [encode(k, f"{path}[{k!r}]"), encode(v, f"{path}[{k!r}]")] for k, v in value.items()
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


def _expect(value: Any, kind: type | tuple[type, ...], what: str, path: str) -> Any:
    if not isinstance(value, kind):
        raise QConfigError(f"{_at(path)}: expected {what}, got {value!r}")
    return value


def _decode_dtype(name: Any, path: str) -> torch.dtype:
    _expect(name, str, "a dtype name such as 'torch.uint8'", path)
    if name.startswith("torch."):
        short = name.removeprefix("torch.")
        value = getattr(torch, short, None)
        if isinstance(value, torch.dtype):
            return value
        if short in _ALIASES:  # an alias PyTorch has removed loads as its canonical dtype
            return _ALIASES[short][0]
    raise QConfigError(f"{_at(path)}: {name!r} is not a torch dtype name such as 'torch.uint8'")


def _decode_kwargs(value: Any, path: str, prefixes: tuple[str, ...]) -> dict[str, Any]:
    _expect(value, dict, "an object of keyword arguments", path)
    return {k: decode(v, _join(path, k), prefixes) for k, v in value.items()}


def _decode_tagged(tag: str, body: Any, path: str, prefixes: tuple[str, ...]) -> Any:
    where = _join(path, tag)
    if tag == "$ref":
        return resolve_name(body, prefixes, path)
    if tag == "$tuple":
        _expect(body, list, "an array", where)
        return tuple(decode(v, f"{path}[{i}]", prefixes) for i, v in enumerate(body))
    if tag == "$dict":
        _expect(body, list, "an array of [key, value] pairs", where)
        out: dict[Any, Any] = {}
        for i, pair in enumerate(body):
            if not isinstance(pair, list) or len(pair) != 2:
                raise QConfigError(f"{_at(path)}[{i}]: expected a [key, value] pair, got {pair!r}")
            out[decode(pair[0], f"{path}[{i}]", prefixes)] = decode(
                pair[1], f"{path}[{i}]", prefixes
            )
        return out
    if tag == "$float":
        _expect(body, str, "'inf', '-inf' or 'nan'", where)
        if body not in ("inf", "-inf", "nan"):
            raise QConfigError(f"{_at(path)}: expected 'inf', '-inf' or 'nan', got {body!r}")
        return float(body)
    if tag == "$dtype":
        return _decode_dtype(body, path)
    if tag == "$qscheme":
        return canonical_qscheme(body, path)
    if tag == "$observation_type":
        try:
            return ObservationType[_expect(body, str, "an ObservationType name", path)]
        except KeyError:
            names = ", ".join(m.name for m in ObservationType)
            raise QConfigError(
                f"{_at(path)}: {body!r} is not an ObservationType; use one of {names}"
            ) from None
    if tag == "$dtype_with_constraints":
        kwargs = _decode_kwargs(body, path, prefixes)
        known = {f.name for f in fields(DTypeWithConstraints)}
        for key in kwargs:
            if key not in known:
                raise QConfigError(
                    f"{_at(path)}: unknown DTypeWithConstraints field {key!r}; accepted are "
                    + ", ".join(sorted(known))
                )
        try:
            return DTypeWithConstraints(**kwargs)
        except QConfigError as e:
            raise QConfigError(f"{_at(path)}: {e}") from None
    if tag == "$qconfig":
        _expect(body, dict, "an object with 'activation' and 'weight'", where)
        if set(body) != {"activation", "weight"}:
            raise QConfigError(
                f"{_at(path)}: a QConfig needs exactly the keys 'activation' and 'weight', "
                f"got {sorted(body)}"
            )
        try:
            return QConfig(
                decode(body["activation"], _join(path, "activation"), prefixes),
                decode(body["weight"], _join(path, "weight"), prefixes),
            )
        except QConfigError as e:
            raise QConfigError(f"{_at(path)}: {e}") from None
    if tag == "$with_args":
        _expect(body, dict, "an object with 'class' and 'kwargs'", where)
        cls = resolve_name(body.get("class"), prefixes, _join(path, "class"))
        kwargs = _decode_kwargs(body.get("kwargs", {}), _join(path, "kwargs"), prefixes)
        with_args = getattr(cls, "with_args", None)
        if not callable(with_args):
            raise QConfigError(
                f"{_at(path)}.class: {body.get('class')!r} has no with_args(); write it as a "
                "$partial instead"
            )
        return with_args(**kwargs)
    if tag == "$partial":
        _expect(body, dict, "an object with 'func', 'args' and 'kwargs'", where)
        func = resolve_name(body.get("func"), prefixes, _join(path, "func"))
        args = _expect(body.get("args", []), list, "an array", _join(path, "args"))
        return functools.partial(
            func,
            *(decode(a, f"{path}.args[{i}]", prefixes) for i, a in enumerate(args)),
            **_decode_kwargs(body.get("kwargs", {}), _join(path, "kwargs"), prefixes),
        )
    raise QConfigError(
        f"{_at(path)}: unknown tag {tag!r}; known tags are $ref, $tuple, $dict, $float, $dtype, "
        "$qscheme, $observation_type, $dtype_with_constraints, $qconfig, $with_args, $partial"
    )


def decode(value: Any, path: str, prefixes: tuple[str, ...]) -> Any:
    """The Python value of a JSON value written by :func:`encode`."""
    if isinstance(value, list):
        return [decode(v, f"{path}[{i}]", prefixes) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if len(value) == 1:
            (key,) = value
            if key.startswith("$"):
                return _decode_tagged(key, value[key], path, prefixes)
        return {k: decode(v, _join(path, k), prefixes) for k, v in value.items()}
    return value


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


def _read_source(source: str | Path | IO[str]) -> str:
    if isinstance(source, Path):
        path = source
    elif isinstance(source, str):
        if source.lstrip().startswith("{"):
            return source
        path = Path(source)
    else:
        text = source.read()
        if not isinstance(text, str):
            raise QConfigError("from_json: the file object must be opened in text mode")
        return text
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise QConfigError(
            f"from_json: cannot read {str(path)!r} ({e.strerror}); pass JSON text (starting "
            "with '{'), a path to a JSON file, or an open text file"
        ) from None


def load_config(
    source: str | Path | IO[str], kind: str, allowed_prefixes: tuple[str, ...]
) -> dict[str, Any]:
    """The decoded ``data`` of a document of type ``kind``, ready for ``from_dict``."""
    prefixes = _check_prefixes(allowed_prefixes)
    text = _read_source(source)
    try:
        document = json.loads(text)
    except json.JSONDecodeError as e:
        raise QConfigError(f"from_json: not valid JSON: {e}") from None
    if not isinstance(document, dict):
        raise QConfigError("from_json: the document must be a JSON object")
    version = document.get("format_version")
    if document.get("format") != FORMAT or version is None:
        raise QConfigError(
            f"from_json: not a {FORMAT} document (expected the keys 'format': {FORMAT!r}, "
            "'format_version', 'type' and 'data')"
        )
    if version != FORMAT_VERSION:
        raise QConfigError(
            f"from_json: format_version {version!r} is not supported; this version of "
            f"quantbridge-qconfig reads format_version {FORMAT_VERSION}"
        )
    if document.get("type") != kind:
        raise QConfigError(
            f"from_json: the document holds a {document.get('type')!r}, not a {kind!r}; load it "
            f"with {document.get('type')}.from_json"
        )
    unknown = set(document) - {"format", "format_version", "type", "data"}
    if unknown:
        raise QConfigError(f"from_json: unknown top-level keys {sorted(unknown)}")
    data = decode(document.get("data"), "", prefixes)
    if not isinstance(data, dict):
        raise QConfigError("from_json: 'data' must be an object")
    return data
