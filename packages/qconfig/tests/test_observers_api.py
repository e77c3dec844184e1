"""Observer API: factories, stored settings, and clear errors for bad input (no torch.ao)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import quantbridge.qconfig as qc
from quantbridge.qconfig import QConfigError
from quantbridge.qconfig._dtypes import QScheme
from quantbridge.qconfig._factory import PartialWrapper


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """Tiny tensors: torch's intra-op thread pool only adds latency here (milliseconds per
    reduction on a loaded machine). Both implementations run under the same setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# -- with_args / with_callable_args ---------------------------------------------------------


def test_with_args_builds_new_instances_with_the_arguments() -> None:
    factory = qc.MinMaxObserver.with_args(dtype=torch.int8, qscheme="per_tensor_symmetric")
    a, b = factory(), factory()
    assert a is not b
    assert a.min_val is not b.min_val
    assert a.dtype == torch.int8
    assert a.qscheme is QScheme.PER_TENSOR_SYMMETRIC


def test_with_args_chains_flat_and_later_arguments_win() -> None:
    factory = qc.HistogramObserver.with_args(bins=8, reduce_range=True).with_args(bins=16)
    assert isinstance(factory, PartialWrapper)
    assert isinstance(factory.p, functools.partial)
    assert factory.p.func is qc.HistogramObserver
    assert factory.p.keywords == {"bins": 16, "reduce_range": True}
    obs = factory()
    assert (obs.bins, obs.reduce_range) == (16, True)


def test_with_callable_args_are_called_per_build_and_can_be_overridden() -> None:
    calls = itertools.count()
    factory = qc.MovingAverageMinMaxObserver.with_callable_args(
        averaging_constant=lambda: 0.1 * (next(calls) + 1)
    ).with_args(dtype=torch.int8)
    assert set(factory.callable_args) == {"averaging_constant"}
    assert factory.p.keywords == {"dtype": torch.int8}
    first, second = factory(), factory()
    assert first.averaging_constant == pytest.approx(0.1)
    assert second.averaging_constant == pytest.approx(0.2)
    assert factory(averaging_constant=0.5).averaging_constant == 0.5
    assert next(calls) == 2  # the explicit keyword skipped the callable


def test_with_args_on_fake_quantize_and_equality() -> None:
    a = qc.FakeQuantize.with_args(observer=qc.MinMaxObserver, quant_min=0, quant_max=255)
    b = qc.FakeQuantize.with_args(observer=qc.MinMaxObserver).with_args(quant_min=0, quant_max=255)
    assert a == b
    assert hash(a) == hash(b)
    assert a != a.with_args(quant_max=127)
    assert a != a.with_callable_args(dtype=lambda: torch.uint8)
    assert "FakeQuantize" in repr(a)
    assert isinstance(a(), qc.FakeQuantize)


def test_partial_wrapper_needs_a_partial() -> None:
    with pytest.raises(QConfigError, match=r"functools\.partial"):
        PartialWrapper(qc.MinMaxObserver)  # type: ignore[arg-type]


# -- stored settings ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "canonical", "quant_range"),
    [
        (torch.quint8, torch.uint8, (0, 255)),
        (torch.qint8, torch.int8, (-128, 127)),
        (torch.qint32, torch.int32, (-(2**31), 2**31 - 1)),
        (torch.uint8, torch.uint8, (0, 255)),
        (torch.int16, torch.int16, (-(2**15), 2**15 - 1)),
        (torch.uint16, torch.uint16, (0, 2**16 - 1)),
        (torch.quint4x2, torch.uint8, (0, 15)),
    ],
)
def test_dtype_is_stored_canonical(
    dtype: torch.dtype, canonical: torch.dtype, quant_range: tuple[int, int]
) -> None:
    obs = qc.MinMaxObserver(dtype=dtype)
    assert obs.dtype == canonical
    assert (obs.quant_min, obs.quant_max) == quant_range


@pytest.mark.parametrize(
    "qscheme", [torch.per_tensor_symmetric, "per_tensor_symmetric", QScheme.PER_TENSOR_SYMMETRIC]
)
def test_qscheme_is_stored_as_qscheme(qscheme: object) -> None:
    obs = qc.MinMaxObserver(qscheme=qscheme)
    assert obs.qscheme is QScheme.PER_TENSOR_SYMMETRIC


