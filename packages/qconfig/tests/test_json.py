"""to_json / from_json: qualified names, exact values, and allow-listed loading."""

from __future__ import annotations

import functools
import io
import json
import math
import operator
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from torch import nn

from quantbridge.patterns import MatchAllNode
from quantbridge.qconfig import (
    BackendConfig,
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    FakeQuantize,
    MinMaxObserver,
    ObservationType,
    PerChannelMinMaxObserver,
    QConfig,
    QConfigError,
    QConfigMapping,
    default_weight_observer,
    get_default_qat_qconfig_mapping,
    get_default_qconfig_mapping,
    qconfig_equals,
)
from quantbridge.qconfig._dtypes import QScheme

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(HERE))

import config_backend_helpers as helpers  # noqa: E402
from test_backend_config import dtype_configs  # noqa: E402

ALLOW = ("config_backend_helpers",)
QUINT8 = getattr(torch, "quint8", torch.uint8)
QINT8 = getattr(torch, "qint8", torch.int8)


def comparable(value: Any) -> Any:
    """to_dict() output with partials and factories made comparable by value."""
    partial = getattr(value, "p", None)
    if isinstance(partial, functools.partial):
        value = partial
    if isinstance(value, functools.partial):
        return ("partial", value.func, comparable(value.args), comparable(value.keywords))
    if isinstance(value, QConfig):
        return ("qconfig", comparable(value.activation), comparable(value.weight))
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    if isinstance(value, tuple):
        return tuple(comparable(v) for v in value)
    return value


def every_feature_backend() -> BackendConfig:
    constrained = DTypeWithConstraints(
        dtype=QUINT8,
        quant_min_lower_bound=0,
        quant_max_upper_bound=127,
        scale_min_lower_bound=2**-12,
        scale_max_upper_bound=0.1 + 0.2,  # not exactly representable: checks exact floats
    )
    fixed = DTypeWithConstraints(
        dtype=QUINT8, scale_exact_match=1.0 / 256.0, zero_point_exact_match=0
    )
    weighted = DTypeConfig(
        input_dtype=constrained,
        output_dtype=constrained,
        weight_dtype=DTypeWithConstraints(
            dtype=QINT8, quant_min_lower_bound=-127, quant_max_upper_bound=127
        ),
        bias_dtype=torch.float,
    )
    four_bit = DTypeConfig(
        input_dtype=torch.float,
        output_dtype=torch.float,
        weight_dtype=getattr(torch, "quint4x2", torch.uint8),
        is_dynamic=True,
    )
    return BackendConfig("every_feature").set_backend_pattern_configs(
        [
            BackendPatternConfig(nn.Linear)
            .add_dtype_config(weighted)
            .add_dtype_config(four_bit)
            .set_root_module(nn.Linear)
            .set_qat_module(helpers.QATConvReLU2dStandIn)
            .set_reference_quantized_module(helpers.ReferenceConv2dStandIn)
            ._set_input_type_to_index({"weight": 1, "bias": 2}),
            BackendPatternConfig((nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.Dropout))
            .set_fused_module(helpers.ConvReLU2dStandIn)
            .set_fuser_method(helpers.fuse_four),
            BackendPatternConfig()
            ._set_pattern_complex_format((nn.ReLU, (nn.BatchNorm2d, nn.Conv2d)))
            ._set_root_node_getter(helpers.root_node_getter),
            BackendPatternConfig()
            ._set_pattern_complex_format((operator.add, (F.relu, MatchAllNode), MatchAllNode))
            ._set_extra_inputs_getter(helpers.extra_inputs_getter)
            ._set_num_tensor_args_to_observation_type(
                {
                    0: ObservationType.INPUT_OUTPUT_NOT_OBSERVED,
                    1: ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT,
                    2: ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT,
                }
            ),
            BackendPatternConfig("reshape").set_observation_type(
                ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT
            ),
            BackendPatternConfig(torch.sigmoid).add_dtype_config(DTypeConfig(fixed, fixed)),
            BackendPatternConfig(torch.ops.aten.relu.default),
            BackendPatternConfig(torch.Tensor.add),
            BackendPatternConfig(F.max_pool2d),
        ]
    )


