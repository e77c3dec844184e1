"""calibrate: run data through an observed model (no grad, eval mode), then sync the ranks."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sized
from typing import Any, TextIO

import torch
from torch import nn

from quantbridge.fx_quant._distributed import sync_observers
from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._observer_insertion import watch_observer_inputs
from quantbridge.fx_quant._range_check import warn_dominated_ranges

__all__ = ["ProgressBar", "calibrate"]


class _Progress:
    """A dependency-free progress bar on a text stream (stderr by default).

    On a TTY it redraws one line in place; otherwise (logs, CI) it prints a line every
    ``interval`` seconds and a final one, so log files stay short. ``update()`` counts one
    step, ``close(suffix)`` prints the final line; ``unit`` / ``units`` name the steps.
    Public as ``quantbridge.fx_quant.ProgressBar`` for other quantbridge loops.
    """

    def __init__(
        self,
        total: int | None,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        interval: float = 10.0,
        label: str = "calibrate",
        unit: str = "batch",
        units: str = "batches",
    ) -> None:
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.interval = interval
        self.label = label
        self.unit, self.units = unit, units
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty()) if callable(isatty) else False
        self.count = 0
        self.start = time.monotonic()
        self.last = self.start

    def _line(self) -> str:
        elapsed = time.monotonic() - self.start
        rate = self.count / elapsed if elapsed > 0 else 0.0
        if self.total:
            width = 24
            filled = min(width, self.count * width // self.total)
            bar = "#" * filled + "-" * (width - filled)
            return (
                f"{self.label}: [{bar}] {self.count}/{self.total} {self.units}, "
                f"{elapsed:.1f}s, {rate:.1f} {self.unit}/s"
            )
        return f"{self.label}: {self.count} {self.units}, {elapsed:.1f}s, {rate:.1f} {self.unit}/s"

    def update(self) -> None:
        self.count += 1
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if now - self.last >= 0.1 or self.count == self.total:
                self.stream.write("\r" + self._line())
                self.stream.flush()
                self.last = now
        elif now - self.last >= self.interval:
            self.stream.write(self._line() + "\n")
            self.stream.flush()
            self.last = now

    def close(self, suffix: str = "") -> None:
        if not self.enabled:
            return
        end = "\r" if self.tty else ""
        self.stream.write(end + self._line() + suffix + "\n")
        self.stream.flush()


ProgressBar = _Progress


def _distributed_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _is_main_rank(group: Any) -> bool:
    import torch.distributed as dist

    if not _distributed_ready():
        return True
    return bool(dist.get_rank() == 0) if group is None else bool(dist.get_rank(group) == 0)


def _call(model: nn.Module, inputs: object, index: int) -> None:
    if isinstance(inputs, torch.Tensor):
        model(inputs)
    elif isinstance(inputs, (tuple, list)):
        model(*inputs)
    elif isinstance(inputs, Mapping):
        model(**inputs)
    else:
        raise FxQuantError(
            f"calibrate: batch {index} is a {type(inputs).__name__}; expected a tensor, a "
            "tuple/list of positional inputs or a dict of keyword inputs. Pass "
            "input_fn=... to turn each batch into the model's inputs (e.g. "
            "input_fn=lambda b: (b[0],) for (input, target) loaders)"
        )


def _require_batches(seen: int, synced: bool, group: Any, kind: str) -> None:
    """Refuse a calibration that fed no batch: convert would compute qparams from empty
    observers. Across ranks the total counts (one all-reduce, so every rank raises or none
    does): a rank with an empty shard takes the others' statistics at the sync."""
    total, where = seen, ""
    if synced:
        import torch.distributed as dist

        count = torch.tensor([seen], dtype=torch.int64)
        if "nccl" in str(dist.get_backend(group)):
            count = count.cuda()
        dist.all_reduce(count, group=group)
        total, where = int(count.item()), f" on any of the {dist.get_world_size(group)} ranks"
    if total == 0:
        raise FxQuantError(
            f"calibrate: 0 batches seen{where}: data (a {kind}) yielded no batch, so the "
            "observers recorded nothing and convert would produce meaningless qparams. Pass "
            "a non-empty iterable (a generator or iterator can be consumed only once: create "
            "a new one for each call)"
        )


