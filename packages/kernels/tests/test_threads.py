"""Thread counts: the setting, the default source, numba's per-thread count left as the caller
had it, and numba's pool start leaving the OpenMP count of a process with torch alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numba
import numpy as np
import pytest

import quantbridge.kernels as qk
from quantbridge.kernels import KernelError, PackedLinearWeight, _threads, linear
from quantbridge.kernels import _quantize as _quantize_module

POOL = numba.config.NUMBA_NUM_THREADS
needs_two = pytest.mark.skipif(POOL < 2, reason="numba runs with one thread on this machine")


@pytest.fixture(autouse=True)
def _clean_settings():
    """Each test starts from the kernels' defaults and leaves the source it found: in a shared
    test process quantbridge.lowering (imported by other tests) has installed torch's count."""
    numba_before, source_before = numba.get_num_threads(), _threads._source
    qk.set_num_threads_source(None)
    yield
    qk.set_num_threads(None)
    qk.set_num_threads_source(source_before)
    numba.set_num_threads(numba_before)


@pytest.fixture
def swaps(monkeypatch):
    """Every count the kernels set numba's per-thread count to, in order."""
    seen: list[int] = []
    real = _threads._swap

    def spy(n):
        seen.append(n)
        return real(n)

    monkeypatch.setattr(_threads, "_swap", spy)
    return seen


def _big_linear():
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, (512, 1024), dtype=np.int8)
    packed = PackedLinearWeight(w, 0.01, 0, None, target="generic")
    # 64 rows x 512 columns x 256 k steps: above the serial cut (SERIAL_BELOW)
    x = rng.integers(0, 256, (64, 1024), dtype=np.uint8)
    return x, packed


def test_default_is_the_whole_pool_then_the_source_then_the_setting():
    assert qk.get_num_threads() == POOL
    qk.set_num_threads_source(lambda: 1)
    assert qk.get_num_threads() == 1
    qk.set_num_threads(POOL)  # the explicit setting wins over the source
    assert qk.get_num_threads() == POOL
    qk.set_num_threads(None)
    qk.set_num_threads_source(None)
    assert qk.get_num_threads() == POOL


def test_source_is_read_at_every_call_and_clamped_to_the_pool():
    wanted = [1]
    qk.set_num_threads_source(lambda: wanted[0])
    assert qk.get_num_threads() == 1
    wanted[0] = POOL + 7  # a wish above the pool is clamped, not refused
    assert qk.get_num_threads() == POOL
    with pytest.raises(KernelError, match="exceeds numba's pool"):
        qk.set_num_threads(POOL + 7)  # an explicit setting above the pool still is


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_a_source_returning_a_non_count_is_refused_at_the_call(bad):
    qk.set_num_threads_source(lambda: bad)
    with pytest.raises(KernelError, match=r"thread count source .* not a positive int"):
        qk.get_num_threads()


def test_a_source_must_be_callable():
    with pytest.raises(KernelError, match="expected a callable"):
        qk.set_num_threads_source(2)  # type: ignore[arg-type]


@needs_two
def test_parallel_gemm_runs_on_the_source_count_and_restores_numbas(swaps):
    x, packed = _big_linear()
    numba.set_num_threads(1)  # the caller's own numba count, different from the call's
    qk.set_num_threads_source(lambda: 2)
    got = linear(x, packed, 0.05, 3, 2.0, 5)
    assert swaps == [2, 1]  # numba's count set to 2 for the run, then put back
    assert numba.get_num_threads() == 1
    swaps.clear()
    qk.set_num_threads_source(lambda: 1)
    one = linear(x, packed, 0.05, 3, 2.0, 5)
    assert swaps == []  # one thread: the serial driver, numba's count untouched
    np.testing.assert_array_equal(got, one)


@needs_two
def test_the_setting_wins_over_the_source(swaps):
    x, packed = _big_linear()
    qk.set_num_threads_source(lambda: 2)
    qk.set_num_threads(1)
    linear(x, packed, 0.05, 3, 2.0, 5)
    assert swaps == []
    qk.set_num_threads(2)
    qk.set_num_threads_source(lambda: 1)
    linear(x, packed, 0.05, 3, 2.0, 5)
    assert swaps[0] == 2


@needs_two
def test_streaming_kernels_follow_the_source_and_restore_numbas(swaps, monkeypatch):
    monkeypatch.setattr(_quantize_module, "PARALLEL_MIN_WORK", 1)
    monkeypatch.setattr(_quantize_module, "STREAM_MIN_WORK", 1)
    x = np.linspace(-3, 3, 50_000, dtype=np.float32)
    numba.set_num_threads(1)
    qk.set_num_threads_source(lambda: 2)
    two = qk.quantize_per_tensor(x, 0.05, 128)
    assert swaps == [2, 1]
    assert numba.get_num_threads() == 1
    swaps.clear()
    qk.set_num_threads_source(lambda: 1)
    one = qk.quantize_per_tensor(x, 0.05, 128)
    assert swaps == []
    np.testing.assert_array_equal(two, one)


@needs_two
def test_numbas_count_is_per_thread_and_left_alone_in_another_thread(swaps):
    x, packed = _big_linear()
    seen: dict[str, int] = {}

    def work() -> None:
        numba.set_num_threads(1)
        linear(x, packed, 0.05, 3, 2.0, 5, num_threads=2)
        seen["worker"] = numba.get_num_threads()

    main_before = numba.get_num_threads()
    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert swaps == [2, 1]
    assert seen["worker"] == 1
    assert numba.get_num_threads() == main_before


_POOL_START = """
import sys, threading
import torch
torch.set_num_threads(1)
import numpy as np

def run():
    assert torch.get_num_threads() == 1  # torch's per-thread set-up done before numba starts
    import quantbridge.kernels as qk
    w = np.ones((256, 512), np.int8)
    x = np.ones((64, 512), np.uint8)
    qk.linear(x, qk.PackedLinearWeight(w, 0.01, 0, None), 0.1, 0, 0.5, 0, num_threads=2)
    return torch.get_num_threads()

if sys.argv[1] == "thread":
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("n", run()))
    t.start(); t.join()
    print(out["n"], torch.get_num_threads())
else:
    n = run()
    print(n, torch.get_num_threads())
"""


@needs_two
@pytest.mark.parametrize("where", ["main", "thread"])
def test_starting_numbas_pool_keeps_torchs_thread_count(where):
    # numba's OpenMP layer sets the OpenMP count of the thread that starts its pool; torch
    # reads the same libgomp. A fresh process, so the pool really starts here.
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_POOL_START), where],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "1"]
