"""auto_quantize: PTQ with a backend, leaving the fewest layers float that keep a metric.

The search (with ``eval_fn`` and ``max_drop``):

1. prepare once with the backend's qconfig mapping and calibrate once; every candidate model
   below is converted from a copy of this one calibrated model (a ``QConfigMapping`` that sets
   the float layers to None at convert), so calibration statistics are reused, never redone;
2. step 0: everything quantized. Within ``max_drop`` of the float metric: done;
3. rank the quantized module layers by the isolated SQNR ``compare_layers`` measures on the
   step-0 reference model (worst first), on up to the first 8 calibration batches;
4. greedy: leave the next layer in that order float, convert, evaluate; stop at the first
   model within ``max_drop``;
5. prune by measured drop: for each float layer but the last added, latest first, quantize it
   again and keep that when the metric stays within ``max_drop``.

Each float layer then is needed: quantizing any single one of them again breaks the budget.
The model's metric at every step is in the lowering report of the returned model.
"""

from __future__ import annotations

import copy
import math
import numbers
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from quantbridge.fx_quant import (
    ProgressBar,
    calibrate,
    compare_layers,
    convert_to_reference_fx,
    prepare_fx,
)
from quantbridge.lowering._backend import Backend, get_backend
from quantbridge.lowering._context import LoweringReport
from quantbridge.lowering._errors import LoweringError
from quantbridge.lowering._lower import _REPORT_KEY

__all__ = ["AutoQuantizeError", "AutoQuantizeReport", "SearchStep", "auto_quantize"]

_RANKING_BATCHES = 8


class AutoQuantizeError(LoweringError):
    """auto_quantize got bad arguments, or no model it tried met ``max_drop``
    (then ``.steps`` holds every model tried, with its metric)."""

    def __init__(self, message: str, steps: list[SearchStep] | None = None) -> None:
        super().__init__(message)
        self.steps = list(steps or [])


@dataclass(frozen=True)
class SearchStep:
    """One model auto_quantize evaluated."""

    step: int
    action: str  # "all quantized", "float <layer>", "quantize <layer> again"
    float_layers: tuple[str, ...]  # the layers left float in this model
    metric: float
    drop: float  # float metric - this metric
    within_budget: bool  # drop <= max_drop


@dataclass
class AutoQuantizeReport(LoweringReport):
    """A :class:`LoweringReport` plus what auto_quantize decided and measured."""

    float_metric: float = math.nan
    max_drop: float = math.nan
    float_layers: list[str] = field(default_factory=list)  # left float by auto_quantize
    steps: list[SearchStep] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [super().__str__()]
        lines.append(
            f"auto_quantize: float metric {self.float_metric:.6g}, max_drop {self.max_drop:g}"
        )
        for s in self.steps:
            mark = "within max_drop" if s.within_budget else "over max_drop"
            lines.append(
                f"  step {s.step:<3} {s.action:<32} metric {s.metric:<10.6g} "
                f"drop {s.drop:<10.4g} {mark}"
            )
        left = ", ".join(self.float_layers) or "(none)"
        lines.append(f"left float by auto_quantize: {left}")
        return "\n".join(lines)


def _metric(eval_fn: Callable[[nn.Module], Any], model: nn.Module, which: str) -> float:
    value = eval_fn(model)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise AutoQuantizeError(
            f"auto_quantize: eval_fn returned {type(value).__name__} {value!r} for {which}; "
            "it must return one number, higher is better (e.g. accuracy)"
        )
    number = float(value)
    if not math.isfinite(number):
        raise AutoQuantizeError(
            f"auto_quantize: eval_fn returned {number} for {which}; it must return a finite "
            "number, higher is better"
        )
    return number