def test_every_feature_backend_round_trips(tmp_path: Path) -> None:
    backend = every_feature_backend()
    text = backend.to_json()
    loaded = BackendConfig.from_json(text, allowed_prefixes=ALLOW)
    assert comparable(loaded.to_dict()) == comparable(backend.to_dict())
    assert list(loaded._pattern_complex_format_to_config) == list(
        backend._pattern_complex_format_to_config
    )
    # the same through a path, a str path and open files
    path = tmp_path / "backend.json"
    assert backend.to_json(path) == text
    for source in (path, str(path)):
        again = BackendConfig.from_json(source, allowed_prefixes=ALLOW)
        assert comparable(again.to_dict()) == comparable(backend.to_dict())
    buffer = io.StringIO()
    backend.to_json(buffer)
    buffer.seek(0)
    assert buffer.getvalue() == text
    again = BackendConfig.from_json(buffer, allowed_prefixes=ALLOW)
    assert comparable(again.to_dict()) == comparable(backend.to_dict())
    # exact floats: the non-representable 0.1 + 0.2 survives bit for bit
    bound = loaded.configs[0].dtype_configs[0].input_dtype_with_constraints.scale_max_upper_bound
    assert bound == 0.30000000000000004


def test_json_spells_out_qualified_names_and_keeps_method_strings() -> None:
    document = json.loads(every_feature_backend().to_json())
    assert document["format"] == "quantbridge.qconfig"
    assert document["format_version"] == 1
    assert document["type"] == "BackendConfig"
    configs = document["data"]["configs"]
    assert configs[0]["pattern"] == {"$ref": "torch.nn.Linear"}
    assert configs[1]["fuser_method"] == {"$ref": "config_backend_helpers.fuse_four"}
    assert configs[2]["root_node_getter"] == {"$ref": "config_backend_helpers.root_node_getter"}
    assert configs[3]["pattern_complex_format"] == {
        "$tuple": [
            {"$ref": "operator.add"},
            {
                "$tuple": [
                    {"$ref": "torch.nn.functional.relu"},
                    {"$ref": "quantbridge.patterns.MatchAllNode"},
                ]
            },
            {"$ref": "quantbridge.patterns.MatchAllNode"},
        ]
    }
    assert configs[4]["pattern"] == "reshape"  # a method name stays a plain string
    assert configs[4]["observation_type"] == {
        "$observation_type": "OUTPUT_SHARE_OBSERVER_WITH_INPUT"
    }
    assert configs[5]["dtype_configs"][0]["input_dtype"] == {
        "$dtype_with_constraints": {
            "dtype": {"$dtype": "torch.uint8"},
            "scale_exact_match": 0.00390625,
            "zero_point_exact_match": 0,
        }
    }
    assert configs[6]["pattern"] == {"$ref": "torch.ops.aten.relu.default"}
    assert configs[7]["pattern"] == {"$ref": "torch.Tensor.add"}
    assert configs[8]["pattern"] == {"$ref": "torch.nn.functional.max_pool2d"}
    four_bit_weight = configs[0]["dtype_configs"][1]["weight_dtype"]["$dtype_with_constraints"]
    if hasattr(torch, "quint4x2"):
        assert four_bit_weight == {
            "dtype": {"$dtype": "torch.uint8"},
            "quant_min_lower_bound": 0,
            "quant_max_upper_bound": 15,
        }


