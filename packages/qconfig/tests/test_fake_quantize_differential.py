"""Fake quantize against torch.ao 2.13: forward outputs, input gradients, buffers, toggles."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import quantbridge.qconfig as qc
from quantbridge.qconfig import QConfigError

ao = pytest.importorskip("torch.ao.quantization")
ao_obs = pytest.importorskip("torch.ao.quantization.observer")
ao_fq = pytest.importorskip("torch.ao.quantization.fake_quantize")


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """Tiny tensors: torch's intra-op thread pool only adds latency here (milliseconds per
    reduction on a loaded machine). Both implementations run under the same setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def assert_same_state(ours: nn.Module, theirs: nn.Module) -> None:
    s_ours, s_theirs = ours.state_dict(), theirs.state_dict()
    assert list(s_ours) == list(s_theirs)
    for key in s_theirs:
        assert same_tensor(s_ours[key], s_theirs[key]), (key, s_ours[key], s_theirs[key])


# A step is ("x", tensor) to run forward/backward, or ("call", method name) to toggle.
Step = tuple[str, Any]


def steps(shape: tuple[int, ...], seed: int, toggles: bool = True) -> list[Step]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(*shape, generator=g) * s + o for s, o in [(1, 0), (3, 1), (0.5, -2)]]
    plan: list[Step] = [("x", xs[0]), ("x", xs[1])]
    if toggles:
        plan += [
            ("call", "disable_observer"),
            ("x", xs[2] * 4),  # out of the frozen range: clipped, zero gradient there
            ("call", "disable_fake_quant"),
            ("x", xs[2]),
            ("call", "enable_observer"),
            ("call", "enable_fake_quant"),
        ]
    plan += [("x", xs[2]), ("x", xs[0] * 10)]
    return plan


def run_pair(ours: nn.Module, theirs: nn.Module, plan: list[Step]) -> None:
    for kind, value in plan:
        if kind == "call":
            getattr(ours, value)()
            getattr(theirs, value)()
            continue
        x_ours = value.clone().requires_grad_()
        x_theirs = value.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y_theirs = theirs(x_theirs)
        y_ours = ours(x_ours)
        assert same_tensor(y_ours, y_theirs)
        weights = torch.linspace(-1, 2, value.numel()).reshape(value.shape)
        (y_ours * weights).sum().backward()
        (y_theirs * weights).sum().backward()
        assert x_ours.grad is not None
        assert x_theirs.grad is not None
        assert same_tensor(x_ours.grad, x_theirs.grad)
        assert_same_state(ours, theirs)


ALIAS = {"uint8": torch.quint8, "int8": torch.qint8, "int32": torch.qint32}


