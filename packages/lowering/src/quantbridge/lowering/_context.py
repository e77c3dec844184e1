"""What a lowering rule's builder works with: the graph, the report and node-emitting helpers.

The pass (``_lower``) finds reference patterns; for each match it calls the rule's builder with
a :class:`LoweringContext`, whose helpers read constant qparams, name and insert lowered
modules before the replaced node, record them in the :class:`LoweringReport` and requantize
between disagreeing qparams. A builder that cannot lower its match raises
:class:`NotLowerableError`; the match then stays in reference form and the reason is reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.fx import GraphModule, Node

from quantbridge import kernels as K
from quantbridge.lowering import _modules as lm
from quantbridge.lowering._errors import LoweringError
from quantbridge.lowering._lowered_ops import QParams

__all__ = [
    "QUANTIZE",
    "DEQUANTIZE",
    "NotLowerableError",
    "LoweringContext",
    "LoweringReport",
    "QParams",
    "constant_tensor",
    "lookup_table",
    "quantized_input",
    "static_qparams",
]

QUANTIZE = torch.ops.quantbridge.quantize_per_tensor.tensor
DEQUANTIZE = torch.ops.quantbridge.dequantize_per_tensor.tensor


@dataclass
class LoweringReport:
    """What the pass did: lowered nodes (name → what runs them) and nodes kept as reference."""

    target: str
    lowered: list[tuple[str, str]] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)
    # reference ops that compute nothing (eval-mode dropout, ...): name -> why they are gone
    removed: list[tuple[str, str]] = field(default_factory=list)
    # lowered node name -> the reference node whose value it computes (a quantize node, or the
    # float module node for dynamic linear and embeddings); node names survive lowering
    origins: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"lowered to quantbridge.kernels (target={self.target}):"]
        lines += [f"  {n:<32} {k}" for n, k in self.lowered] or ["  (nothing)"]
        if self.removed:
            lines.append("removed (the codes flow through):")
            lines += [f"  {n:<32} {why}" for n, why in self.removed]
        lines.append("kept as reference (dequantize -> float op -> quantize):")
        lines += [f"  {n:<32} {why}" for n, why in self.kept] or ["  (nothing)"]
        return "\n".join(lines)


class NotLowerableError(LoweringError):
    """Raised by a rule's builder: the match stays in reference form; the message says why.

    The pass catches it and lists the float op with the message in ``LoweringReport.kept``.
    """


def constant_tensor(graph_module: GraphModule, value: Any) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node reads, or None for anything else."""
    if isinstance(value, Node) and value.op == "get_attr":
        obj: Any = graph_module
        for part in str(value.target).split("."):
            obj = getattr(obj, part)
        if isinstance(obj, torch.Tensor):
            return obj
    return None


def static_qparams(graph_module: GraphModule, node: Node) -> QParams | None:
    """(scale, zero point) of a uint8 [0, 255] quantize/dequantize node with constant qparams."""
    if len(node.args) < 6:
        return None
    s = constant_tensor(graph_module, node.args[1])
    z = constant_tensor(graph_module, node.args[2])
    if s is None or z is None or s.numel() != 1 or z.numel() != 1:
        return None
    if node.args[3:6] != (0, 255, torch.uint8):
        return None
    return float(s), int(z)


def quantized_input(graph_module: GraphModule, arg: Any) -> tuple[Node, QParams] | None:
    """(quantized producer, its qparams) if ``arg`` is a static uint8 dequantize node."""
    if isinstance(arg, Node) and arg.op == "call_function" and arg.target is DEQUANTIZE:
        qp = static_qparams(graph_module, arg)
        src = arg.args[0]
        if qp is not None and isinstance(src, Node):
            return src, qp
    return None


