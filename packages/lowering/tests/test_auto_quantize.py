"""compare_layers / compare_weights on lowered models, and auto_quantize: plain PTQ, the
search (fewest float layers within max_drop, one calibration), its report and its errors."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

from quantbridge.fx_quant import (
    calibrate,
    compare_layers,
    compare_weights,
    convert_to_reference_fx,
    prepare_fx,
)
from quantbridge.lowering import (
    AutoQuantizeError,
    AutoQuantizeReport,
    auto_quantize,
    get_backend,
    lowering_report,
)
from quantbridge.lowering import _auto_quantize as aq


class Sensitive(nn.Module):
    """conv1+relu -> conv2+relu (output channel 3 x300, undone in conv3) -> conv3 + a
    residual add (lowered as one conv+add kernel) -> average pool -> fc."""

    def __init__(self, scale: float = 300.0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv4 = nn.Conv2d(8, 8, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)
        with torch.no_grad():
            self.conv2.weight[3] *= scale
            self.conv2.bias[3] *= scale
            self.conv3.weight[:, 3] /= scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.conv1(x))
        x = self.relu2(self.conv2(x))
        x = self.conv3(x)
        x = self.conv4(x) + x
        return self.fc(torch.flatten(self.pool(x), 1))


def _data(n: int = 6, seed: int = 0) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, 6, 6, generator=g),) for _ in range(n)]


@pytest.fixture(scope="module")
def model() -> nn.Module:
    torch.manual_seed(0)
    return Sensitive().eval()


@pytest.fixture(scope="module")
def data() -> list[tuple[torch.Tensor]]:
    return _data()


def _prepared(model: nn.Module, data: list[Any], mapping: Any = None) -> Any:
    backend = get_backend("numba")
    mapping = backend.qconfig_mapping() if mapping is None else mapping
    prepared = prepare_fx(
        copy.deepcopy(model), mapping, data[0], backend_config=backend.backend_config
    )
    calibrate(prepared, data, progress=False)
    return prepared


def _sqnr_db(model: nn.Module, quantized: nn.Module, data: list[Any]) -> float:
    with torch.no_grad():
        s = sum(float(model(*b).double().square().sum()) for b in data)
        n = sum(float((quantized(*b).double() - model(*b).double()).square().sum()) for b in data)
    return 10 * math.log10(s / n)


# --- compare_layers / compare_weights on lowered models --------------------------------------


def test_compare_layers_lowered_names_the_sensitive_conv(model: nn.Module, data: Any) -> None:
    backend = get_backend("numba")
    lowered = backend.convert(_prepared(model, data))
    report = compare_layers(model, lowered, data)
    names = [r.name for r in report]
    # conv4 + add run as one kernel: the add holds their result
    assert names == ["conv1", "conv2", "conv3", "add", "pool", "flatten", "fc"], names
    assert report["conv2"].quantized_node != "conv2"  # a lowered node, mapped back
    for view in ("isolated", "propagated"):
        assert report.worst(1, view=view)[0].name in ("conv2", "conv3"), str(report)
    # the model output: the last row's propagated SQNR, computed directly
    assert report["fc"].sqnr_db == pytest.approx(_sqnr_db(model, lowered, data), rel=1e-9)


def test_compare_layers_lowered_equals_reference(model: nn.Module, data: Any) -> None:
    """The numba kernels compute the reference model's numbers: same rows, same errors."""
    backend = get_backend("numba")
    prepared = _prepared(model, data)
    reference = convert_to_reference_fx(
        copy.deepcopy(prepared), backend_config=backend.backend_config
    )
    lowered = backend.convert(prepared)
    ref_rows = {r.name: r for r in compare_layers(model, reference, data)}
    low_rows = {r.name: r for r in compare_layers(model, lowered, data)}
    for name in ("conv1", "conv2", "conv3", "add", "pool", "fc"):
        assert low_rows[name].scale == ref_rows[name].scale
        assert low_rows[name].sqnr_db == pytest.approx(ref_rows[name].sqnr_db, abs=0.05), name
        if name != "add":
            assert low_rows[name].isolated_sqnr_db == pytest.approx(
                ref_rows[name].isolated_sqnr_db, abs=0.05
            ), name
    # lowered, conv4 + add is one op: its isolated error includes conv4's own
    assert "conv4" in ref_rows
    assert "conv4" not in low_rows
    assert low_rows["add"].isolated_sqnr_db < ref_rows["add"].isolated_sqnr_db


