"""The values of a lowered graph that depend only on its inputs' sizes, computed once per size.

An exported transformer builds, at every forward, scaffolding that reads no input data: the
position ids sliced to the sequence length, the token-type ids expanded to the batch, the
ranges and comparisons a padding mask is broadcast with. At batch 1 that is ~25 nodes, ~3 %
of a BERT forward. ``partition`` finds them: nodes whose inputs are only the model's own
tensors, constants and the sizes of the model's inputs, whose operation is known to be pure
(an ATen operator that mutates nothing and draws no random numbers, an ``operator``
function, a side-effect-free tensor method, a lowered module). ``StaticCache`` keeps their
values per key: the input sizes the values were computed from, plus the identity, storage
and version counter of every model tensor they read, so an in-place change of a buffer, or a
new one put in its place, computes them again. (Writes through ``.data`` bypass version
counters, as they bypass autograd's checks: a buffer changed that way in place is not seen.
Float modules, whose parameters users do change, are never static.)

A value is kept only when nothing can change it after it is handed out: every node that
reads it, or reads a view of it (followed through every node whose result may alias its
input), must leave it as it is (pure, or a float module that only reads its input; a value a
node could write to is computed fresh each call), and neither it nor a view of it is the
graph's output (the caller could change it).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node

from quantbridge.lowering._modules import LoweredModule

# size queries of a model input: their values (ints) are the cache key
_SIZE_FUNCTIONS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default}
_SIZE_METHODS = {"size", "dim"}
_PURE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
    operator.mod, operator.pow, operator.neg, operator.getitem, operator.and_, operator.or_,
    operator.invert, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
    operator.ge,
}  # fmt: skip
# tensor methods that return new tensors or views and write nothing
_PURE_METHODS = {
    "reshape", "view", "expand", "expand_as", "transpose", "permute", "unsqueeze", "squeeze",
    "flatten", "contiguous", "to", "float", "bool", "long", "int", "type_as", "eq", "ne", "ge",
    "gt", "le", "lt", "masked_fill", "cumsum", "size", "dim", "new_ones", "new_zeros",
    "new_full", "t", "clone", "add", "sub", "mul", "div", "neg", "logical_not", "logical_and",
    "logical_or", "sum", "mean", "amax", "amin", "abs", "pow", "sqrt", "exp",
}  # fmt: skip
# float modules that read their inputs and never write them (the readers a kept value may
# have besides pure nodes); not static themselves: users change their parameters
_READING_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag, torch.nn.Linear, torch.nn.LayerNorm)
# entries kept per graph: one per input size in use (a server's few sequence lengths)
CACHE_ENTRIES = 8


def _pure(node: Node, gm: GraphModule) -> bool:
    """Whether running ``node`` changes nothing but its own result, the same every time for
    the same inputs."""
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            return (
                not target._schema.is_mutable
                and torch.Tag.nondeterministic_seeded not in target.tags
            )
        return target in _PURE_FUNCTIONS
    if node.op == "call_method":
        return node.target in _PURE_METHODS
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        # lowered modules' weights are packed: only load_state_dict changes them
        return isinstance(mod, LoweredModule)
    return False


def _reads_only(node: Node, gm: GraphModule) -> bool:
    """Whether ``node`` leaves its inputs as they were."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return isinstance(mod, (LoweredModule, *_READING_MODULES))
    return _pure(node, gm)


# methods whose result may be their receiver or a view of it
_ALIASING_METHODS = {
    "reshape", "view", "expand", "expand_as", "transpose", "permute", "unsqueeze", "squeeze",
    "flatten", "contiguous", "to", "float", "bool", "long", "int", "type_as", "t",
}  # fmt: skip


def _may_alias(node: Node, gm: GraphModule) -> bool:
    """Whether ``node``'s result may share memory with an input (a view, an element of a
    list, the receiver returned as it is)."""
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            return any(r.alias_info is not None for r in target._schema.returns)
        return target is operator.getitem
    if node.op == "call_method":
        return node.target in _ALIASING_METHODS
    return node.op == "call_module" and not isinstance(
        gm.get_submodule(str(node.target)), _READING_MODULES
    )  # a lowered module may hand an input back (a requantize to the same qparams)


