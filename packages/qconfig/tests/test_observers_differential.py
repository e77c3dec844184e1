"""Observers against torch.ao 2.13, bit for bit: qparams, their dtypes/shapes, and buffers.

The matrix: observer x qscheme x dtype x reduce_range x (default | custom quant range)
x data case. torch.ao is the oracle only (importorskip), so these skip once it is gone.
"""

from __future__ import annotations

import itertools
import warnings
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import quantbridge.qconfig as qc
from quantbridge.qconfig import QConfigError

ao = pytest.importorskip("torch.ao.quantization")
ao_obs = pytest.importorskip("torch.ao.quantization.observer")


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """Tiny tensors: torch's intra-op thread pool only adds latency here (milliseconds per
    reduction on a loaded machine). Both implementations run under the same setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# -- helpers --------------------------------------------------------------------------------


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical: dtype, shape and values (NaN equal to NaN at the same place)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        if not torch.equal(nan_a, nan_b):
            return False
        return torch.equal(a[~nan_a], b[~nan_b])
    return torch.equal(a, b)


def assert_same_state(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    s_ours, s_theirs = ours.state_dict(), theirs.state_dict()
    assert list(s_ours) == list(s_theirs)
    for key in s_theirs:
        assert same_tensor(s_ours[key], s_theirs[key]), (key, s_ours[key], s_theirs[key])


def assert_same_qparams(ours: Any, theirs: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q_theirs = theirs.calculate_qparams()
        q_ours = ours.calculate_qparams()
    for mine, ref in zip(q_ours, q_theirs, strict=True):
        assert same_tensor(mine, ref), (q_ours, q_theirs)


ALIASES = {"uint8": "quint8", "int8": "qint8", "int32": "qint32"}
DTYPES = ["uint8", "int8", "int32", "uint16", "int16"]
PER_TENSOR = ["per_tensor_affine", "per_tensor_symmetric"]
PER_CHANNEL = ["per_channel_affine", "per_channel_symmetric", "per_channel_affine_float_qparams"]
# A custom range per dtype (inside the dtype, containing 0), applied when ``custom`` is set.
CUSTOM_RANGE = {
    "uint8": (0, 127),
    "int8": (-127, 127),
    "int32": (-1000, 1000),
    "uint16": (0, 4095),
    "int16": (-300, 299),
}


def ao_dtype(name: str) -> torch.dtype:
    dtype: torch.dtype = getattr(torch, ALIASES.get(name, name))
    return dtype


def our_dtype(name: str, use_alias: bool) -> torch.dtype:
    dtype: torch.dtype = getattr(torch, ALIASES[name] if use_alias and name in ALIASES else name)
    return dtype


def build_pair(
    cls_name: str, dtype: str, qscheme: str, reduce_range: bool, custom: bool, **extra: Any
) -> tuple[Any, Any] | None:
    """(ours, torch.ao's) observers with the same settings; None when both reject them.

    Our dtype is passed alternately as the torch.ao alias and the canonical dtype.
    """
    kwargs: dict[str, Any] = dict(reduce_range=reduce_range, **extra)
    if custom:
        kwargs["quant_min"], kwargs["quant_max"] = CUSTOM_RANGE[dtype]
    use_alias = zlib.crc32(repr((cls_name, dtype, qscheme, reduce_range, custom)).encode()) % 2 == 1
    theirs_error: Exception | None = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            theirs = getattr(ao_obs, cls_name)(
                dtype=ao_dtype(dtype), qscheme=getattr(torch, qscheme), **kwargs
            )
        except (AssertionError, NotImplementedError) as e:
            theirs_error = e
    if theirs_error is not None or deliberately_rejected(dtype, qscheme, reduce_range, custom):
        with pytest.raises(QConfigError):
            getattr(qc, cls_name)(dtype=our_dtype(dtype, use_alias), qscheme=qscheme, **kwargs)
        return None
    # Alternate the QScheme spelling too: torch's qscheme object, or our name.
    our_qscheme: object = getattr(torch, qscheme) if use_alias else qscheme
    ours = getattr(qc, cls_name)(dtype=our_dtype(dtype, use_alias), qscheme=our_qscheme, **kwargs)
    return ours, theirs


def deliberately_rejected(dtype: str, qscheme: str, reduce_range: bool, custom: bool) -> bool:
    """Settings torch.ao accepts but quantbridge rejects (docs/porting.md: deliberate differences):
    symmetric uint8 with reduce_range (torch.ao rejects it for quint8 min/max observers
    only; its zero point 128 lies outside the reduced range [0, 127] in every case)."""
    return dtype == "uint8" and "symmetric" in qscheme and reduce_range


# -- data cases -----------------------------------------------------------------------------

Batches = list[torch.Tensor]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def data_cases() -> dict[str, Callable[[], Batches]]:
    return {
        "random": lambda: [torch.randn(3, 5, generator=_gen(0)) * 3],
        "batches": lambda: [
            torch.randn(2, 6, generator=_gen(1)),
            torch.randn(2, 6, generator=_gen(2)) * 5 + 1,
            torch.rand(2, 6, generator=_gen(3)) * 0.5,
            torch.randn(2, 6, generator=_gen(4)) * 20 - 3,
        ],
        "constant": lambda: [torch.full((2, 4), 2.5)],
        "negative_constant": lambda: [torch.full((4, 2), -0.75)],
        "zeros": lambda: [torch.zeros(3, 3)],
        "single": lambda: [torch.tensor([[0.3]])],
        "below_eps": lambda: [1e-9 * torch.randn(2, 4, generator=_gen(5))],
        "huge": lambda: [1e30 * torch.randn(2, 4, generator=_gen(6))],
        "positive_only": lambda: [torch.rand(3, 4, generator=_gen(7)) + 1.0],
        "channels_last": lambda: [
            torch.randn(2, 3, 4, 4, generator=_gen(8)).to(memory_format=torch.channels_last)
        ],
        "empty_then_data": lambda: [torch.empty(0, 3), torch.randn(2, 3, generator=_gen(9))],
    }


DATA = data_cases()


def matrix(qschemes: list[str]) -> Iterator[tuple[str, str, bool, bool]]:
    return itertools.product(qschemes, DTYPES, [False, True], [False, True])  # type: ignore[return-value]


def run(ours: Any, theirs: Any, batches: Batches) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in batches:
            out_ours = ours(x)
            out_theirs = theirs(x)
            assert out_ours is x  # observers pass their input through
            assert out_theirs is x
    assert_same_state(ours, theirs)
    assert_same_qparams(ours, theirs)


# -- per-tensor min/max ---------------------------------------------------------------------


@pytest.mark.parametrize("cls_name", ["MinMaxObserver", "MovingAverageMinMaxObserver"])
@pytest.mark.parametrize(("qscheme", "dtype", "reduce_range", "custom"), list(matrix(PER_TENSOR)))
@pytest.mark.parametrize("case", list(DATA))
def test_minmax_matrix(
    cls_name: str, qscheme: str, dtype: str, reduce_range: bool, custom: bool, case: str
) -> None:
    pair = build_pair(cls_name, dtype, qscheme, reduce_range, custom)
    if pair is None:
        return  # both rejected the settings (asserted in build_pair)
    run(*pair, DATA[case]())


@pytest.mark.parametrize("averaging_constant", [0.01, 0.5, 1])
def test_moving_average_constants(averaging_constant: float) -> None:
    pair = build_pair(
        "MovingAverageMinMaxObserver",
        "uint8",
        "per_tensor_affine",
        False,
        False,
        averaging_constant=averaging_constant,
    )
    assert pair is not None
    run(*pair, DATA["batches"]())


@pytest.mark.parametrize("eps", [2**-12, 1e-3, 1.0])
@pytest.mark.parametrize("qscheme", PER_TENSOR)
def test_minmax_eps(eps: float, qscheme: str) -> None:
    pair = build_pair("MinMaxObserver", "int8", qscheme, False, False, eps=eps)
    assert pair is not None
    run(*pair, [torch.tensor([-1e-4, 2e-4, 0.5e-4])])


# -- per-channel ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls_name", ["PerChannelMinMaxObserver", "MovingAveragePerChannelMinMaxObserver"]
)
@pytest.mark.parametrize(("qscheme", "dtype", "reduce_range", "custom"), list(matrix(PER_CHANNEL)))
@pytest.mark.parametrize("ch_axis", [0, 1, -1])
def test_per_channel_matrix(
    cls_name: str, qscheme: str, dtype: str, reduce_range: bool, custom: bool, ch_axis: int
) -> None:
    pair = build_pair(cls_name, dtype, qscheme, reduce_range, custom, ch_axis=ch_axis)
    if pair is None:
        return
    g = _gen(11)
    batches = [
        torch.randn(3, 4, 5, generator=g) * 2,
        torch.randn(3, 4, 5, generator=g) * torch.tensor([1.0, 10.0, 0.1, 3.0, 1e-9]) + 0.5,
        torch.zeros(3, 4, 5),
    ]
    run(*pair, batches)


@pytest.mark.parametrize(
    "cls_name", ["PerChannelMinMaxObserver", "MovingAveragePerChannelMinMaxObserver"]
)
@pytest.mark.parametrize("qscheme", PER_CHANNEL)
@pytest.mark.parametrize(
    "case", ["constant", "zeros", "single", "below_eps", "huge", "channels_last", "batches"]
)
def test_per_channel_data_cases(cls_name: str, qscheme: str, case: str) -> None:
    pair = build_pair(cls_name, "int8", qscheme, False, False, ch_axis=1)
    assert pair is not None
    run(*pair, DATA[case]())


def test_per_channel_channels_last_axis_1() -> None:
    x = torch.randn(2, 3, 4, 4, generator=_gen(12)).to(memory_format=torch.channels_last)
    pair = build_pair("PerChannelMinMaxObserver", "int8", "per_channel_symmetric", False, False)
    assert pair is not None
    ours, theirs = pair
    ours.ch_axis = theirs.ch_axis = 1
    run(ours, theirs, [x, x * 2])


# -- histogram ------------------------------------------------------------------------------


@pytest.mark.parametrize(("qscheme", "dtype", "reduce_range", "custom"), list(matrix(PER_TENSOR)))
def test_histogram_matrix(qscheme: str, dtype: str, reduce_range: bool, custom: bool) -> None:
    pair = build_pair("HistogramObserver", dtype, qscheme, reduce_range, custom, bins=64)
    if pair is None:
        return
    run(*pair, DATA["batches"]())


@pytest.mark.parametrize("bins", [1, 2, 7, 64, 256, 2048])
@pytest.mark.parametrize("qscheme", PER_TENSOR)
def test_histogram_bins(bins: int, qscheme: str) -> None:
    pair = build_pair("HistogramObserver", "uint8", qscheme, False, False, bins=bins)
    assert pair is not None
    g = _gen(13)
    run(*pair, [torch.randn(200, generator=g), torch.randn(300, generator=g) * 3 + 1])


@pytest.mark.parametrize("case", list(DATA))
@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_histogram_data_cases(case: str, dtype: str) -> None:
    pair = build_pair("HistogramObserver", dtype, "per_tensor_affine", True, False, bins=128)
    assert pair is not None
    run(*pair, DATA[case]())


def histogram_sequences() -> dict[str, Batches]:
    g = _gen(14)
    base = torch.randn(500, generator=g)
    return {
        # The new range contains the old one on both sides (re-binning with upsampling).
        "widening": [base, base * 3, base * 10 + 4],
        # Same range again: histograms just add up.
        "same_range": [base, base.clone(), base.flip(0)],
        # Inside the old range: the new histogram is binned over the old range.
        "narrowing": [base * 10, base, base * 0.1],
        # One-sided growth.
        "shift_right": [base, base + 5, base + 50],
        "shift_left": [base, base - 5, base - 50],
        # A constant first batch (min == max) merged into a real range.
        "constant_first": [torch.full((10,), 1.5), base, base * 2],
        "zeros_first": [torch.zeros(10), base],
        "heavy_tail": [base, torch.cat([base, torch.tensor([1e3, -2e3])])],
        "many": [torch.randn(64, generator=g) * (i + 1) + i for i in range(8)],
    }


SEQUENCES = histogram_sequences()


@pytest.mark.parametrize("name", list(SEQUENCES))
@pytest.mark.parametrize("bins", [16, 256])
@pytest.mark.parametrize("qscheme", PER_TENSOR)
def test_histogram_combining(name: str, bins: int, qscheme: str) -> None:
    pair = build_pair("HistogramObserver", "uint8", qscheme, False, False, bins=bins)
    assert pair is not None
    run(*pair, SEQUENCES[name])


def test_histogram_default_bins_widening() -> None:
    """The default 2048 bins, a widening sequence: upsampling at full size."""
    pair = build_pair("HistogramObserver", "uint8", "per_tensor_affine", True, False)
    assert pair is not None
    run(*pair, SEQUENCES["widening"])


def test_histogram_float64_input() -> None:
    pair = build_pair("HistogramObserver", "int8", "per_tensor_symmetric", False, False, bins=32)
    assert pair is not None
    g = _gen(15)
    run(*pair, [torch.randn(50, generator=g, dtype=torch.float64) * 1.1, torch.randn(50).double()])


# -- NaN / inf ------------------------------------------------------------------------------

INF_BATCHES = {
    "inf": [torch.tensor([1.0, float("inf"), -2.0]), torch.tensor([0.5, 3.0])],
    "neg_inf": [torch.tensor([1.0, float("-inf"), -2.0]), torch.tensor([0.5, 3.0])],
    "all_inf": [torch.tensor([float("inf"), float("-inf")]), torch.tensor([0.5, 3.0])],
}


@pytest.mark.parametrize("case", list(INF_BATCHES))
@pytest.mark.parametrize("qscheme", PER_TENSOR)
def test_histogram_skips_inf_like_torch_ao(case: str, qscheme: str) -> None:
    pair = build_pair("HistogramObserver", "uint8", qscheme, False, False, bins=32)
    assert pair is not None
    ours, theirs = pair
    with pytest.warns(UserWarning, match="inf"):
        ours(INF_BATCHES[case][0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs(INF_BATCHES[case][0])
    run(ours, theirs, INF_BATCHES[case][1:])


def test_histogram_nan_raises() -> None:
    obs = qc.HistogramObserver(bins=8)
    with pytest.raises(QConfigError, match="NaN"):
        obs(torch.tensor([1.0, float("nan")]))
    # torch.ao fails too (inside torch.histc), just less clearly.
    with pytest.raises(RuntimeError):
        ao_obs.HistogramObserver(bins=8)(torch.tensor([1.0, float("nan")]))


NONFINITE = {
    "nan": torch.tensor([[1.0, float("nan")], [-2.0, 0.5]]),
    "inf": torch.tensor([[1.0, float("inf")], [-2.0, 0.5]]),
    "neg_inf": torch.tensor([[1.0, 0.25], [float("-inf"), 0.5]]),
}


@pytest.mark.parametrize("case", list(NONFINITE))
@pytest.mark.parametrize(
    "cls_name",
    [
        "MinMaxObserver",
        "MovingAverageMinMaxObserver",
        "PerChannelMinMaxObserver",
        "MovingAveragePerChannelMinMaxObserver",
    ],
)
def test_minmax_nonfinite_records_like_torch_ao_then_raises(case: str, cls_name: str) -> None:
    """Buffers record NaN/inf exactly as torch.ao's do; calculate_qparams refuses them
    (torch.ao would return a NaN/inf scale)."""
    qscheme = "per_channel_affine" if "PerChannel" in cls_name else "per_tensor_affine"
    pair = build_pair(cls_name, "uint8", qscheme, False, False)
    assert pair is not None
    ours, theirs = pair
    batches = [NONFINITE[case], torch.tensor([[0.5, 3.0], [1.0, 1.0]])]
    for x in batches:
        ours(x)
        theirs(x)
    assert_same_state(ours, theirs)
    with pytest.raises(QConfigError, match="not finite"):
        ours.calculate_qparams()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scale, _ = theirs.calculate_qparams()
    assert not bool(torch.isfinite(scale).all())  # what we refuse to hand out


# -- unobserved, state_dict -----------------------------------------------------------------


@pytest.mark.parametrize(
    "cls_name",
    [
        "MinMaxObserver",
        "MovingAverageMinMaxObserver",
        "PerChannelMinMaxObserver",
        "MovingAveragePerChannelMinMaxObserver",
        "HistogramObserver",
    ],
)
def test_unobserved_defaults_match(cls_name: str) -> None:
    qscheme = "per_channel_affine" if "PerChannel" in cls_name else "per_tensor_affine"
    pair = build_pair(cls_name, "uint8", qscheme, False, False)
    assert pair is not None
    ours, theirs = pair
    with pytest.warns(UserWarning, match="before the observer saw any data"):
        ours.calculate_qparams()
    assert_same_qparams(ours, theirs)
    assert_same_state(ours, theirs)


@pytest.mark.parametrize(
    ("cls_name", "qscheme", "kwargs"),
    [
        ("MinMaxObserver", "per_tensor_affine", {}),
        ("MovingAverageMinMaxObserver", "per_tensor_symmetric", {}),
        ("PerChannelMinMaxObserver", "per_channel_affine", {"ch_axis": 1}),
        ("MovingAveragePerChannelMinMaxObserver", "per_channel_symmetric", {}),
        ("PerChannelMinMaxObserver", "per_channel_affine_float_qparams", {}),
        ("HistogramObserver", "per_tensor_affine", {"bins": 32}),
    ],
)
def test_state_dict_loads_across_implementations(
    cls_name: str, qscheme: str, kwargs: dict[str, Any]
) -> None:
    """A calibrated torch.ao state_dict loads into a fresh quantbridge observer (empty
    per-channel buffers included) and gives the same qparams; and the other way round."""
    pair = build_pair(cls_name, "int8", qscheme, False, False, **kwargs)
    assert pair is not None
    ours, theirs = pair
    x = torch.randn(4, 3, 5, generator=_gen(16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs(x)
        theirs(x * 2 - 1)
    fresh_pair = build_pair(cls_name, "int8", qscheme, False, False, **kwargs)
    assert fresh_pair is not None
    fresh_ours, fresh_theirs = fresh_pair
    fresh_ours.load_state_dict(theirs.state_dict())
    assert_same_state(fresh_ours, theirs)
    assert_same_qparams(fresh_ours, theirs)
    # ours -> torch.ao
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours(x)
        ours(x * 2 - 1)
    fresh_theirs.load_state_dict(ours.state_dict())
    assert_same_qparams(ours, fresh_theirs)


def test_loaded_state_is_not_shared_with_the_state_dict() -> None:
    src = qc.HistogramObserver(bins=16)
    src(torch.randn(40, generator=_gen(17)))
    state = {k: v.clone() for k, v in src.state_dict().items()}
    dst = qc.HistogramObserver(bins=16)
    dst.load_state_dict(state)
    before = state["min_val"].clone()
    dst(torch.tensor([-100.0, 100.0]))
    assert torch.equal(state["min_val"], before)
    assert float(dst.min_val) == -100.0


@pytest.mark.parametrize("input_dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    ("cls_name", "qscheme", "extra"),
    [
        ("MinMaxObserver", "per_tensor_affine", {}),
        ("MovingAverageMinMaxObserver", "per_tensor_symmetric", {}),
        ("PerChannelMinMaxObserver", "per_channel_affine", {"ch_axis": 1}),
        ("MovingAveragePerChannelMinMaxObserver", "per_channel_symmetric", {}),
        ("HistogramObserver", "per_tensor_affine", {"bins": 16}),
    ],
)
def test_non_float32_inputs(
    input_dtype: torch.dtype, cls_name: str, qscheme: str, extra: dict[str, Any]
) -> None:
    pair = build_pair(cls_name, "int8", qscheme, False, False, **extra)
    assert pair is not None
    g = _gen(18)
    batches = [(torch.randn(5, 10, generator=g) * s).to(input_dtype) for s in (1.0, 3.0)]
    run(*pair, batches)


def test_histogram_integer_input_raises() -> None:
    with pytest.raises(QConfigError, match="not a floating-point dtype"):
        qc.HistogramObserver(bins=8)(torch.arange(10, dtype=torch.int32))
