"""What prepare leaves on the observed model for convert and explain to read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quantbridge.fx_quant._custom_config import PrepareCustomConfig
from quantbridge.qconfig import BackendConfig, QConfigAny, QConfigMapping, QConfigMatch

__all__ = [
    "DECISIONS_KEY",
    "OBSERVED_KEY",
    "NodeDecision",
    "ObservedState",
    "RecordedDecisions",
    "SwappedModule",
]

# Key of the observed state in ``GraphModule.meta`` (kept by deepcopy, not by state_dict).
OBSERVED_KEY = "_quantbridge_observed"
# Key of prepare's decisions on converted models: convert drops the observed state but keeps
# these, and lowering passes keep meta, so explain also works after convert and lowering.
DECISIONS_KEY = "_quantbridge_decisions"


@dataclass
class NodeDecision:
    """Why prepare did (or did not) quantize one node; rows of ``explain``."""

    node: str
    op: str
    target: str
    pattern: str | None
    pattern_nodes: tuple[str, ...]
    qconfig_rule: str
    qconfig: QConfigAny
    candidates: list[tuple[str, str | None]]  # (DTypeConfig description, rejection or None)
    chosen: int | None
    status: str  # "quantized", "float", "custom module", "standalone module"
    reason: str


@dataclass(frozen=True)
class SwappedModule:
    """A torch module prepare replaced with its traceable equivalent (``nn.quantizable``)."""

    name: str  # qualified module name ("" for the root)
    float_type: str  # e.g. "nn.MultiheadAttention"
    traceable_type: str  # e.g. "quantizable.MultiheadAttention"
    linears: tuple[str, ...] = ()  # qualified names of its own nn.Linear children


@dataclass
class ObservedState:
    """Everything convert needs besides the graph: qconfigs, scopes, configs, decisions."""

    node_name_to_qconfig: dict[str, QConfigAny]
    node_name_to_qconfig_match: dict[str, QConfigMatch]
    node_name_to_scope: dict[str, tuple[str, Any]]
    prepare_custom_config: PrepareCustomConfig
    qconfig_mapping: QConfigMapping
    backend_config: BackendConfig
    is_qat: bool
    observed_node_names: set[str]
    decisions: list[NodeDecision] = field(default_factory=list)
    is_standalone: bool = False
    swapped_modules: list[SwappedModule] = field(default_factory=list)


@dataclass(frozen=True)
class RecordedDecisions:
    """What explain reads on a converted or lowered model: prepare's decisions."""

    backend: str
    rows: tuple[NodeDecision, ...]
    swapped: tuple[SwappedModule, ...] = ()
