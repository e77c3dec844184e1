"""Observer statistics shared across torch.distributed ranks.

``sync_observers`` leaves every rank with the statistics one process would have gathered from
all ranks' data, so every rank computes the same qparams (torch.ao never synchronises its
observers: under DDP rank 0's buffers win, pytorch issue #85627).

Semantics per observer kind:

- min/max observers (per tensor and per channel, running or moving-average): the elementwise
  MIN of ``min_val`` and MAX of ``max_val`` over the ranks. Exact for running extremes. For the
  moving averages every update is monotone in the batch extreme, so when the ranks start from
  the same state and sync after every step, the result is bit for bit the moving average a
  single process computes on the global batch (the union of the ranks' batches), which is
  DDP's notion of a batch. Synced only once at the end, it is the widest of the ranks'
  estimates (no rank's range gets clipped).
- ``HistogramObserver``: the common range is the global [min, max]; each rank moves its
  histogram onto it with the observer's own re-binning (the rule it applies when its range
  grows) and the histograms are summed. Exact when every rank's range already is the common
  one; otherwise each count moves by less than one bin of the common range (the docs'
  "Calibration and QAT across processes" page gives the tested bound). Repeated syncs do not
  double count: the state agreed at the last sync is remembered on the observer and only what
  each rank added since is summed.
- ``PercentileObserver`` / ``EntropyObserver``: exact. Their integer histograms have
  power-of-two bin widths anchored at 0, so each rank coarsens its histogram to the largest
  width of any rank (summing whole bins) and the counts are summed: the result equals one
  process's histogram of all ranks' data, bit for bit, and so do the qparams. Repeated syncs
  subtract the state agreed at the last sync, as for ``HistogramObserver``.
- fixed-qparams, placeholder, noop, reuse-input and recording observers: nothing to share.
- any other module with ``calculate_qparams`` must define ``sync_statistics(group)``, which
  is called on every rank in module order (it does its own collectives).

After the sync every ``FakeQuantize`` whose observer is enabled refreshes its ``scale`` and
``zero_point`` from the synced observer.

Before any statistic moves, the ranks compare everything that decides the result (``check``):
each observer's and fake quantize's name and class and every configuration field in
``_CONFIG_FIELDS`` (dtype, qscheme, quant range, reduce_range, eps, ch_axis, bins, averaging
constant, is_dynamic, fixed qparams, whether the observer is enabled). Each rank sends its
description, or the error it hit while building it, in one exchange that every rank joins and
that waits at most ``timeout``; every rank then raises the same error, so no rank is left
waiting in a collective the others skipped.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.qconfig import (
    EntropyObserver,
    FakeQuantize,
    FixedQParamsFakeQuantize,
    FixedQParamsObserver,
    FusedMovingAvgObsFakeQuantize,
    HistogramObserver,
    MinMaxObserver,
    NoopObserver,
    PercentileObserver,
    PerChannelMinMaxObserver,
    PlaceholderObserver,
    RecordingObserver,
    ReuseInputObserver,
)

__all__ = ["sync_observers", "sync_observers_hook"]

_STATELESS: tuple[type[nn.Module], ...] = (
    FixedQParamsObserver,
    PlaceholderObserver,
    NoopObserver,
    ReuseInputObserver,
    RecordingObserver,
)
# The state agreed by the last sync, kept on each histogram observer (see _sync_histograms).
_BASELINE_ATTR = "_quantbridge_synced_histogram"
_POW2_BASELINE_ATTR = "_quantbridge_synced_pow2_histogram"
# Attributes that decide an observer's statistics or qparams, compared across ranks when
# present (``scale``/``zero_point`` only on FixedQParamsObserver: elsewhere they are results).
_CONFIG_FIELDS = (
    "dtype",
    "qscheme",
    "quant_min",
    "quant_max",
    "reduce_range",
    "has_customized_qrange",
    "eps",
    "ch_axis",
    "bins",
    "percentile",
    "upsample_rate",
    "averaging_constant",
    "is_dynamic",
    "custom_op",
    "observer_enabled",
)
_FIXED_QPARAMS_FIELDS = ("scale", "zero_point")
# One observer as the ranks compare it: [name, class, {field: JSON-able value}].
_Entry = list[Any]


@dataclass
class _Plan:
    """The observers of one model, by how they are synchronised."""

    per_tensor: list[tuple[str, Any]]  # MinMax-like and histogram min/max (0-dim buffers)
    per_channel: list[tuple[str, Any]]
    histograms: list[tuple[str, HistogramObserver]]
    custom: list[tuple[str, Any]]
    fake_quants: list[FakeQuantize]
    signature: list[_Entry]
    # PercentileObserver / EntropyObserver (also in per_tensor for their min/max)
    power_of_two: list[tuple[str, Any]] = dataclasses.field(default_factory=list)


def _require_distributed(group: Any) -> Any:
    import torch.distributed as dist

    if not dist.is_available():
        raise FxQuantError(
            "sync_observers: torch.distributed is not available in this torch build; "
            "calibrate in one process or install a torch with distributed support"
        )
    if not dist.is_initialized():
        raise FxQuantError(
            "sync_observers: no torch.distributed process group is initialised; call "
            "torch.distributed.init_process_group(...) first (torchrun sets up the "
            "environment for it), or skip the sync when running in one process"
        )
    return dist


def _qualname(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _plain(value: object) -> object:
    """``value`` as JSON data (dtypes and other objects by their text)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().reshape(-1).tolist()
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _entry(where: str, module: nn.Module) -> _Entry:
    fields = {f: _plain(getattr(module, f)) for f in _CONFIG_FIELDS if hasattr(module, f)}
    if isinstance(module, FixedQParamsObserver):
        fields.update({f: _plain(getattr(module, f)) for f in _FIXED_QPARAMS_FIELDS})
    return [where, _qualname(module), fields]


