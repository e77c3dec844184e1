"""QConfig, qconfig_equals and QConfigMapping (setters, dict form, resolution and its rule)."""

from __future__ import annotations

import functools
import sys
from collections import OrderedDict, namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch.nn.functional as F
from torch import nn

from quantbridge.qconfig import QConfig, QConfigError, QConfigMapping, QConfigMatch, qconfig_equals

if str(Path(__file__).resolve().parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from config_backend_helpers import DummyObserver, DummyWeightObserver


def _qconfig(tag: int) -> QConfig:
    """Distinct qconfigs, told apart by a keyword."""
    return QConfig(
        activation=functools.partial(DummyObserver, quant_max=tag), weight=DummyWeightObserver
    )


# -- QConfig -----------------------------------------------------------------------------------


def test_qconfig_is_a_named_tuple_of_constructors() -> None:
    q = QConfig(activation=DummyObserver, weight=DummyWeightObserver)
    assert q.activation is DummyObserver
    assert q.weight is DummyWeightObserver
    assert tuple(q) == (DummyObserver, DummyWeightObserver)
    assert q._fields == ("activation", "weight")
    assert isinstance(q, tuple)


def test_qconfig_rejects_observer_instances_like_torch_ao() -> None:
    with pytest.raises(QConfigError, match=r"QConfig.activation: got an observer instance"):
        QConfig(activation=DummyObserver(), weight=DummyWeightObserver)
    with pytest.raises(ValueError, match=r"QConfig.weight: .*with_args"):
        QConfig(activation=DummyObserver, weight=DummyWeightObserver())


def test_qconfig_allows_none_like_torch_ao() -> None:
    q = QConfig(activation=DummyObserver, weight=None)
    assert q.weight is None
    assert QConfigMapping().set_global(q).global_qconfig is q


@pytest.mark.parametrize("bad", [3, "MinMaxObserver", 1.5])
def test_qconfig_rejects_non_callables(bad: Any) -> None:
    with pytest.raises(QConfigError, match=r"QConfig.weight: .* is not an observer constructor"):
        QConfig(activation=DummyObserver, weight=bad)


def test_qconfig_equals_compares_partials_by_value() -> None:
    a = QConfig(functools.partial(DummyObserver, quant_max=7), DummyWeightObserver)
    b = QConfig(functools.partial(DummyObserver, quant_max=7), DummyWeightObserver)
    c = QConfig(functools.partial(DummyObserver, quant_max=8), DummyWeightObserver)
    d = QConfig(functools.partial(DummyWeightObserver, quant_max=7), DummyWeightObserver)
    assert a != b  # functools.partial has identity equality...
    assert qconfig_equals(a, b)  # ...which qconfig_equals looks through
    assert not qconfig_equals(a, c)
    assert not qconfig_equals(a, d)
    assert qconfig_equals(None, None)
    assert not qconfig_equals(a, None)
    assert not qconfig_equals(None, a)
    nested_1 = QConfig(
        functools.partial(DummyObserver, observer=functools.partial(DummyObserver, eps=0.5)),
        DummyWeightObserver,
    )
    nested_2 = QConfig(
        functools.partial(DummyObserver, observer=functools.partial(DummyObserver, eps=0.5)),
        DummyWeightObserver,
    )
    nested_3 = QConfig(
        functools.partial(DummyObserver, observer=functools.partial(DummyObserver, eps=0.25)),
        DummyWeightObserver,
    )
    assert qconfig_equals(nested_1, nested_2)
    assert not qconfig_equals(nested_1, nested_3)


# -- QConfigMapping setters and dict form -----------------------------------------------------


def test_setters_chain_and_fill_ordered_dicts() -> None:
    q1, q2, q3 = _qconfig(1), _qconfig(2), _qconfig(3)
    m = (
        QConfigMapping()
        .set_global(q1)
        .set_object_type(nn.Linear, q2)
        .set_object_type("reshape", None)
        .set_module_name_regex("foo.*", q3)
        .set_module_name("a.b", q1)
        .set_module_name_object_type_order("a", F.linear, 0, q2)
    )
    assert m.global_qconfig is q1
    assert m.object_type_qconfigs == OrderedDict([(nn.Linear, q2), ("reshape", None)])
    assert m.module_name_regex_qconfigs == OrderedDict([("foo.*", q3)])
    assert m.module_name_qconfigs == OrderedDict([("a.b", q1)])
    assert m.module_name_object_type_order_qconfigs == OrderedDict([(("a", F.linear, 0), q2)])
    assert isinstance(m.object_type_qconfigs, OrderedDict)
    d = m.to_dict()
    assert d == {
        "": q1,
        "object_type": [(nn.Linear, q2), ("reshape", None)],
        "module_name_regex": [("foo.*", q3)],
        "module_name": [("a.b", q1)],
        "module_name_object_type_order": [("a", F.linear, 0, q2)],
    }
    assert QConfigMapping.from_dict(d).to_dict() == d


def test_re_registering_keeps_the_original_position() -> None:
    q1, q2 = _qconfig(1), _qconfig(2)
    m = QConfigMapping().set_module_name_regex("a.*", q1).set_module_name_regex("b.*", q1)
    m.set_module_name_regex("a.*", q2)
    assert list(m.module_name_regex_qconfigs.items()) == [("a.*", q2), ("b.*", q1)]


def test_foreign_qconfig_named_tuples_are_converted() -> None:
    foreign_type = namedtuple("QConfig", ["activation", "weight"])
    m = QConfigMapping().set_global(foreign_type(DummyObserver, DummyWeightObserver))
    assert type(m.global_qconfig) is QConfig
    assert m.global_qconfig == (DummyObserver, DummyWeightObserver)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: m.set_global((1, 2)), r"set_global: expected a QConfig or None"),
        (lambda m: m.set_global(DummyObserver), r"set_global: expected a QConfig or None"),
        (
            lambda m: m.set_object_type(3, None),
            r"set_object_type\(3\): 3 \(a int\) is not an object type",
        ),
        (lambda m: m.set_object_type("", None), r"an empty string is not a method name"),
        (
            lambda m: m.set_module_name_regex("(", None),
            r"set_module_name_regex\('\('\): not a valid regular",
        ),
        (lambda m: m.set_module_name_regex(3, None), r"expected a string, got 3"),
        (lambda m: m.set_module_name(nn.Linear, None), r"set_module_name\(.*\): expected a string"),
        (
            lambda m: m.set_module_name_object_type_order("a", nn.Linear, -1, None),
            r"index must be a non-negative int, got -1",
        ),
        (
            lambda m: m.set_module_name_object_type_order("a", nn.Linear, "0", None),
            r"index must be a non-negative int, got '0'",
        ),
        (
            lambda m: m.set_object_type(
                nn.Linear, QConfig(DummyObserver, DummyObserver)._replace(weight=3)
            ),
            r"set_object_type\(torch.nn.modules.linear.Linear\): QConfig.weight: 3",
        ),
    ],
)
def test_setters_reject(call: Any, message: str) -> None:
    with pytest.raises(QConfigError, match=message):
        call(QConfigMapping())


