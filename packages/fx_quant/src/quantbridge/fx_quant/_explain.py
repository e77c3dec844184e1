"""explain(prepared_model): why each node is (or is not) quantized.

torch.ao skips a pattern silently when no DTypeConfig accepts its qconfig. ``explain`` reads
the decisions prepare recorded and reports, per node: the pattern it matched (or none), the
QConfigMapping rule that supplied its qconfig, and, per candidate DTypeConfig, either
"chosen" or the constraint that rejected it. ``str(report)`` is a table; ``report.rows`` (and
``report[node_name]``) give the same data as :class:`NodeDecision` objects.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import nn

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._range_check import RANGES_KEY, RangeFinding, find_dominated_ranges
from quantbridge.fx_quant._state import (
    DECISIONS_KEY,
    OBSERVED_KEY,
    NodeDecision,
    ObservedState,
    RecordedDecisions,
    SwappedModule,
)

__all__ = ["ExplainReport", "explain"]


@dataclass
class ExplainReport:
    """Per-node quantization decisions of one prepared model."""

    backend: str
    rows: list[NodeDecision]
    # Attention/transformer modules prepare replaced with traceable equivalents.
    swapped: list[SwappedModule] = field(default_factory=list)
    # Observers whose range a sentinel (finfo.min, -inf) dominates.
    dominated_ranges: list[RangeFinding] = field(default_factory=list)

    def __iter__(self) -> Iterator[NodeDecision]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, node_name: str) -> NodeDecision:
        for row in self.rows:
            if row.node == node_name:
                return row
        raise KeyError(
            f"no node {node_name!r} in this report; nodes: {[r.node for r in self.rows]}"
        )

    def quantized(self) -> list[str]:
        """Names of the nodes prepare observed for quantization."""
        return [r.node for r in self.rows if r.status == "quantized"]

    def __str__(self) -> str:
        header = ("node", "target", "pattern", "qconfig from", "status", "why")
        table: list[tuple[str, ...]] = []
        details: list[str] = []
        for r in self.rows:
            table.append(
                (
                    r.node,
                    r.target,
                    r.pattern or "-",
                    r.qconfig_rule if r.qconfig is not None else f"{r.qconfig_rule} (None)",
                    r.status,
                    r.reason,
                )
            )
            for i, (desc, reason) in enumerate(r.candidates):
                verdict = "chosen" if i == r.chosen else (reason or "accepted")
                details.append(f"  {r.node}: DTypeConfig #{i} [{desc}]: {verdict}")
        widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
        widths = [min(w, 48) for w in widths]

        def fmt(row: tuple[str, ...]) -> str:
            cells = [
                (c if len(c) <= w else c[: w - 1] + "…").ljust(w)
                for c, w in zip(row, widths, strict=True)
            ]
            return " | ".join(cells).rstrip()

        lines = [f"quantization decisions (backend {self.backend!r})", fmt(header)]
        lines.append("-+-".join("-" * w for w in widths))
        lines += [fmt(row) for row in table]
        if details:
            lines.append("candidate DTypeConfigs:")
            lines += details
        lines += self._swap_lines()
        if self.dominated_ranges:
            lines.append("observer ranges dominated by a sentinel value (the scale is useless):")
            lines += [f"  {f.message()}" for f in self.dominated_ranges]
        return "\n".join(lines)

    def _swap_lines(self) -> list[str]:
        if not self.swapped:
            return []
        status = {r.target: r.status for r in self.rows if r.op == "call_module"}
        lines = ["modules swapped for traceable equivalents (so their Linears can be quantized):"]
        for s in self.swapped:
            line = f"  {s.name or '(root)'}: {s.float_type} -> {s.traceable_type}"
            if s.linears:
                parts = [f"{n.rpartition('.')[2]} {status.get(n, 'not called')}" for n in s.linears]
                line += "; Linears: " + ", ".join(parts)
            lines.append(line)
        return lines


def explain(prepared_model: nn.Module) -> ExplainReport:
    """The per-node decisions recorded by ``prepare_fx`` / ``prepare_qat_fx``.

    Also on the model ``convert_fx`` / ``convert_to_reference_fx`` returned, lowered or not:
    convert keeps prepare's decisions in ``meta``.
    """
    meta = getattr(prepared_model, "meta", None)
    meta = meta if isinstance(meta, dict) else {}
    state = meta.get(OBSERVED_KEY)
    if isinstance(state, ObservedState):
        return ExplainReport(
            state.backend_config.name,
            list(state.decisions),
            list(state.swapped_modules),
            find_dominated_ranges(prepared_model),
        )
    recorded = meta.get(DECISIONS_KEY)
    if isinstance(recorded, RecordedDecisions):
        found = meta.get(RANGES_KEY)
        ranges = list(found.values()) if isinstance(found, dict) else []
        return ExplainReport(recorded.backend, list(recorded.rows), list(recorded.swapped), ranges)
    raise FxQuantError(
        f"explain needs a model returned by prepare_fx / prepare_qat_fx, or by convert_fx / "
        f"convert_to_reference_fx (lowered or not); got a {type(prepared_model).__name__} "
        "without recorded decisions"
    )