def _plan(model: nn.Module) -> _Plan:
    plan = _Plan([], [], [], [], [], [])
    for name, module in model.named_modules():
        where = name or "<root>"
        if isinstance(module, FakeQuantize):
            plan.signature.append(_entry(where, module))
            if not isinstance(module, FixedQParamsFakeQuantize):
                plan.fake_quants.append(module)
        if callable(getattr(module, "sync_statistics", None)):  # the class's own rule wins
            plan.custom.append((where, module))
            plan.signature.append(_entry(where, module))
        elif isinstance(module, (PercentileObserver, EntropyObserver)):
            plan.power_of_two.append((where, module))
            plan.per_tensor.append((where, module))
            plan.signature.append(_entry(where, module))
        elif isinstance(module, HistogramObserver):
            plan.histograms.append((where, module))
            plan.per_tensor.append((where, module))
            plan.signature.append(_entry(where, module))
        elif isinstance(module, PerChannelMinMaxObserver):
            plan.per_channel.append((where, module))
            plan.signature.append(_entry(where, module))
        elif isinstance(module, MinMaxObserver):
            plan.per_tensor.append((where, module))
            plan.signature.append(_entry(where, module))
        elif isinstance(module, _STATELESS):
            plan.signature.append(_entry(where, module))
        elif callable(getattr(module, "calculate_qparams", None)) and not hasattr(
            module, "activation_post_process"
        ):
            raise FxQuantError(
                f"sync_observers: module '{where}' ({type(module).__name__}) looks like an "
                "observer but its statistics cannot be synchronised: quantbridge knows the "
                "qconfig observers only. Give the class a sync_statistics(group) method that "
                "all-reduces its state, or use a quantbridge.qconfig observer."
            )
    return plan


