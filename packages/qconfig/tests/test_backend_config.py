"""ObservationType, DTypeWithConstraints, DTypeConfig, BackendPatternConfig, BackendConfig."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from quantbridge.patterns import MatchAllNode, PatternError
from quantbridge.qconfig import (
    BackendConfig,
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    ObservationType,
    QConfigError,
    QConfigPatternError,
)

QUINT8 = getattr(torch, "quint8", torch.uint8)
QINT8 = getattr(torch, "qint8", torch.int8)
QINT32 = getattr(torch, "qint32", torch.int32)


def test_observation_type_members_match_torch_ao_values() -> None:
    assert [(m.name, m.value) for m in ObservationType] == [
        ("OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT", 0),
        ("OUTPUT_SHARE_OBSERVER_WITH_INPUT", 1),
        ("INPUT_OUTPUT_NOT_OBSERVED", 2),
    ]


# -- DTypeWithConstraints ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given_dtype", "stored"),
    [
        (QUINT8, torch.uint8),
        (QINT8, torch.int8),
        (QINT32, torch.int32),
        (torch.uint8, torch.uint8),
        (torch.float, torch.float32),
        (torch.float16, torch.float16),
    ],
)
def test_dtypes_are_stored_canonically(given_dtype: torch.dtype, stored: torch.dtype) -> None:
    d = DTypeWithConstraints(dtype=given_dtype)
    assert d.dtype is stored
    assert d.quant_min_lower_bound is None
    assert d.quant_max_upper_bound is None


@pytest.mark.parametrize(("alias", "hi"), [("quint4x2", 15), ("quint2x4", 3)])
def test_sub_byte_alias_records_its_range_as_bounds(alias: str, hi: int) -> None:
    dtype = getattr(torch, alias, None)
    if dtype is None:
        pytest.skip(f"torch has no {alias}")
    d = DTypeWithConstraints(dtype=dtype)
    assert (d.dtype, d.quant_min_lower_bound, d.quant_max_upper_bound) == (torch.uint8, 0, hi)
    narrower = DTypeWithConstraints(dtype=dtype, quant_max_upper_bound=hi - 1)
    assert narrower.quant_max_upper_bound == hi - 1
    with pytest.raises(QConfigError, match=r"quant_max_upper_bound: 200 is outside the range"):
        DTypeWithConstraints(dtype=dtype, quant_max_upper_bound=200)


def test_tutorial_constraints_are_kept() -> None:
    d = DTypeWithConstraints(
        dtype=QUINT8,
        quant_min_lower_bound=0,
        quant_max_upper_bound=255,
        scale_min_lower_bound=2**-12,
    )
    assert (d.dtype, d.quant_min_lower_bound, d.quant_max_upper_bound) == (torch.uint8, 0, 255)
    assert d.scale_min_lower_bound == 0.000244140625
    fixed = DTypeWithConstraints(
        dtype=QUINT8, scale_exact_match=1.0 / 256.0, zero_point_exact_match=0
    )
    assert (fixed.scale_exact_match, fixed.zero_point_exact_match) == (0.00390625, 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quant_min_lower_bound": 1}, r"quant_min_lower_bound: 1 excludes 0"),
        ({"quant_max_upper_bound": -1}, r"quant_max_upper_bound: -1 excludes 0"),
        (
            {"quant_min_lower_bound": 0, "quant_max_upper_bound": 0},
            r"quant_min_lower_bound=0 is not below quant_max_upper_bound=0",
        ),
        (
            {"dtype": QINT8, "quant_min_lower_bound": -129},
            r"-129 is outside the range \[-128, 127\]",
        ),
        ({"dtype": QUINT8, "quant_max_upper_bound": 256}, r"256 is outside the range \[0, 255\]"),
        ({"scale_min_lower_bound": 0.0}, r"scale_min_lower_bound: a scale bound must be positive"),
        ({"scale_max_upper_bound": -1.0}, r"scale_max_upper_bound: a scale bound must be positive"),
        (
            {"scale_min_lower_bound": 2.0, "scale_max_upper_bound": 1.0},
            r"scale_min_lower_bound=2.0 is above scale_max_upper_bound=1.0",
        ),
        ({"scale_min_lower_bound": float("nan")}, r"scale_min_lower_bound: must be finite"),
        ({"scale_exact_match": 0.0}, r"scale_exact_match: a scale must be positive"),
        (
            {"dtype": None, "scale_exact_match": 0.5, "zero_point_exact_match": 0},
            r"scale_exact_match, zero_point_exact_match set without a dtype",
        ),
        ({"zero_point_exact_match": 1.5}, r"zero_point_exact_match: expected an int"),
        ({"quant_min_lower_bound": True}, r"quant_min_lower_bound: expected a number"),
        ({"quant_min_lower_bound": "0"}, r"quant_min_lower_bound: expected a number"),
        ({"dtype": "uint8"}, r"DTypeWithConstraints.dtype: expected a torch.dtype"),
        ({"dtype": torch.float64}, r"DTypeWithConstraints.dtype: unsupported dtype torch.float64"),
    ],
)
def test_dtype_with_constraints_rejects(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(QConfigError, match=message):
        DTypeWithConstraints(**kwargs)


# -- DTypeConfig -------------------------------------------------------------------------------


def test_dtype_config_wraps_plain_dtypes_and_round_trips() -> None:
    c = DTypeConfig(
        input_dtype=QUINT8, output_dtype=QUINT8, weight_dtype=QINT8, bias_dtype=torch.float
    )
    assert (c.input_dtype, c.output_dtype, c.weight_dtype, c.bias_dtype) == (
        torch.uint8,
        torch.uint8,
        torch.int8,
        torch.float32,
    )
    assert c.is_dynamic is None
    assert c.to_dict() == {
        "input_dtype": DTypeWithConstraints(dtype=torch.uint8),
        "output_dtype": DTypeWithConstraints(dtype=torch.uint8),
        "weight_dtype": DTypeWithConstraints(dtype=torch.int8),
        "bias_dtype": torch.float32,
    }
    assert DTypeConfig.from_dict(c.to_dict()) == c
    assert DTypeConfig().to_dict() == {}
    dynamic = DTypeConfig(input_dtype=QUINT8, output_dtype=torch.float, is_dynamic=True)
    assert dynamic.to_dict()["is_dynamic"] is True


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_dtype": "quint8"}, r"DTypeConfig.input_dtype: expected a torch.dtype"),
        ({"weight_dtype": 8}, r"DTypeConfig.weight_dtype: expected a torch.dtype"),
        ({"bias_dtype": DTypeWithConstraints()}, r"DTypeConfig.bias_dtype: expected a torch.dtype"),
        ({"output_dtype": torch.complex64}, r"DTypeConfig.output_dtype.*unsupported dtype"),
        ({"is_dynamic": 1}, r"DTypeConfig.is_dynamic: expected True, False or None, got 1"),
    ],
)
def test_dtype_config_rejects(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(QConfigError, match=message):
        DTypeConfig(**kwargs)


def test_dtype_config_from_dict_names_unknown_key_and_accepted_keys() -> None:
    with pytest.raises(
        QConfigError, match=r"unknown key 'bias_type'; accepted keys are .*'bias_dtype'"
    ):
        DTypeConfig.from_dict({"bias_type": torch.float})


# -- BackendPatternConfig ----------------------------------------------------------------------


def test_pattern_config_defaults_and_setters() -> None:
    c = BackendPatternConfig(nn.Linear)
    assert c.pattern is nn.Linear
    assert c.observation_type is ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    assert c.dtype_configs == []
    assert c.root_module is None
    assert c.fuser_method is None
    assert c._root_node_getter is None
    assert c._extra_inputs_getter is None
    assert c._num_tensor_args_to_observation_type == {}
    assert c._input_type_to_index == {}
    assert c._pattern_complex_format is None
    dc = DTypeConfig(input_dtype=QUINT8)
    assert c.add_dtype_config(dc) is c
    assert c.dtype_configs == [dc]
    c.set_dtype_configs([dc, dc])
    assert len(c.dtype_configs) == 2
    assert c.to_dict() == {
        "observation_type": ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT,
        "dtype_configs": [{"input_dtype": DTypeWithConstraints(dtype=torch.uint8)}] * 2,
        "pattern": nn.Linear,
    }


@pytest.mark.parametrize(
    ("pattern", "complex_form"),
    [
        (nn.Linear, nn.Linear),
        ("reshape", "reshape"),
        ((nn.Conv2d, nn.ReLU), (nn.ReLU, nn.Conv2d)),
        ((nn.Conv2d, nn.BatchNorm2d, nn.ReLU), (nn.ReLU, (nn.BatchNorm2d, nn.Conv2d))),
        (
            (nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.Dropout),
            (nn.Dropout, (nn.ReLU, (nn.BatchNorm2d, nn.Conv2d))),
        ),
        ((F.linear, F.relu, "add", operator.mul, torch.sigmoid), None),
    ],
)
def test_tuple_patterns_of_any_length(pattern: Any, complex_form: Any) -> None:
    c = BackendPatternConfig(pattern)
    if complex_form is None:  # five items, written out by hand
        complex_form = (torch.sigmoid, (operator.mul, ("add", (F.relu, F.linear))))
    assert c.complex_pattern == complex_form
    backend = BackendConfig().set_backend_pattern_config(c)
    assert list(backend._pattern_complex_format_to_config) == [complex_form]


def test_complex_pattern_with_match_all_node() -> None:
    pattern = (operator.add, (nn.ReLU, (nn.BatchNorm2d, nn.Conv2d)), MatchAllNode)
    c = BackendPatternConfig()._set_pattern_complex_format(pattern)
    assert c.pattern is None
    assert c._pattern_complex_format == pattern
    assert c.complex_pattern == pattern
    assert c.to_dict()["pattern_complex_format"] == pattern


@pytest.mark.parametrize(
    "bad", [3, (), (nn.Linear, 3), (nn.Linear, (nn.ReLU,)), nn.ReLU(), [nn.Linear]]
)
def test_bad_patterns_raise_an_error_of_both_families(bad: Any) -> None:
    with pytest.raises(QConfigPatternError, match=r"BackendPatternConfig.set_pattern: .*pattern"):
        BackendPatternConfig(bad)
    with pytest.raises(QConfigError):
        BackendPatternConfig(bad)
    with pytest.raises(PatternError):
        BackendPatternConfig(bad)


def test_bad_complex_pattern() -> None:
    with pytest.raises(QConfigPatternError, match=r"pattern_complex_format\[0\]: the first item"):
        BackendPatternConfig()._set_pattern_complex_format(((nn.ReLU, nn.Conv2d), nn.Linear))


def test_pattern_and_complex_pattern_are_exclusive() -> None:
    with pytest.raises(QConfigError, match="set either 'pattern' or 'pattern_complex_format'"):
        BackendPatternConfig(nn.Linear)._set_pattern_complex_format((nn.ReLU, nn.Linear))
    with pytest.raises(QConfigError, match="set either 'pattern' or 'pattern_complex_format'"):
        BackendPatternConfig()._set_pattern_complex_format((nn.ReLU, nn.Linear)).set_pattern(
            nn.Linear
        )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.set_observation_type(0), r"observation_type: expected an ObservationType"),
        (lambda c: c.set_observation_type("OUTPUT_SHARE_OBSERVER_WITH_INPUT"), r"ObservationType"),
        (
            lambda c: c.add_dtype_config({"input_dtype": torch.uint8}),
            r"dtype_configs\[0\]: expected a DTypeConfig",
        ),
        (lambda c: c.set_dtype_configs(DTypeConfig()), r"dtype_configs: expected a list"),
        (
            lambda c: c.set_root_module(nn.Linear(1, 1)),
            r"root_module: expected an nn.Module subclass",
        ),
        (lambda c: c.set_qat_module(F.linear), r"qat_module: expected an nn.Module subclass"),
        (lambda c: c.set_reference_quantized_module(int), r"reference_quantized_module: expected"),
        (
            lambda c: c.set_fused_module("ConvReLU2d"),
            r"fused_module: expected an nn.Module subclass",
        ),
        (lambda c: c.set_fuser_method("fuse"), r"fuser_method: expected a function"),
        (lambda c: c._set_root_node_getter(1), r"root_node_getter: expected a function"),
        (lambda c: c._set_extra_inputs_getter(1), r"extra_inputs_getter: expected a function"),
        (
            lambda c: c._set_num_tensor_args_to_observation_type(
                {"1": ObservationType.INPUT_OUTPUT_NOT_OBSERVED}
            ),
            r"num_tensor_args_to_observation_type: key '1' is not a non-negative int",
        ),
        (
            lambda c: c._set_num_tensor_args_to_observation_type({1: 2}),
            r"num_tensor_args_to_observation_type\[1\]: 2 is not an ObservationType",
        ),
        (
            lambda c: c._set_input_type_to_index({1: 1}),
            r"input_type_to_index: key 1 is not a string",
        ),
        (
            lambda c: c._set_input_type_to_index({"weight": -1}),
            r"input_type_to_index\['weight'\]: -1",
        ),
    ],
)
def test_pattern_config_setters_reject(call: Any, message: str) -> None:
    with pytest.raises(QConfigError, match=message):
        call(BackendPatternConfig(nn.Linear))


def test_pattern_config_from_dict_unknown_key() -> None:
    with pytest.raises(
        QConfigError,
        match=r"unknown key 'reference_quantized_module'; accepted keys are .*_module_for_root'",
    ):
        BackendPatternConfig.from_dict(
            {"pattern": nn.Linear, "reference_quantized_module": nn.Linear}
        )


def test_pattern_config_from_dict_names_bad_dtype_config_entry() -> None:
    with pytest.raises(
        QConfigError, match=r"dtype_configs\[1\]: DTypeConfig.from_dict: unknown key 'dtype'"
    ):
        BackendPatternConfig.from_dict(
            {"pattern": nn.Linear, "dtype_configs": [{"input_dtype": QUINT8}, {"dtype": QUINT8}]}
        )


# -- BackendConfig -----------------------------------------------------------------------------


def test_backend_config_overrides_by_complex_pattern_keeping_first_position() -> None:
    first = BackendPatternConfig((nn.Conv2d, nn.ReLU))
    other = BackendPatternConfig(nn.Linear)
    # Same pattern given in complex form: replaces `first`, as torch.ao keys by complex form.
    replacement = BackendPatternConfig()._set_pattern_complex_format((nn.ReLU, nn.Conv2d))
    b = BackendConfig("b").set_backend_pattern_configs([first, other, replacement])
    assert b.configs == [replacement, other]
    assert b.configs is not b.configs  # a fresh list each time
    assert b.name == "b"
    assert b.set_name("c").name == "c"


def test_backend_config_to_from_dict() -> None:
    linear = BackendPatternConfig(nn.Linear).add_dtype_config(DTypeConfig(input_dtype=QUINT8))
    b = BackendConfig("mine").set_backend_pattern_config(linear)
    d = b.to_dict()
    assert d == {"name": "mine", "configs": [linear.to_dict()]}
    again = BackendConfig.from_dict(d)
    assert again.to_dict() == d
    # from_dict takes config objects too
    assert BackendConfig.from_dict({"configs": [linear]}).configs == [linear]
    assert BackendConfig.from_dict({}).to_dict() == {"name": "", "configs": []}


@pytest.mark.parametrize(
    ("d", "message"),
    [
        (
            {"name": "x", "patterns": []},
            r"BackendConfig.from_dict: unknown key 'patterns'; accepted keys are 'name', 'configs'",
        ),
        (
            {"configs": [{"pattern": nn.Linear}, {"pattern": 5}]},
            r"configs\[1\]: BackendPatternConfig.set_pattern",
        ),
        (
            {"configs": [{"pattern": nn.Linear, "fuser_method": 3}]},
            r"configs\[0\]: BackendPatternConfig.fuser_method",
        ),
        (
            {"configs": [{"observation_type": ObservationType.INPUT_OUTPUT_NOT_OBSERVED}]},
            r"configs\[0\]: .*has no pattern",
        ),
        ({"configs": [3]}, r"configs\[0\]: expected a BackendPatternConfig or its dict"),
        ({"configs": {}}, r"'configs' must be a list"),
        ({"name": 3}, r"BackendConfig.name: expected a string"),
        ([], r"BackendConfig.from_dict: expected a dict"),
    ],
)
def test_backend_config_from_dict_rejects(d: Any, message: str) -> None:
    with pytest.raises(QConfigError, match=message):
        BackendConfig.from_dict(d)


def test_set_backend_pattern_config_needs_a_pattern_config() -> None:
    with pytest.raises(QConfigError, match="expected a BackendPatternConfig"):
        BackendConfig().set_backend_pattern_config(nn.Linear)  # type: ignore[arg-type]
    with pytest.raises(QConfigError, match=r"configs\[1\]: .*has no pattern"):
        BackendConfig().set_backend_pattern_configs(
            [BackendPatternConfig(nn.Linear), BackendPatternConfig()]
        )


# -- property-based round trips ----------------------------------------------------------------

_QUANT_DTYPES = [torch.uint8, torch.int8, torch.uint16, torch.int16, torch.int32]
_FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_positive = st.floats(min_value=1e-30, max_value=1e30, allow_nan=False, allow_infinity=False)


@st.composite
def dtype_with_constraints(draw: st.DrawFn) -> DTypeWithConstraints:
    dtype = draw(st.sampled_from([*_QUANT_DTYPES, *_FLOAT_DTYPES]))
    if dtype in _QUANT_DTYPES:
        info = torch.iinfo(dtype)
        lo, hi = int(info.min), int(info.max)
    else:
        lo, hi = -(2**40), 2**40
    qmin = draw(st.none() | st.integers(min_value=lo, max_value=0))
    qmax = draw(
        st.none() | st.integers(min_value=max(1, 0 if qmin is None else qmin + 1), max_value=hi)
    )
    smin = draw(st.none() | _positive)
    smax = draw(st.none() | _positive)
    if smin is not None and smax is not None and smin > smax:
        smin, smax = smax, smin
    return DTypeWithConstraints(
        dtype=dtype,
        quant_min_lower_bound=qmin,
        quant_max_upper_bound=qmax,
        scale_min_lower_bound=smin,
        scale_max_upper_bound=smax,
        scale_exact_match=draw(st.none() | _positive),
        zero_point_exact_match=draw(
            st.none() | st.integers(min_value=-(2**31), max_value=2**31 - 1)
        ),
    )


_dtype_or_constraints = (
    st.none() | st.sampled_from(_QUANT_DTYPES + _FLOAT_DTYPES) | dtype_with_constraints()
)


@st.composite
def dtype_configs(draw: st.DrawFn) -> DTypeConfig:
    return DTypeConfig(
        input_dtype=draw(_dtype_or_constraints),
        output_dtype=draw(_dtype_or_constraints),
        weight_dtype=draw(_dtype_or_constraints),
        bias_dtype=draw(st.none() | st.sampled_from([*_FLOAT_DTYPES, torch.int32])),
        is_dynamic=draw(st.none() | st.booleans()),
    )


@settings(max_examples=60, deadline=None)
@given(dtype_with_constraints())
def test_dtype_with_constraints_round_trips_through_its_fields(d: DTypeWithConstraints) -> None:
    fields = dict(d.__dict__)
    again = DTypeWithConstraints(**fields)
    assert again == d
    assert again.__dict__ == fields  # canonical values are a fixed point


@settings(max_examples=60, deadline=None)
@given(dtype_configs())
def test_dtype_config_round_trips_through_to_dict(c: DTypeConfig) -> None:
    d = c.to_dict()
    again = DTypeConfig.from_dict(d)
    assert again == c
    assert again.to_dict() == d