def _never_changed(node: Node, gm: GraphModule) -> bool:
    """Whether nothing can write to ``node``'s value once computed: every node that reads it,
    or a view of it (followed through aliasing nodes), leaves it as it is, and neither it nor a
    view of it is the graph's output (the caller's to change)."""
    seen: set[Node] = set()
    todo = list(node.users)
    while todo:
        user = todo.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op == "output" or not _reads_only(user, gm):
            return False
        if _may_alias(user, gm):
            todo.extend(user.users)
    return True


def _size_query(node: Node) -> bool:
    """A size of a model input: computed every call, part of the key."""
    inputs = node.all_input_nodes
    if len(inputs) != 1 or inputs[0].op != "placeholder" or node.kwargs:
        return False
    if node.op == "call_function":
        return node.target in _SIZE_FUNCTIONS
    return node.op == "call_method" and node.target in _SIZE_METHODS


@dataclass
class Partition:
    """``keys``: the size queries, in graph order; ``static``: the nodes computed once per key;
    ``kept``: the static nodes a per-call node reads (the cached values); ``attrs`` and
    ``modules``: the model tensors and modules the static nodes read (versioned in the key)."""

    keys: list[Node] = field(default_factory=list)
    static: set[Node] = field(default_factory=set)
    kept: list[Node] = field(default_factory=list)
    attrs: list[str] = field(default_factory=list)
    modules: list[torch.nn.Module] = field(default_factory=list)


def partition(gm: GraphModule) -> Partition:
    """The size queries and static nodes of ``gm``'s graph (see the module docstring)."""
    part = Partition()
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if _size_query(node):
            part.keys.append(node)
            continue
        if node.op == "get_attr":
            value = attr(gm, str(node.target))
            ok = isinstance(value, torch.Tensor) and not value.is_inference()
        else:
            ok = _pure(node, gm) and all(
                u in part.static or u in part.keys for u in node.all_input_nodes
            )
            if ok and node.op == "call_module":
                mod = gm.get_submodule(str(node.target))
                ok = not any(t.is_inference() for t in _tensors(mod))
        if ok and _never_changed(node, gm):
            part.static.add(node)
    for node in nodes:
        if node in part.static:
            if any(u not in part.static for u in node.users):
                part.kept.append(node)
            if node.op == "get_attr":
                part.attrs.append(str(node.target))
            elif node.op == "call_module":
                part.modules.append(gm.get_submodule(str(node.target)))
    return part


def attr(gm: GraphModule, path: str) -> Any:
    """The value a ``get_attr`` node of ``gm`` reads (``path``: dotted)."""
    value: Any = gm
    for name in str(path).split("."):
        value = getattr(value, name)
    return value


def _version(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return id(t)
    return (id(t), t.data_ptr(), t._version)


def _tensors(mod: torch.nn.Module) -> list[torch.Tensor]:
    return [t for t in (*mod._parameters.values(), *mod._buffers.values()) if t is not None]


class StaticCache:
    """The kept values of one graph per key, the newest ``CACHE_ENTRIES`` keys."""

    def __init__(self, attrs: list[str], modules: list[torch.nn.Module]) -> None:
        self._attrs = attrs
        self._modules = modules
        self._entries: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def key(self, gm: GraphModule, sizes: tuple[Any, ...]) -> tuple[Any, ...]:
        """``sizes`` with the identity and version of every tensor the static nodes read."""
        seen: list[Any] = list(sizes)
        for path in self._attrs:
            t = attr(gm, path)
            seen.append(_version(t))
        for mod in self._modules:
            seen.extend(_version(t) for t in _tensors(mod))
        return tuple(seen)

    def get(self, key: tuple[Any, ...]) -> tuple[Any, ...] | None:
        return self._entries.get(key)

    def put(self, key: tuple[Any, ...], values: tuple[Any, ...]) -> tuple[Any, ...]:
        """Keep ``values`` for ``key`` unless one of them carries autograd history (a
        parameter in grad mode): those are recomputed at every call, as the graph would."""
        if not any(isinstance(v, torch.Tensor) and v.requires_grad for v in values):
            if len(self._entries) >= CACHE_ENTRIES:
                del self._entries[next(iter(self._entries))]  # the oldest
            self._entries[key] = values
        return values
