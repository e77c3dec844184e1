"""sync_observers / calibrate / QAT across two gloo processes on 127.0.0.1.

Each multi-process scenario runs once per module (torch.multiprocessing spawn, a free
loopback port, a hard deadline so a hang fails instead of blocking CI); the tests then compare
what each rank saved with a single process calibrating on the whole data set.
"""

from __future__ import annotations

import copy
import importlib
import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import quantbridge.qconfig as qbq
from quantbridge.fx_quant import (
    FxQuantError,
    calibrate,
    convert_fx,
    prepare_fx,
    prepare_qat_fx,
    sync_observers,
    sync_observers_hook,
)
from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.fx_quant.nn import qat as nnqat
from quantbridge.fx_quant.nn.intrinsic import qat as nniqat

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available in this torch build",
)

WORLD = 2
_TIMEOUT_S = 300.0  # the whole spawn run: ~30 s normally, far more on a loaded machine
_TESTS_DIR = Path(__file__).resolve().parent

# The histogram bound (docs/guide/distributed.md): merged vs. one
# process on the union, when the ranks' ranges differ.
HIST_SCALE_RTOL = 0.02
HIST_ZERO_POINT_ATOL = 2
HIST_MSE_RTOL = 0.02


# -- models and data shared by the parent and the workers ------------------------------------


class CalibModel(nn.Module):
    """Every kind of observer on a linear layer's input and output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.obs_in = qbq.MinMaxObserver()
        self.hist_in = qbq.HistogramObserver()
        self.linear = nn.Linear(8, 6)
        self.minmax_out = qbq.MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
        self.per_channel = qbq.PerChannelMinMaxObserver(ch_axis=1)
        self.hist_out = qbq.HistogramObserver()
        self.ma = qbq.MovingAverageMinMaxObserver()
        self.ma_pc = qbq.MovingAveragePerChannelMinMaxObserver(ch_axis=1)
        self.fq = qbq.FakeQuantize(observer=qbq.MovingAverageMinMaxObserver)
        self.fixed = qbq.default_fixed_qparams_range_0to1_observer()
        self.placeholder = qbq.PlaceholderObserver()
        self.rare = qbq.PerChannelMinMaxObserver(ch_axis=0)  # fed on one rank only
        self.rare_hist = qbq.HistogramObserver()  # fed on one rank only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.hist_in(self.obs_in(x))
        y = self.linear(x)
        for obs in (self.minmax_out, self.per_channel, self.hist_out, self.ma, self.ma_pc):
            obs(y)
        out: torch.Tensor = self.placeholder(self.fixed(self.fq(y)))
        return out


def dataset(seed: int = 1, count: int = 8) -> list[torch.Tensor]:
    """Batches whose ranges differ; batches 0 and 1 (each rank's first) hold the global
    input extremes -6 and 6, so the input histogram has one range everywhere."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for k in range(count):
        b = (torch.randn(16, 8, generator=gen) * (0.6 + 0.15 * k) + 0.1 * k).clamp(-5.9, 5.9)
        if k < 2:
            b[0, 0], b[0, 1] = -6.0, 6.0
        batches.append(b)
    return batches


def extra_batches(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(16, 8, generator=gen) * 3.0 for _ in range(2)]


def rare_input() -> torch.Tensor:
    return torch.linspace(-2.0, 3.0, 12).reshape(4, 3)


def global_batches(seed: int = 3, count: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 5, generator=gen) * (1.0 + 0.3 * k) for k in range(count)]


class MovingAverageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ma = qbq.MovingAverageMinMaxObserver(averaging_constant=0.3)
        self.ma_pc = qbq.MovingAveragePerChannelMinMaxObserver(averaging_constant=0.3, ch_axis=1)
        self.fused = qbq.default_fused_act_fake_quant()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fused(self.ma_pc(self.ma(x)))
        return out


