"""calibrate(): input forms, eval/no-grad handling, progress bar, sync modes, errors."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import quantbridge.qconfig as qbq
from quantbridge.fx_quant import FxQuantError, calibrate, prepare_fx, sync_observers
from quantbridge.fx_quant._calibrate import _Progress


class Recorder(nn.Module):
    """Observes its input and records the mode and grad state of every call."""

    def __init__(self) -> None:
        super().__init__()
        self.obs = qbq.MinMaxObserver()
        self.calls: list[tuple[bool, bool, int]] = []

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.calls.append((self.training, torch.is_grad_enabled(), x.shape[0]))
        out: torch.Tensor = self.obs(x * scale)
        return out


def _batches(count: int = 4) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(3, 5, generator=gen) * (k + 1) for k in range(count)]


def _manual(batches: list[torch.Tensor]) -> qbq.MinMaxObserver:
    obs = qbq.MinMaxObserver()
    for b in batches:
        obs(b)
    return obs


@pytest.mark.parametrize("form", ["tuple", "list", "tensor", "dict", "generator"])
def test_input_forms_feed_the_model(form: str) -> None:
    batches = _batches()
    data: Any
    if form == "tuple":
        data = [(b,) for b in batches]
    elif form == "list":
        data = [[b] for b in batches]
    elif form == "tensor":
        data = batches
    elif form == "dict":
        data = [{"x": b} for b in batches]
    else:
        data = (b for b in batches)
    model = Recorder()
    assert calibrate(model, data, progress=False) is model
    ref = _manual(batches)
    assert torch.equal(model.obs.min_val, ref.min_val)
    assert torch.equal(model.obs.max_val, ref.max_val)
    assert len(model.calls) == len(batches)


def test_positional_and_keyword_extras_reach_the_model() -> None:
    batches = _batches(2)
    model = Recorder()
    calibrate(model, [(b, 2.0) for b in batches], progress=False)
    assert float(model.obs.max_val) == float(torch.cat(batches).max() * 2.0)
    other = Recorder()
    calibrate(other, [{"x": b, "scale": 3.0} for b in batches], progress=False)
    assert float(other.obs.min_val) == float(torch.cat(batches).min() * 3.0)


def test_dataloader_with_targets_and_input_fn() -> None:
    x = torch.randn(10, 5, generator=torch.Generator().manual_seed(1))
    y = torch.randn(10, 1) * 100  # must not be observed
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    model = Recorder()
    calibrate(model, loader, input_fn=lambda b: (b[0],), progress=False)
    assert [c[2] for c in model.calls] == [4, 4, 2]
    assert float(model.obs.max_val) == float(x.max())
    assert float(model.obs.min_val) == float(x.min())


def test_max_batches_stops_early() -> None:
    batches = _batches(5)
    model = Recorder()
    calibrate(model, iter(batches), max_batches=2, progress=False)
    assert len(model.calls) == 2
    assert torch.equal(model.obs.max_val, _manual(batches[:2]).max_val)


def test_eval_and_no_grad_during_then_flags_restored() -> None:
    model = nn.Sequential(Recorder(), nn.BatchNorm1d(5))
    model.train()
    model[1].eval()  # a per-module choice calibrate must not overwrite
    calibrate(model, _batches(2), progress=False)
    assert model[0].calls == [(False, False, 3), (False, False, 3)]
    assert model.training
    assert model[0].training
    assert not model[1].training
    assert torch.is_grad_enabled()


def test_flags_restored_when_the_model_raises() -> None:
    model = nn.Sequential(Recorder(), nn.Linear(5, 2)).train()
    with pytest.raises(RuntimeError):
        calibrate(model, [torch.randn(2, 5), torch.randn(2, 7)], progress=False)
    assert model.training
    assert model[0].training
    assert model[1].training


def test_prepared_model_calibrates_like_a_manual_loop() -> None:
    torch.manual_seed(0)
    float_model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 5)
    ).eval()
    mapping = qbq.get_default_qconfig_mapping("fbgemm")
    example = (torch.randn(1, 3, 6, 6),)
    gen = torch.Generator().manual_seed(2)
    data = [torch.randn(2, 3, 6, 6, generator=gen) for _ in range(3)]
    ours = calibrate(prepare_fx(float_model, mapping, example), data, progress=False)
    manual = prepare_fx(float_model, mapping, example)
    with torch.no_grad():
        for x in data:
            manual(x)
    state = manual.state_dict()
    assert ours.state_dict().keys() == state.keys()
    for key, value in ours.state_dict().items():
        assert torch.equal(value, state[key]), key


# -- progress bar -----------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_tty_redraws_one_line() -> None:
    stream = _Tty()
    bar = _Progress(3, stream=stream)
    bar.last -= 1.0  # let the first update draw
    for _ in range(3):
        bar.update()
    bar.close()
    text = stream.getvalue()
    assert text.startswith("\r")
    assert text.count("\n") == 1
    assert text.endswith("\n")
    assert "[########################] 3/3 batches" in text


def test_progress_in_a_log_prints_periodic_lines() -> None:
    stream = io.StringIO()
    bar = _Progress(None, stream=stream, interval=0.0)
    for _ in range(3):
        bar.update()
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines == [line for line in lines if line.startswith("calibrate: ") and "batches" in line]
    assert len(lines) == 4
    assert "\r" not in stream.getvalue()
    assert lines[-1].startswith("calibrate: 3 batches")


def test_progress_goes_to_stderr_and_can_be_disabled(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calibrate(Recorder(), _batches(2))
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "calibrate: [" in captured.err
    assert "2/2 batches" in captured.err
    calibrate(Recorder(), _batches(2), progress=False)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("QUANTBRIDGE_NO_PROGRESS", "1")
    calibrate(Recorder(), _batches(2), progress=True)
    assert capsys.readouterr().err == ""


# -- errors -----------------------------------------------------------------------------------


def test_bad_arguments_are_refused() -> None:
    model = Recorder()
    with pytest.raises(FxQuantError, match=r"model must be an nn\.Module"):
        calibrate(object(), [])  # type: ignore[arg-type]
    with pytest.raises(FxQuantError, match=r"wrap a single batch in a list"):
        calibrate(model, torch.randn(2, 5))
    with pytest.raises(FxQuantError, match="batch 1 is a int"):
        calibrate(model, [torch.randn(2, 5), 3], progress=False)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(FxQuantError, match="max_batches must be a positive int"):
            calibrate(model, [], max_batches=bad)  # type: ignore[arg-type]
    with pytest.raises(FxQuantError, match="input_fn must be callable"):
        calibrate(model, [], input_fn=3)  # type: ignore[arg-type]


def test_sync_modes_without_a_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    model = Recorder()
    calibrate(model, _batches(1), progress=False)  # sync=None: nothing to sync with
    calibrate(model, _batches(1), progress=False, sync=False)
    with pytest.raises(FxQuantError, match="sync=True needs an initialised"):
        calibrate(model, _batches(1), sync=True)
    with pytest.raises(FxQuantError, match="sync_every needs syncing"):
        calibrate(model, _batches(1), sync_every=1)


# -- with a one-rank gloo group in this process -----------------------------------------------


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


class CountingObserver(nn.Module):
    """A custom observer that shares its state through the documented hook."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([1.0]), torch.tensor([0])

    def sync_statistics(self, group: Any) -> None:
        self.syncs.append(group)