def _collective_device(dist: Any, group: Any) -> torch.device:
    """Where a collective's tensors live: the current GPU for NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wait(dist: Any, work: Any, timeout: float | None, group: Any) -> None:
    """Wait for an asynchronous collective, at most ``timeout`` seconds."""
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:
        limit = "the process group's timeout" if timeout is None else f"{timeout:g} s"
        raise FxQuantError(
            f"sync_observers: rank {dist.get_rank(group)} waited for the other ranks to compare "
            f"observers and gave up after {limit} ({exc}); every rank must call "
            "sync_observers at the same point (a rank that crashed, skipped it or is still "
            "calibrating causes this). The process group is out of step now: destroy it "
            "(torch.distributed.destroy_process_group()) before any other collective"
        ) from exc


def _all_gather(
    dist: Any, tensor: torch.Tensor, group: Any, timeout: float | None
) -> list[torch.Tensor]:
    gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size(group))]
    _wait(dist, dist.all_gather(gathered, tensor, group=group, async_op=True), timeout, group)
    return gathered


def _exchange(dist: Any, payload: object, group: Any, timeout: float | None) -> list[Any]:
    """Every rank's ``payload`` (JSON data), by rank, each wait bounded by ``timeout``.

    One all_gather of a digest when every rank sends the same payload (the common case);
    only when they differ, two more bring the payloads themselves for the error message.
    """
    data = json.dumps(payload, sort_keys=True).encode()
    device = _collective_device(dist, group)
    digest = torch.frombuffer(bytearray(hashlib.sha256(data).digest()), dtype=torch.uint8)
    digests = _all_gather(dist, digest.to(device), group, timeout)
    if all(torch.equal(d, digests[0]) for d in digests):
        return [payload for _ in digests]
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [int(s.item()) for s in _all_gather(dist, size, group, timeout)]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = _all_gather(dist, mine.to(device), group, timeout)
    return [
        json.loads(bytes(t[:n].cpu().tolist()).decode())
        for t, n in zip(gathered, lengths, strict=True)
    ]


def _check_same_structure(
    dist: Any, plan: _Plan | None, local_error: str | None, group: Any, timeout: float | None
) -> None:
    """One exchange: every rank must hold the same observers, configured the same way, in
    the same order. A rank whose model could not be planned sends its error instead, so
    every rank raises it rather than some waiting for collectives that never come."""
    payload = {"error": local_error, "observers": None if plan is None else plan.signature}
    gathered = _exchange(dist, payload, group, timeout)
    rank = dist.get_rank(group)
    failed = [(r, g["error"]) for r, g in enumerate(gathered) if g["error"] is not None]
    if failed:
        if local_error is not None:
            raise FxQuantError(local_error)
        r, message = failed[0]
        raise FxQuantError(f"sync_observers: rank {r} could not take part: {message}")
    signatures: list[list[_Entry]] = [g["observers"] for g in gathered]
    ref = signatures[0]
    for other_rank in range(1, len(signatures)):
        other = signatures[other_rank]
        for index in range(max(len(ref), len(other))):
            a = ref[index] if index < len(ref) else None
            b = other[index] if index < len(other) else None
            if a is None or b is None or a[:2] != b[:2]:
                raise FxQuantError(
                    f"sync_observers: ranks 0 and {other_rank} hold different observers (entry "
                    f"{index}: rank 0 has {_describe(a)}, rank {other_rank} has {_describe(b)}); "
                    "build, prepare and wrap the model identically on every rank"
                )
    differences = []
    for index, (where, cls, _fields) in enumerate(ref):
        names = sorted(set().union(*(sig[index][2] for sig in signatures)))
        for field in names:
            values = [json.dumps(sig[index][2].get(field, "<missing>")) for sig in signatures]
            if len(set(values)) > 1:
                per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                differences.append(
                    f"'{where}' ({cls.rsplit('.', 1)[-1]}) {field} differs ({per_rank})"
                )
    if differences:
        shown = "; ".join(differences[:8])
        more = f"; and {len(differences) - 8} more" if len(differences) > 8 else ""
        raise FxQuantError(
            f"sync_observers (rank {rank}): the ranks' observers are configured differently, "
            f"so their qparams would differ whatever the statistics: {shown}{more}. Prepare "
            "the model with the same qconfig mapping and backend config on every rank"
        )


def _describe(entry: _Entry | None) -> str:
    if entry is None:
        return "nothing"
    return f"'{entry[0]}' ({entry[1].rsplit('.', 1)[-1]})"


def _channel_counts(dist: Any, plan: _Plan, group: Any) -> list[int]:
    """The channel count of every per-channel observer, agreed over the ranks; a rank that
    has observed nothing (empty buffers) takes the others' count."""
    if not plan.per_channel:
        return []
    mine = torch.tensor([obs.min_val.numel() for _, obs in plan.per_channel], dtype=torch.int64)
    unset = torch.iinfo(torch.int64).max
    # One MAX reduce gives both the largest count and (negated) the smallest non-zero one.
    packed = torch.cat([mine, -torch.where(mine > 0, mine, torch.full_like(mine, unset))])
    device = plan.per_channel[0][1].min_val.device
    packed = packed.to(device)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    packed = packed.cpu()
    count = len(plan.per_channel)
    largest, smallest = packed[:count], -packed[count:]
    for (where, obs), big, small in zip(
        plan.per_channel, largest.tolist(), smallest.tolist(), strict=True
    ):
        if big > 0 and small != big:
            raise FxQuantError(
                f"sync_observers: per-channel observer '{where}' has recorded {small} channels "
                f"on one rank and {big} on another; every rank must observe tensors with the "
                f"same channel count along ch_axis={obs.ch_axis}"
            )
    return [int(c) for c in largest.tolist()]