@pytest.mark.parametrize(
    ("d", "message"),
    [
        (
            {"global": None},
            r"unknown key 'global'; accepted keys are '', 'object_type', 'module_name_regex'",
        ),
        ({"object_type": (nn.Linear, None)}, r"object_type\[0\] must be a tuple of 2 items"),
        ({"module_name": {"a": None}}, r"'module_name' must be a list of tuples, got dict"),
        (
            {"module_name_object_type_order": [("a", nn.Linear, None)]},
            r"must be a tuple of 4 items",
        ),
        (
            {"module_name": [("a", None), ("b", 5)]},
            r"module_name\[1\]: set_module_name\('b'\): expected a QConfig",
        ),
    ],
)
def test_from_dict_rejects(d: Any, message: str) -> None:
    with pytest.raises(QConfigError, match=message):
        QConfigMapping.from_dict(d)


def test_repr_lists_every_rule() -> None:
    text = repr(QConfigMapping().set_object_type("reshape", None).set_module_name("x", None))
    assert "object_type_qconfigs:\n    'reshape': None" in text
    assert "module_name_qconfigs:\n    'x': None" in text


# -- resolution --------------------------------------------------------------------------------

G, T_LINEAR, T_FLINEAR, T_SEQ, R_CONV, R_FOO, N_A, N_ABC, O_AB, O_FOO = (
    _qconfig(i) for i in range(10)
)


