"""Default qconfigs and qconfig mappings against torch.ao 2.13's, entry by entry.

Every constructor is built on both sides and compared by class, settings and behaviour
(the same data in, the same buffers and qparams out).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import quantbridge.qconfig as qc
from quantbridge.qconfig import QConfig, QConfigError, QConfigMapping
from quantbridge.qconfig._dtypes import canonical_dtype

ao = pytest.importorskip("torch.ao.quantization")
ao_qconfig = pytest.importorskip("torch.ao.quantization.qconfig")
ao_mapping = pytest.importorskip("torch.ao.quantization.qconfig_mapping")


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """Tiny tensors: torch's intra-op thread pool only adds latency here (milliseconds per
    reduction on a loaded machine). Both implementations run under the same setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


BACKENDS = ["x86", "fbgemm", "qnnpack", "onednn"]
SETTINGS = [
    "quant_min",
    "quant_max",
    "reduce_range",
    "has_customized_qrange",
    "averaging_constant",
    "ch_axis",
    "is_dynamic",
    "bins",
    "custom_op",
    "is_per_channel",
    "is_symmetric_quant",
]


def _settings(module: nn.Module) -> dict[str, Any]:
    found: dict[str, Any] = {"class": type(module).__name__}
    for name in SETTINGS:
        if hasattr(module, name):
            found[name] = getattr(module, name)
    if hasattr(module, "dtype"):
        found["dtype"] = canonical_dtype(module.dtype)
    if hasattr(module, "qscheme") and module.qscheme is not None:
        found["qscheme"] = str(module.qscheme).removeprefix("torch.")
    eps = getattr(module, "eps", None)
    if isinstance(eps, torch.Tensor):
        found["eps"] = eps.tolist()
    elif eps is not None:
        found["eps"] = eps
    post = getattr(module, "activation_post_process", None)
    if isinstance(post, nn.Module):
        found["observer"] = _settings(post)
    return found