class LoweringContext:
    """The pass state a builder works with (one per ``lower_to_kernels`` call).

    New nodes go before :attr:`anchor`, the node the pass is replacing (the quantize of a
    static match, the float op of a float-output match), unless ``before=`` says otherwise.
    """

    def __init__(self, graph_module: GraphModule, target: str) -> None:
        self.graph_module = graph_module
        self.graph = graph_module.graph
        self.target = target
        self.report = LoweringReport(target)
        # ops left in reference form, with why; the report lists those still in the graph
        # when the pass ends (a float-kernel fusion may run one later)
        self._kept: list[tuple[str, str]] = []
        # lowered node -> the op whose quantized output it returns (compare_layers reads it)
        self.outputs: dict[str, dict[str, object]] = {}
        self.anchor: Node | None = None
        self._names: set[str] = {n for n, _ in graph_module.named_modules(remove_duplicate=False)}

    def keep(self, node: Node, why: str) -> None:
        """``node`` stays in reference form (a float op between dequantize and quantize)."""
        self._kept.append((node.name, why))

    def is_kept(self, node: Node) -> bool:
        """Whether the pass left ``node`` in reference form."""
        return any(name == node.name for name, _ in self._kept)

    def finish_report(self) -> LoweringReport:
        """The report, its kept list the kept ops the final graph still runs."""
        live = {n.name for n in self.graph.nodes}
        self.report.kept = [(name, why) for name, why in self._kept if name in live]
        return self.report

    # reading the reference graph ---------------------------------------------------------

    def constant(self, value: Any) -> torch.Tensor | None:
        """The tensor a ``get_attr`` node reads, or None."""
        return constant_tensor(self.graph_module, value)

    def static_qparams(self, node: Node) -> QParams | None:
        """(scale, zero point) of a static uint8 quantize/dequantize node, else None."""
        return static_qparams(self.graph_module, node)

    def quantized_input(self, arg: Any) -> tuple[Node, QParams] | None:
        """(quantized producer, qparams) when ``arg`` is a static uint8 dequantize node."""
        return quantized_input(self.graph_module, arg)

    def module(self, node: Node) -> nn.Module | None:
        """The module a ``call_module`` node calls, else None."""
        if node.op != "call_module":
            return None
        return self.graph_module.get_submodule(str(node.target))

    # emitting lowered nodes --------------------------------------------------------------

    def new_name(self, base: str) -> str:
        """A submodule name free in the graph module, derived from ``base``."""
        base = base.replace(".", "_")
        name, i = base, 0
        while name in self._names or hasattr(self.graph_module, name):
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name

    def _before(self, before: Node | None) -> Node:
        where = before if before is not None else self.anchor
        if where is None:
            raise LoweringError(
                "LoweringContext: no insertion point; pass before= or call this from a builder"
            )
        return where

    def add_module(
        self,
        base: str,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        *,
        before: Node | None = None,
    ) -> Node:
        """Add ``module`` under a fresh name from ``base`` and call it (before the anchor)."""
        name = self.new_name(base)
        self.graph_module.add_submodule(name, module)
        with self.graph.inserting_before(self._before(before)):
            return self.graph.call_module(name, args, kwargs)

    def create_node(
        self, op: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> Node:
        """A new ``op`` node calling ``target`` (before the anchor), e.g. torch.cat on codes."""
        with self.graph.inserting_before(self._before(None)):
            return self.graph.create_node(op, target, args, kwargs or {})

    def record(self, node: Node, what: str) -> None:
        """List ``node`` as lowered, run by ``what``, in the report."""
        self.report.lowered.append((node.name, what))

    def record_removed(self, node: Node, what: str) -> None:
        """List reference op ``node`` as removed (its builder returned its input)."""
        self.report.removed.append((node.name, what))

    def record_output(self, node: Node, op: str, qparams: QParams, **extra: str) -> None:
        """``node`` returns the quantized output of reference op ``op`` (first record wins:
        a builder may return an earlier op's node)."""
        if node.name not in self.outputs:
            self.outputs[node.name] = {
                "output_of": op,
                "scale": qparams[0],
                "zero_point": qparams[1],
                **extra,
            }

    def absorb(self, new: Node, replaced: tuple[Node, ...]) -> None:
        """Report ``new`` in place of the lowered nodes a fusion merged into it: ``replaced[0]``
        (whose value ``new`` computes) gives its origin and output, the others their weights."""
        anchor, inner = replaced[0], replaced[1:]
        gone = {n.name for n in replaced}
        rep = self.report
        rep.lowered = [entry for entry in rep.lowered if entry[0] not in gone]
        rep.origins[new.name] = rep.origins.pop(anchor.name, anchor.name)
        out = self.outputs.pop(anchor.name, None)
        weights: dict[str, object] = {}
        for node in inner:
            rep.origins.pop(node.name, None)
            inner_out = self.outputs.pop(node.name, None)
            if inner_out is not None:
                weights = {"weights_of": inner_out["output_of"]}
        if out is not None:
            self.outputs[new.name] = {**out, **weights}

    def requantize(
        self, value: Node, qp_in: QParams, qp_out: QParams, *, before: Node | None = None
    ) -> Node:
        """``value`` (uint8 codes with ``qp_in``) in ``qp_out``; itself when they agree."""
        if qp_in == qp_out:
            return value
        mod = lm.Requantize(self.target, qp_in, qp_out)
        new = self.add_module(f"{value.name}_requant", mod, (value,), before=before)
        self.record(new, mod.kernel)
        return new

    def lookup_table(
        self,
        node: Node,
        x: Node,
        fn: Callable[[torch.Tensor], torch.Tensor],
        what: str,
        in_qp: QParams,
        out_qp: QParams,
    ) -> Node:
        """Lower ``quantize(fn(dequantize(x)))`` to a 256-entry table built now."""
        mod = lm.QuantizedLookupTable(
            lookup_table(fn, in_qp, out_qp), what, self.target, in_qp, out_qp
        )
        new = self.add_module(f"{node.name}_lut", mod, (x,))
        self.record(new, f"{mod.kernel} ({what})")
        return new


def lookup_table(
    fn: Callable[[torch.Tensor], torch.Tensor], in_qp: QParams, out_qp: QParams
) -> torch.Tensor:
    """uint8[256]: ``quantize(fn(dequantize(code)))`` from ``in_qp`` to ``out_qp``."""

    def table_fn(v: Any) -> Any:
        with torch.no_grad():
            return fn(torch.from_numpy(np.array(v, dtype=np.float32))).numpy()

    return torch.from_numpy(
        np.array(K.build_lut(table_fn, in_qp[0], in_qp[1], out_qp[0], out_qp[1]))
    )
