"""A lowering rule: the reference pattern(s) of one op family and the builder that lowers them.

A ``static`` rule's op is searched as the input of a quantize,

    quantize_per_tensor(op(...), scale, zero_point, 0, 255, torch.uint8)

with constant scalar ``scale``/``zero_point`` (:data:`STATIC_OUTPUT_CONSTRAINTS`, added to every
static rule), ``op`` matching one of the rule's patterns and feeding only that quantize. A
``float_output`` rule matches its pattern alone (dynamic linear, weight-only embeddings: float
results). The builder checks what the pattern cannot express (inputs are static uint8
dequantize nodes, argument values, weight dtypes) and raises :class:`NotLowerableError` with
the reason when the kernels cannot run the match. The built-in table is in ``_table``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, TypeVar

import torch
from torch import nn
from torch.fx import Node

from quantbridge.lowering._context import (
    QUANTIZE,
    LoweringContext,
    NotLowerableError,
    QParams,
    constant_tensor,
)
from quantbridge.lowering._errors import LoweringError
from quantbridge.patterns import (
    ArgConstraint,
    MatchAllNode,
    Nested,
    Pattern,
    PatternError,
    ReplacementPattern,
    RewriteMatch,
    as_complex,
    pattern_operators,
)
from quantbridge.qconfig import BackendConfig, DTypeConfig

__all__ = [
    "STATIC_OUTPUT_CONSTRAINTS",
    "Builder",
    "LoweringRule",
    "RuleKind",
    "RuleMatch",
    "static_pattern",
]

RuleKind: TypeAlias = Literal["static", "float_output", "fusion"]
_Found = TypeVar("_Found")
# dtype modes a rule can declare; BackendConfig dtype configs are classified into these
MODES = ("static", "static_float_output", "dynamic", "weight_only", "fp16", "dynamic_fp16")


@dataclass(frozen=True, eq=False)
class RuleMatch:
    """One match of a :class:`LoweringRule`, handed to its builder.

    ``node`` is the float op the rule lowers (for a static rule: the quantize's input);
    ``nodes`` the operators matched by the rule's op pattern in pre-order, ``node`` first
    (empty when the op pattern is ``MatchAllNode``); ``anchor`` the node whose users the
    builder's result takes over (the quantize of a static rule, else ``node``);
    ``output_qparams`` the quantize's (scale, zero point) for static rules, else None.
    """

    rule: LoweringRule
    node: Node
    nodes: tuple[Node, ...]
    anchor: Node
    output_qparams: QParams | None

    def recheck(self, analyze: Callable[[RewriteMatch], _Found | None], why: str) -> _Found:
        """``analyze`` (the rule's ``match_filter`` returning what it found) on this match as
        the graph is now: an earlier build of the same pass may have replaced a node it
        names. Raises ``NotLowerableError(why)`` when it no longer finds anything."""
        found = analyze(RewriteMatch(self.rule._compiled[0], self.nodes, self.anchor, ()))
        if found is None:
            raise NotLowerableError(why)
        return found

    @property
    def out_qparams(self) -> QParams:
        """``output_qparams`` of a static match (LoweringError for a float-output match)."""
        if self.output_qparams is None:
            raise LoweringError(
                f"rule {self.rule.name!r} ({self.rule.kind}): a float-output match has no "
                "output qparams; declare the rule kind='static' to lower quantize(op(...))"
            )
        return self.output_qparams


Builder: TypeAlias = Callable[[LoweringContext, RuleMatch], Node]


def _not_rewritten(match: RewriteMatch, graph: Any) -> Any:  # pragma: no cover - never called
    raise LoweringError("lowering rules are applied by lower_to_kernels, not replace_pattern")


def _is_scalar_constant(value: Any) -> bool:
    if not isinstance(value, Node) or value.graph.owning_module is None:
        return False
    t = constant_tensor(value.graph.owning_module, value)
    return t is not None and t.numel() == 1


def _equal_to(expected: Any) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        return bool(value == expected)

    return check


# quantize_per_tensor(x, scale, zero_point, quant_min, quant_max, dtype) with constant scalar
# qparams over uint8 [0, 255]: the output of every static rule (op 0 of its pattern)
STATIC_OUTPUT_CONSTRAINTS: tuple[ArgConstraint, ...] = (
    ArgConstraint(position=1, predicate=_is_scalar_constant),
    ArgConstraint(position=2, predicate=_is_scalar_constant),
    ArgConstraint(position=3, predicate=_equal_to(0)),
    ArgConstraint(position=4, predicate=_equal_to(255)),
    ArgConstraint(position=5, predicate=_equal_to(torch.uint8)),
)


def static_pattern(op: Pattern) -> Nested:
    """The pattern ``quantize_per_tensor(op, scale, zero_point, min, max, dtype)``."""
    return Nested(
        QUANTIZE, op, MatchAllNode, MatchAllNode, MatchAllNode, MatchAllNode, MatchAllNode
    )


@dataclass(frozen=True, eq=False)
class LoweringRule:
    """One row of the lowering table: what it lowers, how, and what it supports.

    Args:
        name: the family, used in error messages (e.g. ``"max_pool2d"``).
        ops: typed patterns (quantbridge.patterns) of the float op in the reference model:
            a module class, function or method name, or ``Nested(nn.ReLU, operator.add)``
            (a bare tuple is refused: it cannot say which order it is in). A module class
            also matches its subclasses.
        build: ``build(ctx, match) -> Node``: emits the lowered node(s) with the
            :class:`LoweringContext` helpers and returns the node that takes over the users
            of ``match.anchor``; raises :class:`NotLowerableError` to keep the match as it is.
        kind: ``"static"``: the op's output feeds a static uint8 quantize (the pattern is
            ``quantize(op, ...)``); ``"float_output"``: the op alone (float result);
            ``"fusion"``: runs after the other rules on the lowered graph and merges lowered
            modules (``ops`` then name lowered module classes).
        constraints: ``ArgConstraint`` on the pattern's operators, indexed in pre-order:
            for a static rule 0 is the quantize and 1 the float op; otherwise 0 is the op.
        match_filter: a final test on the ``RewriteMatch`` (``match.anchor``, ``.nodes``).
        description: the op family as the support table shows it (default: ``name``).
        kernel: what runs it, for the support table.
        modes: the dtype modes it lowers (``"static"``, ``"dynamic"``, ``"weight_only"``,
            ``"static_float_output"``: quantized inputs, float output): a backend built from
            the table allows exactly these.
        config_ops: operators of BackendConfig patterns (the float model's modules,
            functions and methods, before convert) whose quantized form this rule lowers,
            besides the operators named in ``ops``.
        folds: operators a BackendConfig pattern may apply to this rule's operators because
            convert folds them away (BatchNorm after a conv or linear); alone they are not
            supported.
    """

    name: str
    ops: tuple[Pattern, ...]
    build: Builder
    kind: RuleKind = "static"
    constraints: tuple[ArgConstraint, ...] = ()
    match_filter: Callable[[RewriteMatch], bool] | None = None
    description: str = ""
    kernel: str = ""
    modes: tuple[str, ...] = ("static",)
    config_ops: tuple[Any, ...] = ()
    folds: tuple[Any, ...] = ()
    _compiled: tuple[ReplacementPattern, ...] = field(init=False, repr=False)
    _module_classes: frozenset[type] = field(init=False, repr=False)
    _operators: frozenset[Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        where = f"LoweringRule {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise LoweringError(f"LoweringRule: name must be a non-empty string, got {self.name!r}")
        if self.kind not in ("static", "float_output", "fusion"):
            raise LoweringError(
                f"{where}: kind must be 'static', 'float_output' or 'fusion', got {self.kind!r}"
            )
        if not callable(self.build):
            raise LoweringError(f"{where}: build must be callable as build(ctx, match) -> Node")
        ops: Any = self.ops
        if isinstance(ops, list):
            ops = tuple(ops)
        if not isinstance(ops, tuple) or not ops:
            raise LoweringError(
                f"{where}: ops must be a non-empty tuple of patterns, e.g. (nn.ReLU, F.relu); "
                f"got {ops!r}"
            )
        object.__setattr__(self, "ops", ops)
        for i, op in enumerate(ops):
            if op is MatchAllNode:
                continue  # static rules only: any input of the quantize, narrowed by constraints
            try:
                as_complex(op, where=f"{where}.ops[{i}]")
            except PatternError as e:
                raise LoweringError(str(e)) from e
        for label in ("modes", "config_ops", "folds"):
            object.__setattr__(self, label, tuple(getattr(self, label)))
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise LoweringError(f"{where}: unknown modes {unknown}; modes are {MODES}")
        object.__setattr__(self, "constraints", tuple(self.constraints))
        object.__setattr__(self, "_compiled", tuple(self.compile(op) for op in self.ops))
        classes = frozenset(c for op in self.ops for c in _module_classes(as_complex(op)))
        object.__setattr__(self, "_module_classes", classes)
        named = [
            o for op in ops if op is not MatchAllNode for o in pattern_operators(as_complex(op))
        ]
        object.__setattr__(self, "_operators", frozenset((*named, *self.config_ops)))

    def names(self, operator: object) -> bool:
        """Whether ``operator`` is named in ``ops`` or ``config_ops`` (not ``folds``)."""
        return operator in self._operators

    def full_pattern(self, op: Pattern) -> Pattern:
        """The pattern searched for ``op``: wrapped in the quantize if static."""
        return static_pattern(op) if self.kind == "static" else op

    def compile(self, op: Pattern) -> ReplacementPattern:
        """The quantbridge.patterns rewrite pattern that finds ``op`` for this rule."""
        if op is MatchAllNode and self.kind != "static":
            raise LoweringError(
                f"LoweringRule {self.name!r}: MatchAllNode alone matches any node; only a static "
                "rule (quantize of anything, narrowed by constraints) may use it"
            )
        extra = STATIC_OUTPUT_CONSTRAINTS if self.kind == "static" else ()
        try:
            return ReplacementPattern(
                pattern=self.full_pattern(op),
                build=_not_rewritten,
                constraints=self.constraints + extra,  # the rule's own first: more selective
                match_filter=self.match_filter,
                name=f"{self.name}: {op!r}",
            )
        except PatternError as e:
            raise LoweringError(f"LoweringRule {self.name!r}, op {op!r}: {e}") from e


def _module_classes(pattern: Pattern) -> Iterator[type]:
    """The nn.Module classes named anywhere in a complex pattern."""
    if isinstance(pattern, tuple):
        for p in pattern:
            yield from _module_classes(p)
    elif isinstance(pattern, type) and issubclass(pattern, nn.Module):
        yield pattern


def dtype_mode(dc: DTypeConfig) -> str:
    """The mode a BackendConfig dtype config quantizes in (one of :data:`MODES`)."""
    if dc.is_dynamic:
        return "dynamic" if dc.weight_dtype != torch.float16 else "dynamic_fp16"
    if dc.input_dtype == torch.float16:
        return "fp16"
    if dc.input_dtype in (None, torch.float32) and dc.weight_dtype is not None:
        return "weight_only"
    if dc.output_dtype == torch.float32:
        return "static_float_output"
    return "static"


def _covering_rules(pattern: Pattern, rules: Sequence[LoweringRule]) -> list[LoweringRule] | None:
    """The rules that cover every operator of a complex pattern, or None if one is uncovered.

    An operator is covered by a rule that names it, or by a rule that declares it in ``folds``
    when the operator's first argument is one the same rule names (BatchNorm over a conv).
    """
    found: list[LoweringRule] = []

    def walk(p: Pattern) -> bool:
        if p is MatchAllNode:
            return True
        op, args = (p[0], p[1:]) if isinstance(p, tuple) else (p, ())
        owners = [r for r in rules if r.names(op)]
        if not owners:
            first = args[0] if args else None
            first_op = first[0] if isinstance(first, tuple) else first
            owners = [
                r for r in rules if op in r.folds and first_op is not None and r.names(first_op)
            ]
        if not owners:
            return False
        found.extend(r for r in owners if r not in found)
        return all(walk(a) for a in args)

    return found if walk(pattern) else None


def backend_config_from_rules(
    name: str, rules: Sequence[LoweringRule], source: BackendConfig
) -> BackendConfig:
    """The BackendConfig named ``name`` allowing what ``rules`` lower: the entries of
    ``source`` (in order) whose every operator a rule covers, each with only the dtype
    configs of the modes its covering rules declare. Where they declare
    ``"static_float_output"``, each static dtype config gets a twin with a float32 output."""
    config = BackendConfig(name)
    for entry in source.configs:
        owners = _covering_rules(entry.complex_pattern, rules)
        if owners is None:
            continue
        modes = {m for rule in owners for m in rule.modes}
        kept = [dc for dc in entry.dtype_configs if dtype_mode(dc) in modes]
        if "static_float_output" in modes:
            kept += [_float_output_twin(dc) for dc in kept if dtype_mode(dc) == "static"]
        if kept:
            config.set_backend_pattern_config(entry.set_dtype_configs(kept))
    return config


def _float_output_twin(dc: DTypeConfig) -> DTypeConfig:
    """``dc`` with its inputs, weight and bias, and a float32 output."""
    return DTypeConfig(
        input_dtype=dc.input_dtype_with_constraints,
        output_dtype=torch.float32,
        weight_dtype=dc.weight_dtype_with_constraints,
        bias_dtype=dc.bias_dtype,
        is_dynamic=False,
    )
