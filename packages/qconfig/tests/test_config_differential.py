"""Configuration types against torch.ao 2.13 as the oracle (skipped once torch.ao is gone)."""

from __future__ import annotations

import functools
import itertools
import json
import operator
import sys
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("torch.ao.quantization")

import torch.ao.quantization as ao_q
import torch.ao.quantization.backend_config.utils
from torch.ao.quantization import backend_config as ao_bc
from torch.ao.quantization.backend_config.x86 import get_x86_backend_config
from torch.ao.quantization.fx import qconfig_mapping_utils as ao_utils
from torch.ao.quantization.utils import MatchAllNode as AoMatchAllNode

import quantbridge.qconfig as qb
from quantbridge.patterns import MatchAllNode

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(HERE))

import config_backend_helpers as helpers  # noqa: E402
from test_json import comparable  # noqa: E402

AO_GETTERS = {
    "native": ao_bc.get_native_backend_config,
    "fbgemm": ao_bc.get_fbgemm_backend_config,
    "x86": get_x86_backend_config,
    "qnnpack": ao_bc.get_qnnpack_backend_config,
    "onednn": ao_bc.get_onednn_backend_config,
    "executorch": ao_bc.get_executorch_backend_config,
    "tensorrt": ao_bc.get_tensorrt_backend_config,
}


def canon(value: Any) -> Any:
    """torch.ao's to_dict() values rewritten with our types (dtypes canonicalised by ours)."""
    if value is AoMatchAllNode:
        return MatchAllNode
    if isinstance(value, ao_bc.ObservationType):
        return qb.ObservationType[value.name]
    if isinstance(value, ao_bc.DTypeWithConstraints):
        return qb.DTypeWithConstraints(**{f.name: getattr(value, f.name) for f in fields(value)})
    if isinstance(value, dict):
        return {canon(k): canon(v) for k, v in value.items()}
    if isinstance(value, list):
        return [canon(v) for v in value]
    if isinstance(value, tuple):
        return tuple(canon(v) for v in value)
    return value


# -- native backend configs read back through from_dict ---------------------------------------


@pytest.mark.parametrize("name", sorted(AO_GETTERS))
def test_torch_ao_backend_configs_read_back_unchanged(name: str) -> None:
    ao_config = AO_GETTERS[name]()
    expected = canon(ao_config.to_dict())
    ours = qb.BackendConfig.from_dict(expected)
    assert ours.name == ao_config.name
    assert len(ours.configs) == len(ao_config.configs)
    assert ours.to_dict() == expected
    assert list(ours._pattern_complex_format_to_config) == [
        canon(k) for k in ao_config._pattern_complex_format_to_config
    ]


@pytest.mark.parametrize("name", sorted(AO_GETTERS))
def test_torch_ao_backend_configs_through_json(name: str) -> None:
    ours = qb.BackendConfig.from_dict(canon(AO_GETTERS[name]().to_dict()))
    closures = [
        i
        for i, c in enumerate(ours.configs)
        if c.fuser_method is not None and "<locals>" in c.fuser_method.__qualname__
    ]
    if closures:  # torch.ao builds most fuser methods as closures: no name to write
        with pytest.raises(
            qb.QConfigError,
            match=rf"^\$\.configs\[{closures[0]}\]\.fuser_method: .* has no importable",
        ):
            ours.to_json()
        for i in closures:
            ours.configs[i].set_fuser_method(None)
    # torch.ao's module-level fuser methods and node getters are written, but a file may not
    # call into torch: loading refuses them (patterns and module classes are data and load).
    text = ours.to_json()
    calls_torch = [
        i
        for i, c in enumerate(ours.configs)
        if c.fuser_method or c._root_node_getter or c._extra_inputs_getter
    ]
    if calls_torch:
        with pytest.raises(
            qb.QConfigError,
            match=rf"^\$\.configs\[{calls_torch[0]}\]\.\w+: refusing to call 'torch\.",
        ):
            qb.BackendConfig.from_json(text)
        for i in calls_torch:
            ours.configs[i].set_fuser_method(None)
            ours.configs[i]._set_root_node_getter(None)  # type: ignore[arg-type]
            ours.configs[i]._set_extra_inputs_getter(None)  # type: ignore[arg-type]
    loaded = qb.BackendConfig.from_json(ours.to_json())
    assert comparable(loaded.to_dict()) == comparable(ours.to_dict())


