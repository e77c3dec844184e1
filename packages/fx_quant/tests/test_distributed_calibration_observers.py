"""sync_observers on PercentileObserver / EntropyObserver across two gloo processes: the synced
state equals one process observing the concatenated data, bit for bit."""

from __future__ import annotations

import importlib
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import quantbridge.qconfig as qbq
from quantbridge.fx_quant import FxQuantError, sync_observers

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available in this torch build",
)

WORLD = 2
_TIMEOUT_S = 300.0
_TESTS_DIR = Path(__file__).resolve().parent


def make_model() -> nn.ModuleDict:
    return nn.ModuleDict(
        {
            "pct_affine": qbq.PercentileObserver(percentile=99.0),
            "pct_sym": qbq.PercentileObserver(
                percentile=99.9, qscheme=torch.per_tensor_symmetric, dtype=torch.qint8
            ),
            "entropy": qbq.EntropyObserver(bins=256),
            "rare": qbq.PercentileObserver(percentile=95.0, bins=64),  # rank 1 only
        }
    )


def batches(rank: int, stage: int) -> list[torch.Tensor]:
    """Rank 1's data reaches much further out, so the ranks' bin widths differ."""
    gen = torch.Generator().manual_seed(10 * stage + rank)
    spread = 1.0 if rank == 0 else 7.0
    return [torch.randn(300, generator=gen) * spread + 0.2 * k for k in range(3)]


def feed(model: nn.ModuleDict, data: list[torch.Tensor], rare: bool) -> None:
    for b in data:
        for name in ("pct_affine", "pct_sym", "entropy"):
            model[name](b)
        if rare:
            model["rare"](b * 0.5)


def state(model: nn.ModuleDict) -> dict[str, Any]:
    out: dict[str, Any] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, obs in model.items():
        out[f"{name}.qparams"] = tuple(t.clone() for t in obs.calculate_qparams())
    return out


def _worker(rank: int, world: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    model = make_model()
    feed(model, batches(rank, 0), rare=rank == 1)
    result["pre"] = state(model)
    sync_observers(model)
    result["synced"] = state(model)
    sync_observers(model)
    result["again"] = state(model)
    feed(model, batches(rank, 1), rare=rank == 1)
    sync_observers(model)
    result["continued"] = state(model)
    mismatch = nn.ModuleDict({"p": qbq.PercentileObserver(percentile=99.0 + rank)})
    try:
        sync_observers(mismatch)
        result["mismatch"] = ""
    except FxQuantError as exc:
        result["mismatch"] = str(exc)
    return result


def _entry(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        torch.save(_worker(rank, world), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    if str(_TESTS_DIR) not in sys.path:
        sys.path.insert(0, str(_TESTS_DIR))
    module = importlib.import_module(Path(__file__).stem)  # importable by the children
    out_dir = tmp_path_factory.mktemp("ranks")
    ctx = mp.start_processes(
        module._entry,
        args=(WORLD, _free_port(), str(out_dir)),
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
            pytest.fail(f"the workers did not finish within {_TIMEOUT_S}s (a hang?)")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def single_process(stages: int) -> dict[str, Any]:
    model = make_model()
    for stage in range(stages):
        for rank in range(WORLD):
            feed(model, batches(rank, stage), rare=rank == 1)
    return state(model)


def assert_identical(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, tuple):
            for a, b in zip(got[key], value, strict=True):
                assert torch.equal(a, b), key
        else:
            assert torch.equal(got[key], value), key


def test_ranks_differed_before_the_sync(ranks: list[dict[str, Any]]) -> None:
    a, b = ranks[0]["pre"], ranks[1]["pre"]
    assert not torch.equal(a["pct_sym.exponent"], b["pct_sym.exponent"])
    assert not torch.equal(a["entropy.histogram"], b["entropy.histogram"])


@pytest.mark.parametrize("rank", range(WORLD))
def test_sync_equals_one_process_on_the_concatenated_data(
    ranks: list[dict[str, Any]], rank: int
) -> None:
    assert_identical(ranks[rank]["synced"], single_process(1))


@pytest.mark.parametrize("rank", range(WORLD))
def test_repeated_sync_and_later_data_count_once(ranks: list[dict[str, Any]], rank: int) -> None:
    assert_identical(ranks[rank]["again"], single_process(1))
    assert_identical(ranks[rank]["continued"], single_process(2))


def test_different_percentiles_are_refused(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert "percentile differs" in result["mismatch"]
