"""The backend description: what a backend supports, for which patterns, and how to observe them.

Same names, constructor arguments, setters, attributes and dict keys as torch.ao 2.13's
``backend_config`` module, with three differences:

* values are checked when set, and errors name the field and the bad value;
* dtypes are stored as plain torch dtypes (``torch.quint8`` is accepted and stored as
  ``torch.uint8``; the sub-byte ``torch.quint4x2``/``torch.quint2x4`` become ``torch.uint8``
  with their range recorded as ``quant_min_lower_bound``/``quant_max_upper_bound``);
* tuple patterns may have any length (torch.ao stops at three operators).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any

import torch

from quantbridge.patterns import (
    Pattern,
    PatternError,
    check_complex_pattern,
    check_sequential_pattern,
    sequential_to_complex,
)
from quantbridge.qconfig._dtypes import (
    canonical_dtype,
    dtype_alias_name,
    is_quantized_dtype,
    natural_quant_range,
)
from quantbridge.qconfig._errors import QConfigError, QConfigPatternError

INPUT_DTYPE_DICT_KEY = "input_dtype"
OUTPUT_DTYPE_DICT_KEY = "output_dtype"
WEIGHT_DTYPE_DICT_KEY = "weight_dtype"
BIAS_DTYPE_DICT_KEY = "bias_dtype"
IS_DYNAMIC_DICT_KEY = "is_dynamic"
NAME_DICT_KEY = "name"
CONFIGS_DICT_KEY = "configs"
PATTERN_DICT_KEY = "pattern"
PATTERN_COMPLEX_FORMAT_DICT_KEY = "pattern_complex_format"
OBSERVATION_TYPE_DICT_KEY = "observation_type"
DTYPE_CONFIGS_DICT_KEY = "dtype_configs"
ROOT_MODULE_DICT_KEY = "root_module"
QAT_MODULE_DICT_KEY = "qat_module"
REFERENCE_QUANTIZED_MODULE_DICT_KEY = "reference_quantized_module_for_root"
FUSED_MODULE_DICT_KEY = "fused_module"
FUSER_METHOD_DICT_KEY = "fuser_method"
ROOT_NODE_GETTER_DICT_KEY = "root_node_getter"
EXTRA_INPUTS_GETTER_DICT_KEY = "extra_inputs_getter"
NUM_TENSOR_ARGS_TO_OBSERVATION_TYPE_DICT_KEY = "num_tensor_args_to_observation_type"
INPUT_TYPE_TO_INDEX_DICT_KEY = "input_type_to_index"

_DTYPE_CONFIG_KEYS = (
    INPUT_DTYPE_DICT_KEY,
    OUTPUT_DTYPE_DICT_KEY,
    WEIGHT_DTYPE_DICT_KEY,
    BIAS_DTYPE_DICT_KEY,
    IS_DYNAMIC_DICT_KEY,
)
_PATTERN_CONFIG_KEYS = (
    PATTERN_DICT_KEY,
    OBSERVATION_TYPE_DICT_KEY,
    DTYPE_CONFIGS_DICT_KEY,
    ROOT_MODULE_DICT_KEY,
    QAT_MODULE_DICT_KEY,
    REFERENCE_QUANTIZED_MODULE_DICT_KEY,
    FUSED_MODULE_DICT_KEY,
    FUSER_METHOD_DICT_KEY,
    ROOT_NODE_GETTER_DICT_KEY,
    EXTRA_INPUTS_GETTER_DICT_KEY,
    NUM_TENSOR_ARGS_TO_OBSERVATION_TYPE_DICT_KEY,
    INPUT_TYPE_TO_INDEX_DICT_KEY,
    PATTERN_COMPLEX_FORMAT_DICT_KEY,
)
_BACKEND_CONFIG_KEYS = (NAME_DICT_KEY, CONFIGS_DICT_KEY)


class ObservationType(enum.Enum):
    """Where observers go around a pattern (same members and values as torch.ao's)."""

    OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT = 0
    """Input and output get separate observers (conv, linear, softmax)."""
    OUTPUT_SHARE_OBSERVER_WITH_INPUT = 1
    """The output reuses the input's observer (cat, max pool)."""
    INPUT_OUTPUT_NOT_OBSERVED = 2
    """Neither input nor output is observed (``x.shape``, ``x.size()``)."""


def _check_unknown_keys(d: object, accepted: Sequence[str], where: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise QConfigError(f"{where}: expected a dict, got {d!r} (a {type(d).__name__})")
    for key in d:
        if key not in accepted:
            raise QConfigError(
                f"{where}: unknown key {key!r}; accepted keys are "
                + ", ".join(repr(k) for k in accepted)
            )
    return d


def _optional_dtype(value: object, where: str) -> torch.dtype | None:
    if value is None:
        return None
    if not isinstance(value, torch.dtype):
        raise QConfigError(
            f"{where}: expected a torch.dtype or None, got {value!r} (a {type(value).__name__})"
        )
    return canonical_dtype(value, where)


def _optional_number(value: object, where: str, *, integer: bool = False) -> int | float | None:
    if value is None:
        return None
    allowed: tuple[type, ...] = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed):
        kind = "an int" if integer else "a number"
        raise QConfigError(f"{where}: expected {kind} or None, got {value!r}")
    number = float(value) if isinstance(value, float) else int(value)  # type: ignore[call-overload]
    if not math.isfinite(number):
        raise QConfigError(f"{where}: must be finite, got {value!r}")
    return number


@dataclass
class DTypeWithConstraints:
    """A dtype plus the limits a backend puts on its quantization parameters.

    * ``quant_min_lower_bound`` / ``quant_max_upper_bound``: the qconfig's ``quant_min`` and
      ``quant_max`` must lie within them; the range must contain 0.
    * ``scale_min_lower_bound`` / ``scale_max_upper_bound``: positive bounds on the scale.
    * ``scale_exact_match`` / ``zero_point_exact_match``: the fixed qparams an operator such
      as sigmoid needs.
    * ``group_sizes`` (not in torch.ao): the group sizes a backend takes for per-group
      weights (``QScheme.PER_GROUP_*``, weight-only LLM quantization). None: the backend
      takes no per-group qparams for this dtype.

    ``dtype`` is stored canonically (``torch.quint8`` -> ``torch.uint8``). Sub-byte aliases
    keep their range: ``dtype=torch.quint4x2`` becomes ``dtype=torch.uint8`` with
    ``quant_min_lower_bound=0, quant_max_upper_bound=15`` unless narrower bounds are given.
    """

    dtype: torch.dtype | None = None
    quant_min_lower_bound: int | float | None = None
    quant_max_upper_bound: int | float | None = None
    scale_min_lower_bound: int | float | None = None
    scale_max_upper_bound: int | float | None = None
    scale_exact_match: float | None = None
    zero_point_exact_match: int | None = None
    group_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        where = "DTypeWithConstraints"
        self.group_sizes = _group_sizes(self.group_sizes, f"{where}.group_sizes")
        raw = self.dtype
        self.dtype = _optional_dtype(raw, f"{where}.dtype")
        qmin = _optional_number(self.quant_min_lower_bound, f"{where}.quant_min_lower_bound")
        qmax = _optional_number(self.quant_max_upper_bound, f"{where}.quant_max_upper_bound")
        if raw is not None and is_quantized_dtype(raw):
            lo, hi = natural_quant_range(raw)
            alias = dtype_alias_name(raw)
            if alias in ("quint4x2", "quint2x4"):
                # The canonical uint8 would lose the sub-byte range, so record it as bounds.
                qmin = lo if qmin is None else qmin
                qmax = hi if qmax is None else qmax
            for name, bound in (("quant_min_lower_bound", qmin), ("quant_max_upper_bound", qmax)):
                if bound is not None and not lo <= bound <= hi:
                    raise QConfigError(
                        f"{where}.{name}: {bound!r} is outside the range [{lo}, {hi}] of "
                        f"{raw}; use a bound within the dtype's range"
                    )
        if qmin is not None and qmin > 0:
            raise QConfigError(
                f"{where}.quant_min_lower_bound: {qmin!r} excludes 0; a quantized range must "
                "contain 0 so the zero point is representable"
            )
        if qmax is not None and qmax < 0:
            raise QConfigError(
                f"{where}.quant_max_upper_bound: {qmax!r} excludes 0; a quantized range must "
                "contain 0 so the zero point is representable"
            )
        if qmin is not None and qmax is not None and qmin >= qmax:
            raise QConfigError(
                f"{where}: quant_min_lower_bound={qmin!r} is not below "
                f"quant_max_upper_bound={qmax!r}; the lower bound must be the smaller one"
            )
        self.quant_min_lower_bound, self.quant_max_upper_bound = qmin, qmax
        smin = _optional_number(self.scale_min_lower_bound, f"{where}.scale_min_lower_bound")
        smax = _optional_number(self.scale_max_upper_bound, f"{where}.scale_max_upper_bound")
        for name, value in (("scale_min_lower_bound", smin), ("scale_max_upper_bound", smax)):
            if value is not None and value <= 0:
                raise QConfigError(f"{where}.{name}: a scale bound must be positive, got {value!r}")
        if smin is not None and smax is not None and smin > smax:
            raise QConfigError(
                f"{where}: scale_min_lower_bound={smin!r} is above "
                f"scale_max_upper_bound={smax!r}; swap them"
            )
        exact = _optional_number(self.scale_exact_match, f"{where}.scale_exact_match")
        if exact is not None and exact <= 0:
            raise QConfigError(
                f"{where}.scale_exact_match: a scale must be positive, got {exact!r}"
            )
        self.scale_exact_match = None if exact is None else float(exact)
        zp = _optional_number(
            self.zero_point_exact_match, f"{where}.zero_point_exact_match", integer=True
        )
        self.zero_point_exact_match = None if zp is None else int(zp)
        if self.dtype is None:
            # torch.ao ignores (and to_dict drops) constraints on a missing dtype; refuse them.
            given = [
                f.name
                for f in fields(self)
                if f.name != "dtype" and getattr(self, f.name) is not None
            ]
            if given:
                raise QConfigError(
                    f"{where}: {', '.join(given)} set without a dtype; constraints apply to a "
                    "dtype, so pass dtype=... as well"
                )


def _group_sizes(value: object, where: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (tuple, list)) or not value:
        raise QConfigError(f"{where}: expected a non-empty tuple of ints, got {value!r}")
    for size in value:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise QConfigError(f"{where}: {size!r} is not a positive int group size")
    return tuple(sorted(set(value)))


def _dtype_with_constraints(value: object, where: str) -> DTypeWithConstraints:
    if isinstance(value, DTypeWithConstraints):
        return value
    if value is None or isinstance(value, torch.dtype):
        try:
            return DTypeWithConstraints(dtype=value)
        except QConfigError as e:
            raise QConfigError(f"{where}: {e}") from None
    raise QConfigError(
        f"{where}: expected a torch.dtype, a DTypeWithConstraints or None, got {value!r} "
        f"(a {type(value).__name__})"
    )


@dataclass(init=False)
class DTypeConfig:
    """The dtypes a pattern's reference quantize ops use: input, output, weight, bias.

    ``input_dtype``/``output_dtype``/``weight_dtype`` take a dtype or a
    :class:`DTypeWithConstraints`; ``bias_dtype`` a dtype; ``is_dynamic`` a bool. All default
    to None (not set).
    """

    input_dtype_with_constraints: DTypeWithConstraints
    output_dtype_with_constraints: DTypeWithConstraints
    weight_dtype_with_constraints: DTypeWithConstraints
    bias_dtype: torch.dtype | None
    is_dynamic: bool | None

    def __init__(
        self,
        input_dtype: torch.dtype | DTypeWithConstraints | None = None,
        output_dtype: torch.dtype | DTypeWithConstraints | None = None,
        weight_dtype: torch.dtype | DTypeWithConstraints | None = None,
        bias_dtype: torch.dtype | None = None,
        is_dynamic: bool | None = None,
    ) -> None:
        self.input_dtype_with_constraints = _dtype_with_constraints(
            input_dtype, "DTypeConfig.input_dtype"
        )
        self.output_dtype_with_constraints = _dtype_with_constraints(
            output_dtype, "DTypeConfig.output_dtype"
        )
        self.weight_dtype_with_constraints = _dtype_with_constraints(
            weight_dtype, "DTypeConfig.weight_dtype"
        )
        self.bias_dtype = _optional_dtype(bias_dtype, "DTypeConfig.bias_dtype")
        if is_dynamic is not None and not isinstance(is_dynamic, bool):
            raise QConfigError(
                f"DTypeConfig.is_dynamic: expected True, False or None, got {is_dynamic!r}"
            )
        self.is_dynamic = is_dynamic

    @property
    def input_dtype(self) -> torch.dtype | None:
        return self.input_dtype_with_constraints.dtype

    @property
    def output_dtype(self) -> torch.dtype | None:
        return self.output_dtype_with_constraints.dtype

    @property
    def weight_dtype(self) -> torch.dtype | None:
        return self.weight_dtype_with_constraints.dtype

    @classmethod
    def from_dict(cls, dtype_config_dict: dict[str, Any]) -> DTypeConfig:
        """Build from a dict with the optional keys ``input_dtype``, ``output_dtype``,
        ``weight_dtype`` (dtype or DTypeWithConstraints), ``bias_dtype`` and ``is_dynamic``."""
        d = _check_unknown_keys(dtype_config_dict, _DTYPE_CONFIG_KEYS, "DTypeConfig.from_dict")
        return cls(
            d.get(INPUT_DTYPE_DICT_KEY),
            d.get(OUTPUT_DTYPE_DICT_KEY),
            d.get(WEIGHT_DTYPE_DICT_KEY),
            d.get(BIAS_DTYPE_DICT_KEY),
            d.get(IS_DYNAMIC_DICT_KEY),
        )

    def to_dict(self) -> dict[str, Any]:
        """The keys of :meth:`from_dict` that are set; dtypes as DTypeWithConstraints."""
        d: dict[str, Any] = {}
        if self.input_dtype is not None:
            d[INPUT_DTYPE_DICT_KEY] = self.input_dtype_with_constraints
        if self.output_dtype is not None:
            d[OUTPUT_DTYPE_DICT_KEY] = self.output_dtype_with_constraints
        if self.weight_dtype is not None:
            d[WEIGHT_DTYPE_DICT_KEY] = self.weight_dtype_with_constraints
        if self.bias_dtype is not None:
            d[BIAS_DTYPE_DICT_KEY] = self.bias_dtype
        if self.is_dynamic is not None:
            d[IS_DYNAMIC_DICT_KEY] = self.is_dynamic
        return d

    def to_json(self, file: str | Path | IO[str] | None = None, *, indent: int | None = 2) -> str:
        """JSON text of this config (docs: "Configuration files"); also written to ``file``."""
        from quantbridge.qconfig._json import dump_config

        return dump_config(self, "DTypeConfig", self.to_dict(), file, indent)

    @classmethod
    def from_json(
        cls, source: str | Path | IO[str], *, allowed_prefixes: tuple[str, ...] = ()
    ) -> DTypeConfig:
        """Load from JSON text, a file path or an open text file."""
        from quantbridge.qconfig._json import build_from_json

        return build_from_json(cls.from_dict, source, "DTypeConfig", allowed_prefixes)


def _wrap_pattern_error(e: PatternError, where: str) -> QConfigPatternError:
    return QConfigPatternError(f"{where}: {e}")


def _optional_module_class(value: object, where: str) -> type[torch.nn.Module] | None:
    if value is None:
        return None
    if not (isinstance(value, type) and issubclass(value, torch.nn.Module)):
        raise QConfigError(
            f"{where}: expected an nn.Module subclass or None, got {value!r} "
            f"(a {type(value).__name__})"
        )
    return value


def _optional_callable(value: object, where: str) -> Callable[..., Any] | None:
    if value is None:
        return None
    if not callable(value):
        raise QConfigError(
            f"{where}: expected a function or None, got {value!r} (a {type(value).__name__})"
        )
    return value


class BackendPatternConfig:
    """How a backend quantizes one pattern: observation type, dtype configs, module mappings,
    and (for fusion patterns) the fused module and fuser method.

    ``pattern`` is one operator or a tuple of operators in execution order (any length ≥ 1);
    nested patterns use :meth:`_set_pattern_complex_format`. Setters return ``self``.
    """

    def __init__(self, pattern: Pattern | None = None) -> None:
        self.pattern: Pattern | None = None
        self.observation_type = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
        self.dtype_configs: list[DTypeConfig] = []
        self.root_module: type[torch.nn.Module] | None = None
        self.qat_module: type[torch.nn.Module] | None = None
        self.reference_quantized_module: type[torch.nn.Module] | None = None
        self.fused_module: type[torch.nn.Module] | None = None
        self.fuser_method: Callable[..., Any] | None = None
        self._root_node_getter: Callable[..., Any] | None = None
        self._extra_inputs_getter: Callable[..., Any] | None = None
        self._num_tensor_args_to_observation_type: dict[int, ObservationType] = {}
        self._input_type_to_index: dict[str, int] = {}
        self._pattern_complex_format: Pattern | None = None
        if pattern is not None:
            self.set_pattern(pattern)

    def __repr__(self) -> str:
        shown = {
            k: v
            for k, v in self.__dict__.items()
            if (v is not None and not isinstance(v, (list, dict)))
            or (isinstance(v, (list, dict)) and v)
        }
        return f"BackendPatternConfig({shown})"

    @property
    def pattern_complex_format(self) -> Pattern | None:
        """The pattern as given in complex (reverse-nested) form; None if set another way."""
        return self._pattern_complex_format

    def set_pattern_complex_format(self, pattern: Pattern) -> BackendPatternConfig:
        """Set a nested pattern in complex form (torch.ao's ``_set_pattern_complex_format``)."""
        return self._set_pattern_complex_format(pattern)

    def set_root_node_getter(self, getter: Callable[..., Any] | None) -> BackendPatternConfig:
        """torch.ao's ``_set_root_node_getter`` under a public name."""
        return self._set_root_node_getter(getter)

    def set_extra_inputs_getter(self, getter: Callable[..., Any] | None) -> BackendPatternConfig:
        """torch.ao's ``_set_extra_inputs_getter`` under a public name."""
        return self._set_extra_inputs_getter(getter)

    def set_input_type_to_index(self, input_type_to_index: dict[str, int]) -> BackendPatternConfig:
        """torch.ao's ``_set_input_type_to_index`` under a public name."""
        return self._set_input_type_to_index(input_type_to_index)

    def set_num_tensor_args_to_observation_type(
        self, num_tensor_args_to_observation_type: dict[int, ObservationType]
    ) -> BackendPatternConfig:
        """torch.ao's ``_set_num_tensor_args_to_observation_type`` under a public name."""
        return self._set_num_tensor_args_to_observation_type(num_tensor_args_to_observation_type)

    @property
    def root_node_getter(self) -> Callable[..., Any] | None:
        """Picks the root node of a complex pattern's match (None: the default)."""
        return self._root_node_getter

    @property
    def extra_inputs_getter(self) -> Callable[..., Any] | None:
        """Extra inputs of a fused module beyond the root's (None: none)."""
        return self._extra_inputs_getter

    @property
    def input_type_to_index(self) -> Mapping[str, int]:
        """Argument index of ``"weight"`` / ``"bias"`` for functional patterns (read-only)."""
        return MappingProxyType(self._input_type_to_index)

    @property
    def num_tensor_args_to_observation_type(self) -> Mapping[int, ObservationType]:
        """Observation type by the number of tensor arguments (read-only; empty: use
        ``observation_type``)."""
        return MappingProxyType(self._num_tensor_args_to_observation_type)

    @property
    def complex_pattern(self) -> Pattern | None:
        """The pattern in complex (reverse-nested) form, whichever way it was set; None if unset."""
        if self._pattern_complex_format is not None:
            return self._pattern_complex_format
        if self.pattern is None:
            return None
        return sequential_to_complex(self.pattern)

    def set_pattern(self, pattern: Pattern) -> BackendPatternConfig:
        """Set the pattern: one operator or a tuple of operators in execution order."""
        if self._pattern_complex_format is not None:
            raise QConfigError(
                "BackendPatternConfig.set_pattern: this config already has a complex-format "
                "pattern; set either 'pattern' or 'pattern_complex_format', not both"
            )
        try:
            check_sequential_pattern(pattern, "BackendPatternConfig.pattern")
        except PatternError as e:
            raise _wrap_pattern_error(e, "BackendPatternConfig.set_pattern") from None
        self.pattern = pattern
        return self

    def set_observation_type(self, observation_type: ObservationType) -> BackendPatternConfig:
        """Set where observers go for this pattern."""
        if not isinstance(observation_type, ObservationType):
            raise QConfigError(
                f"BackendPatternConfig.observation_type: expected an ObservationType member, "
                f"got {observation_type!r}; use e.g. "
                "ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT"
            )
        self.observation_type = observation_type
        return self

    def add_dtype_config(self, dtype_config: DTypeConfig) -> BackendPatternConfig:
        """Add one supported set of dtypes."""
        self.dtype_configs.append(self._check_dtype_config(dtype_config, len(self.dtype_configs)))
        return self

    def set_dtype_configs(self, dtype_configs: list[DTypeConfig]) -> BackendPatternConfig:
        """Replace the supported dtype sets."""
        if not isinstance(dtype_configs, (list, tuple)):
            raise QConfigError(
                "BackendPatternConfig.dtype_configs: expected a list of DTypeConfig, got "
                f"{type(dtype_configs).__name__}"
            )
        self.dtype_configs = [self._check_dtype_config(c, i) for i, c in enumerate(dtype_configs)]
        return self

    @staticmethod
    def _check_dtype_config(value: object, index: int) -> DTypeConfig:
        if not isinstance(value, DTypeConfig):
            raise QConfigError(
                f"BackendPatternConfig.dtype_configs[{index}]: expected a DTypeConfig, got "
                f"{value!r} (a {type(value).__name__})"
            )
        return value

    def set_root_module(self, root_module: type[torch.nn.Module] | None) -> BackendPatternConfig:
        """Set the float module that convert swaps for the reference quantized module."""
        self.root_module = _optional_module_class(root_module, "BackendPatternConfig.root_module")
        return self

    def set_qat_module(self, qat_module: type[torch.nn.Module] | None) -> BackendPatternConfig:
        """Set the QAT module class for this pattern."""
        self.qat_module = _optional_module_class(qat_module, "BackendPatternConfig.qat_module")
        return self

    def set_reference_quantized_module(
        self, reference_quantized_module: type[torch.nn.Module] | None
    ) -> BackendPatternConfig:
        """Set the reference quantized module class for this pattern's root module."""
        self.reference_quantized_module = _optional_module_class(
            reference_quantized_module, "BackendPatternConfig.reference_quantized_module"
        )
        return self

    def set_fused_module(self, fused_module: type[torch.nn.Module] | None) -> BackendPatternConfig:
        """Set the fused module class that fusion produces for this pattern."""
        self.fused_module = _optional_module_class(
            fused_module, "BackendPatternConfig.fused_module"
        )
        return self

    def set_fuser_method(self, fuser_method: Callable[..., Any] | None) -> BackendPatternConfig:
        """Set ``fuser_method(is_qat, *modules) -> fused module`` for this pattern."""
        self.fuser_method = _optional_callable(fuser_method, "BackendPatternConfig.fuser_method")
        return self

    def _set_root_node_getter(
        self, root_node_getter: Callable[..., Any] | None
    ) -> BackendPatternConfig:
        self._root_node_getter = _optional_callable(
            root_node_getter, "BackendPatternConfig.root_node_getter"
        )
        return self

    def _set_extra_inputs_getter(
        self, extra_inputs_getter: Callable[..., Any] | None
    ) -> BackendPatternConfig:
        self._extra_inputs_getter = _optional_callable(
            extra_inputs_getter, "BackendPatternConfig.extra_inputs_getter"
        )
        return self

    def _set_num_tensor_args_to_observation_type(
        self, num_tensor_args_to_observation_type: dict[int, ObservationType]
    ) -> BackendPatternConfig:
        where = "BackendPatternConfig.num_tensor_args_to_observation_type"
        if not isinstance(num_tensor_args_to_observation_type, dict):
            raise QConfigError(
                f"{where}: expected a dict of int -> ObservationType, got "
                f"{num_tensor_args_to_observation_type!r}"
            )
        for k, v in num_tensor_args_to_observation_type.items():
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise QConfigError(f"{where}: key {k!r} is not a non-negative int")
            if not isinstance(v, ObservationType):
                raise QConfigError(f"{where}[{k}]: {v!r} is not an ObservationType member")
        self._num_tensor_args_to_observation_type = dict(num_tensor_args_to_observation_type)
        return self

    def _set_input_type_to_index(self, input_type_to_index: dict[str, int]) -> BackendPatternConfig:
        where = "BackendPatternConfig.input_type_to_index"
        if not isinstance(input_type_to_index, dict):
            raise QConfigError(
                f"{where}: expected a dict of str -> int, got {input_type_to_index!r}"
            )
        for k, v in input_type_to_index.items():
            if not isinstance(k, str):
                raise QConfigError(f"{where}: key {k!r} is not a string such as 'weight'")
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise QConfigError(f"{where}[{k!r}]: {v!r} is not a non-negative int index")
        self._input_type_to_index = dict(input_type_to_index)
        return self

    def _set_pattern_complex_format(self, pattern: Pattern) -> BackendPatternConfig:
        if self.pattern is not None:
            raise QConfigError(
                "BackendPatternConfig._set_pattern_complex_format: this config already has a "
                "sequential pattern; set either 'pattern' or 'pattern_complex_format', not both"
            )
        try:
            check_complex_pattern(pattern, "BackendPatternConfig.pattern_complex_format")
        except PatternError as e:
            raise _wrap_pattern_error(
                e, "BackendPatternConfig._set_pattern_complex_format"
            ) from None
        self._pattern_complex_format = pattern
        return self

    @classmethod
    def from_dict(cls, backend_pattern_config_dict: dict[str, Any]) -> BackendPatternConfig:
        """Build from torch.ao's dict form (``pattern``, ``observation_type``,
        ``dtype_configs``, ``root_module``, ``qat_module``,
        ``reference_quantized_module_for_root``, ``fused_module``, ``fuser_method``,
        ``root_node_getter``, ``extra_inputs_getter``,
        ``num_tensor_args_to_observation_type``, ``input_type_to_index``,
        ``pattern_complex_format``); unknown keys are an error."""
        d = _check_unknown_keys(
            backend_pattern_config_dict, _PATTERN_CONFIG_KEYS, "BackendPatternConfig.from_dict"
        )
        conf = cls()
        if PATTERN_DICT_KEY in d:
            conf.set_pattern(d[PATTERN_DICT_KEY])
        if OBSERVATION_TYPE_DICT_KEY in d:
            conf.set_observation_type(d[OBSERVATION_TYPE_DICT_KEY])
        dtype_configs = d.get(DTYPE_CONFIGS_DICT_KEY, [])
        if not isinstance(dtype_configs, (list, tuple)):
            raise QConfigError(
                "BackendPatternConfig.from_dict: 'dtype_configs' must be a list, got "
                f"{type(dtype_configs).__name__}"
            )
        for i, dc in enumerate(dtype_configs):
            if isinstance(dc, dict):
                try:
                    dc = DTypeConfig.from_dict(dc)
                except QConfigError as e:
                    raise QConfigError(f"dtype_configs[{i}]: {e}") from None
            conf._check_dtype_config(dc, i)
            conf.dtype_configs.append(dc)
        conf.set_root_module(d.get(ROOT_MODULE_DICT_KEY))
        conf.set_qat_module(d.get(QAT_MODULE_DICT_KEY))
        conf.set_reference_quantized_module(d.get(REFERENCE_QUANTIZED_MODULE_DICT_KEY))
        conf.set_fused_module(d.get(FUSED_MODULE_DICT_KEY))
        conf.set_fuser_method(d.get(FUSER_METHOD_DICT_KEY))
        conf._set_root_node_getter(d.get(ROOT_NODE_GETTER_DICT_KEY))
        conf._set_extra_inputs_getter(d.get(EXTRA_INPUTS_GETTER_DICT_KEY))
        conf._set_num_tensor_args_to_observation_type(
            d.get(NUM_TENSOR_ARGS_TO_OBSERVATION_TYPE_DICT_KEY, {})
        )
        conf._set_input_type_to_index(d.get(INPUT_TYPE_TO_INDEX_DICT_KEY, {}))
        if PATTERN_COMPLEX_FORMAT_DICT_KEY in d:
            conf._set_pattern_complex_format(d[PATTERN_COMPLEX_FORMAT_DICT_KEY])
        return conf

    def to_dict(self) -> dict[str, Any]:
        """torch.ao's dict form: always ``observation_type`` and ``dtype_configs`` (as dicts),
        plus every other key that is set."""
        d: dict[str, Any] = {
            OBSERVATION_TYPE_DICT_KEY: self.observation_type,
            DTYPE_CONFIGS_DICT_KEY: [c.to_dict() for c in self.dtype_configs],
        }
        optional: tuple[tuple[str, object], ...] = (
            (PATTERN_DICT_KEY, self.pattern),
            (ROOT_MODULE_DICT_KEY, self.root_module),
            (QAT_MODULE_DICT_KEY, self.qat_module),
            (REFERENCE_QUANTIZED_MODULE_DICT_KEY, self.reference_quantized_module),
            (FUSED_MODULE_DICT_KEY, self.fused_module),
            (FUSER_METHOD_DICT_KEY, self.fuser_method),
            (ROOT_NODE_GETTER_DICT_KEY, self._root_node_getter),
            (EXTRA_INPUTS_GETTER_DICT_KEY, self._extra_inputs_getter),
        )
        for key, value in optional:
            if value is not None:
                d[key] = value
        if self._num_tensor_args_to_observation_type:
            d[NUM_TENSOR_ARGS_TO_OBSERVATION_TYPE_DICT_KEY] = (
                self._num_tensor_args_to_observation_type
            )
        if self._input_type_to_index:
            d[INPUT_TYPE_TO_INDEX_DICT_KEY] = self._input_type_to_index
        if self._pattern_complex_format is not None:
            d[PATTERN_COMPLEX_FORMAT_DICT_KEY] = self._pattern_complex_format
        return d

    def to_json(self, file: str | Path | IO[str] | None = None, *, indent: int | None = 2) -> str:
        """JSON text of this config (docs: "Configuration files"); also written to ``file``."""
        from quantbridge.qconfig._json import dump_config

        return dump_config(self, "BackendPatternConfig", self.to_dict(), file, indent)

    @classmethod
    def from_json(
        cls, source: str | Path | IO[str], *, allowed_prefixes: tuple[str, ...] = ()
    ) -> BackendPatternConfig:
        """Load from JSON text, a file path or an open text file."""
        from quantbridge.qconfig._json import build_from_json

        return build_from_json(cls.from_dict, source, "BackendPatternConfig", allowed_prefixes)


class BackendConfig:
    """Everything a backend supports: a name and one BackendPatternConfig per pattern.

    Registering a config whose pattern (compared in complex form) is already present replaces
    the earlier entry, as in torch.ao.
    """

    def __init__(self, name: str = "") -> None:
        self.name = self._check_name(name)
        self._pattern_complex_format_to_config: dict[Pattern, BackendPatternConfig] = {}

    @staticmethod
    def _check_name(name: object) -> str:
        if not isinstance(name, str):
            raise QConfigError(f"BackendConfig.name: expected a string, got {name!r}")
        return name

    def __repr__(self) -> str:
        return f"BackendConfig({self.__dict__})"

    def set_name(self, name: str) -> BackendConfig:
        """Set the backend's name."""
        self.name = self._check_name(name)
        return self

    def set_backend_pattern_config(self, config: BackendPatternConfig) -> BackendConfig:
        """Add ``config``, replacing any earlier config for the same pattern."""
        if not isinstance(config, BackendPatternConfig):
            raise QConfigError(
                f"BackendConfig.set_backend_pattern_config: expected a BackendPatternConfig, "
                f"got {config!r} (a {type(config).__name__})"
            )
        pattern = config.complex_pattern
        if pattern is None:
            raise QConfigError(
                "BackendConfig.set_backend_pattern_config: the BackendPatternConfig has no "
                "pattern; call set_pattern(...) (or _set_pattern_complex_format(...)) first"
            )
        self._pattern_complex_format_to_config[pattern] = config
        return self

    def set_backend_pattern_configs(self, configs: list[BackendPatternConfig]) -> BackendConfig:
        """Add several configs in order (later ones replace earlier ones for the same pattern)."""
        for i, config in enumerate(configs):
            try:
                self.set_backend_pattern_config(config)
            except QConfigError as e:
                raise type(e)(f"configs[{i}]: {e}") from None
        return self

    @property
    def complex_format_to_config(self) -> Mapping[Pattern, BackendPatternConfig]:
        """Each registered pattern in complex form, to its config (read-only, no copy)."""
        return MappingProxyType(self._pattern_complex_format_to_config)

    @property
    def configs(self) -> list[BackendPatternConfig]:
        """A new list of the registered configs, in registration order."""
        return list(self._pattern_complex_format_to_config.values())

    @classmethod
    def from_dict(cls, backend_config_dict: dict[str, Any]) -> BackendConfig:
        """Build from ``{"name": str, "configs": [BackendPatternConfig or its dict, ...]}``;
        unknown keys are an error."""
        d = _check_unknown_keys(
            backend_config_dict, _BACKEND_CONFIG_KEYS, "BackendConfig.from_dict"
        )
        conf = cls(d.get(NAME_DICT_KEY, ""))
        configs = d.get(CONFIGS_DICT_KEY, [])
        if not isinstance(configs, (list, tuple)):
            raise QConfigError(
                f"BackendConfig.from_dict: 'configs' must be a list, got {type(configs).__name__}"
            )
        for i, item in enumerate(configs):
            try:
                if isinstance(item, dict):
                    item = BackendPatternConfig.from_dict(item)
                elif not isinstance(item, BackendPatternConfig):
                    raise QConfigError(
                        f"expected a BackendPatternConfig or its dict, got {type(item).__name__}"
                    )
                conf.set_backend_pattern_config(item)
            except QConfigError as e:
                raise type(e)(f"configs[{i}]: {e}") from None
        return conf

    def to_dict(self) -> dict[str, Any]:
        """``{"name": ..., "configs": [each BackendPatternConfig.to_dict(), ...]}``."""
        return {
            NAME_DICT_KEY: self.name,
            CONFIGS_DICT_KEY: [c.to_dict() for c in self.configs],
        }

    def to_json(self, file: str | Path | IO[str] | None = None, *, indent: int | None = 2) -> str:
        """JSON text of this backend (docs: "Configuration files"); also written to ``file``."""
        from quantbridge.qconfig._json import dump_config

        return dump_config(self, "BackendConfig", self.to_dict(), file, indent)

    @classmethod
    def from_json(
        cls, source: str | Path | IO[str], *, allowed_prefixes: tuple[str, ...] = ()
    ) -> BackendConfig:
        """Load from JSON text, a file path or an open text file.

        The file is untrusted input: it may only call registered callables and the
        functions and classes of your own ``allowed_prefixes`` modules (e.g.
        ``("my_backend",)``); see "Security" on the docs' "Configuration files" page.
        """
        from quantbridge.qconfig._json import build_from_json

        return build_from_json(cls.from_dict, source, "BackendConfig", allowed_prefixes)