def _check_args(eval_fn: Any, max_drop: Any) -> None:
    if max_drop is not None and eval_fn is None:
        raise AutoQuantizeError(
            "auto_quantize: max_drop needs eval_fn, the function that measures a model "
            "(higher is better); pass eval_fn=..., or drop max_drop for plain PTQ"
        )
    if eval_fn is not None and not callable(eval_fn):
        raise AutoQuantizeError(
            f"auto_quantize: eval_fn must be callable (model -> number), got "
            f"{type(eval_fn).__name__}"
        )
    if max_drop is not None:
        if isinstance(max_drop, bool) or not isinstance(max_drop, numbers.Real):
            raise AutoQuantizeError(
                f"auto_quantize: max_drop must be a number, got {type(max_drop).__name__}"
            )
        if not math.isfinite(float(max_drop)) or max_drop < 0:
            raise AutoQuantizeError(
                f"auto_quantize: max_drop must be a finite number >= 0 (the largest allowed "
                f"eval_fn(float) - eval_fn(quantized)), got {max_drop}"
            )


def _as_args(batch: Any) -> tuple[Any, ...]:
    if isinstance(batch, torch.Tensor):
        return (batch,)
    if isinstance(batch, (tuple, list)):
        return tuple(batch)
    raise AutoQuantizeError(
        f"auto_quantize: a calibration batch is a {type(batch).__name__}; each batch must be "
        "a tensor or a tuple of the model's positional inputs"
    )


class _Stash:
    """Passes batches through, keeping the first few (for the SQNR ranking)."""

    def __init__(self, data: Iterator[Any], keep: int) -> None:
        self.data, self.keep = data, keep
        self.kept: list[Any] = []

    def __iter__(self) -> Iterator[Any]:
        for batch in self.data:
            if len(self.kept) < self.keep:
                self.kept.append(batch)
            yield batch


