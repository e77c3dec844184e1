"""QConfigMapping: which QConfig applies to which part of a model, and why.

Five kinds of rule, in increasing precedence (as in torch.ao): the global qconfig, object
types (module classes, functions, method names), module-name regexes (first registered match
wins), module names (the nearest registered ancestor applies), and (module name, object type,
call index) triples. :meth:`QConfigMapping.qconfig_for` resolves a qconfig and reports the rule
that supplied it.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal, TypeAlias

from quantbridge.patterns import describe_pattern_element
from quantbridge.qconfig._errors import QConfigError
from quantbridge.qconfig._qconfig import QConfigAny, as_qconfig

ObjectType: TypeAlias = Callable[..., Any] | str

GLOBAL_DICT_KEY = ""
OBJECT_TYPE_DICT_KEY = "object_type"
MODULE_NAME_REGEX_DICT_KEY = "module_name_regex"
MODULE_NAME_DICT_KEY = "module_name"
MODULE_NAME_OBJECT_TYPE_ORDER_DICT_KEY = "module_name_object_type_order"
_DICT_KEYS = (
    GLOBAL_DICT_KEY,
    OBJECT_TYPE_DICT_KEY,
    MODULE_NAME_REGEX_DICT_KEY,
    MODULE_NAME_DICT_KEY,
    MODULE_NAME_OBJECT_TYPE_ORDER_DICT_KEY,
)

Rule: TypeAlias = Literal[
    "global", "object_type", "module_name_regex", "module_name", "module_name_object_type_order"
]


@dataclass(frozen=True)
class QConfigMatch:
    """A resolved qconfig and the rule that supplied it.

    ``rule`` is ``"global"``, ``"object_type"``, ``"module_name_regex"``, ``"module_name"`` or
    ``"module_name_object_type_order"``; ``key`` is that rule's key (None for global): the
    object type, the regex, the (possibly ancestor) module name, or the
    ``(module_name, object_type, index)`` triple.
    """

    qconfig: QConfigAny
    rule: Rule
    key: Any = None

    def describe(self) -> str:
        """One line for tables such as ``explain``: ``module_name 'features.0'``."""
        if self.rule == "global":
            return "global"
        return f"{self.rule} {_describe_key(self.key)}"


def _describe_key(key: object) -> str:
    if isinstance(key, tuple):
        return "(" + ", ".join(_describe_key(k) for k in key) + ")"
    if isinstance(key, int):
        return repr(key)
    return describe_pattern_element(key)


def _check_object_type(object_type: object, where: str) -> None:
    if isinstance(object_type, str):
        if not object_type:
            raise QConfigError(f"{where}: an empty string is not a method name")
        return
    if not callable(object_type):
        raise QConfigError(
            f"{where}: {object_type!r} (a {type(object_type).__name__}) is not an object type; "
            "use a module class, a function or torch op, or a method name string"
        )
    if not isinstance(object_type, Hashable):
        raise QConfigError(f"{where}: {object_type!r} is not hashable, so it cannot be a key")


def _check_str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise QConfigError(f"{where}: expected a string, got {value!r} (a {type(value).__name__})")
    return value


def _parent_module_name(name: str) -> str:
    return name.rpartition(".")[0]


class QConfigMapping:
    """Mapping from model parts to QConfigs (torch.ao ``QConfigMapping``'s API).

    Setters return ``self`` so they chain. Registering an existing key again replaces its
    qconfig and keeps its original position (regexes are tried in registration order).
    """

    def __init__(self) -> None:
        self.global_qconfig: QConfigAny = None
        self.object_type_qconfigs: OrderedDict[ObjectType, QConfigAny] = OrderedDict()
        self.module_name_regex_qconfigs: OrderedDict[str, QConfigAny] = OrderedDict()
        self.module_name_qconfigs: OrderedDict[str, QConfigAny] = OrderedDict()
        self.module_name_object_type_order_qconfigs: OrderedDict[
            tuple[str, ObjectType, int], QConfigAny
        ] = OrderedDict()

    # -- setters -----------------------------------------------------------------------------

    def set_global(self, global_qconfig: QConfigAny) -> QConfigMapping:
        """Set the qconfig used where no other rule applies."""
        self.global_qconfig = as_qconfig(global_qconfig, "set_global")
        return self

    def set_object_type(self, object_type: ObjectType, qconfig: QConfigAny) -> QConfigMapping:
        """Set the qconfig for a module class, function/op, or method name string."""
        where = f"set_object_type({_describe_key(object_type)})"
        _check_object_type(object_type, where)
        self.object_type_qconfigs[object_type] = as_qconfig(qconfig, where)
        return self

    def set_module_name_regex(self, module_name_regex: str, qconfig: QConfigAny) -> QConfigMapping:
        """Set the qconfig for modules whose name matches a regex (``re.match``, first wins)."""
        where = f"set_module_name_regex({module_name_regex!r})"
        _check_str(module_name_regex, where)
        try:
            re.compile(module_name_regex)
        except re.error as e:
            raise QConfigError(f"{where}: not a valid regular expression: {e}") from None
        self.module_name_regex_qconfigs[module_name_regex] = as_qconfig(qconfig, where)
        return self

    def set_module_name(self, module_name: str, qconfig: QConfigAny) -> QConfigMapping:
        """Set the qconfig for the module with this qualified name and its submodules."""
        where = f"set_module_name({module_name!r})"
        _check_str(module_name, where)
        self.module_name_qconfigs[module_name] = as_qconfig(qconfig, where)
        return self

    def set_module_name_object_type_order(
        self, module_name: str, object_type: ObjectType, index: int, qconfig: QConfigAny
    ) -> QConfigMapping:
        """Set the qconfig for the ``index``-th call of ``object_type`` inside ``module_name``."""
        where = (
            f"set_module_name_object_type_order({module_name!r}, "
            f"{_describe_key(object_type)}, {index!r})"
        )
        _check_str(module_name, where)
        _check_object_type(object_type, where)
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise QConfigError(f"{where}: index must be a non-negative int, got {index!r}")
        self.module_name_object_type_order_qconfigs[(module_name, object_type, index)] = as_qconfig(
            qconfig, where
        )
        return self

    # -- resolution --------------------------------------------------------------------------

    def qconfig_for(
        self,
        module_name: str,
        object_type: ObjectType | None = None,
        call_index: int | None = None,
        *,
        scope_type: ObjectType | None = None,
        order_module_name: str | None = None,
    ) -> QConfigMatch:
        """The qconfig for one operation, with the rule that supplied it.

        Args:
            module_name: qualified name of the module the operation belongs to (for a module
                call, the called module's own name; for a function or method call, the name of
                the module whose ``forward`` makes the call; ``""`` for the root).
            object_type: the operation's type: module class, function/op or method name.
            call_index: how many calls of ``object_type`` preceded this one in
                ``order_module_name``; None skips the order rules.
            scope_type: class of the module whose ``forward`` makes a function or method
                call; as in torch.ao its object-type entry overrides ``object_type``'s.
            order_module_name: module name used for the order rules; defaults to
                ``module_name`` (torch.ao counts a module call in the parent module, so pass
                the parent's name there).

        Precedence, lowest to highest: global, object type (``object_type`` then
        ``scope_type``), the first matching module-name regex, the module name or its nearest
        registered ancestor, then an exact (module name, object type, index) entry.
        """
        match = QConfigMatch(self.global_qconfig, "global")
        for candidate in (object_type, scope_type):
            if candidate is not None and candidate in self.object_type_qconfigs:
                match = QConfigMatch(self.object_type_qconfigs[candidate], "object_type", candidate)
        for regex, qconfig in self.module_name_regex_qconfigs.items():
            if re.match(regex, module_name):
                match = QConfigMatch(qconfig, "module_name_regex", regex)
                break
        name = module_name
        while name:  # the root's "" never matches a module-name rule, as in torch.ao
            if name in self.module_name_qconfigs:
                match = QConfigMatch(self.module_name_qconfigs[name], "module_name", name)
                break
            name = _parent_module_name(name)
        if call_index is not None and object_type is not None:
            key = (
                module_name if order_module_name is None else order_module_name,
                object_type,
                call_index,
            )
            if key in self.module_name_object_type_order_qconfigs:
                match = QConfigMatch(
                    self.module_name_object_type_order_qconfigs[key],
                    "module_name_object_type_order",
                    key,
                )
        return match

    # -- conversion --------------------------------------------------------------------------

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}("]
        lines.append(f"  global_qconfig: {self.global_qconfig}")
        for attr in (
            "object_type_qconfigs",
            "module_name_regex_qconfigs",
            "module_name_qconfigs",
            "module_name_object_type_order_qconfigs",
        ):
            entries: OrderedDict[Any, QConfigAny] = getattr(self, attr)
            lines.append(f"  {attr}:")
            lines += [f"    {_describe_key(k)}: {v}" for k, v in entries.items()]
        return "\n".join(lines) + "\n)"

    def to_dict(self) -> dict[str, Any]:
        """torch.ao's dict form: ``""`` (global) and four lists of tuples."""
        return {
            GLOBAL_DICT_KEY: self.global_qconfig,
            OBJECT_TYPE_DICT_KEY: list(self.object_type_qconfigs.items()),
            MODULE_NAME_REGEX_DICT_KEY: list(self.module_name_regex_qconfigs.items()),
            MODULE_NAME_DICT_KEY: list(self.module_name_qconfigs.items()),
            MODULE_NAME_OBJECT_TYPE_ORDER_DICT_KEY: [
                (*key, qconfig)
                for key, qconfig in self.module_name_object_type_order_qconfigs.items()
            ],
        }

    @classmethod
    def from_dict(cls, qconfig_dict: dict[str, Any]) -> QConfigMapping:
        """Build from torch.ao's dict form (every key optional; unknown keys are an error)."""
        if not isinstance(qconfig_dict, dict):
            raise QConfigError(
                f"QConfigMapping.from_dict: expected a dict, got {type(qconfig_dict).__name__}"
            )
        unknown = [k for k in qconfig_dict if k not in _DICT_KEYS]
        if unknown:
            raise QConfigError(
                f"QConfigMapping.from_dict: unknown key {unknown[0]!r}; accepted keys are "
                + ", ".join(repr(k) for k in _DICT_KEYS)
            )
        mapping = cls()
        if GLOBAL_DICT_KEY in qconfig_dict:
            mapping.set_global(qconfig_dict[GLOBAL_DICT_KEY])
        arity = {
            OBJECT_TYPE_DICT_KEY: 2,
            MODULE_NAME_REGEX_DICT_KEY: 2,
            MODULE_NAME_DICT_KEY: 2,
            MODULE_NAME_OBJECT_TYPE_ORDER_DICT_KEY: 4,
        }
        setters: dict[str, Callable[..., QConfigMapping]] = {
            OBJECT_TYPE_DICT_KEY: mapping.set_object_type,
            MODULE_NAME_REGEX_DICT_KEY: mapping.set_module_name_regex,
            MODULE_NAME_DICT_KEY: mapping.set_module_name,
            MODULE_NAME_OBJECT_TYPE_ORDER_DICT_KEY: mapping.set_module_name_object_type_order,
        }
        for key, size in arity.items():
            entries = qconfig_dict.get(key, [])
            if not isinstance(entries, (list, tuple)):
                raise QConfigError(
                    f"QConfigMapping.from_dict: {key!r} must be a list of tuples, "
                    f"got {type(entries).__name__}"
                )
            for i, entry in enumerate(entries):
                if not isinstance(entry, (list, tuple)) or len(entry) != size:
                    raise QConfigError(
                        f"QConfigMapping.from_dict: {key}[{i}] must be a tuple of {size} "
                        f"items, got {entry!r}"
                    )
                try:
                    setters[key](*entry)
                except QConfigError as e:
                    raise QConfigError(f"QConfigMapping.from_dict: {key}[{i}]: {e}") from None
        return mapping

    def to_json(self, file: str | Path | IO[str] | None = None, *, indent: int | None = 2) -> str:
        """JSON text of this mapping (docs: "Configuration files"); also written to ``file``
        (a path or an open text file) when given."""
        from quantbridge.qconfig._json import dump_config

        return dump_config(self, "QConfigMapping", self.to_dict(), file, indent)

    @classmethod
    def from_json(
        cls, source: str | Path | IO[str], *, allowed_prefixes: tuple[str, ...] = ()
    ) -> QConfigMapping:
        """Load from JSON text, a file path or an open text file.

        The file is untrusted input: it may only call registered callables and the
        functions and classes of your own ``allowed_prefixes`` modules; see "Security" on the
        docs' "Configuration files" page.
        """
        from quantbridge.qconfig._json import build_from_json

        return build_from_json(cls.from_dict, source, "QConfigMapping", allowed_prefixes)