def kwargs_pair(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(our kwargs, torch.ao kwargs): observer classes, dtypes and qschemes translated."""
    ours: dict[str, Any] = {}
    theirs: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key == "observer":
            ours[key], theirs[key] = getattr(qc, value), getattr(ao_obs, value)
        elif key == "dtype":
            ours[key], theirs[key] = getattr(torch, value), ALIAS.get(value, getattr(torch, value))
        elif key == "qscheme":
            ours[key], theirs[key] = value, getattr(torch, value)
        else:
            ours[key] = theirs[key] = value
    return ours, theirs


FAKE_QUANT_CONFIGS: dict[str, dict[str, Any]] = {
    "ma_affine_u8": dict(observer="MovingAverageMinMaxObserver", quant_min=0, quant_max=255),
    "ma_affine_u8_reduce": dict(
        observer="MovingAverageMinMaxObserver", quant_min=0, quant_max=255, reduce_range=True
    ),
    "ma_symmetric_i8": dict(
        observer="MovingAverageMinMaxObserver",
        quant_min=-128,
        quant_max=127,
        dtype="int8",
        qscheme="per_tensor_symmetric",
    ),
    "ma_symmetric_i8_127": dict(
        observer="MovingAverageMinMaxObserver",
        quant_min=-127,
        quant_max=127,
        dtype="int8",
        qscheme="per_tensor_symmetric",
        eps=2**-12,
    ),
    "ma_default_range": dict(observer="MovingAverageMinMaxObserver", averaging_constant=0.5),
    "minmax_affine_i8": dict(observer="MinMaxObserver", dtype="int8"),
    "minmax_i32": dict(observer="MinMaxObserver", dtype="int32"),
    "histogram": dict(observer="HistogramObserver", bins=64, quant_min=0, quant_max=255),
    "histogram_reduce": dict(
        observer="HistogramObserver", bins=64, quant_min=0, quant_max=255, reduce_range=True
    ),
    "pc_symmetric_axis0": dict(
        observer="MovingAveragePerChannelMinMaxObserver",
        quant_min=-128,
        quant_max=127,
        dtype="int8",
        qscheme="per_channel_symmetric",
        ch_axis=0,
    ),
    "pc_affine_axis1": dict(
        observer="MovingAveragePerChannelMinMaxObserver",
        quant_min=0,
        quant_max=255,
        qscheme="per_channel_affine",
        ch_axis=1,
    ),
    "pc_minmax_axis_neg1": dict(
        observer="PerChannelMinMaxObserver",
        dtype="int8",
        qscheme="per_channel_symmetric",
        ch_axis=-1,
    ),
    "pc_float_qparams": dict(
        observer="MovingAveragePerChannelMinMaxObserver",
        quant_min=0,
        quant_max=255,
        qscheme="per_channel_affine_float_qparams",
        averaging_constant=1,
    ),
}


@pytest.mark.parametrize("name", list(FAKE_QUANT_CONFIGS))
@pytest.mark.parametrize("toggles", [False, True])
def test_fake_quantize_matches_torch_ao(name: str, toggles: bool) -> None:
    ours_kw, theirs_kw = kwargs_pair(FAKE_QUANT_CONFIGS[name])
    if theirs_kw.get("ch_axis") == -1:
        # torch.ao's FakeQuantize fails on a negative axis (the aten op rejects it); ours
        # counts it from the end, so compare with the equivalent positive axis.
        theirs_kw["ch_axis"] = 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = ao_fq.FakeQuantize(**theirs_kw)
    ours = qc.FakeQuantize(**ours_kw)
    assert_same_state(ours, theirs)
    assert (ours.quant_min, ours.quant_max) == (theirs.quant_min, theirs.quant_max)
    assert ours.ch_axis % 3 == theirs.ch_axis % 3
    run_pair(ours, theirs, steps((4, 3, 5), seed=len(name), toggles=toggles))


def test_fake_quantize_channels_last_per_channel() -> None:
    ours_kw, theirs_kw = kwargs_pair(FAKE_QUANT_CONFIGS["pc_affine_axis1"])
    ours, theirs = qc.FakeQuantize(**ours_kw), ao_fq.FakeQuantize(**theirs_kw)
    plan = [
        ("x", x.to(memory_format=torch.channels_last))
        for x in (torch.randn(2, 3, 4, 4) * 2, torch.randn(2, 3, 4, 4) + 1)
    ]
    run_pair(ours, theirs, plan)


FUSED_CONFIGS: dict[str, dict[str, Any]] = {
    "act": dict(observer="MovingAverageMinMaxObserver", quant_min=0, quant_max=255),
    "act_reduce": dict(
        observer="MovingAverageMinMaxObserver", quant_min=0, quant_max=255, reduce_range=True
    ),
    "wt_symmetric": dict(
        observer="MovingAverageMinMaxObserver",
        quant_min=-128,
        quant_max=127,
        dtype="int8",
        qscheme="per_tensor_symmetric",
    ),
    "wt_per_channel": dict(
        observer="MovingAveragePerChannelMinMaxObserver",
        quant_min=-128,
        quant_max=127,
        dtype="int8",
        qscheme="per_channel_symmetric",
    ),
    "wt_per_channel_127": dict(
        observer="MovingAveragePerChannelMinMaxObserver",
        quant_min=-127,
        quant_max=127,
        dtype="int8",
        qscheme="per_channel_symmetric",
        eps=2**-12,
    ),
    "act_per_channel_affine": dict(
        observer="MovingAveragePerChannelMinMaxObserver",
        quant_min=0,
        quant_max=255,
        qscheme="per_channel_affine",
        averaging_constant=0.1,
    ),
}


@pytest.mark.parametrize("name", list(FUSED_CONFIGS))
@pytest.mark.parametrize("toggles", [False, True])
def test_fused_fake_quantize_matches_torch_ao(name: str, toggles: bool) -> None:
    ours_kw, theirs_kw = kwargs_pair(FUSED_CONFIGS[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = ao_fq.FusedMovingAvgObsFakeQuantize(**theirs_kw)
    ours = qc.FusedMovingAvgObsFakeQuantize(**ours_kw)
    assert_same_state(ours, theirs)
    assert ours.fake_quant_enabled.dtype == torch.long
    run_pair(ours, theirs, steps((4, 6), seed=len(name), toggles=toggles))


@pytest.mark.parametrize(
    "factory_name",
    [
        "default_fixed_qparams_range_0to1_fake_quant",
        "default_fixed_qparams_range_neg1to1_fake_quant",
    ],
)
def test_fixed_qparams_fake_quantize(factory_name: str) -> None:
    ours = getattr(qc, factory_name)()
    theirs = getattr(ao_fq, factory_name)()
    assert_same_state(ours, theirs)
    plan: list[Step] = [
        ("x", torch.linspace(-1.5, 1.5, 41)),
        ("call", "disable_fake_quant"),
        ("x", torch.linspace(-1.5, 1.5, 41)),
        ("call", "enable_fake_quant"),
        ("x", torch.linspace(-3, 3, 7)),
    ]
    run_pair(ours, theirs, plan)
    assert ours.scale is ours.activation_post_process.scale  # shared with the observer


DEFAULT_FACTORIES = [
    "default_fake_quant",
    "default_weight_fake_quant",
    "default_dynamic_fake_quant",
    "default_per_channel_weight_fake_quant",
    "default_embedding_fake_quant",
    "default_embedding_fake_quant_4bit",
    "default_histogram_fake_quant",
    "default_fused_act_fake_quant",
    "default_fused_wt_fake_quant",
    "default_fused_per_channel_wt_fake_quant",
    "fused_wt_fake_quant_range_neg_127_to_127",
    "fused_per_channel_wt_fake_quant_range_neg_127_to_127",
]


@pytest.mark.parametrize("factory_name", DEFAULT_FACTORIES)
def test_default_fake_quant_factories_match(factory_name: str) -> None:
    ours = getattr(qc, factory_name)()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = getattr(ao_fq, factory_name)()
    assert type(ours).__name__ == type(theirs).__name__
    assert (
        type(ours.activation_post_process).__name__ == type(theirs.activation_post_process).__name__
    )
    assert (ours.quant_min, ours.quant_max, ours.is_dynamic, ours.ch_axis) == (
        theirs.quant_min,
        theirs.quant_max,
        theirs.is_dynamic,
        theirs.ch_axis,
    )
    assert ours.qscheme.value == str(theirs.qscheme).removeprefix("torch.")
    run_pair(ours, theirs, steps((6, 4), seed=3, toggles=False))


# -- state_dict -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls_name", "config"),
    [("FakeQuantize", c) for c in ("ma_affine_u8", "pc_symmetric_axis0", "histogram")]
    + [("FusedMovingAvgObsFakeQuantize", c) for c in ("act", "wt_per_channel")],
)
def test_state_dict_round_trips(cls_name: str, config: str) -> None:
    table = FAKE_QUANT_CONFIGS if cls_name == "FakeQuantize" else FUSED_CONFIGS
    ours_kw, theirs_kw = kwargs_pair(table[config])
    trained = getattr(qc, cls_name)(**ours_kw)
    trained_ao = getattr(ao_fq, cls_name)(**theirs_kw)
    for x in (torch.randn(4, 3, 5), torch.randn(4, 3, 5) * 2):
        trained(x)
        trained_ao(x)
    x = torch.randn(4, 3, 5) * 3
    # quantbridge -> fresh quantbridge, and torch.ao -> fresh quantbridge.
    for source in (trained, trained_ao):
        fresh = getattr(qc, cls_name)(**ours_kw)
        fresh.load_state_dict(source.state_dict())
        fresh.disable_observer()
        source.disable_observer()
        assert same_tensor(fresh(x), source(x))
        source.enable_observer()
    # quantbridge -> fresh torch.ao.
    fresh_ao = getattr(ao_fq, cls_name)(**theirs_kw)
    fresh_ao.load_state_dict(trained.state_dict())
    assert_same_state(trained, fresh_ao)


# -- helpers for model.apply, errors --------------------------------------------------------


def test_apply_helpers_toggle_every_fake_quant() -> None:
    model = nn.Sequential(
        qc.default_fake_quant(), nn.ReLU(), qc.default_fused_wt_fake_quant(), nn.Identity()
    )
    fqs = [model[0], model[2]]
    toggles: list[tuple[Callable[[nn.Module], None], str, int]] = [
        (qc.disable_observer, "observer_enabled", 0),
        (qc.disable_fake_quant, "fake_quant_enabled", 0),
        (qc.enable_observer, "observer_enabled", 1),
        (qc.enable_fake_quant, "fake_quant_enabled", 1),
    ]
    for func, buffer, expected in toggles:
        model.apply(func)
        assert [int(getattr(fq, buffer)[0]) for fq in fqs] == [expected, expected]


def test_observer_disabled_freezes_qparams() -> None:
    fq = qc.default_fake_quant()
    fq(torch.randn(10))
    frozen = fq.scale.clone(), fq.zero_point.clone()
    fq.disable_observer()
    fq(torch.randn(10) * 100)
    assert torch.equal(fq.scale, frozen[0])
    assert torch.equal(fq.zero_point, frozen[1])


def test_fake_quant_disabled_is_identity() -> None:
    fq = qc.default_weight_fake_quant()
    fq.disable_fake_quant()
    x = torch.randn(7)
    assert torch.equal(fq(x), x)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: qc.FakeQuantize(quant_min=10, quant_max=5), "must not exceed"),
        (lambda: qc.FakeQuantize(quant_min=-128, quant_max=127), "outside the range"),
        (
            lambda: qc.FakeQuantize(
                observer=qc.MinMaxObserver.with_args(dtype=torch.int8), quant_min=0, quant_max=255
            ),
            "outside the range",
        ),
        (lambda: qc.FixedQParamsFakeQuantize(observer=qc.MinMaxObserver), "FixedQParamsObserver"),
        (lambda: qc.FakeQuantize(observer=lambda **kw: qc.NoopObserver()), "no quantization"),
        (lambda: qc.FusedMovingAvgObsFakeQuantize(observer=qc.MinMaxObserver), "MovingAverage"),
        (lambda: qc.FusedMovingAvgObsFakeQuantize(observer=qc.HistogramObserver), "MovingAverage"),
    ],
)
def test_bad_fake_quantize_settings_raise(build: Callable[[], Any], match: str) -> None:
    with pytest.raises(QConfigError, match=match):
        build()


NONFINITE_INPUTS = {
    "nan": torch.tensor([1.0, float("nan"), -2.0]),
    "inf": torch.tensor([1.0, float("inf"), -2.0]),
    "neg_inf": torch.tensor([float("-inf"), 0.5, 2.0]),
}


@pytest.mark.parametrize("case", list(NONFINITE_INPUTS))
@pytest.mark.parametrize(
    "factory_name",
    ["default_fake_quant", "default_fused_act_fake_quant", "default_weight_fake_quant"],
)
def test_nonfinite_input_raises_where_torch_ao_returns_garbage(
    case: str, factory_name: str
) -> None:
    x = NONFINITE_INPUTS[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = getattr(ao_fq, factory_name)()
        y = theirs(x)
    assert not bool(torch.isfinite(theirs.scale).all()) or not bool(torch.isfinite(y).all())
    with pytest.raises(QConfigError, match="not finite"):
        getattr(qc, factory_name)()(x)


def test_histogram_fake_quant_clamps_inf_like_torch_ao() -> None:
    plan: list[Step] = [("x", torch.tensor([1.0, float("inf"), -2.0, 0.5]))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours, theirs = qc.default_histogram_fake_quant(), ao_fq.default_histogram_fake_quant()
        run_pair(ours, theirs, plan)