def test_tutorial_backend_round_trips_with_its_fuser_allowed() -> None:
    """The seed tutorial's my_backend, with stand-ins for torch.ao's fused/QAT modules."""
    quint8_with_constraints = DTypeWithConstraints(
        dtype=QUINT8,
        quant_min_lower_bound=0,
        quant_max_upper_bound=255,
        scale_min_lower_bound=2**-12,
    )
    weighted_int8 = DTypeConfig(
        input_dtype=quint8_with_constraints,
        output_dtype=quint8_with_constraints,
        weight_dtype=QINT8,
        bias_dtype=torch.float,
    )
    backend = (
        BackendConfig("my_backend")
        .set_backend_pattern_config(
            BackendPatternConfig()
            .set_pattern(nn.Linear)
            .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
            .add_dtype_config(weighted_int8)
            .set_root_module(nn.Linear)
            .set_reference_quantized_module(helpers.ReferenceConv2dStandIn)
        )
        .set_backend_pattern_config(
            BackendPatternConfig()
            .set_pattern((nn.Conv2d, nn.ReLU))
            .set_fused_module(helpers.ConvReLU2dStandIn)
            .set_fuser_method(helpers.fuse_conv2d_relu)
        )
    )
    text = backend.to_json()
    loaded = BackendConfig.from_json(text, allowed_prefixes=ALLOW)
    assert loaded.name == "my_backend"
    assert loaded.configs[1].fuser_method is helpers.fuse_conv2d_relu
    assert comparable(loaded.to_dict()) == comparable(backend.to_dict())
    with pytest.raises(QConfigError) as info:
        BackendConfig.from_json(text)
    message = str(info.value)
    assert "configs[0].reference_quantized_module_for_root" in message
    assert "'config_backend_helpers.ReferenceConv2dStandIn'" in message
    assert "allowed_prefixes" in message


def test_disallowed_name_is_named_by_its_json_path() -> None:
    document = json.loads(every_feature_backend().to_json())
    with pytest.raises(QConfigError, match=r"^\$\.configs\[0\]\.qat_module: refusing to load"):
        BackendConfig.from_json(json.dumps(document))
    del document["data"]["configs"][0]["qat_module"]
    del document["data"]["configs"][0]["reference_quantized_module_for_root"]
    del document["data"]["configs"][1]["fused_module"]
    with pytest.raises(
        QConfigError,
        match=r"^\$\.configs\[1\]\.fuser_method: refusing to call 'config_backend_helpers",
    ):
        BackendConfig.from_json(json.dumps(document))


def _backend_document(fuser: str) -> str:
    return json.dumps(
        {
            "format": "quantbridge.qconfig",
            "format_version": 1,
            "type": "BackendConfig",
            "data": {
                "name": "evil",
                "configs": [
                    {"pattern": {"$ref": "torch.nn.Linear"}},
                    {
                        "pattern": {
                            "$tuple": [{"$ref": "torch.nn.Conv2d"}, {"$ref": "torch.nn.ReLU"}]
                        },
                        "fuser_method": {"$ref": fuser},
                    },
                ],
            },
        }
    )


_CALL_REFUSED = "refusing to call '{}' as a function or class: a config file may only call"


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("os.system", _CALL_REFUSED),
        ("subprocess.Popen", _CALL_REFUSED),
        ("builtins.eval", _CALL_REFUSED),
        ("torch.os.system", _CALL_REFUSED),  # reachable by getattr from torch: still refused
        ("torch.nn.functional.relu", _CALL_REFUSED),  # a pattern operator, not a fuser
        ("config_backend_helpers_evil.fuse", _CALL_REFUSED),  # prefixes match whole components
        ("quantbridge.qconfig.QConfig", "refusing to call 'quantbridge.qconfig.QConfig'"),
        ("torch.nn.Module.__init__.__globals__", "refusing to load '{}': names with dunder"),
        ("operator.__builtins__", "refusing to load '{}': names with dunder"),
    ],
)
def test_names_outside_the_registry_are_refused_as_callables(name: str, what: str) -> None:
    message = "^" + re.escape("$.configs[1].fuser_method: " + what.format(name))
    with pytest.raises(QConfigError, match=message):
        BackendConfig.from_json(_backend_document(name), allowed_prefixes=ALLOW)


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("os.system", "refusing to load 'os.system': a pattern comes from ['torch', 'operator'"),
        ("torch.os.system", "refusing to load 'torch.os.system': it passes through module 'os'"),
        (
            "torch.nn.functional.Callable",
            "refusing to load 'torch.nn.functional.Callable': its defining module "
            "'collections.abc'",
        ),
        ("torch.nn", "'torch.nn' is a module; a pattern names a module class, a function"),
        ("torch.float32", "'torch.float32' is a dtype; a pattern names"),
    ],
)
def test_names_outside_the_data_namespaces_are_refused_as_patterns(name: str, what: str) -> None:
    document = json.loads(_backend_document("quantbridge.fx_quant.nn.intrinsic.ConvReLU2d"))
    document["data"]["configs"][0]["pattern"] = {"$ref": name}
    del document["data"]["configs"][1]
    with pytest.raises(QConfigError, match="^" + re.escape("$.configs[0].pattern: " + what)):
        BackendConfig.from_json(json.dumps(document), allowed_prefixes=ALLOW)


