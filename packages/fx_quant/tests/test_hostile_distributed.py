"""sync_observers / calibrate when the ranks disagree, across two gloo processes.

Every scenario runs in one spawn (one process group, reused): each rank builds its own
variant of a model, calls sync_observers (or calibrate) and records the error text it got
and how long the call took. The tests then check that BOTH ranks raised, naming the observer,
the field and each rank's value, and that nobody waited for a collective that never came.
"""

from __future__ import annotations

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
from quantbridge.fx_quant import FxQuantError, calibrate, sync_observers

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available in this torch build",
)

WORLD = 2
_SPAWN_TIMEOUT_S = 300.0  # the whole run: ~15 s normally
_SYNC_TIMEOUT_S = 60.0  # each sync's wait for the other rank (a bug fails, never hangs)
_FAST_S = 20.0  # a refused sync takes well under this (no timeout involved)
_TESTS_DIR = Path(__file__).resolve().parent


def _pair(rank: int, first: Callable[[], nn.Module], second: Callable[[], nn.Module]) -> nn.Module:
    """An observer after a linear layer: ``first()`` on rank 0, ``second()`` on rank 1."""
    return nn.Sequential(nn.Linear(4, 4), first() if rank == 0 else second())


class OpaqueObserver(nn.Module):
    """An observer class sync_observers cannot synchronise (no sync_statistics)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([1.0]), torch.tensor([0])


def _fake_quant(enabled: bool) -> nn.Module:
    fq = qbq.FakeQuantize(observer=qbq.MovingAverageMinMaxObserver)
    if not enabled:
        fq.disable_observer()
    return fq


# case name -> (rank 0's observer, rank 1's observer); each differs in the named field
FIELD_CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], nn.Module]]] = {
    "dtype": (
        lambda: qbq.MinMaxObserver(dtype=torch.quint8),
        lambda: qbq.MinMaxObserver(dtype=torch.qint8),
    ),
    "qscheme": (
        lambda: qbq.MinMaxObserver(qscheme=torch.per_tensor_affine),
        lambda: qbq.MinMaxObserver(qscheme=torch.per_tensor_symmetric),
    ),
    "quant_max": (
        lambda: qbq.MinMaxObserver(quant_min=0, quant_max=127),
        lambda: qbq.MinMaxObserver(quant_min=0, quant_max=255),
    ),
    "quant_min": (
        lambda: qbq.MinMaxObserver(dtype=torch.qint8, quant_min=-128, quant_max=127),
        lambda: qbq.MinMaxObserver(dtype=torch.qint8, quant_min=-127, quant_max=127),
    ),
    "reduce_range": (
        lambda: qbq.MinMaxObserver(reduce_range=True),
        lambda: qbq.MinMaxObserver(reduce_range=False),
    ),
    "eps": (lambda: qbq.MinMaxObserver(eps=1e-5), lambda: qbq.MinMaxObserver()),
    "ch_axis": (
        lambda: qbq.PerChannelMinMaxObserver(ch_axis=0),
        lambda: qbq.PerChannelMinMaxObserver(ch_axis=1),
    ),
    "bins": (lambda: qbq.HistogramObserver(bins=256), lambda: qbq.HistogramObserver()),
    "averaging_constant": (
        lambda: qbq.MovingAverageMinMaxObserver(averaging_constant=0.01),
        lambda: qbq.MovingAverageMinMaxObserver(averaging_constant=0.3),
    ),
    "is_dynamic": (
        lambda: qbq.PlaceholderObserver(dtype=torch.quint8, is_dynamic=True),
        lambda: qbq.PlaceholderObserver(dtype=torch.quint8, is_dynamic=False),
    ),
    "scale": (
        lambda: qbq.FixedQParamsObserver(scale=1.0 / 256.0, zero_point=0),
        lambda: qbq.FixedQParamsObserver(scale=2.0 / 256.0, zero_point=0),
    ),
    "zero_point": (
        lambda: qbq.FixedQParamsObserver(scale=2.0 / 256.0, zero_point=0),
        lambda: qbq.FixedQParamsObserver(scale=2.0 / 256.0, zero_point=128),
    ),
    "observer_enabled": (lambda: _fake_quant(True), lambda: _fake_quant(False)),
}
# what each rank's value looks like in the message (JSON text)
FIELD_VALUES: dict[str, tuple[str, str]] = {
    "dtype": ('"torch.uint8"', '"torch.int8"'),
    "qscheme": ('"per_tensor_affine"', '"per_tensor_symmetric"'),
    "quant_max": ("127", "255"),
    "quant_min": ("-128", "-127"),
    "reduce_range": ("true", "false"),
    "eps": ("[9.999999747378752e-06]", "[1.1920928955078125e-07]"),  # float32 buffers
    "ch_axis": ("0", "1"),
    "bins": ("256", "2048"),
    "averaging_constant": ("0.01", "0.3"),
    "is_dynamic": ("true", "false"),
    "scale": ("[0.00390625]", "[0.0078125]"),
    "zero_point": ("[0]", "[128]"),
    "observer_enabled": ("[1]", "[0]"),
}


def _attempt(results: dict[str, dict[str, Any]], name: str, call: Callable[[], object]) -> None:
    start = time.monotonic()
    try:
        call()
        message = ""
    except FxQuantError as exc:
        message = str(exc)
    results[name] = {"message": message, "seconds": time.monotonic() - start}


def _scenarios(rank: int) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for field, (first, second) in FIELD_CASES.items():
        model = _pair(rank, first, second)
        _attempt(results, field, lambda m=model: sync_observers(m, timeout=_SYNC_TIMEOUT_S))

    # the reported bug: quint8 on one rank, qint8 on the other, through calibrate
    first, second = FIELD_CASES["dtype"]
    model = _pair(rank, first, second)
    data = [torch.randn(8, 4, generator=torch.Generator().manual_seed(rank)) for _ in range(2)]
    _attempt(results, "calibrate_dtype", lambda: calibrate(model, data, progress=False))
    results["calibrate_dtype"]["zero_point"] = int(model[1].calculate_qparams()[1])

    # another class on one rank
    model = _pair(rank, qbq.MinMaxObserver, qbq.MovingAverageMinMaxObserver)
    _attempt(results, "class", lambda: sync_observers(model, timeout=_SYNC_TIMEOUT_S))

    # one rank fails while planning: it still joins the exchange, both raise
    model = _pair(rank, qbq.MinMaxObserver, OpaqueObserver)
    _attempt(results, "local_error", lambda: sync_observers(model, timeout=_SYNC_TIMEOUT_S))

    # identical configurations still sync (and agree afterwards)
    same = nn.Sequential(
        qbq.MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
        qbq.HistogramObserver(bins=256),
        qbq.PerChannelMinMaxObserver(ch_axis=1),
        qbq.FixedQParamsObserver(scale=1.0 / 256.0, zero_point=0),
        _fake_quant(True),
    )
    same(torch.randn(6, 3, generator=torch.Generator().manual_seed(10 + rank)) * (rank + 1))
    _attempt(results, "identical", lambda: sync_observers(same, timeout=_SYNC_TIMEOUT_S))
    results["identical"]["state"] = {k: v.clone() for k, v in same.state_dict().items()}

    # calibrate with no data: on both ranks it raises on both; on one rank only it is fine
    empty_model = nn.Sequential(qbq.MinMaxObserver())
    _attempt(results, "empty_everywhere", lambda: calibrate(empty_model, [], progress=False))
    one_empty = nn.Sequential(qbq.MinMaxObserver())
    shard = [] if rank == 1 else [torch.arange(6.0).reshape(2, 3)]
    _attempt(results, "empty_on_one_rank", lambda: calibrate(one_empty, shard, progress=False))
    results["empty_on_one_rank"]["max_val"] = float(one_empty[0].max_val)

    # rank 1 never arrives in time: rank 0 gives up after its timeout (on a separate group,
    # which the timeout leaves out of step; rank 1 drains it afterwards)
    late_group = dist.new_group(list(range(WORLD)))
    if rank == 0:
        model = nn.Sequential(qbq.MinMaxObserver())
        _attempt(results, "timeout", lambda: sync_observers(model, late_group, timeout=1.0))
    else:
        time.sleep(4.0)
        digest = torch.zeros(32, dtype=torch.uint8)
        dist.all_gather([torch.zeros_like(digest) for _ in range(WORLD)], digest, late_group)
    dist.barrier()
    return results


def _entry(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["QUANTBRIDGE_NO_PROGRESS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        torch.save(_scenarios(rank), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    import torch.multiprocessing as mp

    # spawned children import this file under a plain name (pytest's importlib mode does not)
    if str(_TESTS_DIR) not in sys.path:
        sys.path.insert(0, str(_TESTS_DIR))
    module = importlib.import_module(Path(__file__).stem)
    out_dir = tmp_path_factory.mktemp("hostile")
    ctx = mp.start_processes(
        module._entry,
        args=(WORLD, _free_port(), str(out_dir)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + _SPAWN_TIMEOUT_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            pytest.fail(f"the workers did not finish within {_SPAWN_TIMEOUT_S}s (a hang?)")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("field", list(FIELD_CASES))
def test_a_field_mismatch_is_refused_on_both_ranks(
    ranks: list[dict[str, dict[str, Any]]], field: str
) -> None:
    first, second = FIELD_VALUES[field]
    for rank, results in enumerate(ranks):
        message = results[field]["message"]
        assert message, f"rank {rank} synced observers configured differently ({field})"
        assert "configured differently" in message
        assert f"'1' ({type(FIELD_CASES[field][0]()).__name__}) {field} differs" in message
        assert f"rank 0: {first}" in message, message
        assert f"rank 1: {second}" in message, message
        assert results[field]["seconds"] < _FAST_S


def test_the_messages_agree_across_ranks(ranks: list[dict[str, dict[str, Any]]]) -> None:
    for field in FIELD_CASES:
        texts = [r[field]["message"].replace(f"(rank {i})", "") for i, r in enumerate(ranks)]
        assert texts[0] == texts[1], field


def test_calibrate_with_quint8_and_qint8_is_refused(ranks: list[dict[str, dict[str, Any]]]) -> None:
    for results in ranks:
        assert "dtype differs" in results["calibrate_dtype"]["message"]
    # the statistics were not exchanged: each rank kept its own (different) qparams
    assert ranks[0]["calibrate_dtype"]["zero_point"] >= 0
    assert ranks[1]["calibrate_dtype"]["zero_point"] < 128


def test_another_class_is_refused(ranks: list[dict[str, dict[str, Any]]]) -> None:
    for results in ranks:
        message = results["class"]["message"]
        assert "ranks 0 and 1 hold different observers" in message
        assert "rank 0 has '1' (MinMaxObserver)" in message
        assert "rank 1 has '1' (MovingAverageMinMaxObserver)" in message


def test_a_local_error_reaches_every_rank(ranks: list[dict[str, dict[str, Any]]]) -> None:
    own = ranks[1]["local_error"]["message"]
    assert "'1' (OpaqueObserver)" in own
    assert "sync_statistics" in own
    other = ranks[0]["local_error"]["message"]
    assert other.startswith("sync_observers: rank 1 could not take part:")
    assert "'1' (OpaqueObserver)" in other
    for results in ranks:
        assert results["local_error"]["seconds"] < _FAST_S


def test_identical_configurations_still_sync(ranks: list[dict[str, dict[str, Any]]]) -> None:
    a, b = ranks[0]["identical"], ranks[1]["identical"]
    assert a["message"] == ""
    assert b["message"] == ""
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        assert torch.equal(a["state"][key], b["state"][key]), key


def test_calibrate_without_any_batch_raises_on_every_rank(
    ranks: list[dict[str, dict[str, Any]]],
) -> None:
    for results in ranks:
        assert "0 batches seen on any of the 2 ranks" in results["empty_everywhere"]["message"]
        assert results["empty_on_one_rank"]["message"] == ""
        # the rank without data took the other's statistics
        assert results["empty_on_one_rank"]["max_val"] == 5.0


def test_a_missing_rank_times_out_instead_of_hanging(
    ranks: list[dict[str, dict[str, Any]]],
) -> None:
    result = ranks[0]["timeout"]
    assert "gave up after 1 s" in result["message"]
    assert "destroy_process_group" in result["message"]
    assert 0.9 <= result["seconds"] < 3.5
