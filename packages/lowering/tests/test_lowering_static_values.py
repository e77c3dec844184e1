"""Values of a lowered graph that depend only on its inputs' sizes (position ids, mask
scaffolding) are computed once per size, with the generated forward's numbers, and computed
again when a buffer they read changes; values a node could change are never kept."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.fx import GraphModule, symbolic_trace

import quantbridge.lowering as L
from quantbridge.fx_quant import calibrate, prepare_fx
from quantbridge.lowering._array_forward import ArrayForward
from quantbridge.lowering._static_values import CACHE_ENTRIES, StaticCache, partition


class _Scaffold(nn.Module):
    """Position ids sliced to the sequence, a causal range mask, a padding mask from data."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("position_ids", torch.arange(16).unsqueeze(0), persistent=False)
        self.pos = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        h = self.fc(x + self.pos(self.position_ids[:, :s]))
        rng = torch.arange(s)
        causal = rng[None, :] <= rng[:, None]  # sizes only
        seen = (causal[None] & mask[:, None, :].bool()).float().sum(-1, keepdim=True)
        return h * seen


def _batch(seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, seq // 2 :] = 0
    return torch.randn(2, seq, 8, generator=g), mask


def _lowered() -> GraphModule:
    backend = L.get_backend("numba")
    torch.manual_seed(0)
    prepared = prepare_fx(
        _Scaffold().eval(), backend.qconfig_mapping(), _batch(6, 0),
        backend_config=backend.backend_config, capture="export",
    )  # fmt: skip
    calibrate(prepared, [_batch(s, s) for s in (5, 6, 9)], progress=False)
    gm = backend.convert(prepared)
    assert isinstance(gm.forward, ArrayForward)
    return gm


def _generated(gm: GraphModule, *args: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = type(gm).forward(gm, *args)
    return out


def test_size_only_values_are_computed_once_per_size_with_the_same_numbers():
    gm = _lowered()
    with torch.no_grad():
        gm(*_batch(5, 1))
        plan = gm.forward._plan
        assert plan is not None
        assert plan.cache is not None
        assert plan.kept  # the sliced position ids and the causal scaffolding
        static_ops = {str(n.target) for i, n in enumerate(gm.graph.nodes) if i in plan.static}
        assert any("arange" in op for op in static_ops)
        fills = []
        put = plan.cache.put
        plan.cache.put = lambda key, values: fills.append(key) or put(key, values)  # type: ignore[method-assign]
        for seq, seed in ((5, 2), (5, 3), (7, 4), (5, 5), (7, 6)):
            x = _batch(seq, seed)
            torch.testing.assert_close(gm(*x), _generated(gm, *x), rtol=0, atol=0)
            codegen = gm.graph._codegen  # an exported graph takes and returns flat tuples
            steps = codegen.process_outputs(plan.run_steps(gm, codegen.process_inputs(*x)))
            torch.testing.assert_close(gm(*x), steps, rtol=0, atol=0)
        assert len(fills) == 1  # 7 was new; 5 was computed by the first call


def test_a_buffer_changed_in_place_or_replaced_is_seen():
    gm = _lowered()
    x = _batch(6, 7)
    with torch.no_grad():
        before = gm(*x)
        buffers = dict(gm.named_buffers())
        name = next(n for n in buffers if n.endswith("position_ids"))
        owner = gm.get_submodule(name.rpartition(".")[0]) if "." in name else gm
        attr = name.rpartition(".")[2]
        getattr(owner, attr).copy_(torch.arange(16).flip(0).unsqueeze(0))  # in place
        changed = gm(*x)
        assert not torch.equal(changed, before)
        torch.testing.assert_close(changed, _generated(gm, *x), rtol=0, atol=0)
        setattr(owner, attr, torch.arange(16).roll(3).unsqueeze(0))  # a new tensor
        replaced = gm(*x)
        assert not torch.equal(replaced, changed)
        torch.testing.assert_close(replaced, _generated(gm, *x), rtol=0, atol=0)


def test_a_copy_keeps_its_own_values():
    gm = _lowered()
    x = _batch(6, 8)
    with torch.no_grad():
        want = gm(*x)
        copied = copy.deepcopy(gm)
        torch.testing.assert_close(copied(*x), want, rtol=0, atol=0)


class _Writes(nn.Module):
    def __init__(self, in_place: bool, returned: bool) -> None:
        super().__init__()
        self.in_place, self.returned = in_place, returned

    def forward(self, x: torch.Tensor) -> object:
        r = torch.ops.aten.arange.default(x.size(1))
        r = r.add_(1) if self.in_place else r.add(1)
        y = x + r
        return (y, r) if self.returned else y


@pytest.mark.parametrize(
    ("in_place", "returned", "arange_kept", "add_kept"),
    [(False, False, True, True), (True, False, False, False), (False, True, True, False)],
)
def test_values_a_node_or_the_caller_could_change_are_not_kept(
    in_place, returned, arange_kept, add_kept
):
    # r = arange(x.size(1)); r.add(1) reads r, r.add_(1) writes it; a returned value is the
    # caller's to change
    gm = symbolic_trace(_Writes(in_place, returned))
    part = partition(gm)
    arange = next(n for n in gm.graph.nodes if "arange" in str(n.target))
    add = next(n for n in gm.graph.nodes if n.target in ("add", "add_"))
    assert [n.target for n in part.keys] == ["size"]
    assert (arange in part.static) == arange_kept
    assert (add in part.static) == add_kept


class _ViewWrites(nn.Module):
    def __init__(self, use: str) -> None:
        super().__init__()
        self.use = use

    def forward(self, x: torch.Tensor) -> object:
        r = torch.ops.aten.arange.default(x.size(1))
        v = r.view(1, -1)  # a view: writing to it writes to r
        if self.use == "write":
            v.add_(1)
            return x + v
        if self.use == "return":
            return x + v, v
        return x + v.add(1)


@pytest.mark.parametrize(("use", "kept"), [("read", True), ("write", False), ("return", False)])
def test_a_value_whose_view_is_written_or_returned_is_not_kept(use, kept):
    gm = symbolic_trace(_ViewWrites(use))
    part = partition(gm)
    arange = next(n for n in gm.graph.nodes if "arange" in str(n.target))
    assert (arange in part.static) == kept


def test_values_with_autograd_history_are_not_kept():
    cache = StaticCache([], [])
    w = torch.ones(3, requires_grad=True)
    cache.put(("a",), (w * 2,))
    assert cache.get(("a",)) is None
    cache.put(("b",), (torch.ones(3),))
    assert cache.get(("b",)) is not None
    for i in range(CACHE_ENTRIES):
        cache.put((i,), (i,))
    assert cache.get(("b",)) is None  # the oldest entries go first
    assert cache.get((CACHE_ENTRIES - 1,)) == (CACHE_ENTRIES - 1,)