def calibrate(
    model: nn.Module,
    data: Iterable[Any],
    *,
    input_fn: Callable[[Any], Any] | None = None,
    max_batches: int | None = None,
    progress: bool | None = None,
    sync: bool | None = None,
    group: Any = None,
    sync_every: int | None = None,
) -> nn.Module:
    """Feed ``data`` through the observed ``model`` so its observers record statistics.

    ``data`` is any iterable (a list, a generator, a ``DataLoader``) of batches: a tuple or
    list is passed as positional inputs (``model(*batch)``), a dict as keywords
    (``model(**batch)``), a tensor as the single input. ``input_fn(batch)`` maps a batch to
    such inputs first (``lambda b: (b[0],)`` drops the targets of an (input, target)
    loader). At most ``max_batches`` batches are used.

    Runs under ``torch.no_grad()`` with every module in eval mode, and restores each module's
    own training flag afterwards. ``progress``: a progress bar on stderr (``None``: on rank 0
    only; ``False``: never). ``sync``: ``None`` syncs the ranks' observers at the end when a
    torch.distributed process group is initialised, ``True`` requires one, ``False`` never
    syncs. ``sync_every=n`` also syncs after every n-th batch (every rank must then run the
    same number of batches, e.g. with a ``DistributedSampler``); with moving-average observers
    ``sync_every=1`` gives exactly the statistics of one process seeing the global batches.
    Raises FxQuantError when no batch was seen (on every rank when syncing: one rank's empty
    shard is fine, all ranks' is not). Returns ``model``.
    """
    if not isinstance(model, nn.Module):
        raise FxQuantError(f"calibrate: model must be an nn.Module, got {type(model).__name__}")
    if isinstance(data, (torch.Tensor, str, bytes)) or not isinstance(data, Iterable):
        raise FxQuantError(
            f"calibrate: data must be an iterable of batches (a list, a generator or a "
            f"DataLoader), got {type(data).__name__}; wrap a single batch in a list: [batch]"
        )
    for name, value in (("max_batches", max_batches), ("sync_every", sync_every)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise FxQuantError(f"calibrate: {name} must be a positive int or None, got {value!r}")
    if input_fn is not None and not callable(input_fn):
        raise FxQuantError(f"calibrate: input_fn must be callable, got {type(input_fn).__name__}")
    if sync is True and not _distributed_ready():
        raise FxQuantError(
            "calibrate: sync=True needs an initialised torch.distributed process group; call "
            "torch.distributed.init_process_group(...) first, or pass sync=None/False"
        )
    do_sync = _distributed_ready() if sync is None else bool(sync)
    if sync_every is not None and not do_sync:
        raise FxQuantError(
            "calibrate: sync_every needs syncing across ranks (an initialised process group "
            "and sync not False)"
        )

    total: int | None = None
    if isinstance(data, Sized):
        try:
            total = len(data)
        except TypeError:  # e.g. an IterableDataset's DataLoader
            total = None
    if max_batches is not None:
        total = max_batches if total is None else min(total, max_batches)
    show = _is_main_rank(group) if progress is None else bool(progress)
    if os.environ.get("QUANTBRIDGE_NO_PROGRESS"):
        show = False
    bar = _Progress(total, enabled=show)

    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    seen = 0
    watches = watch_observer_inputs(model)  # name the node if an observer gets integers
    try:
        with torch.no_grad():
            for index, batch in enumerate(data):
                if max_batches is not None and index >= max_batches:
                    break
                _call(model, batch if input_fn is None else input_fn(batch), index)
                seen += 1
                bar.update()
                if sync_every is not None and (index + 1) % sync_every == 0:
                    sync_observers(model, group, check=index + 1 == sync_every)
    finally:
        for module, training in flags:
            module.training = training
        for handle in watches:
            handle.remove()
    _require_batches(seen, do_sync, group, type(data).__name__)
    if do_sync:
        sync_observers(model, group)
    bar.close(" (observers synced across ranks)" if do_sync else "")
    warn_dominated_ranges(model, "calibrate")
    return model