def auto_quantize(
    model: nn.Module,
    backend: Backend | str,
    calibration_data: Iterable[Any],
    *,
    example_inputs: tuple[Any, ...] | None = None,
    eval_fn: Callable[[nn.Module], Any] | None = None,
    max_drop: float | None = None,
    progress: bool | None = None,
) -> GraphModule:
    """Quantize ``model`` for ``backend`` (a :class:`Backend` or its name); returns the
    lowered model. ``model`` itself is not changed (a copy in eval mode is quantized).

    ``calibration_data``: batches (a tensor or a tuple of positional inputs each), iterated
    once. ``example_inputs``: for ``prepare_fx``; default the first batch.

    Without ``eval_fn``: plain PTQ (``prepare_fx`` with the backend's mapping, ``calibrate``,
    ``backend.convert``). With ``eval_fn`` (model -> number, higher is better) and
    ``max_drop``: the search in this module's docstring; the result has the fewest float
    layers it found with ``eval_fn(model) - eval_fn(result) <= max_drop``. With ``eval_fn``
    alone: plain PTQ, measured (the report has the metric). Only whole modules are left float
    (``QConfigMapping.set_module_name(name, None)``); functional ops stay quantized.

    ``lowering_report(result)`` is an :class:`AutoQuantizeReport`: the layers left float and
    every step's metric. ``progress``: a progress bar over the evaluations (and calibration)
    on stderr (``None``: shown unless ``QUANTBRIDGE_NO_PROGRESS`` is set).

    Raises :class:`AutoQuantizeError` for ``max_drop`` without ``eval_fn``, a negative
    ``max_drop``, an ``eval_fn`` that returns no finite number, and when leaving every ranked
    layer float still misses ``max_drop`` (``.steps`` has each model's metric): a model that
    is float almost everywhere is not a useful int8 model, so none is returned.
    """
    _check_args(eval_fn, max_drop)
    if not isinstance(model, nn.Module):
        raise AutoQuantizeError(
            f"auto_quantize: model must be an nn.Module, got {type(model).__name__}"
        )
    be = get_backend(backend) if isinstance(backend, str) else backend
    if not isinstance(be, Backend):
        raise AutoQuantizeError(
            f"auto_quantize: backend must be a Backend or a backend name, got "
            f"{type(backend).__name__}"
        )
    if isinstance(calibration_data, (torch.Tensor, str, bytes)) or not isinstance(
        calibration_data, Iterable
    ):
        raise AutoQuantizeError(
            f"auto_quantize: calibration_data must be an iterable of batches, got "
            f"{type(calibration_data).__name__}; wrap one batch in a list: [(x,)]"
        )
    data = iter(calibration_data)
    first = next(data, None)
    if first is None:
        raise AutoQuantizeError("auto_quantize: calibration_data yielded no batch")
    if example_inputs is None:
        example_inputs = _as_args(first)
    stash = _Stash(chain([first], data), _RANKING_BATCHES)

    show = progress is not False and not os.environ.get("QUANTBRIDGE_NO_PROGRESS")
    mapping = be.qconfig_mapping()
    prepared = prepare_fx(  # post-training: a copy in eval mode (batch norms fold)
        copy.deepcopy(model).eval(), mapping, example_inputs, backend_config=be.backend_config
    )
    calibrate(prepared, stash, progress=show)

    def build(float_layers: Iterable[str]) -> GraphModule:
        chosen = be.qconfig_mapping()
        for name in float_layers:
            chosen.set_module_name(name, None)
        reference = convert_to_reference_fx(
            copy.deepcopy(prepared), qconfig_mapping=chosen, backend_config=be.backend_config
        )
        return be.lower(reference)

    quantized = build(())
    if eval_fn is None:
        return quantized

    bar = ProgressBar(None, enabled=show, label="auto_quantize", unit="eval", units="evals")
    float_metric = _metric(eval_fn, model, "the float model")
    bar.update()
    budget = math.inf if max_drop is None else float(max_drop)
    steps: list[SearchStep] = []

    def measure(m: GraphModule, action: str, layers: tuple[str, ...]) -> SearchStep:
        value = _metric(eval_fn, m, f"the model with {action}")
        bar.update()
        ok = float_metric - value <= budget
        step = SearchStep(len(steps), action, layers, value, float_metric - value, ok)
        steps.append(step)
        return step

    best: GraphModule = quantized
    best_layers: tuple[str, ...] = ()
    if not measure(quantized, "all quantized", ()).within_budget:
        # ranked on the reference model: there every op has its own output (a lowered
        # model may run two ops as one kernel)
        reference = convert_to_reference_fx(
            copy.deepcopy(prepared), backend_config=be.backend_config
        )
        ranking = compare_layers(model, reference, [_as_args(b) for b in stash.kept])
        order = [r.module for r in ranking.worst(len(ranking), view="isolated") if r.module]
        order = list(dict.fromkeys(order))
        found = None
        layers: tuple[str, ...] = ()
        for name in order:
            layers = (*layers, name)
            candidate = build(layers)
            if measure(candidate, f"float {name}", layers).within_budget:
                found = candidate
                break
        if found is None:
            bar.close(" (max_drop not reached)")
            raise AutoQuantizeError(
                f"auto_quantize: max_drop {max_drop} not reached: with all {len(order)} "
                f"ranked layers float the drop is still {steps[-1].drop:.6g} (best: "
                f"{min(s.drop for s in steps):.6g}). Allow a larger max_drop, calibrate on "
                "more representative data, or use better observers; .steps lists every "
                "model tried",
                steps,
            )
        best, best_layers = found, layers
        for name in reversed(layers[:-1]):
            trial = tuple(n for n in best_layers if n != name)
            candidate = build(trial)
            if measure(candidate, f"quantize {name} again", trial).within_budget:
                best, best_layers = candidate, trial
    bar.close()

    report = _report_of(best)
    best.meta[_REPORT_KEY] = AutoQuantizeReport(
        **{f.name: getattr(report, f.name) for f in fields(LoweringReport)},
        float_metric=float_metric,
        max_drop=budget,
        float_layers=list(best_layers),
        steps=steps,
    )
    return best


def _report_of(model: GraphModule) -> LoweringReport:
    rep = model.meta.get(_REPORT_KEY)
    if isinstance(rep, LoweringReport):
        return rep
    # the reference backend does not lower: an empty report of its own
    return LoweringReport(target="reference (not lowered)")