# -- the same calls in both libraries ----------------------------------------------------------


def _build(lib: Any, match_all: Any) -> Any:
    quint8, qint8 = getattr(torch, "quint8"), getattr(torch, "qint8")  # noqa: B009
    constrained = lib.DTypeWithConstraints(
        dtype=quint8,
        quant_min_lower_bound=0,
        quant_max_upper_bound=255,
        scale_min_lower_bound=2**-12,
        scale_max_upper_bound=1.0,
    )
    fixed = lib.DTypeWithConstraints(
        dtype=quint8, scale_exact_match=1.0 / 256.0, zero_point_exact_match=0
    )
    weighted = lib.DTypeConfig(
        input_dtype=constrained,
        output_dtype=constrained,
        weight_dtype=lib.DTypeWithConstraints(
            dtype=qint8, quant_min_lower_bound=-127, quant_max_upper_bound=127
        ),
        bias_dtype=torch.float,
    )
    dynamic = lib.DTypeConfig(
        input_dtype=quint8, output_dtype=torch.float, weight_dtype=qint8, is_dynamic=True
    )
    configs = [
        lib.BackendPatternConfig(nn.Linear)
        .add_dtype_config(weighted)
        .add_dtype_config(dynamic)
        .set_root_module(nn.Linear)
        .set_qat_module(helpers.QATConvReLU2dStandIn)
        .set_reference_quantized_module(helpers.ReferenceConv2dStandIn)
        ._set_input_type_to_index({"weight": 1, "bias": 2}),
        lib.BackendPatternConfig((nn.Conv2d, nn.ReLU))
        .set_fused_module(helpers.ConvReLU2dStandIn)
        .set_fuser_method(helpers.fuse_conv2d_relu),
        lib.BackendPatternConfig((nn.Conv2d, nn.BatchNorm2d, nn.ReLU)).set_dtype_configs(
            [weighted]
        ),
        lib.BackendPatternConfig()
        ._set_pattern_complex_format((nn.ReLU, (nn.BatchNorm2d, nn.Conv2d)))
        ._set_root_node_getter(helpers.root_node_getter),
        lib.BackendPatternConfig()
        ._set_pattern_complex_format((operator.add, (F.relu, match_all), match_all))
        ._set_extra_inputs_getter(helpers.extra_inputs_getter)
        ._set_num_tensor_args_to_observation_type(
            {
                0: lib.ObservationType.INPUT_OUTPUT_NOT_OBSERVED,
                1: lib.ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT,
            }
        ),
        lib.BackendPatternConfig("reshape").set_observation_type(
            lib.ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT
        ),
        lib.BackendPatternConfig(torch.sigmoid).add_dtype_config(lib.DTypeConfig(fixed, fixed)),
        # re-registering (Conv2d, ReLU) replaces the first entry in both libraries
        lib.BackendPatternConfig((nn.Conv2d, nn.ReLU)).add_dtype_config(weighted),
    ]
    return lib.BackendConfig("both").set_backend_pattern_configs(configs)