def _sync_min_max(dist: Any, plan: _Plan, counts: list[int], group: Any) -> None:
    """MIN of every min_val and MAX of every max_val, in one MAX all-reduce of
    ``[-mins, maxes]`` (negation is exact; computed in float64, which round-trips float32)."""
    mins: list[torch.Tensor] = []
    maxes: list[torch.Tensor] = []
    targets: list[tuple[Any, int]] = []
    for _, obs in plan.per_tensor:
        mins.append(obs.min_val.detach().reshape(-1).double())
        maxes.append(obs.max_val.detach().reshape(-1).double())
        targets.append((obs, -1))
    for (_, obs), count in zip(plan.per_channel, counts, strict=True):
        if obs.min_val.numel() == count:
            mins.append(obs.min_val.detach().reshape(-1).double())
            maxes.append(obs.max_val.detach().reshape(-1).double())
        else:  # nothing observed on this rank: neutral elements
            mins.append(torch.full((count,), float("inf"), dtype=torch.float64))
            maxes.append(torch.full((count,), float("-inf"), dtype=torch.float64))
        targets.append((obs, count))
    if not targets:
        return
    device = mins[0].device
    packed = torch.cat([-torch.cat([m.to(device) for m in mins]), torch.cat(maxes).to(device)])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    total = packed.numel() // 2
    new_mins, new_maxes = -packed[:total], packed[total:]
    offset = 0
    with torch.no_grad():
        for obs, count in targets:
            size = 1 if count < 0 else count
            low = new_mins[offset : offset + size]
            high = new_maxes[offset : offset + size]
            offset += size
            if count < 0:
                _assign(obs, "min_val", low.reshape(obs.min_val.shape))
                _assign(obs, "max_val", high.reshape(obs.max_val.shape))
            elif count > 0:
                _assign(obs, "min_val", low)
                _assign(obs, "max_val", high)


def _assign(obs: Any, name: str, value: torch.Tensor) -> None:
    buffer: torch.Tensor = getattr(obs, name)
    if buffer.shape != value.shape:
        buffer.resize_(value.shape)
    buffer.copy_(value.to(device=buffer.device, dtype=buffer.dtype))


def _on_range(
    obs: HistogramObserver,
    hist: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
    new_low: torch.Tensor,
    new_high: torch.Tensor,
) -> torch.Tensor:
    """``hist`` over [low, high] moved onto [new_low, new_high] by the observer's own rule
    (zero when nothing was observed)."""
    if bool(low == float("inf")) or bool(high == float("-inf")):
        return torch.zeros(obs.bins, dtype=torch.float64, device=hist.device)
    moved = obs.rebin(hist, low, high, new_low, new_high)
    return moved.double()