def test_compare_weights_lowered(model: nn.Module, data: Any) -> None:
    backend = get_backend("numba")
    prepared = _prepared(model, data)
    reference = convert_to_reference_fx(
        copy.deepcopy(prepared), backend_config=backend.backend_config
    )
    lowered = backend.convert(prepared)
    ref_rows = {r.name: r for r in compare_weights(model, reference)}
    low = compare_weights(model, lowered)
    # conv4's weight lives in the conv+add kernel module, reported under conv4
    assert sorted(r.name for r in low) == sorted(ref_rows) == ["conv1", "conv2", "conv3",
                                                              "conv4", "fc"]  # fmt: skip
    for row in low:
        assert row.module == row.name
        # (reference get_weight() dequantizes in float32, the lowered weight here in float64)
        assert row.sqnr_db == pytest.approx(ref_rows[row.name].sqnr_db, rel=1e-6)
        assert row.max_abs_error == pytest.approx(ref_rows[row.name].max_abs_error, rel=1e-5)
    # direct: dequantize the lowered module's int8 weight by hand
    fc = next(m for n, m in lowered.named_modules() if n.startswith("fc") and hasattr(m, "weight"))
    deq = (fc.weight.double() - fc.weight_zero_point.double()[:, None]) * fc.weight_scale[:, None]
    w = model.fc.weight.detach().double()
    direct = 10 * math.log10(float(w.square().sum()) / float((deq - w).square().sum()))
    assert low["fc"].sqnr_db == pytest.approx(direct, rel=1e-9)


# --- auto_quantize -------------------------------------------------------------------------