def test_refused_modules_are_never_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A module that would record its import; it is on sys.path but must stay unimported.
    (tmp_path / "qb_json_canary.py").write_text("import os\nos.environ['QB_JSON_CANARY'] = '1'\n")
    (tmp_path / "qb_json_pkg").mkdir()
    (tmp_path / "qb_json_pkg" / "__init__.py").write_text("IMPORTED = True\n")
    (tmp_path / "qb_json_pkg" / "sub.py").write_text("def fuse(*a): return a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("QB_JSON_CANARY", raising=False)
    had_subprocess = "subprocess" in sys.modules
    for name in ("qb_json_canary.fuse", "subprocess.Popen", "qb_json_pkg.sub.fuse"):
        with pytest.raises(QConfigError, match="refusing to call"):
            BackendConfig.from_json(_backend_document(name), allowed_prefixes=ALLOW)
    assert "qb_json_canary" not in sys.modules
    assert "QB_JSON_CANARY" not in __import__("os").environ
    assert "qb_json_pkg" not in sys.modules
    assert ("subprocess" in sys.modules) == had_subprocess
    # Allowing only the subpackage imports it (and, as Python must, its parent), nothing else.
    loaded = BackendConfig.from_json(
        _backend_document("qb_json_pkg.sub.fuse"), allowed_prefixes=("qb_json_pkg.sub",)
    )
    assert loaded.configs[1].fuser_method is sys.modules["qb_json_pkg.sub"].fuse
    assert "qb_json_canary" not in sys.modules


@pytest.mark.parametrize(
    ("fuser", "message"),
    [
        (
            lambda is_qat, a, b: a,
            r"configs\[0\]\.fuser_method: <function .*<lambda>.* has no importable",
        ),
        (
            helpers.make_local_function(),
            r"configs\[0\]\.fuser_method: .*local_fuser.* has no importable",
        ),
    ],
)
def test_unnamed_objects_fail_at_to_json_naming_the_field(fuser: Any, message: str) -> None:
    backend = BackendConfig().set_backend_pattern_config(
        BackendPatternConfig((nn.Conv2d, nn.ReLU)).set_fuser_method(fuser)
    )
    with pytest.raises(QConfigError, match=message):
        backend.to_json()


# -- QConfigMapping ----------------------------------------------------------------------------


def _tutorial_mapping() -> QConfigMapping:
    activation = MinMaxObserver.with_args(quant_min=0, quant_max=127, eps=2**-12)
    qconfig = QConfig(activation=activation, weight=default_weight_observer)
    return (
        QConfigMapping()
        .set_object_type(nn.Linear, qconfig)
        .set_object_type(nn.Conv2d, qconfig)
        .set_object_type(nn.BatchNorm2d, qconfig)
        .set_object_type(nn.ReLU, qconfig)
    )


def test_tutorial_mapping_round_trips_with_real_observers() -> None:
    mapping = _tutorial_mapping().set_module_name("features.0", None)
    text = mapping.to_json()
    document = json.loads(text)
    assert document["type"] == "QConfigMapping"
    first = document["data"]["object_type"][0]["$tuple"]
    assert first[0] == {"$ref": "torch.nn.Linear"}
    assert first[1]["$qconfig"]["activation"] == {
        "$with_args": {
            "class": "quantbridge.qconfig.MinMaxObserver",
            "kwargs": {"quant_min": 0, "quant_max": 127, "eps": 0.000244140625},
        }
    }
    loaded = QConfigMapping.from_json(text)
    assert comparable(loaded.to_dict()) == comparable(mapping.to_dict())
    observer = loaded.object_type_qconfigs[nn.Linear].activation()  # type: ignore[union-attr]
    assert isinstance(observer, MinMaxObserver)
    assert (observer.quant_min, observer.quant_max, float(observer.eps)) == (0, 127, 2**-12)


@pytest.mark.parametrize(
    "make",
    [
        lambda: get_default_qconfig_mapping("x86"),
        lambda: get_default_qconfig_mapping("qnnpack"),
        lambda: get_default_qat_qconfig_mapping("fbgemm"),
    ],
)
def test_default_mappings_round_trip(make: Any) -> None:
    mapping = make()
    loaded = QConfigMapping.from_json(mapping.to_json())
    assert comparable(loaded.to_dict()) == comparable(mapping.to_dict())
    for (k1, q1), (k2, q2) in zip(
        mapping.object_type_qconfigs.items(), loaded.object_type_qconfigs.items(), strict=True
    ):
        assert k1 == k2
        assert qconfig_equals(q1, q2)


def test_observer_arguments_keep_dtypes_qschemes_and_exact_floats() -> None:
    fq = FakeQuantize.with_args(
        observer=PerChannelMinMaxObserver.with_args(
            dtype=QINT8, qscheme=QScheme.PER_CHANNEL_SYMMETRIC, ch_axis=0
        ),
        quant_min=-127,
        quant_max=127,
    )
    odd = functools.partial(helpers.DummyObserver, eps=0.1 + 0.2, quant_max=None)
    mapping = QConfigMapping().set_global(QConfig(activation=odd, weight=fq))
    text = mapping.to_json()
    weight = json.loads(text)["data"][""]["$qconfig"]["weight"]["$with_args"]
    assert weight["class"] == "quantbridge.qconfig.FakeQuantize"
    inner = weight["kwargs"]["observer"]["$with_args"]
    assert inner["class"] == "quantbridge.qconfig.PerChannelMinMaxObserver"
    assert inner["kwargs"]["dtype"] == {"$dtype": str(QINT8)}
    assert inner["kwargs"]["qscheme"] == {"$qscheme": "per_channel_symmetric"}
    loaded = QConfigMapping.from_json(text, allowed_prefixes=ALLOW)
    q = loaded.global_qconfig
    assert q is not None
    assert qconfig_equals(q, mapping.global_qconfig)
    assert q.activation.keywords["eps"] == 0.30000000000000004  # type: ignore[attr-defined]
    assert q.weight.p.keywords["observer"].p.keywords["dtype"] is QINT8  # type: ignore[attr-defined]


def test_torch_qscheme_objects_load_as_qscheme() -> None:
    qscheme = getattr(torch, "per_tensor_symmetric", None)
    if qscheme is None:
        pytest.skip("torch has no qscheme objects any more")
    mapping = QConfigMapping().set_global(
        QConfig(functools.partial(helpers.DummyObserver, qscheme=qscheme), helpers.DummyObserver)
    )
    loaded = QConfigMapping.from_json(mapping.to_json(), allowed_prefixes=ALLOW)
    assert loaded.global_qconfig.activation.keywords["qscheme"] is QScheme.PER_TENSOR_SYMMETRIC  # type: ignore[union-attr]


def test_qconfig_with_a_none_field_round_trips() -> None:
    mapping = QConfigMapping().set_object_type(
        "relu",
        QConfig(activation=MinMaxObserver.with_args(quant_min=0, quant_max=127), weight=None),
    )
    text = mapping.to_json()
    assert json.loads(text)["data"]["object_type"][0]["$tuple"][1]["$qconfig"]["weight"] is None
    loaded = QConfigMapping.from_json(text)
    q = loaded.object_type_qconfigs["relu"]
    assert q is not None
    assert q.weight is None
    assert qconfig_equals(q, mapping.object_type_qconfigs["relu"])


def test_non_finite_floats_are_tagged() -> None:
    odd = functools.partial(helpers.DummyObserver, eps=math.inf, quant_min=None)
    mapping = QConfigMapping().set_global(QConfig(odd, odd))
    text = mapping.to_json()
    assert '"$float": "inf"' in text
    loaded = QConfigMapping.from_json(text, allowed_prefixes=ALLOW)
    assert loaded.global_qconfig.activation.keywords["eps"] == math.inf  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("activation", "message"),
    [
        (
            MinMaxObserver.with_callable_args(eps=lambda: 1e-5),
            r"^\$\[\"\"\]\.activation: .*callable_args \['eps'\].* cannot be written",
        ),
        (
            functools.partial(helpers.DummyObserver, eps=torch.tensor(1.0)),
            r'^\$\[""\]\.activation\.kwargs\.eps: tensors cannot be written',
        ),
        (
            functools.partial(helpers.DummyObserver, observer=object()),
            r'^\$\[""\]\.activation\.kwargs\.observer: cannot write <object',
        ),
    ],
)
def test_unserialisable_observer_arguments(activation: Any, message: str) -> None:
    mapping = QConfigMapping().set_global(QConfig(activation, helpers.DummyObserver))
    with pytest.raises(QConfigError, match=message):
        mapping.to_json()