def test_same_calls_give_the_same_dicts_and_keys() -> None:
    theirs = _build(ao_bc, AoMatchAllNode)
    ours = _build(qb, MatchAllNode)
    assert ours.to_dict() == canon(theirs.to_dict())
    assert list(ours._pattern_complex_format_to_config) == [
        canon(k) for k in theirs._pattern_complex_format_to_config
    ]
    for our_config, their_config in zip(ours.configs, theirs.configs, strict=True):
        assert our_config.to_dict() == canon(their_config.to_dict())
        for dc_ours, dc_theirs in zip(
            our_config.dtype_configs, their_config.dtype_configs, strict=True
        ):
            assert dc_ours.to_dict() == canon(dc_theirs.to_dict())
            assert qb.DTypeConfig.from_dict(canon(dc_theirs.to_dict())) == dc_ours


def test_the_seed_tutorial_backend_against_torch_ao() -> None:
    """Seed 002's my_backend, built with torch.ao's modules in both libraries, and its JSON."""
    import torch.ao.nn.intrinsic as nni
    import torch.ao.nn.intrinsic.qat as nniqat
    import torch.ao.nn.qat as nnqat
    import torch.ao.nn.quantized.reference as nnqr

    def build(lib: Any) -> Any:
        quint8_with_constraints = lib.DTypeWithConstraints(
            dtype=getattr(torch, "quint8"),  # noqa: B009
            quant_min_lower_bound=0,
            quant_max_upper_bound=255,
            scale_min_lower_bound=2**-12,
        )
        weighted_int8_dtype_config = lib.DTypeConfig(
            input_dtype=quint8_with_constraints,
            output_dtype=quint8_with_constraints,
            weight_dtype=getattr(torch, "qint8"),  # noqa: B009
            bias_dtype=torch.float,
        )
        linear_config = (
            lib.BackendPatternConfig()
            .set_pattern(torch.nn.Linear)
            .set_observation_type(lib.ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
            .add_dtype_config(weighted_int8_dtype_config)
            .set_root_module(torch.nn.Linear)
            .set_qat_module(nnqat.Linear)
            .set_reference_quantized_module(nnqr.Linear)
        )
        conv_relu_config = (
            lib.BackendPatternConfig()
            .set_pattern((torch.nn.Conv2d, torch.nn.ReLU))
            .set_fused_module(nni.ConvReLU2d)
            .set_fuser_method(helpers.fuse_conv2d_relu)
        )
        fused_conv_relu_config = (
            lib.BackendPatternConfig()
            .set_pattern(nni.ConvReLU2d)
            .set_observation_type(lib.ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
            .add_dtype_config(weighted_int8_dtype_config)
            .set_root_module(torch.nn.Conv2d)
            .set_qat_module(nniqat.ConvReLU2d)
            .set_reference_quantized_module(nnqr.Conv2d)
        )
        return (
            lib.BackendConfig("my_backend")
            .set_backend_pattern_config(linear_config)
            .set_backend_pattern_config(conv_relu_config)
            .set_backend_pattern_config(fused_conv_relu_config)
        )

    theirs, ours = build(ao_bc), build(qb)
    assert ours.to_dict() == canon(theirs.to_dict())
    text = ours.to_json()
    document = json.loads(text)
    assert document["data"]["configs"][1]["fuser_method"] == {
        "$ref": "config_backend_helpers.fuse_conv2d_relu"
    }
    assert document["data"]["configs"][2]["pattern"] == {"$ref": "torch.ao.nn.intrinsic.ConvReLU2d"}
    loaded = qb.BackendConfig.from_json(text, allowed_prefixes=("config_backend_helpers",))
    assert loaded.to_dict() == canon(theirs.to_dict())
    fused = loaded.configs[1].fuser_method(False, nn.Conv2d(1, 1, 1), nn.ReLU())
    assert isinstance(fused, nni.ConvReLU2d)
    with pytest.raises(qb.QConfigError, match=r"^\$\.configs\[1\]\.fuser_method: refusing to call"):
        qb.BackendConfig.from_json(text)


# -- QConfig and qconfig_equals ----------------------------------------------------------------


def test_qconfig_rejects_instances_like_torch_ao() -> None:
    with pytest.raises(ValueError, match="observer instance"):
        ao_q.QConfig(activation=ao_q.MinMaxObserver(), weight=ao_q.default_weight_observer)
    with pytest.raises(ValueError, match="observer instance"):
        qb.QConfig(activation=qb.MinMaxObserver(), weight=qb.default_weight_observer)


_AO_CONSTRUCTORS = [
    ao_q.default_observer,
    ao_q.default_weight_observer,
    ao_q.MinMaxObserver,
    ao_q.MinMaxObserver.with_args(quant_min=0, quant_max=127),
    ao_q.MinMaxObserver.with_args(quant_min=0, quant_max=127),
    ao_q.MinMaxObserver.with_args(quant_min=0, quant_max=255),
    ao_q.default_fake_quant,
    ao_q.FakeQuantize.with_args(
        observer=ao_q.MovingAverageMinMaxObserver, quant_min=0, quant_max=255
    ),
    ao_q.FakeQuantize.with_args(
        observer=ao_q.MovingAverageMinMaxObserver.with_args(averaging_constant=0.5)
    ),
    ao_q.FakeQuantize.with_args(
        observer=ao_q.MovingAverageMinMaxObserver.with_args(averaging_constant=0.5)
    ),
    ao_q.default_per_channel_weight_observer,
]


@pytest.mark.parametrize(
    ("i", "j"), list(itertools.product(range(len(_AO_CONSTRUCTORS)), repeat=2))
)
def test_qconfig_equals_agrees_with_torch_ao(i: int, j: int) -> None:
    a, b = _AO_CONSTRUCTORS[i], _AO_CONSTRUCTORS[j]
    q1 = ao_q.QConfig(activation=a, weight=ao_q.default_weight_observer)
    q2 = ao_q.QConfig(activation=b, weight=ao_q.default_weight_observer)
    assert qb.qconfig_equals(q1, q2) == ao_q.qconfig_equals(q1, q2)


# -- QConfigMapping against torch.ao's resolution ----------------------------------------------

# Distinct qconfigs told apart by identity (functools.partial of torch.nn.Identity).
_Q = [qb.QConfig(functools.partial(nn.Identity, i), nn.Identity) for i in range(12)]
MODULE_NAMES = [
    "",
    "a",
    "a.b",
    "a.b.c",
    "a.b.c.d",
    "ab",
    "foo",
    "foo.bar",
    "foo.bar.conv1",
    "x.foo",
]
MODULE_TYPES = [nn.Linear, nn.Conv2d, nn.Sequential, nn.ReLU]
FUNCTIONS = [F.linear, F.relu, operator.add]
METHODS = ["reshape", "relu"]
INDICES = [0, 1, 2]


def _mapping(cls: Any) -> Any:
    return (
        cls()
        .set_global(_Q[0])
        .set_object_type(nn.Linear, _Q[1])
        .set_object_type(F.linear, _Q[2])
        .set_object_type(nn.Sequential, _Q[3])
        .set_object_type(nn.Conv2d, None)
        .set_object_type("reshape", _Q[4])
        .set_module_name_regex("foo.*bar.*conv[0-9]+", _Q[5])
        .set_module_name_regex("foo.*", _Q[6])
        .set_module_name_regex("a\\.b", _Q[7])
        .set_module_name("a", _Q[8])
        .set_module_name("a.b.c", _Q[9])
        .set_module_name_object_type_order("a.b", nn.Linear, 1, _Q[10])
        .set_module_name_object_type_order("foo.bar", F.linear, 0, _Q[11])
        .set_module_name_object_type_order("", operator.add, 2, _Q[10])
        .set_module_name_object_type_order("a.b.c", nn.Conv2d, 0, _Q[11])
    )


def test_mapping_dict_form_matches_torch_ao() -> None:
    theirs, ours = _mapping(ao_q.QConfigMapping), _mapping(qb.QConfigMapping)
    assert ours.to_dict() == theirs.to_dict()
    assert qb.QConfigMapping.from_dict(theirs.to_dict()).to_dict() == theirs.to_dict()
    assert ao_q.QConfigMapping.from_dict(ours.to_dict()).to_dict() == ours.to_dict()


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _ao_call_module(m: Any, name: str, module_type: Any, index: int) -> Any:
    q = ao_utils._maybe_adjust_qconfig_for_module_type_or_name(
        m, module_type, name, m.global_qconfig
    )
    return ao_utils._maybe_adjust_qconfig_for_module_name_object_type_order(
        m, _parent(name), module_type, index, q
    )


def _ao_call_function(m: Any, scope: str, scope_type: Any, target: Any, index: int) -> Any:
    q = ao_utils._get_object_type_qconfig(m, target, m.global_qconfig)
    q = ao_utils._maybe_adjust_qconfig_for_module_type_or_name(m, scope_type, scope, q)
    return ao_utils._maybe_adjust_qconfig_for_module_name_object_type_order(
        m, scope, target, index, q
    )


def _ao_call_method(m: Any, scope: str, scope_type: Any, target: str) -> Any:
    q = ao_utils._maybe_adjust_qconfig_for_module_type_or_name(m, target, scope, m.global_qconfig)
    return ao_utils._maybe_adjust_qconfig_for_module_type_or_name(m, scope_type, scope, q)


def test_precedence_grid_matches_torch_ao() -> None:
    theirs, ours = _mapping(ao_q.QConfigMapping), _mapping(qb.QConfigMapping)
    checked = SimpleNamespace(module=0, function=0, method=0)
    rules_seen = set()
    for name, module_type, index in itertools.product(MODULE_NAMES, MODULE_TYPES, INDICES):
        expected = _ao_call_module(theirs, name, module_type, index)
        got = ours.qconfig_for(name, module_type, index, order_module_name=_parent(name))
        assert got.qconfig is expected, (name, module_type, index, got)
        rules_seen.add(got.rule)
        checked.module += 1
    for scope, scope_type, target, index in itertools.product(
        MODULE_NAMES, MODULE_TYPES, FUNCTIONS, INDICES
    ):
        expected = _ao_call_function(theirs, scope, scope_type, target, index)
        got = ours.qconfig_for(scope, target, index, scope_type=scope_type)
        assert got.qconfig is expected, (scope, scope_type, target, index, got)
        rules_seen.add(got.rule)
        checked.function += 1
    for scope, scope_type, target in itertools.product(MODULE_NAMES, MODULE_TYPES, METHODS):
        expected = _ao_call_method(theirs, scope, scope_type, target)
        got = ours.qconfig_for(scope, target, scope_type=scope_type)
        assert got.qconfig is expected, (scope, scope_type, target, got)
        rules_seen.add(got.rule)
        checked.method += 1
    assert (checked.module, checked.function, checked.method) == (120, 360, 80)
    # the grid exercises every rule, so the comparison covers every precedence step
    assert rules_seen == {
        "global",
        "object_type",
        "module_name_regex",
        "module_name",
        "module_name_object_type_order",
    }


def test_rule_reported_is_the_one_that_holds_the_qconfig() -> None:
    ours = _mapping(qb.QConfigMapping)
    tables = {
        "object_type": ours.object_type_qconfigs,
        "module_name_regex": ours.module_name_regex_qconfigs,
        "module_name": ours.module_name_qconfigs,
        "module_name_object_type_order": ours.module_name_object_type_order_qconfigs,
    }
    for scope, scope_type, target, index in itertools.product(
        MODULE_NAMES, MODULE_TYPES, FUNCTIONS, INDICES
    ):
        got = ours.qconfig_for(scope, target, index, scope_type=scope_type)
        if got.rule == "global":
            assert got.qconfig is ours.global_qconfig
        else:
            assert tables[got.rule][got.key] is got.qconfig