def _outputs(m: nn.Module, data: list[Any]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [m(*b) for b in data]


def test_plain_ptq_equals_the_manual_flow(model: nn.Module, data: Any) -> None:
    auto = auto_quantize(model, "numba", data, progress=False)
    manual = get_backend("numba").convert(_prepared(model, data))
    for a, b in zip(_outputs(auto, data), _outputs(manual, data), strict=True):
        assert torch.equal(a, b)
    assert not isinstance(lowering_report(auto), AutoQuantizeReport)


def _metric(model: nn.Module, data: list[Any]) -> Any:
    """Output SQNR against the float model, capped (the float model scores the cap)."""

    def eval_fn(m: nn.Module) -> float:
        return 60.0 if m is model else min(60.0, _sqnr_db(model, m, data))

    return eval_fn


def test_search_leaves_the_sensitive_pair_float(
    model: nn.Module, data: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"calibrate": 0, "prepare": 0}
    for name in calls:
        real = getattr(aq, f"{name}_fx" if name == "prepare" else name)

        def counting(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(aq, f"{name}_fx" if name == "prepare" else name, counting)
    eval_fn = _metric(model, data)
    all_int8 = auto_quantize(model, "numba", data, progress=False)
    base = _sqnr_db(model, all_int8, data)
    assert base < 20  # the x300 channel breaks it
    max_drop = 60.0 - 35.0  # needs >= 35 dB

    result = auto_quantize(model, "numba", data, eval_fn=eval_fn, max_drop=max_drop)
    report = lowering_report(result)
    assert isinstance(report, AutoQuantizeReport)
    assert sorted(report.float_layers) == ["conv2", "conv3"]
    assert calls == {"calibrate": 2, "prepare": 2}  # once per auto_quantize call
    got = _sqnr_db(model, result, data)
    assert 60.0 - got <= max_drop
    # every step is recorded with its metric; the last within-budget one is returned
    steps = report.steps
    assert steps[0].action == "all quantized"
    assert steps[0].metric == pytest.approx(base)
    assert not steps[0].within_budget
    final = [s for s in steps if s.within_budget][-1]
    assert sorted(final.float_layers) == ["conv2", "conv3"]
    assert final.metric == pytest.approx(got)
    assert report.float_metric == 60.0
    text = str(report)
    assert "left float by auto_quantize: " in text
    assert "conv2" in text.split("left float by auto_quantize: ")[1]
    assert "step 0" in text

    # fewest: quantizing either one again misses the budget, checked independently
    backend = get_backend("numba")
    for keep_float in (["conv2"], ["conv3"]):
        mapping = backend.qconfig_mapping()
        for name in keep_float:
            mapping.set_module_name(name, None)
        single = backend.convert(_prepared(model, data, mapping))
        assert 60.0 - _sqnr_db(model, single, data) > max_drop, keep_float


def test_search_stops_at_step_zero_when_int8_is_good(model: nn.Module, data: Any) -> None:
    result = auto_quantize(model, "numba", data, eval_fn=_metric(model, data), max_drop=60.0)
    report = lowering_report(result)
    assert isinstance(report, AutoQuantizeReport)
    assert report.float_layers == []
    assert [s.action for s in report.steps] == ["all quantized"]


def test_eval_fn_alone_measures_plain_ptq(model: nn.Module, data: Any) -> None:
    result = auto_quantize(model, "numba", data, eval_fn=_metric(model, data), progress=False)
    report = lowering_report(result)
    assert isinstance(report, AutoQuantizeReport)
    assert len(report.steps) == 1
    assert report.steps[0].metric == pytest.approx(_sqnr_db(model, result, data))


def test_progress_bar_counts_evaluations(
    model: nn.Module, data: Any, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    monkeypatch.delenv("QUANTBRIDGE_NO_PROGRESS", raising=False)
    auto_quantize(model, "numba", data, eval_fn=_metric(model, data), max_drop=60.0)
    err = capsys.readouterr().err
    assert "calibrate:" in err
    assert "auto_quantize: 2 evals" in err  # the float model and the all-int8 one
    auto_quantize(model, "numba", data, eval_fn=_metric(model, data), max_drop=60.0,
                  progress=False)  # fmt: skip
    assert capsys.readouterr().err == ""


def test_unreachable_max_drop_raises_with_steps(model: nn.Module, data: Any) -> None:
    def eval_fn(m: nn.Module) -> float:
        return 1.0 if m is model else 0.0  # nothing quantized ever matches

    with pytest.raises(AutoQuantizeError, match=r"max_drop 0\.5 not reached") as info:
        auto_quantize(model, "numba", data, eval_fn=eval_fn, max_drop=0.5, progress=False)
    steps = info.value.steps
    assert steps[0].action == "all quantized"
    # every quantized module layer was tried float before giving up
    assert sorted(steps[-1].float_layers) == ["conv1", "conv2", "conv3", "conv4", "fc", "pool"]
    assert all(not s.within_budget and s.drop == 1.0 for s in steps)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_drop": 1.0}, "max_drop needs eval_fn"),
        ({"eval_fn": lambda m: 1.0, "max_drop": -0.1}, "max_drop must be a finite number >= 0"),
        ({"eval_fn": lambda m: 1.0, "max_drop": math.nan}, "finite number >= 0"),
        ({"eval_fn": lambda m: 1.0, "max_drop": "1"}, "max_drop must be a number"),
        ({"eval_fn": 3, "max_drop": 1.0}, "eval_fn must be callable"),
        ({"eval_fn": lambda m: "high", "max_drop": 1.0}, "returned str 'high' for the float"),
        ({"eval_fn": lambda m: None, "max_drop": 1.0}, "returned NoneType"),
        ({"eval_fn": lambda m: True, "max_drop": 1.0}, "returned bool"),
        ({"eval_fn": lambda m: math.nan, "max_drop": 1.0}, "returned nan"),
    ],
)
def test_argument_errors(model: nn.Module, data: Any, kwargs: Any, match: str) -> None:
    with pytest.raises(AutoQuantizeError, match=match):
        auto_quantize(model, "numba", data, progress=False, **kwargs)


def test_eval_fn_failing_on_quantized_model_names_it(model: nn.Module, data: Any) -> None:
    def eval_fn(m: nn.Module) -> Any:
        return 1.0 if m is model else [0.5]

    with pytest.raises(AutoQuantizeError, match=r"returned list .* all quantized"):
        auto_quantize(model, "numba", data, eval_fn=eval_fn, max_drop=0.1, progress=False)


def test_data_errors(model: nn.Module, data: Any) -> None:
    with pytest.raises(AutoQuantizeError, match="no batch"):
        auto_quantize(model, "numba", [], progress=False)
    with pytest.raises(AutoQuantizeError, match="iterable of batches"):
        auto_quantize(model, "numba", data[0][0], progress=False)
    with pytest.raises(AutoQuantizeError, match="backend must be"):
        auto_quantize(model, 3, data, progress=False)  # type: ignore[arg-type]
    # a generator works (iterated once) and a tensor batch counts as one input
    gen = (b[0] for b in data)
    auto_quantize(model, "numba", gen, progress=False)
