"""compare_layers / compare_weights: which quantized op (or weight) loses the signal, in dB.

Both take the float model the user started from and a quantized model (a reference model from
``convert_to_reference_fx`` / ``convert_fx``, or a model a backend lowered). The float model is
traced with the flow's tracer, so its node names are the names prepare saw; an op fused by
prepare (conv → bn → relu) keeps the first node's name and is compared with the float value of
the last node of the fused chain.

Where a quantized op's output lives:

- reference form: a ``quantize_per_tensor`` node whose input is the op;
- lowered models: ``GraphModule.meta["quantbridge_quantized_outputs"]``, a dict written by the
  lowering pass: ``{node name: {"output_of": op name, "scale": float, "zero_point": int,
  "weights_of": op name (optional)}}`` for nodes returning uint8 codes in [0, 255]. Any backend
  can write it; this package reads only plain Python values from it.

Two views per op. *Propagated*: the quantized model runs on its own; the op's output carries
the error of everything before it. *Isolated*: the quantized model runs, but after each
quantized op the value passed on is the float model's value at that point, quantized with the
same qparams; so each op sees the float model's input (quantized as the model quantizes it),
as in torch.ao's shadow models, and its error is its own.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Interpreter, Node
from torch.nn.utils.fusion import fuse_conv_bn_weights, fuse_linear_bn_weights

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._state import DECISIONS_KEY, OBSERVED_KEY
from quantbridge.fx_quant._tracer import trace

__all__ = [
    "QUANTIZED_OUTPUTS_KEY",
    "LayerComparison",
    "LayerError",
    "WeightComparison",
    "WeightError",
    "compare_layers",
    "compare_weights",
]

# GraphModule.meta key a lowering pass fills (see the module docstring).
QUANTIZED_OUTPUTS_KEY = "quantbridge_quantized_outputs"

_Q = torch.ops.quantbridge
_QUANTIZE = (_Q.quantize_per_tensor.default, _Q.quantize_per_tensor.tensor)
_DEQUANTIZE = (_Q.dequantize_per_tensor.default, _Q.dequantize_per_tensor.tensor)
_VIEWS = ("isolated", "propagated")


# --- statistics ----------------------------------------------------------------------------


def sqnr_db(signal_power: float, noise_power: float) -> float:
    """10·log10(Σx² / Σ(x - x̂)²); +inf when there is no noise."""
    if noise_power == 0.0:
        return math.inf
    if signal_power == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal_power / noise_power)


@dataclass
class _Stats:
    signal: float = 0.0
    noise: float = 0.0
    max_err: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf

    def add(self, ref: torch.Tensor, got: torch.Tensor) -> None:
        ref64, diff = ref.detach().double(), got.detach().double() - ref.detach().double()
        self.signal += float(ref64.square().sum())
        self.noise += float(diff.square().sum())
        if diff.numel():
            self.max_err = max(self.max_err, float(diff.abs().max()))
            self.lo = min(self.lo, float(ref64.min()))
            self.hi = max(self.hi, float(ref64.max()))

    @property
    def sqnr(self) -> float:
        return sqnr_db(self.signal, self.noise)


# --- report rows ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerError:
    """One quantized op: its error against the float model in both views."""

    name: str  # the op's node name, as explain() shows it (a fused op: its first module)
    module: str | None  # qualified module name of the op (None for functions)
    op: str  # what it computes in the float model, e.g. "Conv2d+BatchNorm2d+ReLU"
    float_node: str  # float model node compared with (the last node of a fused chain)
    quantized_node: str  # the node in the quantized model holding the op's output
    scale: float  # output quantization step
    sqnr_db: float  # propagated view
    max_abs_error: float
    isolated_sqnr_db: float
    isolated_max_abs_error: float
    output_min: float  # range of the float model's output
    output_max: float

    def sqnr(self, view: str) -> float:
        return self.isolated_sqnr_db if view == "isolated" else self.sqnr_db


@dataclass(frozen=True)
class WeightError:
    """One weighted layer: its dequantized weight against the float weight."""

    name: str  # the op's node name
    module: str  # qualified name of the float module holding the weight
    quantized_module: str  # where the quantized weight lives in the quantized model
    scheme: str  # "per_channel" or "per_tensor"
    sqnr_db: float
    max_abs_error: float


def _fmt_db(value: float) -> str:
    return "inf" if value == math.inf else ("-inf" if value == -math.inf else f"{value:.2f}")


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [line.format(*header), line.format(*("-" * w for w in widths))]
    return [s.rstrip() for s in out + [line.format(*r) for r in rows]]


def _check_view(view: str) -> str:
    if view not in _VIEWS:
        raise FxQuantError(f"view must be one of {_VIEWS}, got {view!r}")
    return view


def _pyplot(where: str) -> Any:
    try:
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise FxQuantError(
            f"{where} needs matplotlib, which is not installed; install it with "
            "pip install 'quantbridge-fx-quant[plot]' (or pip install matplotlib)"
        ) from None
    return plt


@dataclass
class LayerComparison:
    """compare_layers' report: one :class:`LayerError` per quantized op, in graph order.

    ``worst(k, view)`` lists the k lowest-SQNR ops, ``str(report)`` is a table,
    ``to_dict()`` plain data, ``plot()`` a matplotlib chart of SQNR per layer.
    ``unmatched`` lists quantized outputs with no float counterpart, and why.
    """

    rows: list[LayerError]
    batches: int
    unmatched: list[tuple[str, str]] = field(default_factory=list)

    def __iter__(self) -> Iterator[LayerError]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, name: str) -> LayerError:
        for row in self.rows:
            if name in (row.name, row.quantized_node):
                return row
        raise KeyError(f"no op {name!r} in this report; ops: {[r.name for r in self.rows]}")

    def worst(self, k: int = 5, view: str = "isolated") -> list[LayerError]:
        """The ``k`` ops with the lowest SQNR in ``view`` ("isolated": the op's own error,
        which names the culprit; "propagated": the error accumulated up to the op)."""
        _check_view(view)
        return sorted(self.rows, key=lambda r: r.sqnr(view))[: max(k, 0)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "rows": [asdict(r) for r in self.rows],
            "unmatched": [list(u) for u in self.unmatched],
        }

    def __str__(self) -> str:
        header = ("op", "module", "computes", "SQNR dB", "max err", "isolated dB",
                  "isolated max err", "float range", "scale")  # fmt: skip
        rows = [
            (
                r.name,
                r.module or "-",
                r.op,
                _fmt_db(r.sqnr_db),
                f"{r.max_abs_error:.4g}",
                _fmt_db(r.isolated_sqnr_db),
                f"{r.isolated_max_abs_error:.4g}",
                f"[{r.output_min:.4g}, {r.output_max:.4g}]",
                f"{r.scale:.3g}",
            )
            for r in self.rows
        ]
        lines = [f"per-op error of the quantized model ({self.batches} batches)"]
        lines += _table(header, rows)
        for node, why in self.unmatched:
            lines.append(f"  not compared: {node}: {why}")
        return "\n".join(lines)

    def plot(self, view: str = "both", ax: Any = None) -> Any:
        """SQNR per layer as a bar chart (needs matplotlib); returns the Axes.

        ``view``: "isolated", "propagated" or "both" (side by side)."""
        views = _VIEWS if view == "both" else (_check_view(view),)
        plt = _pyplot("LayerComparison.plot")
        if ax is None:
            _, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(self.rows) + 2), 3.5))
        width = 0.8 / len(views)
        for i, v in enumerate(views):
            xs = [j + (i - (len(views) - 1) / 2) * width for j in range(len(self.rows))]
            ax.bar(xs, [_finite(r.sqnr(v)) for r in self.rows], width, label=v)
        ax.set_xticks(range(len(self.rows)))
        ax.set_xticklabels([r.name for r in self.rows], rotation=45, ha="right")
        ax.set_ylabel("SQNR (dB)")
        ax.set_title("quantized vs float, per op")
        ax.legend()
        return ax


def _finite(v: float) -> float:
    return 200.0 if v == math.inf else (-200.0 if v == -math.inf else v)


@dataclass
class WeightComparison:
    """compare_weights' report: one :class:`WeightError` per weighted layer."""

    rows: list[WeightError]

    def __iter__(self) -> Iterator[WeightError]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, name: str) -> WeightError:
        for row in self.rows:
            if name in (row.name, row.module):
                return row
        raise KeyError(f"no layer {name!r} in this report; layers: {[r.name for r in self.rows]}")

    def worst(self, k: int = 5) -> list[WeightError]:
        """The ``k`` layers whose quantized weight has the lowest SQNR."""
        return sorted(self.rows, key=lambda r: r.sqnr_db)[: max(k, 0)]

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [asdict(r) for r in self.rows]}

    def __str__(self) -> str:
        header = ("layer", "module", "scheme", "SQNR dB", "max err")
        rows = [
            (r.name, r.module, r.scheme, _fmt_db(r.sqnr_db), f"{r.max_abs_error:.4g}")
            for r in self.rows
        ]
        return "\n".join(["weight quantization error per layer", *_table(header, rows)])

    def plot(self, ax: Any = None) -> Any:
        """Weight SQNR per layer as a bar chart (needs matplotlib); returns the Axes."""
        plt = _pyplot("WeightComparison.plot")
        if ax is None:
            _, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(self.rows) + 2), 3.5))
        ax.bar(range(len(self.rows)), [_finite(r.sqnr_db) for r in self.rows])
        ax.set_xticks(range(len(self.rows)))
        ax.set_xticklabels([r.name for r in self.rows], rotation=45, ha="right")
        ax.set_ylabel("weight SQNR (dB)")
        return ax