def qat_model(sync_bn: bool) -> nn.Module:
    """Fake-quantized input -> ConvBnReLU2d (BN folded, statistics frozen) -> Linear."""
    torch.manual_seed(5)
    qconfig = qbq.get_default_qat_qconfig("fbgemm")
    conv = nn.Conv2d(2, 4, 3)
    bn: nn.Module = nn.BatchNorm2d(4)
    with torch.no_grad():
        bn.running_mean.uniform_(-0.3, 0.3)  # type: ignore[operator]
        bn.running_var.uniform_(0.5, 1.5)  # type: ignore[operator]
    if sync_bn:
        bn = nn.SyncBatchNorm.convert_sync_batchnorm(bn)
    fused = nni.ConvBnReLU2d(conv, bn, nn.ReLU())
    for sub in fused.modules():
        sub.qconfig = qconfig  # type: ignore[assignment]
    linear = nn.Linear(4 * 4 * 4, 3)
    linear.qconfig = qconfig  # type: ignore[assignment]
    convbn = nniqat.ConvBnReLU2d.from_float(fused)
    convbn.freeze_bn_stats()
    return nn.Sequential(
        qconfig.activation(),
        convbn,
        nn.Flatten(),
        nnqat.Linear.from_float(linear),
        qconfig.activation(),
    )


def qat_batches(step_count: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches; rank r trains on rows r::WORLD of each."""
    gen = torch.Generator().manual_seed(11)
    return [
        (torch.randn(4, 2, 6, 6, generator=gen) * (1 + 0.5 * s), torch.randn(4, 3, generator=gen))
        for s in range(step_count)
    ]


def float_net(bn: bool = False) -> nn.Module:
    torch.manual_seed(6)
    layers: list[nn.Module] = [nn.Conv2d(2, 4, 3)]
    if bn:
        layers.append(nn.BatchNorm2d(4))
    layers += [nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)]
    return nn.Sequential(*layers)


EXAMPLE = (torch.zeros(1, 2, 6, 6),)


def prepared_net() -> nn.Module:
    """prepare_fx with the fbgemm defaults (histogram activations, per-channel weights)."""
    return prepare_fx(float_net().eval(), qbq.get_default_qconfig_mapping("fbgemm"), EXAMPLE)


def prepared_qat_net() -> nn.Module:
    from quantbridge.fx_quant.nn.intrinsic.qat import freeze_bn_stats

    model = prepare_qat_fx(
        float_net(bn=True).train(), qbq.get_default_qat_qconfig_mapping("fbgemm"), EXAMPLE
    )
    model.apply(freeze_bn_stats)  # BN statistics are per rank on CPU (no SyncBatchNorm)
    return model


def image_dataset(count: int = 6) -> list[torch.Tensor]:
    """Batches 0 and 1 (each rank's first) hold the global input extremes."""
    gen = torch.Generator().manual_seed(4)
    batches = []
    for k in range(count):
        b = (torch.randn(4, 2, 6, 6, generator=gen) * (0.5 + 0.2 * k)).clamp(-3.9, 3.9)
        if k < 2:
            b[0, 0, 0, 0], b[0, 0, 0, 1] = -4.0, 4.0
        batches.append(b)
    return batches


def probe_input() -> torch.Tensor:
    return torch.randn(3, 2, 6, 6, generator=torch.Generator().manual_seed(9))


def observers_qparams(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    kinds = (qbq.MinMaxObserver, qbq.PerChannelMinMaxObserver, qbq.HistogramObserver)
    return {
        name: tuple(t.clone() for t in mod.calculate_qparams())  # type: ignore[misc]
        for name, mod in model.named_modules()
        if isinstance(mod, kinds) and mod.min_val.numel() > 0 and bool(mod.min_val.isfinite().all())
    }


def snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "qparams": observers_qparams(model),
    }


# -- workers (run in the spawned processes) ---------------------------------------------------


def _calibration_worker(rank: int, world: int) -> dict[str, Any]:
    model = CalibModel()
    if rank == 1:
        model.rare(rare_input())
        model.rare_hist(rare_input())
    shard = [(b,) for b in dataset()[rank::world]]
    calibrate(model, shard, sync=False, progress=False)
    result: dict[str, Any] = {"pre": snapshot(model)}
    sync_observers(model)
    result["post"] = snapshot(model)
    sync_observers(model)
    result["again"] = snapshot(model)
    # More data after a sync, then calibrate's own sync: earlier data must count once.
    calibrate(model, extra_batches(rank), progress=False)
    result["continued"] = snapshot(model)

    per_step = MovingAverageModel()
    calibrate(per_step, [g[rank::world] for g in global_batches()], sync_every=1, progress=False)
    result["per_step"] = snapshot(per_step)

    prepared = prepared_net()
    calibrate(prepared, image_dataset()[rank::world], progress=False)  # syncs: group is up
    result["prepared"] = snapshot(prepared)
    result["converted_out"] = convert_fx(copy.deepcopy(prepared))(probe_input())
    return result


def _mismatch_worker(rank: int, world: int) -> dict[str, str]:
    messages: dict[str, str] = {}
    model = nn.Sequential(qbq.MinMaxObserver(), qbq.MinMaxObserver())
    if rank == 1:
        model.append(qbq.HistogramObserver())
    try:
        sync_observers(model)
    except FxQuantError as exc:
        messages["structure"] = str(exc)
    pc = nn.Sequential(qbq.PerChannelMinMaxObserver(ch_axis=1))
    pc(torch.randn(4, 3 if rank == 0 else 5))
    try:
        sync_observers(pc)
    except FxQuantError as exc:
        messages["channels"] = str(exc)
    return messages


def _train(model: nn.Module, rank: int, world: int, hook: bool, sync_buffers: bool) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, forward_sync_buffers=sync_buffers)
    handle = sync_observers_hook(ddp) if hook else None
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, target in qat_batches():
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x[rank::world]), target[rank::world])
        loss.backward()
        opt.step()
    if handle is not None:
        handle.remove()
    return model