@pytest.mark.parametrize(
    ("dtype", "reduce_range", "custom", "expected"),
    [
        (torch.uint8, True, None, (0, 127)),
        (torch.int8, True, None, (-64, 63)),
        (torch.int32, True, None, (-(2**31), 2**31 - 1)),  # reduce_range is 8-bit only
        (torch.uint16, True, None, (0, 2**16 - 1)),
        (torch.uint8, False, (0, 15), (0, 15)),
        (torch.uint8, True, (0, 255), (0, 127)),
        (torch.int8, True, (-127, 127), (-64, 63)),  # floor division, like torch.ao
    ],
)
def test_quant_range_resolution(
    dtype: torch.dtype,
    reduce_range: bool,
    custom: tuple[int, int] | None,
    expected: tuple[int, int],
) -> None:
    kwargs: dict[str, Any] = {}
    if custom is not None:
        kwargs = {"quant_min": custom[0], "quant_max": custom[1]}
    obs = qc.MinMaxObserver(dtype=dtype, reduce_range=reduce_range, **kwargs)
    assert (obs.quant_min, obs.quant_max) == expected
    assert obs.has_customized_qrange is (custom is not None)


def test_buffers_and_factory_kwargs() -> None:
    obs = qc.MinMaxObserver(factory_kwargs={"dtype": torch.float64})
    assert obs.min_val.dtype == torch.float64
    assert obs.eps.dtype == torch.float64
    assert set(dict(obs.named_buffers())) == {"eps", "min_val", "max_val"}
    hist = qc.HistogramObserver(bins=10)
    assert set(dict(hist.named_buffers())) == {"eps", "histogram", "min_val", "max_val"}
    assert hist.histogram.shape == (10,)


def test_reset_min_max_vals() -> None:
    obs = qc.PerChannelMinMaxObserver()
    obs(torch.randn(3, 4))
    assert obs.min_val.shape == (3,)
    obs.reset_min_max_vals()
    assert obs.min_val.shape == (0,)
    obs(torch.randn(5, 2))  # a different channel count is fine after a reset
    assert obs.min_val.shape == (5,)
    per_tensor = qc.MinMaxObserver()
    per_tensor(torch.tensor([1.0, 2.0]))
    per_tensor.reset_min_max_vals()
    assert float(per_tensor.min_val) == float("inf")
    assert float(per_tensor.max_val) == float("-inf")


def test_passthrough_observers() -> None:
    x = torch.randn(3)
    fixed = qc.FixedQParamsObserver(scale=0.5, zero_point=3)
    assert fixed(x) is x
    scale, zero_point = fixed.calculate_qparams()
    assert scale.dtype == torch.float32
    assert zero_point.dtype == torch.int32
    assert (scale.tolist(), zero_point.tolist()) == ([0.5], [3])
    placeholder = qc.PlaceholderObserver(dtype=torch.quint8, is_dynamic=True)
    assert (placeholder.dtype, placeholder.is_dynamic) == (torch.uint8, True)
    assert placeholder.qscheme is QScheme.PER_TENSOR_AFFINE
    assert qc.NoopObserver().dtype == torch.float16
    assert qc.ReuseInputObserver().dtype == torch.uint8
    recorder = qc.RecordingObserver()
    recorder(x)
    assert torch.equal(recorder.get_tensor_value()[0], x)
    for obs in (placeholder, qc.NoopObserver(), qc.ReuseInputObserver(), recorder):
        assert obs(x) is x
        with pytest.raises(QConfigError, match="computes no quantization parameters"):
            obs.calculate_qparams()


def test_placeholder_compute_dtype_only_warns() -> None:
    with pytest.warns(FutureWarning, match="is_dynamic"):
        obs = qc.PlaceholderObserver(dtype=torch.uint8, compute_dtype=torch.uint8)
    assert obs.is_dynamic is False  # torch.ao 2.13 behaves the same


# -- errors ---------------------------------------------------------------------------------