# -- documents and other errors ----------------------------------------------------------------


def _doc(**changes: Any) -> str:
    base: dict[str, Any] = {
        "format": "quantbridge.qconfig",
        "format_version": 1,
        "type": "QConfigMapping",
        "data": {},
    }
    base.update(changes)
    return json.dumps({k: v for k, v in base.items() if v is not None})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (_doc(format_version=2), r"format_version 2 is not supported; .* reads format_version 1"),
        (_doc(format_version=None), r"not a quantbridge.qconfig document"),
        (_doc(type="BackendConfig"), r"holds a 'BackendConfig', not a 'QConfigMapping'"),
        (_doc(extra=1), r"unknown top-level keys \['extra'\]"),
        (_doc(data={"global": None}), r"unknown key 'global'"),
        (
            _doc(data={"": {"$qconfig": {"activation": {"$ref": "torch.nn.Identity"}}}}),
            r"exactly the keys",
        ),
        (_doc(data={"": {"$bogus": 1}}), r"^: unknown tag '\$bogus'|unknown tag '\$bogus'"),
        (
            _doc(data={"object_type": [{"$tuple": [{"$ref": "torch.nn.Nope"}, None]}]}),
            r"object_type\[0\]\[0\]: 'torch.nn.Nope' does not exist",
        ),
        (
            _doc(data={"object_type": [{"$tuple": [{"$ref": "torch..x"}, None]}]}),
            r"is not a dotted Python name",
        ),
        ('{"format": ', r"not valid JSON"),
        ("[1, 2]", r"cannot read|must be a JSON object"),
    ],
)
def test_bad_documents(text: str, message: str) -> None:
    with pytest.raises(QConfigError, match=message):
        QConfigMapping.from_json(text)


