"""Custom configs for fuse/prepare/convert: torch.ao 2.13's classes, setters and dict keys.

* :class:`PrepareCustomConfig`: standalone modules (by name or class), float -> observed
  custom module classes, non-traceable modules, quantized input/output indexes, preserved
  attributes;
* :class:`ConvertCustomConfig`: observed -> quantized custom module classes, preserved
  attributes;
* :class:`FuseCustomConfig`: preserved attributes.

Setters validate their arguments and return ``self``; ``from_dict``/``to_dict`` use torch.ao's
keys.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from torch import nn

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._torch_ao_names import port_backend_config, port_class
from quantbridge.qconfig import BackendConfig, QConfigMapping

__all__ = [
    "ConvertCustomConfig",
    "FuseCustomConfig",
    "PrepareCustomConfig",
    "QuantType",
    "StandaloneModuleConfigEntry",
]

STANDALONE_MODULE_NAME_DICT_KEY = "standalone_module_name"
STANDALONE_MODULE_CLASS_DICT_KEY = "standalone_module_class"
FLOAT_TO_OBSERVED_DICT_KEY = "float_to_observed_custom_module_class"
OBSERVED_TO_QUANTIZED_DICT_KEY = "observed_to_quantized_custom_module_class"
NON_TRACEABLE_MODULE_NAME_DICT_KEY = "non_traceable_module_name"
NON_TRACEABLE_MODULE_CLASS_DICT_KEY = "non_traceable_module_class"
INPUT_QUANTIZED_INDEXES_DICT_KEY = "input_quantized_idxs"
OUTPUT_QUANTIZED_INDEXES_DICT_KEY = "output_quantized_idxs"
OUTPUT_FLOAT_INDEXES_DICT_KEY = "output_float_idxs"  # quantbridge's; torch.ao has no such key
PRESERVED_ATTRIBUTES_DICT_KEY = "preserved_attributes"

_PREPARE_KEYS = (
    STANDALONE_MODULE_NAME_DICT_KEY,
    STANDALONE_MODULE_CLASS_DICT_KEY,
    FLOAT_TO_OBSERVED_DICT_KEY,
    NON_TRACEABLE_MODULE_NAME_DICT_KEY,
    NON_TRACEABLE_MODULE_CLASS_DICT_KEY,
    INPUT_QUANTIZED_INDEXES_DICT_KEY,
    OUTPUT_QUANTIZED_INDEXES_DICT_KEY,
    OUTPUT_FLOAT_INDEXES_DICT_KEY,
    PRESERVED_ATTRIBUTES_DICT_KEY,
)


class QuantType(enum.IntEnum):
    """Quantization mode a custom module mapping applies to (torch.ao's values)."""

    DYNAMIC = 0
    STATIC = 1
    QAT = 2
    WEIGHT_ONLY = 3

    @property
    def dict_name(self) -> str:
        return self.name.lower()

    @classmethod
    def from_name(cls, name: object, where: str) -> QuantType:
        if isinstance(name, QuantType):
            return name
        for member in cls:
            if member.dict_name == name:
                return member
        allowed = ", ".join(repr(m.dict_name) for m in cls)
        raise FxQuantError(f"{where}: unknown quantization type {name!r}; use one of {allowed}")


def _check_keys(d: object, accepted: tuple[str, ...], where: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise FxQuantError(f"{where}: expected a dict, got {type(d).__name__}")
    for key in d:
        if key not in accepted:
            raise FxQuantError(
                f"{where}: unknown key {key!r}; accepted keys are "
                + ", ".join(repr(k) for k in accepted)
            )
    return d


def _str_list(value: object, where: str) -> list[str]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise FxQuantError(f"{where}: expected a list of strings, got {value!r}")
    for item in value:
        if not isinstance(item, str):
            raise FxQuantError(f"{where}: expected strings, got {item!r}")
    return list(value)


def _class_list(value: object, where: str) -> list[type]:
    if not isinstance(value, (list, tuple)):
        raise FxQuantError(f"{where}: expected a list of module classes, got {value!r}")
    for item in value:
        if not (isinstance(item, type) and issubclass(item, nn.Module)):
            raise FxQuantError(
                f"{where}: expected nn.Module subclasses, got {item!r}; pass the class, "
                "not an instance"
            )
    return list(value)


def _index_list(value: object, where: str) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise FxQuantError(f"{where}: expected a list of ints, got {value!r}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise FxQuantError(f"{where}: expected non-negative ints, got {item!r}")
    return list(value)


def _module_class(value: object, where: str) -> type[nn.Module]:
    if not (isinstance(value, type) and issubclass(value, nn.Module)):
        raise FxQuantError(f"{where}: expected an nn.Module subclass, got {value!r}")
    return value


@dataclass
class StandaloneModuleConfigEntry:
    """How one standalone module is prepared: its own mapping, inputs, config and backend."""

    qconfig_mapping: QConfigMapping | None
    example_inputs: tuple[Any, ...]
    prepare_custom_config: PrepareCustomConfig | None
    backend_config: BackendConfig | None


class PrepareCustomConfig:
    """Custom settings for ``prepare_fx`` / ``prepare_qat_fx`` (torch.ao's API)."""

    def __init__(self) -> None:
        self.standalone_module_names: dict[str, StandaloneModuleConfigEntry] = {}
        self.standalone_module_classes: dict[type, StandaloneModuleConfigEntry] = {}
        self.float_to_observed_mapping: dict[QuantType, dict[type, type]] = {}
        self.non_traceable_module_names: list[str] = []
        self.non_traceable_module_classes: list[type] = []
        self.input_quantized_indexes: list[int] = []
        self.output_quantized_indexes: list[int] = []
        self.output_float_indexes: list[int] = []
        self.preserved_attributes: list[str] = []

    def __repr__(self) -> str:
        shown = {k: v for k, v in self.__dict__.items() if v}
        return f"PrepareCustomConfig({shown})"

    @staticmethod
    def _entry(
        where: str,
        qconfig_mapping: QConfigMapping | None,
        example_inputs: tuple[Any, ...],
        prepare_custom_config: PrepareCustomConfig | None,
        backend_config: BackendConfig | None,
    ) -> StandaloneModuleConfigEntry:
        if qconfig_mapping is not None and not isinstance(qconfig_mapping, QConfigMapping):
            raise FxQuantError(f"{where}: qconfig_mapping must be a QConfigMapping or None")
        if not isinstance(example_inputs, tuple):
            raise FxQuantError(
                f"{where}: example_inputs must be a tuple, got {type(example_inputs).__name__}"
            )
        if prepare_custom_config is not None and not isinstance(
            prepare_custom_config, PrepareCustomConfig
        ):
            raise FxQuantError(f"{where}: prepare_custom_config must be a PrepareCustomConfig")
        if backend_config is not None and not isinstance(backend_config, BackendConfig):
            raise FxQuantError(f"{where}: backend_config must be a BackendConfig or None")
        if backend_config is not None:
            backend_config = port_backend_config(backend_config)  # torch.ao.nn classes
        return StandaloneModuleConfigEntry(
            qconfig_mapping, example_inputs, prepare_custom_config, backend_config
        )

    def set_standalone_module_name(
        self,
        module_name: str,
        qconfig_mapping: QConfigMapping | None,
        example_inputs: tuple[Any, ...],
        prepare_custom_config: PrepareCustomConfig | None,
        backend_config: BackendConfig | None,
    ) -> PrepareCustomConfig:
        """Prepare the submodule ``module_name`` on its own (None: the parent's settings)."""
        where = f"set_standalone_module_name({module_name!r})"
        if not isinstance(module_name, str):
            raise FxQuantError(f"{where}: module_name must be a string")
        self.standalone_module_names[module_name] = self._entry(
            where, qconfig_mapping, example_inputs, prepare_custom_config, backend_config
        )
        return self

    def set_standalone_module_class(
        self,
        module_class: type,
        qconfig_mapping: QConfigMapping | None,
        example_inputs: tuple[Any, ...],
        prepare_custom_config: PrepareCustomConfig | None,
        backend_config: BackendConfig | None,
    ) -> PrepareCustomConfig:
        """Prepare every submodule of class ``module_class`` on its own."""
        where = f"set_standalone_module_class({getattr(module_class, '__name__', module_class)})"
        _module_class(module_class, where)
        self.standalone_module_classes[module_class] = self._entry(
            where, qconfig_mapping, example_inputs, prepare_custom_config, backend_config
        )
        return self

    def set_float_to_observed_mapping(
        self,
        float_class: type,
        observed_class: type,
        quant_type: QuantType = QuantType.STATIC,
    ) -> PrepareCustomConfig:
        """Swap ``float_class`` for ``observed_class.from_float(module)`` at prepare.

        torch.ao.nn classes are replaced by quantbridge's equivalents (or refused)."""
        where = "set_float_to_observed_mapping"
        float_class = port_class(float_class, f"{where}: float_class")
        observed_class = port_class(observed_class, f"{where}: observed_class")
        _module_class(float_class, f"{where}: float_class")
        _module_class(observed_class, f"{where}: observed_class")
        if not callable(getattr(observed_class, "from_float", None)):
            raise FxQuantError(
                f"{where}: {observed_class.__name__} needs a from_float(float_module) classmethod"
            )
        qt = QuantType.from_name(quant_type, where)
        if qt is not QuantType.STATIC:
            raise FxQuantError(
                f"{where}: only QuantType.STATIC custom module mappings are supported at "
                f"prepare (got {qt.name}), as in torch.ao"
            )
        self.float_to_observed_mapping.setdefault(qt, {})[float_class] = observed_class
        return self

    def set_non_traceable_module_names(self, module_names: list[str]) -> PrepareCustomConfig:
        """Submodules (by qualified name) kept out of tracing; they stay float."""
        self.non_traceable_module_names = _str_list(module_names, "set_non_traceable_module_names")
        return self

    def set_non_traceable_module_classes(self, module_classes: list[type]) -> PrepareCustomConfig:
        """Submodule classes kept out of tracing; they stay float."""
        self.non_traceable_module_classes = _class_list(
            module_classes, "set_non_traceable_module_classes"
        )
        return self

    def set_input_quantized_indexes(self, indexes: list[int]) -> PrepareCustomConfig:
        """Graph inputs (by position) that arrive already quantized (uint8)."""
        self.input_quantized_indexes = _index_list(indexes, "set_input_quantized_indexes")
        return self

    def set_output_quantized_indexes(self, indexes: list[int]) -> PrepareCustomConfig:
        """Graph outputs (by position) returned quantized (uint8)."""
        self.output_quantized_indexes = _index_list(indexes, "set_output_quantized_indexes")
        return self

    def set_output_float_indexes(self, indexes: list[int]) -> PrepareCustomConfig:
        """Graph outputs (by position) computed straight to float where the backend can.

        torch.ao quantizes the output of the op that produces a model output and dequantizes
        it again (a classifier's logits get 256 levels). For these outputs, when the
        BackendConfig computes the producing op from quantized inputs to float32 (a
        DTypeConfig with ``output_dtype=torch.float32``, as the numba backends declare for
        Linear), the output is left float: no observer, no quantize. Not in torch.ao.
        """
        self.output_float_indexes = _index_list(indexes, "set_output_float_indexes")
        return self

    def set_preserved_attributes(self, attributes: list[str]) -> PrepareCustomConfig:
        """Attributes of the model kept on the result even if ``forward`` does not use them."""
        self.preserved_attributes = _str_list(attributes, "set_preserved_attributes")
        return self

    @property
    def custom_module_classes(self) -> list[type]:
        """Every float class with a float -> observed mapping, all quant types."""
        seen: dict[type, None] = {}
        for mapping in self.float_to_observed_mapping.values():
            seen.update(dict.fromkeys(mapping))
        return list(seen)

    @classmethod
    def from_dict(cls, prepare_custom_config_dict: dict[str, Any]) -> PrepareCustomConfig:
        """Build from torch.ao's dict form (see the module docstring for the keys)."""
        where = "PrepareCustomConfig.from_dict"
        d = _check_keys(prepare_custom_config_dict, _PREPARE_KEYS, where)
        conf = cls()

        def sub_config(value: object) -> PrepareCustomConfig | None:
            if isinstance(value, dict):
                return PrepareCustomConfig.from_dict(value)
            return value  # type: ignore[return-value]  # checked by the setter

        def sub_mapping(value: object) -> QConfigMapping | None:
            if isinstance(value, dict):
                return QConfigMapping.from_dict(value)
            return value  # type: ignore[return-value]

        def sub_backend(value: object) -> BackendConfig | None:
            if isinstance(value, dict):
                return BackendConfig.from_dict(value)
            return value  # type: ignore[return-value]

        for key, setter in (
            (STANDALONE_MODULE_NAME_DICT_KEY, conf.set_standalone_module_name),
            (STANDALONE_MODULE_CLASS_DICT_KEY, conf.set_standalone_module_class),
        ):
            for i, entry in enumerate(d.get(key, [])):
                if not isinstance(entry, (list, tuple)) or len(entry) != 5:
                    raise FxQuantError(
                        f"{where}: {key}[{i}] must be a 5-tuple (name or class, "
                        "qconfig_mapping, example_inputs, prepare_custom_config, "
                        f"backend_config), got {entry!r}"
                    )
                target, mapping, inputs, child, backend = entry
                setter(
                    target, sub_mapping(mapping), inputs, sub_config(child), sub_backend(backend)
                )
        for qt_name, mapping in d.get(FLOAT_TO_OBSERVED_DICT_KEY, {}).items():
            qt = QuantType.from_name(qt_name, where)
            for float_class, observed_class in mapping.items():
                conf.set_float_to_observed_mapping(float_class, observed_class, qt)
        conf.set_non_traceable_module_names(d.get(NON_TRACEABLE_MODULE_NAME_DICT_KEY, []))
        conf.set_non_traceable_module_classes(d.get(NON_TRACEABLE_MODULE_CLASS_DICT_KEY, []))
        conf.set_input_quantized_indexes(d.get(INPUT_QUANTIZED_INDEXES_DICT_KEY, []))
        conf.set_output_quantized_indexes(d.get(OUTPUT_QUANTIZED_INDEXES_DICT_KEY, []))
        conf.set_output_float_indexes(d.get(OUTPUT_FLOAT_INDEXES_DICT_KEY, []))
        conf.set_preserved_attributes(d.get(PRESERVED_ATTRIBUTES_DICT_KEY, []))
        return conf

    def to_dict(self) -> dict[str, Any]:
        """torch.ao's dict form; only the keys that are set."""

        def as_tuple(target: Any, e: StandaloneModuleConfigEntry) -> tuple[Any, ...]:
            return (
                target,
                e.qconfig_mapping.to_dict() if e.qconfig_mapping is not None else None,
                e.example_inputs,
                e.prepare_custom_config.to_dict() if e.prepare_custom_config else None,
                e.backend_config,
            )

        d: dict[str, Any] = {}
        if self.standalone_module_names:
            d[STANDALONE_MODULE_NAME_DICT_KEY] = [
                as_tuple(k, v) for k, v in self.standalone_module_names.items()
            ]
        if self.standalone_module_classes:
            d[STANDALONE_MODULE_CLASS_DICT_KEY] = [
                as_tuple(k, v) for k, v in self.standalone_module_classes.items()
            ]
        if self.float_to_observed_mapping:
            d[FLOAT_TO_OBSERVED_DICT_KEY] = {
                qt.dict_name: dict(m) for qt, m in self.float_to_observed_mapping.items()
            }
        if self.non_traceable_module_names:
            d[NON_TRACEABLE_MODULE_NAME_DICT_KEY] = list(self.non_traceable_module_names)
        if self.non_traceable_module_classes:
            d[NON_TRACEABLE_MODULE_CLASS_DICT_KEY] = list(self.non_traceable_module_classes)
        if self.input_quantized_indexes:
            d[INPUT_QUANTIZED_INDEXES_DICT_KEY] = list(self.input_quantized_indexes)
        if self.output_quantized_indexes:
            d[OUTPUT_QUANTIZED_INDEXES_DICT_KEY] = list(self.output_quantized_indexes)
        if self.output_float_indexes:
            d[OUTPUT_FLOAT_INDEXES_DICT_KEY] = list(self.output_float_indexes)
        if self.preserved_attributes:
            d[PRESERVED_ATTRIBUTES_DICT_KEY] = list(self.preserved_attributes)
        return d


class ConvertCustomConfig:
    """Custom settings for ``convert_fx`` / ``convert_to_reference_fx`` (torch.ao's API)."""

    def __init__(self) -> None:
        self.observed_to_quantized_mapping: dict[QuantType, dict[type, type]] = {}
        self.preserved_attributes: list[str] = []

    def __repr__(self) -> str:
        shown = {k: v for k, v in self.__dict__.items() if v}
        return f"ConvertCustomConfig({shown})"

    def set_observed_to_quantized_mapping(
        self,
        observed_class: type,
        quantized_class: type,
        quant_type: QuantType = QuantType.STATIC,
    ) -> ConvertCustomConfig:
        """Swap ``observed_class`` for ``quantized_class.from_observed(module)`` at convert.

        torch.ao.nn classes are replaced by quantbridge's equivalents (or refused)."""
        where = "set_observed_to_quantized_mapping"
        observed_class = port_class(observed_class, f"{where}: observed_class")
        quantized_class = port_class(quantized_class, f"{where}: quantized_class")
        _module_class(observed_class, f"{where}: observed_class")
        _module_class(quantized_class, f"{where}: quantized_class")
        if not callable(getattr(quantized_class, "from_observed", None)):
            raise FxQuantError(
                f"{where}: {quantized_class.__name__} needs a from_observed(observed_module) "
                "classmethod"
            )
        qt = QuantType.from_name(quant_type, where)
        self.observed_to_quantized_mapping.setdefault(qt, {})[observed_class] = quantized_class
        return self

    def set_preserved_attributes(self, attributes: list[str]) -> ConvertCustomConfig:
        """Attributes of the model kept on the result even if ``forward`` does not use them."""
        self.preserved_attributes = _str_list(attributes, "set_preserved_attributes")
        return self

    @classmethod
    def from_dict(cls, convert_custom_config_dict: dict[str, Any]) -> ConvertCustomConfig:
        """Build from torch.ao's dict form."""
        where = "ConvertCustomConfig.from_dict"
        d = _check_keys(
            convert_custom_config_dict,
            (OBSERVED_TO_QUANTIZED_DICT_KEY, PRESERVED_ATTRIBUTES_DICT_KEY),
            where,
        )
        conf = cls()
        for qt_name, mapping in d.get(OBSERVED_TO_QUANTIZED_DICT_KEY, {}).items():
            qt = QuantType.from_name(qt_name, where)
            for observed_class, quantized_class in mapping.items():
                conf.set_observed_to_quantized_mapping(observed_class, quantized_class, qt)
        conf.set_preserved_attributes(d.get(PRESERVED_ATTRIBUTES_DICT_KEY, []))
        return conf

    def to_dict(self) -> dict[str, Any]:
        """torch.ao's dict form; only the keys that are set."""
        d: dict[str, Any] = {}
        if self.observed_to_quantized_mapping:
            d[OBSERVED_TO_QUANTIZED_DICT_KEY] = {
                qt.dict_name: dict(m) for qt, m in self.observed_to_quantized_mapping.items()
            }
        if self.preserved_attributes:
            d[PRESERVED_ATTRIBUTES_DICT_KEY] = list(self.preserved_attributes)
        return d


class FuseCustomConfig:
    """Custom settings for ``fuse_fx`` (torch.ao's API): preserved attributes."""

    def __init__(self) -> None:
        self.preserved_attributes: list[str] = []

    def __repr__(self) -> str:
        shown = {k: v for k, v in self.__dict__.items() if v}
        return f"FuseCustomConfig({shown})"

    def set_preserved_attributes(self, attributes: list[str]) -> FuseCustomConfig:
        """Attributes of the model kept on the result even if ``forward`` does not use them."""
        self.preserved_attributes = _str_list(attributes, "set_preserved_attributes")
        return self

    @classmethod
    def from_dict(cls, fuse_custom_config_dict: dict[str, Any]) -> FuseCustomConfig:
        """Build from torch.ao's dict form."""
        d = _check_keys(
            fuse_custom_config_dict, (PRESERVED_ATTRIBUTES_DICT_KEY,), "FuseCustomConfig.from_dict"
        )
        return cls().set_preserved_attributes(d.get(PRESERVED_ATTRIBUTES_DICT_KEY, []))

    def to_dict(self) -> dict[str, Any]:
        """torch.ao's dict form; only the keys that are set."""
        if self.preserved_attributes:
            return {PRESERVED_ATTRIBUTES_DICT_KEY: list(self.preserved_attributes)}
        return {}