# --- matching the quantized model to the float model ---------------------------------------


@dataclass(frozen=True)
class _Point:
    """A node of the quantized model that returns an op's output as integer codes."""

    node: str
    source: str  # the op's node name (prepare's graph)
    qparams: Callable[[tuple[Any, ...]], tuple[float, int, int, int, torch.dtype]]


def _reference_qparams(args: tuple[Any, ...]) -> tuple[float, int, int, int, torch.dtype]:
    return float(args[1]), int(args[2]), int(args[3]), int(args[4]), args[5]


def _is_dequantize(node: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in _DEQUANTIZE


def _fixed(
    qp: tuple[float, int, int, int, torch.dtype],
) -> Callable[[tuple[Any, ...]], tuple[float, int, int, int, torch.dtype]]:
    return lambda _args: qp


def _points(model: GraphModule) -> dict[str, _Point]:
    points: dict[str, _Point] = {}
    names = {n.name for n in model.graph.nodes}
    recorded = model.meta.get(QUANTIZED_OUTPUTS_KEY, {})
    for name, entry in (recorded if isinstance(recorded, dict) else {}).items():
        if name not in names or not isinstance(entry, dict):
            continue
        qp = (float(entry["scale"]), int(entry["zero_point"]), 0, 255, torch.uint8)
        points[name] = _Point(name, str(entry["output_of"]), _fixed(qp))
    for node in model.graph.nodes:
        if node.op != "call_function" or node.target not in _QUANTIZE or len(node.args) < 6:
            continue
        src = node.args[0]
        if not isinstance(src, Node) or src.op in ("placeholder", "get_attr"):
            continue
        if _is_dequantize(src):  # a requantize between two qparams, not an op
            continue
        points.setdefault(node.name, _Point(node.name, src.name, _reference_qparams))
    return points


def _runs_float(model: GraphModule, name: str) -> bool:
    """Whether node ``name`` calls a float weighted module (left float by a convert-time
    qconfig of None): a weight, and no weight qparams on it or its children."""
    node = next((n for n in model.graph.nodes if n.name == name), None)
    if node is None or node.op != "call_module":
        return False
    module = model.get_submodule(str(node.target))
    parts = (module, *module.children())
    if any(hasattr(m, "weight_scale") for m in parts):
        return False
    weights = [getattr(m, "weight", None) for m in parts]
    return any(isinstance(w, torch.Tensor) and w.is_floating_point() for w in weights)


def _prepared_names(model: nn.Module, where: str) -> dict[str, str]:
    """Node name -> prepare's status ("quantized", "float", ...) for the graph prepare worked
    on (after fusion), from the recorded decisions."""
    meta = getattr(model, "meta", None)
    meta = meta if isinstance(meta, dict) else {}
    recorded = meta.get(DECISIONS_KEY)
    if recorded is None:
        state = meta.get(OBSERVED_KEY)
        rows = getattr(state, "decisions", None)
    else:
        rows = getattr(recorded, "rows", None)
    if not isinstance(model, GraphModule) or rows is None:
        raise FxQuantError(
            f"{where}: quantized_model must be the GraphModule returned by convert_fx / "
            f"convert_to_reference_fx or by a backend's convert / lower; got a "
            f"{type(model).__name__} without quantbridge's recorded decisions (torch.fx drops "
            "GraphModule.meta when a whole model is pickled: compare before saving)"
        )
    return {r.node: r.status for r in rows}


@dataclass
class _FloatSide:
    gm: GraphModule
    nodes: dict[str, Node]
    known: set[str]

    def chain(self, source: str) -> list[Node] | None:
        """The float nodes an op of prepare's graph stands for: itself, then the nodes
        fusion folded into it (single-user successors that prepare's graph lacks)."""
        node = self.nodes.get(source)
        if node is None:
            return None
        chain = [node]
        while len(node.users) == 1:
            nxt = next(iter(node.users))
            if nxt.name in self.known or nxt.op not in ("call_module", "call_function",
                                                        "call_method"):  # fmt: skip
                break
            chain.append(nxt)
            node = nxt
        return chain

    def describe(self, chain: list[Node]) -> str:
        parts = []
        for n in chain:
            if n.op == "call_module":
                parts.append(type(self.gm.get_submodule(str(n.target))).__name__)
            else:
                parts.append(getattr(n.target, "__name__", str(n.target)))
        return "+".join(parts)


def _float_side(float_model: nn.Module, names: set[str], where: str) -> _FloatSide:
    if not isinstance(float_model, nn.Module):
        raise FxQuantError(
            f"{where}: float_model must be the float nn.Module that was quantized, got "
            f"{type(float_model).__name__}"
        )
    gm, _ = trace(float_model)
    return _FloatSide(gm, {n.name: n for n in gm.graph.nodes}, names)


# --- running both models -------------------------------------------------------------------


class _Recorder(Interpreter):
    """Runs a graph, calling ``seen(node, value, args)`` for each watched node; the value it
    returns replaces the node's output (the isolated view substitutes float values)."""

    def __init__(
        self,
        gm: GraphModule,
        watched: set[str],
        seen: Callable[[Node, Any, tuple[Any, ...]], Any],
    ) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.watched = watched
        self.seen = seen

    def run_node(self, n: Node) -> Any:
        out = super().run_node(n)
        if n.name in self.watched:
            args, _ = self.fetch_args_kwargs_from_env(n)
            out = self.seen(n, out, args)
        return out


def _as_args(batch: Any, index: int, where: str) -> tuple[Any, ...]:
    if isinstance(batch, torch.Tensor):
        return (batch,)
    if isinstance(batch, (tuple, list)):
        return tuple(batch)
    raise FxQuantError(
        f"{where}: inputs[{index}] is a {type(batch).__name__}; each item of inputs must be a "
        "tuple of the model's positional arguments (or one tensor)"
    )


def compare_layers(
    float_model: nn.Module, quantized_model: nn.Module, inputs: Iterable[Any]
) -> LayerComparison:
    """Per quantized op: SQNR (dB), max abs error and float output range, two views.

    ``inputs`` is an iterable of argument tuples (a tensor counts as a 1-tuple); both models
    run on each, in eval mode without gradients. Errors accumulate over all of them: SQNR is
    10·log10(Σ float² / Σ (dequantized - float)²) over every element of every batch.

    Rows are the ops prepare quantized (explain's "quantized" status) whose output the
    quantized model holds as integer codes with static qparams (ops a lowered model fused
    away, such as the conv of a conv + add, report through the op that holds the result).
    "propagated": the quantized model runs on its own. "isolated": every quantized op gets
    the float model's values as input, quantized with the quantized model's own qparams, so
    its error is its own (torch.ao's shadow-model view). Works on reference models and on
    lowered ones (read from ``meta["quantbridge_quantized_outputs"]``).
    """
    where = "compare_layers"
    status = _prepared_names(quantized_model, where)
    assert isinstance(quantized_model, GraphModule)
    # a quantize after an op prepare left float quantizes the next op's input: not a row
    points = {
        k: p
        for k, p in _points(quantized_model).items()
        if status.get(p.source, "quantized") == "quantized"
        and not _runs_float(quantized_model, p.source)
    }
    floats = _float_side(float_model, set(status) | {p.source for p in points.values()}, where)
    if isinstance(inputs, (torch.Tensor, str, bytes)) or not isinstance(inputs, Iterable):
        raise FxQuantError(
            f"{where}: inputs must be an iterable of argument tuples, got "
            f"{type(inputs).__name__}; wrap one batch in a list: [(x,)]"
        )

    unmatched: dict[str, str] = {}
    anchors: dict[str, Node] = {}  # quantized node -> float node compared with
    chains: dict[str, list[Node]] = {}
    for name, p in points.items():
        chain = floats.chain(p.source)
        if chain is None:
            unmatched[name] = f"op {p.source!r} is not a node of the traced float model"
            continue
        if chain[0].op == "placeholder":
            continue  # the model input's own quantize
        anchors[name], chains[name] = chain[-1], chain
    if not anchors and not unmatched:
        raise FxQuantError(
            f"{where}: quantized_model holds no quantized op output to compare: prepare "
            "quantized nothing (see explain(quantized_model)), or it was lowered by a backend "
            f"that does not record meta[{QUANTIZED_OUTPUTS_KEY!r}]"
        )
    stats = {name: (_Stats(), _Stats()) for name in anchors}  # (propagated, isolated)

    float_values: dict[str, torch.Tensor] = {}
    scales: dict[str, float] = {}

    def keep_float(n: Node, value: Any, _args: tuple[Any, ...]) -> Any:
        float_values[n.name] = value
        return value

    def observe(isolated: bool) -> Callable[[Node, Any, tuple[Any, ...]], Any]:
        def seen(n: Node, codes: Any, args: tuple[Any, ...]) -> Any:
            ref = float_values.get(anchors[n.name].name)
            s, z, lo, hi, dtype = points[n.name].qparams(args)
            scales[n.name] = s
            if not isinstance(ref, torch.Tensor) or not isinstance(codes, torch.Tensor):
                unmatched[n.name] = "the float or the quantized output is not a tensor"
                return codes
            got = _Q.dequantize_per_tensor(codes, s, z, lo, hi, dtype)
            if got.shape != ref.shape:
                unmatched[n.name] = (
                    f"shape {tuple(got.shape)} differs from the float model's "
                    f"{tuple(ref.shape)} at {anchors[n.name].name!r}"
                )
                return codes
            stats[n.name][int(isolated)].add(ref, got)
            if isolated:
                return _Q.quantize_per_tensor(ref.float(), s, z, lo, hi, dtype)
            return codes

        return seen

    float_run = _Recorder(floats.gm, {a.name for a in anchors.values()}, keep_float)
    watched = set(anchors)
    runs = [_Recorder(quantized_model, watched, observe(v == "isolated")) for v in _VIEWS]
    modes = [(m, m.training) for m in (*float_model.modules(), *quantized_model.modules())]
    batches = 0
    try:
        for m, _ in modes:
            m.training = False
        with torch.no_grad():
            for index, batch in enumerate(inputs):
                args = _as_args(batch, index, where)
                float_values.clear()
                float_run.run(*args)
                for run in runs:
                    run.run(*args)
                batches += 1
    finally:
        for m, training in modes:
            m.training = training
    if batches == 0:
        raise FxQuantError(f"{where}: inputs yielded no batch; pass at least one (x,) tuple")

    rows = []
    for node in quantized_model.graph.nodes:
        name = node.name
        if name not in anchors or name in unmatched:
            continue
        p = points[name]
        prop, iso = stats[name]
        chain = chains[name]
        root = chain[0]
        rows.append(
            LayerError(
                name=p.source,
                module=str(root.target) if root.op == "call_module" else None,
                op=floats.describe(chain),
                float_node=anchors[name].name,
                quantized_node=name,
                scale=scales.get(name, math.nan),
                sqnr_db=prop.sqnr,
                max_abs_error=prop.max_err,
                isolated_sqnr_db=iso.sqnr,
                isolated_max_abs_error=iso.max_err,
                output_min=prop.lo,
                output_max=prop.hi,
            )
        )
    return LayerComparison(rows, batches, sorted(unmatched.items()))


# --- weights -------------------------------------------------------------------------------


def _reference_weight(module: nn.Module) -> tuple[nn.Module, torch.Tensor, str] | None:
    """(module, dequantized weight, scheme) of a reference weighted module (or a fused
    module's first child)."""
    for m in (module, *module.children()):
        get_weight = getattr(m, "get_weight", None)
        if callable(get_weight) and hasattr(m, "weight_scale"):
            scheme = str(getattr(m, "weight_qscheme", ""))
            return m, get_weight(), "per_channel" if "channel" in scheme else "per_tensor"
    return None


def _lowered_weight(module: nn.Module) -> tuple[torch.Tensor, str] | None:
    """Dequantized weight of a lowered module holding int8 ``weight`` codes with
    ``weight_scale`` / ``weight_zero_point`` (one value, or one per output channel)."""
    w = getattr(module, "weight", None)
    s = getattr(module, "weight_scale", None)
    z = getattr(module, "weight_zero_point", None)
    if not all(isinstance(t, torch.Tensor) for t in (w, s, z)):
        return None
    assert isinstance(w, torch.Tensor)
    assert isinstance(s, torch.Tensor)
    assert isinstance(z, torch.Tensor)
    if w.dtype not in (torch.int8, torch.uint8) or s.numel() not in (1, w.shape[0]):
        return None
    shape = [-1] + [1] * (w.dim() - 1)
    deq = (w.double() - z.double().reshape(shape)) * s.double().reshape(shape)
    return deq, "per_channel" if s.numel() > 1 else "per_tensor"


def _float_weight(floats: _FloatSide, chain: list[Node]) -> torch.Tensor | None:
    """The float weight the op quantized: the module's, with a fused batch norm folded in."""
    root = chain[0]
    if root.op != "call_module":
        return None
    module = floats.gm.get_submodule(str(root.target))
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    bn = floats.gm.get_submodule(str(chain[1].target)) if len(chain) > 1 else None
    if not isinstance(bn, nn.modules.batchnorm._BatchNorm) or bn.running_mean is None:
        return weight.detach()
    assert bn.running_var is not None
    bias = getattr(module, "bias", None)
    if isinstance(module, nn.Linear):
        folded, _ = fuse_linear_bn_weights(
            weight, bias, bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias
        )
    else:
        transpose = isinstance(module, nn.modules.conv._ConvTransposeNd)
        folded, _ = fuse_conv_bn_weights(
            weight, bias, bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias, transpose
        )
    return folded.detach()


def compare_weights(float_model: nn.Module, quantized_model: nn.Module) -> WeightComparison:
    """Per weighted layer: SQNR (dB) and max abs error of the dequantized weight against the
    float weight (batch norms folded as fusion folds them), in graph order.

    Works on reference models (the reference modules' ``get_weight()``) and lowered ones
    (int8 ``weight`` with ``weight_scale`` / ``weight_zero_point`` on the lowered module).
    """
    where = "compare_weights"
    names = set(_prepared_names(quantized_model, where))
    assert isinstance(quantized_model, GraphModule)
    recorded = quantized_model.meta.get(QUANTIZED_OUTPUTS_KEY, {})
    recorded = recorded if isinstance(recorded, dict) else {}
    sources = {
        k: str(v.get("weights_of", v.get("output_of")))
        for k, v in recorded.items()
        if isinstance(v, dict)
    }
    floats = _float_side(float_model, names | set(sources.values()), where)
    rows: list[WeightError] = []
    for node in quantized_model.graph.nodes:
        if node.op != "call_module":
            continue
        module = quantized_model.get_submodule(str(node.target))
        path = str(node.target)
        ref = _reference_weight(module)
        if ref is not None:
            sub, deq, scheme = ref
            name = node.name
            path = next((f"{path}.{n}" for n, c in module.named_children() if c is sub), path)
        else:
            low = _lowered_weight(module) if node.name in sources else None
            if low is None:
                continue
            deq, scheme = low
            name = sources[node.name]
        chain = floats.chain(name)
        weight = None if chain is None else _float_weight(floats, chain)
        if chain is None or weight is None:
            raise FxQuantError(
                f"{where}: the quantized model's layer {name!r} ({path}) has no float "
                "weight in float_model; pass the float model this model was quantized from"
            )
        if tuple(weight.shape) != tuple(deq.shape):
            raise FxQuantError(
                f"{where}: layer {name!r}: float weight shape {tuple(weight.shape)} differs "
                f"from the quantized weight's {tuple(deq.shape)} ({path}); pass the float "
                "model this model was quantized from"
            )
        stats = _Stats()
        with torch.no_grad():
            stats.add(weight, deq)
        rows.append(
            WeightError(name, str(chain[0].target), path, scheme, stats.sqnr, stats.max_err)
        )
    return WeightComparison(rows)