class CustomMinMax(qbq.MinMaxObserver):
    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[Any] = []

    def sync_statistics(self, group: Any) -> None:
        self.syncs.append(group)


class OpaqueObserver(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([1.0]), torch.tensor([0])


@pytest.mark.usefixtures("one_rank_group")
def test_one_rank_sync_keeps_the_statistics(capsys: pytest.CaptureFixture[str]) -> None:
    batches = _batches()
    model = nn.Sequential(
        qbq.MinMaxObserver(), qbq.HistogramObserver(), qbq.PerChannelMinMaxObserver(ch_axis=1)
    )
    manual = nn.Sequential(
        qbq.MinMaxObserver(), qbq.HistogramObserver(), qbq.PerChannelMinMaxObserver(ch_axis=1)
    )
    with torch.no_grad():
        for b in batches:
            manual(b)
    calibrate(model, batches, sync_every=2)
    assert "(observers synced across ranks)" in capsys.readouterr().err
    for key, value in manual.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.usefixtures("one_rank_group")
def test_custom_observer_hook_and_unknown_observers() -> None:
    counting = CountingObserver()
    sync_observers(nn.Sequential(qbq.MinMaxObserver(), counting))
    assert counting.syncs == [None]
    # A known observer class with its own hook: the hook decides, min/max are left alone.
    custom_minmax = CustomMinMax()
    custom_minmax(torch.tensor([1.0, 2.0]))
    sync_observers(nn.Sequential(custom_minmax))
    assert custom_minmax.syncs == [None]
    assert float(custom_minmax.max_val) == 2.0
    with pytest.raises(FxQuantError, match=r"module '1' \(OpaqueObserver\).*sync_statistics"):
        sync_observers(nn.Sequential(qbq.MinMaxObserver(), OpaqueObserver()))
    with pytest.raises(FxQuantError, match=r"model must be an nn\.Module"):
        sync_observers([qbq.MinMaxObserver()])  # type: ignore[arg-type]


@pytest.mark.usefixtures("one_rank_group")
def test_observers_without_statistics_are_left_alone() -> None:
    model = nn.Sequential(
        qbq.default_fixed_qparams_range_0to1_observer(),
        qbq.PlaceholderObserver(),
        qbq.NoopObserver(),
        qbq.ReuseInputObserver(),
        qbq.RecordingObserver(),
        qbq.default_fixed_qparams_range_0to1_fake_quant(),
    )
    model(torch.randn(2, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sync_observers(model)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert len(model[4].tensor_val) == 1


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("per_channel", [False, True])
def test_fused_fake_quant_refresh_matches_its_own_forward(per_channel: bool) -> None:
    """After a sync the fused module's scale/zero_point are what its forward computed (the
    fused op's own rule, which differs from the observer's calculate_qparams per channel)."""
    if per_channel:
        fq = qbq.default_fused_per_channel_wt_fake_quant()
    else:
        fq = qbq.default_fused_act_fake_quant()
    gen = torch.Generator().manual_seed(3)
    for k in range(3):
        fq(torch.randn(4, 3, 3, 3, generator=gen) * (k + 1))
    want = {k: v.clone() for k, v in fq.state_dict().items()}
    fq.scale.mul_(1.5)
    fq.zero_point.add_(1)
    sync_observers(nn.Sequential(fq))
    for key, value in fq.state_dict().items():
        assert torch.equal(value, want[key]), key


@pytest.mark.usefixtures("one_rank_group")
def test_sync_hook_counts_training_forwards_only() -> None:
    from quantbridge.fx_quant import sync_observers_hook

    counting = CountingObserver()
    model = nn.Sequential(nn.Linear(5, 5), counting)
    handle = sync_observers_hook(model, every=2)
    for _ in range(5):
        model(torch.randn(2, 5))
    model.eval()
    for _ in range(3):
        model(torch.randn(2, 5))
    assert len(counting.syncs) == 2
    handle.remove()
    model.train()
    model(torch.randn(2, 5))
    model(torch.randn(2, 5))
    assert len(counting.syncs) == 2
    for bad in (0, True, 1.5):
        with pytest.raises(FxQuantError, match="every must be a positive int"):
            sync_observers_hook(model, every=bad)  # type: ignore[arg-type]


@pytest.mark.usefixtures("one_rank_group")
def test_hundreds_of_observers_take_four_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Statistics travel in a few flat tensors, not one collective per observer."""
    calls: list[str] = []
    for name in ("all_reduce", "all_gather_object", "broadcast", "all_gather"):
        original = getattr(dist, name)

        def counted(*args: Any, _name: str = name, _orig: Any = original, **kw: Any) -> Any:
            calls.append(_name)
            return _orig(*args, **kw)

        monkeypatch.setattr(dist, name, counted)
    kinds = (qbq.MinMaxObserver, qbq.PerChannelMinMaxObserver, qbq.HistogramObserver)
    model = nn.Sequential(*(kinds[i % 3]() for i in range(300)))
    model(torch.randn(4, 3))
    sync_observers(model)
    # the check: one all_gather of a digest of every rank's observer configuration
    assert sorted(calls) == ["all_gather", "all_reduce", "all_reduce", "all_reduce"]
    calls.clear()
    sync_observers(model, check=False)
    assert calls == ["all_reduce", "all_reduce", "all_reduce"]


@pytest.mark.usefixtures("one_rank_group")
def test_sync_true_with_a_group() -> None:
    model = Recorder()
    calibrate(model, _batches(2), sync=True, progress=False)
    assert torch.equal(model.obs.max_val, _manual(_batches(2)).max_val)


@pytest.mark.parametrize("form", ["list", "generator", "exhausted_generator", "dataloader"])
def test_calibrate_without_any_batch_raises(form: str) -> None:
    data: Any
    if form == "list":
        data = []
    elif form == "generator":
        data = (b for b in _batches(0))
    elif form == "exhausted_generator":  # the usual way to get here: a generator reused
        data = (b for b in _batches(2))
        calibrate(Recorder(), data, progress=False)
    else:
        data = DataLoader(TensorDataset(torch.zeros(0, 5)), batch_size=2)
    model = Recorder()
    with pytest.raises(FxQuantError, match=r"calibrate: 0 batches seen: data .* yielded no batch"):
        calibrate(model, data, progress=False, sync=False)
    assert model.training  # the modules' own flags are restored


@pytest.mark.usefixtures("one_rank_group")
def test_calibrate_without_any_batch_raises_with_a_group() -> None:
    with pytest.raises(FxQuantError, match="0 batches seen on any of the 1 ranks"):
        calibrate(Recorder(), [], progress=False)


@pytest.mark.usefixtures("one_rank_group")
def test_sync_timeout_must_be_positive() -> None:
    model = nn.Sequential(qbq.MinMaxObserver())
    for bad in (0, -1.0, True, "5"):
        with pytest.raises(FxQuantError, match="timeout must be a positive number"):
            sync_observers(model, timeout=bad)  # type: ignore[arg-type]
    assert sync_observers(model, timeout=5) is model