def _sync_histograms(
    dist: Any, plan: _Plan, local: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], group: Any
) -> None:
    """Sum the ranks' histograms on the common range (already in min_val/max_val).

    ``local`` holds each observer's pre-sync (histogram, min, max) on this rank. A baseline
    from the previous sync (identical on every rank) is subtracted from each rank's share and
    added back once, so data seen before that sync is counted once.
    """
    if not plan.histograms:
        return
    shares: list[torch.Tensor] = []
    bases: list[torch.Tensor | None] = []
    flags: list[int] = []
    for (_, obs), (hist, low, high) in zip(plan.histograms, local, strict=True):
        common_low, common_high = obs.min_val.detach(), obs.max_val.detach()
        if bool(common_low == float("inf")):  # nobody saw data
            shares.append(torch.zeros(obs.bins, dtype=torch.float64, device=hist.device))
            bases.append(None)
            flags.append(0)
            continue
        share = _on_range(obs, hist, low, high, common_low, common_high)
        baseline = getattr(obs, _BASELINE_ATTR, None)
        base: torch.Tensor | None = None
        if baseline is not None:
            b_hist, b_low, b_high = baseline
            base = _on_range(obs, b_hist, b_low, b_high, common_low, common_high)
            share = share - base
        shares.append(share)
        bases.append(base)
        flags.append(1 if base is not None else 0)

    device = shares[0].device
    # The baseline flags travel with the sums: a baseline must exist on all ranks or none.
    packed = torch.cat(
        [torch.cat(shares).to(device), torch.tensor(flags, dtype=torch.float64, device=device)]
    )
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    world = dist.get_world_size(group)
    flag_sums = packed[-len(flags) :].tolist()
    offset = 0
    with torch.no_grad():
        for (where, obs), base, flag_sum in zip(plan.histograms, bases, flag_sums, strict=True):
            total = packed[offset : offset + obs.bins]
            offset += obs.bins
            if flag_sum not in (0.0, float(world)):
                raise FxQuantError(
                    f"sync_observers: histogram observer '{where}' was synced before on some "
                    "ranks only (e.g. a checkpoint or a fresh model loaded on one rank); "
                    "restart calibration from the same state on every rank"
                )
            if bool(obs.min_val == float("inf")):
                continue
            if base is not None:
                # Re-binning is not exactly linear across different ranges: clip tiny negatives.
                total = (total + base).clamp_min(0.0)
            hist = total.to(dtype=obs.histogram.dtype, device=obs.histogram.device)
            obs.set_histogram(hist)
            setattr(
                obs,
                _BASELINE_ATTR,
                (hist.clone(), obs.min_val.detach().clone(), obs.max_val.detach().clone()),
            )


def _refresh_fake_quants(plan: _Plan) -> None:
    """Fake quantizes use their scale/zero_point buffers: recompute them from the synced
    observer, as the module's own forward would (only while the observer is enabled; a
    frozen one keeps its qparams)."""
    with torch.no_grad():
        for fq in plan.fake_quants:
            if int(fq.observer_enabled[0]) != 1:
                continue
            low = getattr(fq.activation_post_process, "min_val", None)
            high = getattr(fq.activation_post_process, "max_val", None)
            if isinstance(low, torch.Tensor) and (
                low.numel() == 0 or not bool(torch.isfinite(low).all())
            ):
                continue  # nothing observed anywhere: keep the initial qparams
            if (
                isinstance(fq, FusedMovingAvgObsFakeQuantize)
                and isinstance(low, torch.Tensor)
                and isinstance(high, torch.Tensor)
            ):
                # The fused op computes qparams its own way (not the observer's
                # calculate_qparams). Feeding it a tensor holding exactly the synced extremes
                # leaves the moving average unchanged (m + c * (m - m) == m) and stores the
                # qparams it would use.
                if fq.is_per_channel:  # the fused op supports ch_axis == 0 only
                    probe = torch.stack([low, high], dim=1)
                else:
                    probe = torch.stack([low.reshape(()), high.reshape(())])
                fq(probe)
                continue
            scale, zero_point = fq.calculate_qparams()
            if fq.scale.shape != scale.shape:
                fq.scale.resize_(scale.shape)
                fq.zero_point.resize_(zero_point.shape)
            fq.scale.copy_(scale)
            fq.zero_point.copy_(zero_point)


def _sync_power_of_two_histograms(dist: Any, plan: _Plan, group: Any) -> None:
    """Coarsen every rank's histogram to the widest bin width of any rank, then sum (one MAX
    and one SUM all-reduce). What the last sync agreed on (the same on every rank) is taken
    out of each rank's share and added back once, so nothing is counted twice."""
    if not plan.power_of_two:
        return
    observers = [obs for _, obs in plan.power_of_two]
    device = observers[0].histogram.device
    exponents = torch.tensor([int(obs.exponent) for obs in observers], device=device)
    dist.all_reduce(exponents, op=dist.ReduceOp.MAX, group=group)
    shares: list[torch.Tensor] = []
    bases: list[torch.Tensor | None] = []
    for obs, common in zip(observers, exponents.tolist(), strict=True):
        share = obs.coarsened(obs.histogram, int(obs.exponent), common)
        baseline = getattr(obs, _POW2_BASELINE_ATTR, None)
        base = None if baseline is None else obs.coarsened(baseline[0], baseline[1], common)
        shares.append(share if base is None else share - base)
        bases.append(base)
    # The baseline flags travel with the counts: a baseline must exist on all ranks or none.
    flags = torch.tensor([0 if b is None else 1 for b in bases], dtype=torch.int64)
    packed = torch.cat([torch.cat(shares).to(device), flags.to(device)])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    world = dist.get_world_size(group)
    summed_flags = packed[-len(observers) :].tolist()
    offset = 0
    for (where, obs), common, base, flag in zip(
        plan.power_of_two, exponents.tolist(), bases, summed_flags, strict=True
    ):
        size = obs.histogram.numel()
        total = packed[offset : offset + size]
        offset += size
        if flag not in (0, world):
            raise FxQuantError(
                f"sync_observers: observer '{where}' was synced before on some ranks only "
                "(its state was reset or replaced on the others); reset it on every rank"
            )
        if base is not None:
            total = total + base
        obs.histogram.copy_(total.to(obs.histogram.device))
        obs.exponent.fill_(int(common))
        setattr(obs, _POW2_BASELINE_ATTR, (obs.histogram.detach().clone(), int(common)))