def test_missing_file_and_bad_prefixes(tmp_path: Path) -> None:
    with pytest.raises(QConfigError, match=r"cannot read .*nope.json"):
        QConfigMapping.from_json(tmp_path / "nope.json")
    with pytest.raises(
        QConfigError, match=r"allowed_prefixes must be a tuple .* write \('my_backend',\)"
    ):
        QConfigMapping.from_json(_doc(), allowed_prefixes="my_backend")  # type: ignore[arg-type]
    with pytest.raises(QConfigError, match=r"must be a tuple of module prefixes such as"):
        QConfigMapping.from_json(_doc(), allowed_prefixes=None)  # type: ignore[arg-type]
    with pytest.raises(QConfigError, match=r"allowed_prefixes: 'my backend' is not a dotted"):
        QConfigMapping.from_json(_doc(), allowed_prefixes=("my backend",))


def test_bad_values_name_their_path() -> None:
    doc = json.loads(every_feature_backend().to_json())
    doc["data"]["configs"][0]["dtype_configs"][0]["input_dtype"]["$dtype_with_constraints"][
        "quant_min_lower_bound"
    ] = 5
    with pytest.raises(
        QConfigError,
        match=r"configs\[0\]\.dtype_configs\[0\]\.input_dtype: .*_lower_bound: 5 excludes 0",
    ):
        BackendConfig.from_json(json.dumps(doc), allowed_prefixes=ALLOW)
    doc = json.loads(every_feature_backend().to_json())
    doc["data"]["configs"][4]["observation_type"] = {"$observation_type": "SOMETIMES"}
    with pytest.raises(
        QConfigError, match=r"configs\[4\]\.observation_type: 'SOMETIMES' is not an"
    ):
        BackendConfig.from_json(json.dumps(doc), allowed_prefixes=ALLOW)
    doc["data"]["configs"][4]["observation_type"] = {"$dtype": "torch.nothing"}
    with pytest.raises(
        QConfigError, match=r"configs\[4\]\.observation_type: 'torch.nothing' is not"
    ):
        BackendConfig.from_json(json.dumps(doc), allowed_prefixes=ALLOW)