def _qat_worker(rank: int, world: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, hook, sync_buffers in (
        ("synced", True, False),
        ("synced_forward_sync_buffers", True, True),
        ("unsynced", False, False),
        ("unsynced_forward_sync_buffers", False, True),
    ):
        model = _train(qat_model(sync_bn=False), rank, world, hook, sync_buffers)
        result[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result["prepared_qat"] = {
        k: v.detach().clone()
        for k, v in _train(prepared_qat_net(), rank, world, True, False).state_dict().items()
    }
    # torch 2.13 on CPU: DDP refuses SyncBatchNorm modules, and SyncBatchNorm refuses to
    # compute cross-rank statistics of CPU tensors.
    try:
        _train(qat_model(sync_bn=True), rank, world, True, False)
        result["sync_bn_ddp_error"] = ""
    except ValueError as exc:
        result["sync_bn_ddp_error"] = str(exc)
    live = qat_model(sync_bn=True)
    live[1].update_bn_stats()
    try:
        live(torch.randn(2, 2, 6, 6))
        result["sync_bn_train_error"] = ""
    except ValueError as exc:
        result["sync_bn_train_error"] = str(exc)
    # What does work: QAT steps with frozen statistics (no DDP; gradients averaged by hand),
    # eval forward and folding, all equal to the BatchNorm2d model's.
    sync_m, plain_m = qat_model(sync_bn=True), qat_model(sync_bn=False)
    handles = [sync_observers_hook(sync_m), sync_observers_hook(plain_m)]
    for mod in (sync_m, plain_m):
        opt = torch.optim.SGD(mod.parameters(), lr=0.1)
        for x, target in qat_batches():
            opt.zero_grad()
            nn.functional.mse_loss(mod(x[rank::world]), target[rank::world]).backward()
            for p in mod.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
    for handle in handles:
        handle.remove()
    result["sync_bn_state"] = {k: v.detach().clone() for k, v in sync_m.state_dict().items()}
    plain_state = plain_m.state_dict()
    result["sync_bn_params_equal_plain"] = all(
        torch.equal(p, plain_state[k]) for k, p in sync_m.named_parameters()
    )
    sync_m.eval()
    plain_m.eval()
    x = torch.randn(2, 2, 6, 6, generator=torch.Generator().manual_seed(rank))
    result["eval_equal"] = torch.equal(sync_m[1](x), plain_m[1](x))
    folded_sync, folded_plain = sync_m[1].to_float(), plain_m[1].to_float()
    result["folded_equal"] = all(
        torch.equal(a, b)
        for a, b in zip(
            folded_sync.state_dict().values(),
            folded_plain.state_dict().values(),
            strict=True,
        )
    )
    return result


_WORKERS: dict[str, Callable[[int, int], Any]] = {
    "calibration": _calibration_worker,
    "mismatch": _mismatch_worker,
    "qat": _qat_worker,
}


def _entry(rank: int, world: int, port: int, workers: list[str], out_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),  # a hung collective fails
    )
    try:
        # One spawn for every scenario: starting the processes costs more than the work.
        result = {worker: _WORKERS[worker](rank, world) for worker in workers}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# -- the parent side --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _spawnable() -> Any:
    """This file imported under a plain module name, so spawned children can find _entry
    (pytest's importlib mode gives the collected module a name children cannot import)."""
    if str(_TESTS_DIR) not in sys.path:
        sys.path.insert(0, str(_TESTS_DIR))
    return importlib.import_module(Path(__file__).stem)


def run_workers(workers: list[str], out_dir: Path) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    module = _spawnable()
    ctx = mp.start_processes(
        module._entry,
        args=(WORLD, _free_port(), workers, str(out_dir)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + _TIMEOUT_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            pytest.fail(f"the workers {workers} did not finish within {_TIMEOUT_S}s (a hang?)")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_workers(list(_WORKERS), tmp_path_factory.mktemp("ranks"))


@pytest.fixture(scope="module")
def calib(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["calibration"] for r in ranks]


@pytest.fixture(scope="module")
def qat(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["qat"] for r in ranks]


def _single_process(batches: list[torch.Tensor]) -> CalibModel:
    model = CalibModel()
    model.rare(rare_input())
    model.rare_hist(rare_input())
    calibrate(model, [(b,) for b in batches], sync=False, progress=False)
    return model


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, tuple):
            for i, (u, v) in enumerate(zip(x, y, strict=True)):
                assert torch.equal(u, v), f"{what}: {key}[{i}] differs: {u} vs {v}"
        else:
            assert torch.equal(x, y), f"{what}: {key} differs: {x} vs {y}"


# -- calibration ------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["post", "again", "continued", "per_step", "prepared"])
def test_every_buffer_and_qparam_identical_on_both_ranks(
    calib: list[dict[str, Any]], stage: str
) -> None:
    _assert_same(calib[0][stage]["state"], calib[1][stage]["state"], f"{stage} state")
    _assert_same(calib[0][stage]["qparams"], calib[1][stage]["qparams"], f"{stage} qparams")


def test_ranks_differed_before_the_sync(calib: list[dict[str, Any]]) -> None:
    pre0, pre1 = calib[0]["pre"]["state"], calib[1]["pre"]["state"]
    for key in ("minmax_out.min_val", "per_channel.max_val", "hist_out.histogram", "ma.min_val"):
        assert not torch.equal(pre0[key], pre1[key]), key
    assert pre0["rare.min_val"].numel() == 0  # rank 0 never fed it: empty buffers
    assert float(pre0["rare_hist.histogram"].sum()) == 0
    assert pre1["rare.min_val"].numel() == 4


@pytest.mark.parametrize("order", ["sequential", "interleaved"])
def test_minmax_and_per_channel_equal_one_process_on_the_union(
    calib: list[dict[str, Any]], order: str
) -> None:
    data = dataset()
    batches = data if order == "sequential" else data[0::2] + data[1::2]
    single = _single_process(batches)
    state = single.state_dict()
    qparams = observers_qparams(single)
    synced = calib[0]["post"]
    for name in ("obs_in", "minmax_out", "per_channel", "rare"):
        for buf in ("min_val", "max_val"):
            key = f"{name}.{buf}"
            assert torch.equal(synced["state"][key], state[key]), key
        for got, want in zip(synced["qparams"][name], qparams[name], strict=True):
            assert torch.equal(got, want), name


def test_histogram_exact_when_every_rank_has_the_common_range(
    calib: list[dict[str, Any]],
) -> None:
    single = _single_process(dataset())
    synced = calib[0]["post"]
    for name in ("hist_in", "rare_hist"):
        for buf in ("histogram", "min_val", "max_val"):
            got = synced["state"][f"{name}.{buf}"]
            assert torch.equal(got, getattr(single, name).get_buffer(buf)), (name, buf)
    for got, want in zip(
        synced["qparams"]["hist_in"], single.hist_in.calculate_qparams(), strict=True
    ):
        assert torch.equal(got, want)


def _mse(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> float:
    q = torch.fake_quantize_per_tensor_affine(x, scale, zero_point.to(torch.int32), 0, 255)
    return float(((q - x) ** 2).mean())


@pytest.mark.parametrize("order", ["sequential", "interleaved"])
def test_histogram_within_the_documented_bound(calib: list[dict[str, Any]], order: str) -> None:
    data = dataset()
    batches = data if order == "sequential" else data[0::2] + data[1::2]
    single = _single_process(batches)
    synced = calib[0]["post"]
    # The range itself is exact (MIN/MAX); the counts differ by where re-binning puts them.
    assert torch.equal(synced["state"]["hist_out.min_val"], single.hist_out.min_val)
    assert torch.equal(synced["state"]["hist_out.max_val"], single.hist_out.max_val)
    merged = synced["state"]["hist_out.histogram"]
    assert float(merged.sum()) == pytest.approx(float(single.hist_out.histogram.sum()), rel=1e-6)
    scale, zp = synced["qparams"]["hist_out"]
    ref_scale, ref_zp = single.hist_out.calculate_qparams()
    assert abs(float(scale / ref_scale) - 1) <= HIST_SCALE_RTOL
    assert abs(int(zp) - int(ref_zp)) <= HIST_ZERO_POINT_ATOL
    with torch.no_grad():
        outputs = torch.cat([single.linear(b) for b in data])
    assert _mse(outputs, scale, zp) <= _mse(outputs, ref_scale, ref_zp) * (1 + HIST_MSE_RTOL)


def _merge_like_sync(observers: list[qbq.HistogramObserver]) -> qbq.HistogramObserver:
    """What sync_observers computes from these per-rank observers (its own helper, without
    the collectives): MIN/MAX range, each histogram re-binned onto it, float64 sum."""
    from quantbridge.fx_quant._distributed import _on_range

    low = torch.stack([o.min_val for o in observers]).min()
    high = torch.stack([o.max_val for o in observers]).max()
    total = sum(_on_range(o, o.histogram, o.min_val, o.max_val, low, high) for o in observers)
    merged = qbq.HistogramObserver()
    merged.min_val.copy_(low)
    merged.max_val.copy_(high)
    assert isinstance(total, torch.Tensor)
    merged._set_histogram(total.float())
    return merged


def _family(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kind = seed % 3
    batches = []
    for k in range(8):
        if kind == 0:  # growing spread
            b = torch.randn(32, 16, generator=gen) * (0.2 + 0.5 * k)
        elif kind == 1:  # heavy tails
            b = torch.randn(32, 16, generator=gen) / (torch.rand(32, 16, generator=gen) + 0.05)
        else:  # drifting uniform ranges
            b = torch.rand(32, 16, generator=gen) * (k + 1) - 0.3 * k
        batches.append(b)
    return batches


def test_histogram_bound_over_many_data_sets() -> None:
    """The documented bound, on 9 data sets of three shapes, against two single-process
    orders: scale within 2%, zero point within 2, quantization MSE at most 2% above."""
    approximated = 0
    for seed in range(9):
        batches = _family(seed)
        ranks = []
        for r in range(WORLD):
            obs = qbq.HistogramObserver()
            for b in batches[r::WORLD]:
                obs(b)
            ranks.append(obs)
        merged = _merge_like_sync(ranks)
        scale, zp = merged.calculate_qparams()
        values = torch.cat(batches)
        assert float(merged.histogram.sum()) == pytest.approx(values.numel(), rel=1e-6)
        for order in (batches, batches[0::2] + batches[1::2]):
            single = qbq.HistogramObserver()
            for b in order:
                single(b)
            ref_scale, ref_zp = single.calculate_qparams()
            assert abs(float(scale / ref_scale) - 1) <= HIST_SCALE_RTOL, seed
            assert abs(int(zp) - int(ref_zp)) <= HIST_ZERO_POINT_ATOL, seed
            ratio = _mse(values, scale, zp) / _mse(values, ref_scale, ref_zp)
            assert ratio <= 1 + HIST_MSE_RTOL, seed
            approximated += not torch.equal(merged.histogram, single.histogram)
    assert approximated >= 9  # the histograms do differ: the bound is what is tested


def test_moving_average_end_sync_is_the_widest_rank_estimate(
    calib: list[dict[str, Any]],
) -> None:
    pre = [c["pre"]["state"] for c in calib]
    post = calib[0]["post"]["state"]
    for name in ("ma", "ma_pc", "fq.activation_post_process"):
        want_min = torch.minimum(pre[0][f"{name}.min_val"], pre[1][f"{name}.min_val"])
        want_max = torch.maximum(pre[0][f"{name}.max_val"], pre[1][f"{name}.max_val"])
        assert torch.equal(post[f"{name}.min_val"], want_min), name
        assert torch.equal(post[f"{name}.max_val"], want_max), name


def test_fake_quantize_uses_the_synced_qparams(calib: list[dict[str, Any]]) -> None:
    post = calib[0]["post"]["state"]
    observer = qbq.MovingAverageMinMaxObserver()
    observer.min_val.copy_(post["fq.activation_post_process.min_val"])
    observer.max_val.copy_(post["fq.activation_post_process.max_val"])
    scale, zero_point = observer.calculate_qparams()
    assert torch.equal(post["fq.scale"], scale)
    assert torch.equal(post["fq.zero_point"], zero_point)
    pre_scales = [c["pre"]["state"]["fq.scale"] for c in calib]
    assert any(not torch.equal(s, scale) for s in pre_scales)


def test_repeated_sync_changes_nothing(calib: list[dict[str, Any]]) -> None:
    _assert_same(calib[0]["post"]["state"], calib[0]["again"]["state"], "second sync")


def test_data_after_a_sync_is_counted_once(calib: list[dict[str, Any]]) -> None:
    """Histogram mass after sync + more data + sync = every value observed, once."""
    state = calib[0]["continued"]["state"]
    values_per_batch = 16 * 6
    total_batches = len(dataset()) + WORLD * len(extra_batches(0))
    assert float(state["hist_out.histogram"].sum()) == pytest.approx(
        values_per_batch * total_batches, rel=1e-5
    )
    inputs = [*dataset(), *(b for r in range(WORLD) for b in extra_batches(r))]
    assert float(state["obs_in.min_val"]) == float(torch.cat(inputs).min())
    assert float(state["obs_in.max_val"]) == float(torch.cat(inputs).max())


def test_per_step_sync_equals_one_process_on_the_global_batches(
    calib: list[dict[str, Any]],
) -> None:
    single = MovingAverageModel()
    calibrate(single, global_batches(), sync=False, progress=False)
    synced = calib[0]["per_step"]["state"]
    for key, value in single.state_dict().items():
        assert torch.equal(synced[key], value), key


def test_prepared_model_on_two_ranks(calib: list[dict[str, Any]]) -> None:
    """prepare_fx + calibrate on shards: the input observer (one range everywhere) equals a
    single process exactly, the others within the histogram bound; convert_fx then gives the
    same quantized model on both ranks."""
    single = prepared_net()
    calibrate(single, image_dataset(), sync=False, progress=False)
    want = observers_qparams(single)
    got = calib[0]["prepared"]["qparams"]
    assert got.keys() == want.keys()
    assert len(want) >= 3
    first = next(name for name in want if name.startswith("activation_post_process"))
    for key in ("histogram", "min_val", "max_val"):
        assert torch.equal(
            calib[0]["prepared"]["state"][f"{first}.{key}"],
            single.get_submodule(first).get_buffer(key),
        )
    for name, (scale, zero_point) in got.items():
        ref_scale, ref_zero_point = want[name]
        assert torch.allclose(scale, ref_scale, rtol=HIST_SCALE_RTOL, atol=0), name
        assert (zero_point - ref_zero_point).abs().max() <= HIST_ZERO_POINT_ATOL, name
    assert torch.equal(calib[0]["converted_out"], calib[1]["converted_out"])


# -- errors -----------------------------------------------------------------------------------


def test_mismatched_observers_are_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for rank_messages in (r["mismatch"] for r in ranks):
        assert "ranks 0 and 1 hold different observers" in rank_messages["structure"]
        assert "'2' (HistogramObserver" in rank_messages["structure"]
        assert "3 channels on one rank and 5 on another" in rank_messages["channels"]


def test_without_a_process_group_sync_raises() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(FxQuantError, match="init_process_group"):
        sync_observers(nn.Sequential(qbq.MinMaxObserver()))
    with pytest.raises(FxQuantError, match="init_process_group"):
        sync_observers_hook(nn.Sequential(qbq.MinMaxObserver()))


# -- QAT under DDP ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant", ["synced", "synced_forward_sync_buffers", "sync_bn_state", "prepared_qat"]
)
def test_qat_steps_under_ddp_leave_identical_models(
    qat: list[dict[str, Any]], variant: str
) -> None:
    _assert_same(qat[0][variant], qat[1][variant], variant)


@pytest.mark.parametrize("variant", ["unsynced", "unsynced_forward_sync_buffers"])
def test_without_the_hook_the_ranks_disagree(qat: list[dict[str, Any]], variant: str) -> None:
    """pytorch issue #85627: unsynchronised observers give each rank its own qparams (with
    forward_sync_buffers=True rank 0's buffers are broadcast before each forward, and each
    rank's own data is observed on top)."""
    a, b = qat[0][variant], qat[1][variant]
    key = "0.activation_post_process.min_val"
    assert not torch.equal(a[key], b[key])
    assert not torch.equal(a["0.scale"], b["0.scale"])


def test_per_step_qat_sync_tracks_the_global_batch(qat: list[dict[str, Any]]) -> None:
    """The input fake-quantize sees raw data: after each step's sync its moving average is
    the one a single process computes on the whole global batch, bit for bit."""
    reference = qbq.get_default_qat_qconfig("fbgemm").activation()
    for x, _ in qat_batches():
        reference(x)
    for variant in ("synced", "synced_forward_sync_buffers"):
        for key, value in reference.state_dict().items():
            assert torch.equal(qat[0][variant][f"0.{key}"], value), (variant, key)


def test_sync_batchnorm_on_cpu(qat: list[dict[str, Any]]) -> None:
    """torch 2.13 on CPU: DDP refuses SyncBatchNorm and SyncBatchNorm refuses to train on CPU
    tensors in a multi-rank group. With frozen statistics the BN-folding QAT modules train
    (gradients averaged by hand) exactly like the BatchNorm2d version; eval forward and
    folding are equal too."""
    for result in qat:
        assert "SyncBatchNorm layers only work with GPU modules" in result["sync_bn_ddp_error"]
        assert "SyncBatchNorm expected input tensor to be on GPU" in result["sync_bn_train_error"]
        assert result["sync_bn_params_equal_plain"]
        assert result["eval_equal"]
        assert result["folded_equal"]
