"""Lowered numba models run on torch's intra-op thread count, read at every call, and leave
torch's and numba's thread counts as the user set them (main thread, other threads, a fresh
process); an explicit quantbridge.kernels.set_num_threads wins."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numba
import pytest
import torch
from torch import nn

from quantbridge import kernels as K
from quantbridge.fx_quant import convert_to_reference_fx, prepare_fx
from quantbridge.kernels import _threads
from quantbridge.lowering import get_backend
from quantbridge.lowering._custom_ops import linear_op
from quantbridge.lowering._modules import QuantizedLinear

POOL = numba.config.NUMBA_NUM_THREADS
pytestmark = pytest.mark.skipif(POOL < 2, reason="numba runs with one thread on this machine")


class _Net(nn.Module):
    """Convs and a Linear big enough that the kernels split them at two threads."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(8, 64, 3, padding=1)
        self.conv2 = nn.Conv2d(64, 64, 3, padding=1)
        self.fc = nn.Linear(64 * 4 * 4, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        x = nn.functional.adaptive_avg_pool2d(x, 4)
        return self.fc(torch.flatten(x, 1))


@pytest.fixture(scope="module")
def lowered():
    backend = get_backend("numba")
    torch.manual_seed(0)
    model = _Net().eval()
    x = torch.randn(64, 8, 32, 32)
    prepared = prepare_fx(
        model, backend.qconfig_mapping(), (x,), backend_config=backend.backend_config
    )
    with torch.no_grad():
        prepared(x)
    lowered = backend.lower(
        convert_to_reference_fx(prepared, backend_config=backend.backend_config)
    )
    return lowered, x


@pytest.fixture(autouse=True)
def _restore_counts():
    """Each test starts from lowering's defaults (no kernels setting, torch's count as the
    source) whatever an earlier test in the process left, and leaves the counts it found."""
    torch_before, numba_before = torch.get_num_threads(), numba.get_num_threads()
    source_before = _threads._source
    K.set_num_threads(None)
    K.set_num_threads_source(torch.get_num_threads)
    yield
    K.set_num_threads(None)
    K.set_num_threads_source(source_before)
    torch.set_num_threads(torch_before)
    numba.set_num_threads(numba_before)


def _state() -> str:
    """The thread settings a count depends on, for assertion messages."""
    return (
        f"kernels setting {_threads._setting}, source {_threads._source!r}, torch "
        f"{torch.get_num_threads()}, numba {numba.get_num_threads()}"
    )


@pytest.fixture
def chosen(monkeypatch):
    """The thread count each kernel call without num_threads= chose, and numba's count
    each parallel run was given (``swaps``: set, then put back when it differed)."""
    seen: dict[str, list[int]] = {"counts": [], "swaps": []}
    real_count, real_swap = _threads.get_num_threads, _threads._swap

    def count() -> int:
        n = real_count()
        seen["counts"].append(n)
        return n

    def swap(n: int) -> int:
        seen["swaps"].append(n)
        return real_swap(n)

    monkeypatch.setattr(_threads, "get_num_threads", count)
    monkeypatch.setattr(_threads, "_swap", swap)
    return seen


@pytest.mark.parametrize("torch_threads", [1, 2])
@pytest.mark.parametrize("numba_threads", [1, 2])
def test_forwards_leave_torch_and_numba_counts_as_set(lowered, torch_threads, numba_threads):
    model, x = lowered
    torch.set_num_threads(torch_threads)
    numba.set_num_threads(numba_threads)
    with torch.no_grad():
        for _ in range(2):
            model(x)
    assert torch.get_num_threads() == torch_threads
    assert numba.get_num_threads() == numba_threads


def test_kernels_follow_torchs_count_at_call_time(lowered, chosen):
    model, x = lowered
    numba.set_num_threads(1)  # numba's own count plays no part
    torch.set_num_threads(1)
    with torch.no_grad():
        one = model(x)
    assert chosen["counts"]
    assert set(chosen["counts"]) == {1}
    assert chosen["swaps"] == []  # one thread: serial drivers only
    chosen["counts"].clear()
    torch.set_num_threads(2)  # same model object: the count is read per call, not at lowering
    with torch.no_grad():
        two = model(x)
    assert chosen["counts"]
    assert set(chosen["counts"]) == {2}
    assert 2 in chosen["swaps"]  # the parallel drivers ran on two threads
    assert numba.get_num_threads() == 1
    torch.testing.assert_close(one, two, rtol=0, atol=0)


def test_an_explicit_kernels_setting_wins_over_torch(lowered, chosen):
    model, x = lowered
    torch.set_num_threads(2)
    K.set_num_threads(1)
    with torch.no_grad():
        model(x)
    assert set(chosen["counts"]) == {1}
    assert chosen["swaps"] == []
    chosen["counts"].clear()
    torch.set_num_threads(1)
    K.set_num_threads(2)
    with torch.no_grad():
        model(x)
    assert set(chosen["counts"]) == {2}
    assert 2 in chosen["swaps"]
    assert torch.get_num_threads() == 1


def test_an_explicit_setting_above_the_pool_is_refused_but_torchs_is_clamped(lowered, chosen):
    model, x = lowered
    with pytest.raises(K.KernelError, match="exceeds numba's pool"):
        K.set_num_threads(POOL + 1)
    torch.set_num_threads(POOL + 1)
    before = _state()
    with torch.no_grad():
        model(x)
    assert set(chosen["counts"]) == {POOL}, f"before the forward: {before}; after: {_state()}"
    assert torch.get_num_threads() == POOL + 1


def test_a_forward_in_another_python_thread(lowered, chosen):
    model, x = lowered
    torch.set_num_threads(1)
    main_numba = numba.get_num_threads()
    seen: dict[str, object] = {}

    def work() -> None:
        try:
            numba.set_num_threads(1)
            with torch.no_grad():
                seen["one"] = model(x)
            seen["counts"] = list(chosen["counts"])
            seen["after"] = (torch.get_num_threads(), numba.get_num_threads())
        except BaseException as e:  # reported by the main thread
            seen["error"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "error" not in seen, seen.get("error")
    assert set(seen["counts"]) == {1}  # type: ignore[arg-type]
    assert seen["after"] == (1, 1)
    assert (torch.get_num_threads(), numba.get_num_threads()) == (1, main_numba)


def test_custom_ops_follow_torchs_count(lowered, chosen):
    model, _x = lowered
    fc = next(m for m in model.modules() if isinstance(m, QuantizedLinear))
    q = torch.randint(0, 256, (64, fc.weight.shape[1]), dtype=torch.uint8)
    args = (fc.weight, fc.weight_scale, fc.weight_zero_point, fc.bias, *fc.input_qparams,
            *fc.output_qparams, False, fc.target)  # fmt: skip
    results = {}
    for n in (1, 2):
        torch.set_num_threads(n)
        chosen["counts"].clear()
        before = _state()
        results[n] = linear_op(q, *args)
        assert chosen["counts"] == [n], f"before the call: {before}; after: {_state()}"
    torch.testing.assert_close(results[1], results[2], rtol=0, atol=0)
    assert torch.get_num_threads() == 2


_FRESH = """
import numba, torch
from torch import nn
torch.set_num_threads(1)
assert torch.get_num_threads() == 1  # torch's per-thread set-up done before numba starts
from quantbridge.fx_quant import convert_to_reference_fx, prepare_fx
from quantbridge.lowering import get_backend
backend = get_backend("numba")
model = nn.Sequential(nn.Linear(512, 256), nn.ReLU()).eval()
x = torch.randn(64, 512)
prepared = prepare_fx(model, backend.qconfig_mapping(), (x,), backend_config=backend.backend_config)
prepared(x)
lowered = backend.lower(convert_to_reference_fx(prepared, backend_config=backend.backend_config))
with torch.no_grad():
    lowered(x)
print(torch.get_num_threads(), numba.get_num_threads())
"""


def test_first_forward_in_a_fresh_process_keeps_torch_at_one_thread():
    # numba's pool starts once per process: only a new process shows its start-up effect
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_FRESH)], capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", str(POOL)]