def sync_observers(
    model: nn.Module, group: Any = None, *, check: bool = True, timeout: float | None = None
) -> nn.Module:
    """All-reduce the statistics of every observer in ``model`` so that every rank of
    ``group`` (default: the world) ends with identical statistics and qparams, equal to one
    process having observed all ranks' data (see the module docstring for each observer's
    semantics). Every rank must call it, with the same model structure.

    ``check=True`` first compares, across ranks, every observer's and fake quantize's name,
    class and configuration (dtype, qscheme, quant_min/quant_max, reduce_range, eps, ch_axis,
    bins, averaging_constant, is_dynamic, fixed qparams, observer enabled); any difference
    raises FxQuantError on every rank, naming the module, the field and each rank's value.
    That exchange waits at most ``timeout`` seconds for the other ranks (``None``: the process
    group's own timeout); after a timeout the group is out of step and must be destroyed.
    Per-step callers that already checked may pass ``check=False``. Uses 2 to 4 collectives
    however many observers there are (2 more when the check finds a difference). Returns
    ``model``.
    """
    if not isinstance(model, nn.Module):
        raise FxQuantError(f"sync_observers: model must be an nn.Module, got {type(model)}")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
    ):
        raise FxQuantError(
            f"sync_observers: timeout must be a positive number of seconds or None, got {timeout!r}"
        )
    dist = _require_distributed(group)
    if check:
        # every rank joins the comparison, even one whose model cannot be planned
        try:
            plan: _Plan | None = _plan(model)
            local_error = None
        except FxQuantError as exc:
            plan, local_error = None, str(exc)
        _check_same_structure(dist, plan, local_error, group, timeout)
        assert plan is not None  # a local error was raised on every rank above
    else:
        plan = _plan(model)
    with torch.no_grad():
        local = [
            (obs.histogram.detach().clone(), obs.min_val.detach().clone(), obs.max_val.clone())
            for _, obs in plan.histograms
        ]
        counts = _channel_counts(dist, plan, group)
        _sync_min_max(dist, plan, counts, group)
        _sync_histograms(dist, plan, local, group)
        _sync_power_of_two_histograms(dist, plan, group)
    for _, module in plan.custom:
        module.sync_statistics(group)
    _refresh_fake_quants(plan)
    return model


def sync_observers_hook(module: nn.Module, every: int = 1, group: Any = None) -> RemovableHandle:
    """Sync ``module``'s observers after every ``every``-th training-mode forward (QAT under
    DDP). Register it on the DDP wrapper (or the plain model): it runs after the forward,
    before backward, so the step's qparams and the model after the step agree on every rank.

    Eval-mode forwards are not counted (validation often runs on one rank only). The first
    sync checks the structure across ranks; later ones skip that check. Returns the handle;
    ``handle.remove()`` stops syncing.
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise FxQuantError(f"sync_observers_hook: every must be a positive int, got {every!r}")
    _require_distributed(group)
    state = {"calls": 0, "checked": False}

    def hook(mod: nn.Module, args: Any, output: Any) -> None:
        if not mod.training:
            return
        state["calls"] += 1
        if state["calls"] % every == 0:
            sync_observers(mod, group, check=not state["checked"])
            state["checked"] = True

    return module.register_forward_hook(hook)