def _exercise(module: nn.Module) -> dict[str, torch.Tensor]:
    """Feed two batches (if it computes qparams) and return its state and qparams."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(module, nn.Identity):
        return out
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for scale in (1.0, 3.0):
            module(torch.randn(4, 6, generator=g) * scale + 0.5)
        try:
            scale_t, zero_point = module.calculate_qparams()  # type: ignore[operator]
            out["scale"], out["zero_point"] = scale_t, zero_point
        except Exception:  # placeholders: no qparams on either side (checked by class)
            pass
    out.update(module.state_dict())
    return out


# Pairs already verified (the objects are kept alive so their ids stay unique). Mappings
# share one constructor among many entries; building a 2048-bin histogram twice per entry
# would only slow the suite down.
_VERIFIED: dict[tuple[int, int], tuple[Any, Any]] = {}


def assert_same_constructor(ours: Any, theirs: Any) -> None:
    if theirs is None:
        assert ours is None
        return
    if (id(ours), id(theirs)) in _VERIFIED:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mine, ref = ours(), theirs()
    assert _settings(mine) == _settings(ref)
    s_mine, s_ref = _exercise(mine), _exercise(ref)
    assert list(s_mine) == list(s_ref)
    for key in s_ref:
        assert s_mine[key].dtype == s_ref[key].dtype, key
        assert torch.equal(s_mine[key], s_ref[key]), key
    _VERIFIED[(id(ours), id(theirs))] = (ours, theirs)


def assert_same_qconfig(ours: QConfig | None, theirs: Any) -> None:
    if theirs is None:
        assert ours is None
        return
    assert ours is not None
    assert_same_constructor(ours.activation, theirs.activation)
    assert_same_constructor(ours.weight, theirs.weight)


@pytest.mark.parametrize("backend", BACKENDS)
def test_get_default_qconfig(backend: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = ao_qconfig.get_default_qconfig(backend)
        ours = qc.get_default_qconfig(backend)
    assert isinstance(ours, QConfig)
    assert_same_qconfig(ours, theirs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("version", [0, 1])
def test_get_default_qat_qconfig(backend: str, version: int) -> None:
    theirs = ao_qconfig.get_default_qat_qconfig(backend, version)
    ours = qc.get_default_qat_qconfig(backend, version)
    assert_same_qconfig(ours, theirs)


def test_default_arguments_match_torch_ao() -> None:
    assert_same_qconfig(qc.get_default_qconfig(), ao_qconfig.get_default_qconfig())
    assert_same_qconfig(qc.get_default_qat_qconfig(), ao_qconfig.get_default_qat_qconfig())


def _key_name(key: object) -> str:
    return key if isinstance(key, str) else f"{key.__module__}.{getattr(key, '__name__', key)}"


def assert_same_mapping(ours: QConfigMapping, theirs: Any) -> None:
    assert_same_qconfig(ours.global_qconfig, theirs.global_qconfig)
    assert [_key_name(k) for k in ours.object_type_qconfigs] == [
        _key_name(k) for k in theirs.object_type_qconfigs
    ]
    for key, ref in theirs.object_type_qconfigs.items():
        assert_same_qconfig(ours.object_type_qconfigs[key], ref)
    # Which entries share one QConfig object is part of the structure too.
    sharing_ours = [id(q) for q in ours.object_type_qconfigs.values()]
    sharing_theirs = [id(q) for q in theirs.object_type_qconfigs.values()]
    assert [sharing_ours.index(i) for i in sharing_ours] == [
        sharing_theirs.index(i) for i in sharing_theirs
    ]
    assert not ours.module_name_qconfigs
    assert not ours.module_name_regex_qconfigs
    assert not ours.module_name_object_type_order_qconfigs


@pytest.mark.parametrize("backend", BACKENDS)
def test_get_default_qconfig_mapping(backend: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = ao_mapping.get_default_qconfig_mapping(backend)
        ours = qc.get_default_qconfig_mapping(backend)
    assert_same_mapping(ours, theirs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("version", [0, 1])
def test_get_default_qat_qconfig_mapping(backend: str, version: int) -> None:
    theirs = ao_mapping.get_default_qat_qconfig_mapping(backend, version)
    ours = qc.get_default_qat_qconfig_mapping(backend, version)
    assert_same_mapping(ours, theirs)


def test_symmetric_qnnpack_mappings() -> None:
    assert_same_mapping(
        qc.get_symmetric_qnnpack_qconfig_mapping(),
        ao_mapping._get_symmetric_qnnpack_qconfig_mapping(),
    )
    assert_same_mapping(
        qc.get_symmetric_qnnpack_qat_qconfig_mapping(),
        ao_mapping._get_symmetric_qnnpack_qat_qconfig_mapping(),
    )


MODULE_QCONFIGS = [
    "default_qconfig",
    "default_debug_qconfig",
    "default_per_channel_qconfig",
    "default_dynamic_qconfig",
    "float16_dynamic_qconfig",
    "float16_static_qconfig",
    "per_channel_dynamic_qconfig",
    "float_qparams_weight_only_qconfig",
    "float_qparams_weight_only_qconfig_4bit",
    "default_qat_qconfig",
    "default_dynamic_qat_qconfig",
    "default_weight_only_qconfig",
    "default_activation_only_qconfig",
    "default_qat_qconfig_v2",
    "default_reuse_input_qconfig",
    "default_symmetric_qnnpack_qconfig",
    "default_per_channel_symmetric_qnnpack_qconfig",
    "default_embedding_qat_qconfig",
    "default_embedding_qat_qconfig_4bit",
    "default_quint8_weight_qconfig",
    "default_symmetric_qnnpack_qat_qconfig",
    "default_per_channel_symmetric_qnnpack_qat_qconfig",
]


@pytest.mark.parametrize("name", MODULE_QCONFIGS)
def test_module_level_qconfigs(name: str) -> None:
    assert_same_qconfig(getattr(qc, name), getattr(ao_qconfig, name))


def test_quint8_placeholder_qconfig() -> None:
    assert_same_qconfig(
        qc.default_quint8_placeholder_qconfig, ao_qconfig._default_quint8_placeholder_qconfig
    )


def test_fp32_placeholder_qconfig() -> None:
    assert_same_qconfig(
        qc.default_fp32_placeholder_qconfig, ao_qconfig._default_fp32_placeholder_qconfig
    )


OBSERVER_FACTORIES = [
    "default_observer",
    "default_placeholder_observer",
    "default_weight_observer",
    "weight_observer_range_neg_127_to_127",
    "default_histogram_observer",
    "default_per_channel_weight_observer",
    "per_channel_weight_observer_range_neg_127_to_127",
    "default_dynamic_quant_observer",
    "default_float_qparams_observer",
    "default_float_qparams_observer_4bit",
    "default_fixed_qparams_range_neg1to1_observer",
    "default_fixed_qparams_range_0to1_observer",
    "default_symmetric_fixed_qparams_observer",
    "default_affine_fixed_qparams_observer",
    "default_reuse_input_observer",
]


@pytest.mark.parametrize("name", OBSERVER_FACTORIES)
def test_observer_factories(name: str) -> None:
    assert_same_constructor(getattr(qc, name), getattr(ao.observer, name))


def test_float16_placeholders() -> None:
    assert_same_constructor(
        qc.default_float16_placeholder_observer,
        ao.observer.PlaceholderObserver.with_args(dtype=torch.float16),
    )
    assert_same_constructor(
        qc.default_float16_dynamic_placeholder_observer,
        ao.observer.PlaceholderObserver.with_args(dtype=torch.float16, is_dynamic=True),
    )


def test_fixed_qparams_ops_table() -> None:
    ours = {_key_name(k): v for k, v in qc.FIXED_QPARAMS_OP_TO_OBSERVER.items()}
    theirs = {_key_name(k): v for k, v in ao_mapping._FIXED_QPARAMS_OP_TO_OBSERVER.items()}
    assert list(ours) == list(theirs)
    for key, ref in theirs.items():
        assert_same_constructor(ours[key], ref)


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "func",
    [
        qc.get_default_qconfig,
        qc.get_default_qat_qconfig,
        qc.get_default_qconfig_mapping,
        qc.get_default_qat_qconfig_mapping,
    ],
)
@pytest.mark.parametrize("backend", ["tensorrt", "X86", "", None, "native"])
def test_unknown_backend_raises(func: Any, backend: Any) -> None:
    with pytest.raises(QConfigError, match="not supported") as info:
        func(backend)
    assert "x86" in str(info.value)  # the message lists what is supported
    theirs = getattr(ao_mapping if "mapping" in func.__name__ else ao_qconfig, func.__name__)
    with pytest.raises(AssertionError):  # torch.ao rejects the same names
        theirs(backend)


@pytest.mark.parametrize(
    ("func", "bad_versions"),
    [
        (qc.get_default_qconfig, [1, 2, None]),
        (qc.get_default_qat_qconfig, [2, -1, None]),
        (qc.get_default_qconfig_mapping, [1]),
        (qc.get_default_qat_qconfig_mapping, [2]),
    ],
)
def test_unknown_version_raises(func: Any, bad_versions: list[Any]) -> None:
    theirs = getattr(ao_mapping if "mapping" in func.__name__ else ao_qconfig, func.__name__)
    for version in bad_versions:
        with pytest.raises(QConfigError, match="version"):
            func("x86", version)
        with pytest.raises(AssertionError):
            theirs("x86", version)


def test_default_factories_are_flat_partials() -> None:
    """The factory contract the JSON code relies on: ``.p`` is a partial over the class."""
    factory = qc.get_default_qat_qconfig("fbgemm").activation
    assert isinstance(factory.p, functools.partial)
    assert factory.p.func is qc.FusedMovingAvgObsFakeQuantize
    assert factory.p.keywords["observer"] is qc.MovingAverageMinMaxObserver
    assert factory.p.keywords["reduce_range"] is True
    assert factory.callable_args == {}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qat", [False, True])
def test_default_mappings_survive_json(backend: str, qat: bool) -> None:
    """The default mappings serialize with the package's JSON and load back to
    constructors that build the same modules (the factory contract the JSON code uses)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if qat:
            mapping = qc.get_default_qat_qconfig_mapping(backend)
        else:
            mapping = qc.get_default_qconfig_mapping(backend)
    loaded = QConfigMapping.from_json(mapping.to_json())
    assert qc.qconfig_equals(loaded.global_qconfig, mapping.global_qconfig)
    assert list(loaded.object_type_qconfigs) == list(mapping.object_type_qconfigs)
    for key, qconfig in mapping.object_type_qconfigs.items():
        assert qc.qconfig_equals(loaded.object_type_qconfigs[key], qconfig), key
    assert loaded.global_qconfig is not None
    assert_same_constructor(loaded.global_qconfig.activation, mapping.global_qconfig.activation)