def test_pattern_config_and_dtype_config_have_json_too() -> None:
    pattern_config = every_feature_backend().configs[3]
    loaded = BackendPatternConfig.from_json(pattern_config.to_json(), allowed_prefixes=ALLOW)
    assert comparable(loaded.to_dict()) == comparable(pattern_config.to_dict())
    dtype_config = every_feature_backend().configs[0].dtype_configs[0]
    assert DTypeConfig.from_json(dtype_config.to_json()) == dtype_config


@settings(max_examples=60, deadline=None)
@given(dtype_configs())
def test_dtype_config_json_round_trip(c: DTypeConfig) -> None:
    text = c.to_json(indent=None)
    again = DTypeConfig.from_json(text)
    assert again == c
    assert again.to_json(indent=None) == text


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"": {"$float": "1e400"}}, r"expected 'inf', '-inf' or 'nan', got '1e400'"),
        ({"": {"$dict": [[1]]}}, r"expected a \[key, value\] pair, got \[1\]"),
        ({"": {"$tuple": {"a": 1}}}, r"expected an array"),
        (
            {"object_type": [{"$tuple": ["relu", {"$qconfig": {"activation": 1, "weight": 2}}]}]},
            r"^\$\.object_type\[0\]\[1\]\.activation: 1 does not build an observer",
        ),
        (
            {
                "": {
                    "$qconfig": {
                        "activation": {"$with_args": {"class": "torch.nn.Identity"}},
                        "weight": {"$ref": "torch.nn.Identity"},
                    }
                }
            },
            r"^\$\[\"\"\]\.activation\.\$with_args\.class: refusing to call 'torch.nn.Identity'",
        ),
        (
            {
                "": {
                    "$qconfig": {
                        "activation": {"$partial": {"func": "os.getcwd"}},
                        "weight": {"$ref": "torch.nn.Identity"},
                    }
                }
            },
            r"^\$\[\"\"\]\.activation\.\$partial\.func: refusing to call 'os.getcwd'",
        ),
    ],
)
def test_bad_tagged_values(data: Any, message: str) -> None:
    with pytest.raises(QConfigError, match=message):
        QConfigMapping.from_json(_doc(data=data))


def test_bad_dtype_with_constraints_field_and_non_object_data() -> None:
    doc = json.loads(DTypeConfig(input_dtype=torch.uint8).to_json())
    doc["data"]["input_dtype"]["$dtype_with_constraints"]["qmin"] = 0
    with pytest.raises(
        QConfigError, match=r"input_dtype: unknown DTypeWithConstraints field 'qmin'"
    ):
        DTypeConfig.from_json(json.dumps(doc))
    doc["data"] = [1]
    with pytest.raises(QConfigError, match=r"'data' must be an object"):
        DTypeConfig.from_json(json.dumps(doc))


def test_allowed_prefix_without_a_module_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(QConfigError, match=r"fuser_method: no importable module in 'qb_nowhere.f'"):
        BackendConfig.from_json(_backend_document("qb_nowhere.f"), allowed_prefixes=("qb_nowhere",))
    path = tmp_path / "m.json"
    path.write_text(_doc())
    with open(path, "rb") as binary, pytest.raises(QConfigError, match="opened in text mode"):
        QConfigMapping.from_json(binary)  # type: ignore[arg-type]
    with open(path) as text:
        assert QConfigMapping.from_json(text).to_dict() == QConfigMapping().to_dict()


def test_broken_module_under_an_allowed_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "qb_json_broken.py").write_text("import qb_json_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        QConfigError,
        match=r"fuser_method: importing 'qb_json_broken.fuse' failed: No module named "
        r"'qb_json_missing_dependency'",
    ):
        BackendConfig.from_json(
            _backend_document("qb_json_broken.fuse"), allowed_prefixes=("qb_json_broken",)
        )