BAD: list[tuple[str, Callable[[], Any], str]] = [
    ("per-channel qscheme", lambda: qc.MinMaxObserver(qscheme="per_channel_affine"), "qscheme"),
    (
        "per-tensor qscheme",
        lambda: qc.PerChannelMinMaxObserver(qscheme=torch.per_tensor_affine),
        "qscheme",
    ),
    (
        "histogram per-channel",
        lambda: qc.HistogramObserver(qscheme="per_channel_symmetric"),
        "qscheme",
    ),
    ("unknown qscheme", lambda: qc.MinMaxObserver(qscheme="per_tensor"), "unknown qscheme"),
    ("float dtype", lambda: qc.MinMaxObserver(dtype=torch.float32), "float dtype"),
    ("bool dtype", lambda: qc.MinMaxObserver(dtype=torch.bool), "unsupported dtype"),
    ("lone quant_min", lambda: qc.MinMaxObserver(quant_min=0), "both or neither"),
    ("range without 0", lambda: qc.MinMaxObserver(quant_min=1, quant_max=10), "must include 0"),
    ("empty range", lambda: qc.MinMaxObserver(quant_min=0, quant_max=0), "strictly less"),
    (
        "range outside dtype",
        lambda: qc.MinMaxObserver(dtype=torch.int8, quant_min=0, quant_max=255),
        "does not fit",
    ),
    ("float bound", lambda: qc.MinMaxObserver(quant_min=0.0, quant_max=255), "must be an int"),
    ("zero eps", lambda: qc.MinMaxObserver(eps=0.0), "eps"),
    ("typo kwarg", lambda: qc.MinMaxObserver(reduce_rnage=True), "reduce_rnage"),
    (
        "symmetric uint8 reduce",
        lambda: qc.MinMaxObserver(qscheme="per_tensor_symmetric", reduce_range=True),
        "reduce_range",
    ),
    (
        "symmetric uint8 reduce per channel",
        lambda: qc.PerChannelMinMaxObserver(qscheme="per_channel_symmetric", reduce_range=True),
        "reduce_range",
    ),
    ("bins", lambda: qc.HistogramObserver(bins=0), "bins"),
    ("dynamic histogram", lambda: qc.HistogramObserver(is_dynamic=True), "dynamic"),
    ("dynamic per channel", lambda: qc.PerChannelMinMaxObserver(is_dynamic=True), "dynamic"),
    (
        "dynamic moving average",
        lambda: qc.MovingAverageMinMaxObserver(is_dynamic=True),
        "averaging_constant=1",
    ),
    ("ch_axis type", lambda: qc.PerChannelMinMaxObserver(ch_axis=1.0), "ch_axis"),
    ("fixed scale", lambda: qc.FixedQParamsObserver(scale=0.0, zero_point=0), "scale"),
    (
        "fixed zero point",
        lambda: qc.FixedQParamsObserver(scale=0.1, zero_point=300),
        "zero_point 300",
    ),
    ("placeholder dtype", lambda: qc.PlaceholderObserver(dtype=torch.complex64), "dtype"),
]


@pytest.mark.parametrize(("label", "build", "match"), BAD, ids=[b[0] for b in BAD])
def test_bad_settings_raise_qconfig_error(label: str, build: Callable[[], Any], match: str) -> None:
    with pytest.raises(QConfigError, match=match) as info:
        build()
    assert "Observer" in str(info.value) or "dtype" in str(info.value)  # says where


def test_per_channel_axis_out_of_range_raises_at_forward() -> None:
    obs = qc.PerChannelMinMaxObserver(ch_axis=3)
    with pytest.raises(QConfigError, match=r"ch_axis=3 is out of range .*\(2, 5\)"):
        obs(torch.randn(2, 5))
    with pytest.raises(QConfigError, match="out of range"):
        qc.PerChannelMinMaxObserver()(torch.tensor(1.0))


def test_per_channel_changed_channel_count_raises() -> None:
    obs = qc.MovingAveragePerChannelMinMaxObserver()
    obs(torch.randn(4, 2))
    with pytest.raises(QConfigError, match=r"3 channels .* recorded 4"):
        obs(torch.randn(3, 2))


def test_corrupted_state_raises() -> None:
    obs = qc.MinMaxObserver()
    obs.load_state_dict(
        {"eps": torch.tensor([1e-7]), "min_val": torch.tensor(2.0), "max_val": torch.tensor(1.0)}
    )
    with pytest.raises(QConfigError, match="exceeds max_val"):
        obs.calculate_qparams()


def test_histogram_bins_mismatch_on_load_is_reported() -> None:
    src = qc.HistogramObserver(bins=8)
    src(torch.randn(20))
    with pytest.raises(RuntimeError, match="histogram"):
        qc.HistogramObserver(bins=16).load_state_dict(src.state_dict())