@pytest.fixture
def mapping() -> QConfigMapping:
    return (
        QConfigMapping()
        .set_global(G)
        .set_object_type(nn.Linear, T_LINEAR)
        .set_object_type(F.linear, T_FLINEAR)
        .set_object_type(nn.Sequential, T_SEQ)
        .set_object_type(nn.Conv2d, None)
        .set_module_name_regex("foo.*bar.*conv[0-9]+", R_CONV)
        .set_module_name_regex("foo.*", R_FOO)
        .set_module_name("a", N_A)
        .set_module_name("a.b.c", N_ABC)
        .set_module_name_object_type_order("a.b", nn.Linear, 1, O_AB)
        .set_module_name_object_type_order("foo.bar", F.linear, 0, O_FOO)
    )


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        (("x", None), {}, QConfigMatch(G, "global")),
        (("", F.relu), {}, QConfigMatch(G, "global")),
        (("x", nn.Linear), {}, QConfigMatch(T_LINEAR, "object_type", nn.Linear)),
        (("x", nn.Conv2d), {}, QConfigMatch(None, "object_type", nn.Conv2d)),
        # the enclosing module's type overrides the function's own entry, as in torch.ao
        (
            ("x", F.linear),
            {"scope_type": nn.Sequential},
            QConfigMatch(T_SEQ, "object_type", nn.Sequential),
        ),
        (
            ("x", F.linear),
            {"scope_type": nn.ReLU},
            QConfigMatch(T_FLINEAR, "object_type", F.linear),
        ),
        (
            ("foo.bar.conv1", nn.Linear),
            {},
            QConfigMatch(R_CONV, "module_name_regex", "foo.*bar.*conv[0-9]+"),
        ),
        (("foo.baz", nn.Linear), {}, QConfigMatch(R_FOO, "module_name_regex", "foo.*")),
        (
            ("xfoo", nn.Linear),
            {},
            QConfigMatch(T_LINEAR, "object_type", nn.Linear),
        ),  # re.match anchors
        (("a", nn.Linear), {}, QConfigMatch(N_A, "module_name", "a")),
        (("a.b", nn.Linear), {}, QConfigMatch(N_A, "module_name", "a")),  # nearest ancestor
        (("a.b.c.d", nn.Linear), {}, QConfigMatch(N_ABC, "module_name", "a.b.c")),
        (
            ("ab", nn.Linear),
            {},
            QConfigMatch(T_LINEAR, "object_type", nn.Linear),
        ),  # not a prefix match
        (
            ("a.b", nn.Linear, 1),
            {},
            QConfigMatch(O_AB, "module_name_object_type_order", ("a.b", nn.Linear, 1)),
        ),
        (("a.b", nn.Linear, 0), {}, QConfigMatch(N_A, "module_name", "a")),
        (
            ("a.b.lin", nn.Linear, 1),
            {"order_module_name": "a.b"},
            QConfigMatch(O_AB, "module_name_object_type_order", ("a.b", nn.Linear, 1)),
        ),
        (
            ("foo.bar", F.linear, 0),
            {"scope_type": nn.Sequential},
            QConfigMatch(O_FOO, "module_name_object_type_order", ("foo.bar", F.linear, 0)),
        ),
        (("foo.bar", F.linear, 1), {}, QConfigMatch(R_FOO, "module_name_regex", "foo.*")),
    ],
)
def test_qconfig_for_precedence_and_rule(
    mapping: QConfigMapping, args: tuple[Any, ...], kwargs: dict[str, Any], expected: QConfigMatch
) -> None:
    got = mapping.qconfig_for(*args, **kwargs)
    assert got.rule == expected.rule
    assert got.key == expected.key
    assert got.qconfig is expected.qconfig


def test_empty_mapping_resolves_to_none_from_global() -> None:
    assert QConfigMapping().qconfig_for("a.b", nn.Linear, 0) == QConfigMatch(None, "global", None)


def test_root_module_name_rule_never_matches_like_torch_ao() -> None:
    m = QConfigMapping().set_module_name("", _qconfig(1))
    assert m.qconfig_for("", nn.Linear).rule == "global"
    assert m.qconfig_for("a", nn.Linear).rule == "global"


def test_match_describe() -> None:
    assert QConfigMatch(None, "global").describe() == "global"
    assert QConfigMatch(None, "module_name", "a.b").describe() == "module_name 'a.b'"
    assert (
        QConfigMatch(None, "module_name_object_type_order", ("a", F.relu, 0)).describe()
        == "module_name_object_type_order ('a', torch.nn.functional.relu, 0)"
    )
