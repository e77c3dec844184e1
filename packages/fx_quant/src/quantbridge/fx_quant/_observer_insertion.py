"""Observer insertion: decide each node's target dtypes, then put observers where they change.

This is torch.ao 2.13's algorithm, node by node in graph order:

1. every node of a matched pattern gets a :class:`TargetInfo` from its match's qconfig
   (activation constructor for inputs and output, weight, bias placeholder, which argument
   positions are weight and bias, shared or reused observers);
2. quantized graph inputs/outputs and nodes whose arguments hold no tensors are special;
   known non-float arguments (``masked_fill``'s mask, ``view``'s sizes) are marked unobserved;
3. patterns whose qconfig no DTypeConfig accepts fall back to float;
4. walking the original nodes: at a pattern's root node, an input observer is inserted on
   each argument whose producer's output dtype differs from the dtype this node wants; at the
   pattern's last node an output observer; ops that share observers with their input
   (``OUTPUT_SHARE_OBSERVER_WITH_INPUT``) then point their observers at the first input's.

What differs from torch.ao is bookkeeping only: observer constructors are probed once instead
of instantiated per question, the module table is updated instead of rebuilt per node, and
attribute names are allocated from a counter.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.utils.hooks import RemovableHandle

from quantbridge.fx_quant._dtype_matching import (
    ObserverProbe,
    TargetInfo,
    dtype_config_rejection,
    inputs_rejection,
)
from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._qconfig_propagation import is_observer_module
from quantbridge.fx_quant._state import OBSERVED_KEY
from quantbridge.fx_quant._transformer_swap import attention_core_reason
from quantbridge.patterns import Pattern
from quantbridge.qconfig import (
    BackendConfig,
    BackendPatternConfig,
    NoopObserver,
    ObservationType,
    PlaceholderObserver,
    QConfigAny,
    ReuseInputObserver,
)

__all__ = [
    "FP32_CTOR",
    "PatternMatch",
    "UINT8_CTOR",
    "describe_non_float_observations",
    "insert_observers",
    "non_float_observations",
    "observed_value",
    "watch_observer_inputs",
]

FP32_CTOR = PlaceholderObserver.with_args(dtype=torch.float32)
UINT8_CTOR = PlaceholderObserver.with_args(dtype=torch.uint8)
_BIAS_FP32 = PlaceholderObserver.with_args(dtype=torch.float32)
_BIAS_FP16 = PlaceholderObserver.with_args(dtype=torch.float16)

# Dtypes an observer can produce (quantized integers and float16).
_OBS_DTYPES = (torch.uint8, torch.int8, torch.uint16, torch.int16, torch.int32, torch.float16)
# Ops whose weight-position argument is not quantized (normalization weights).
_NON_QUANTIZABLE_WEIGHT_OPS = {
    torch.nn.functional.layer_norm,
    torch.nn.functional.group_norm,
    torch.nn.functional.instance_norm,
}


def _all_but_first(node: Node) -> list[int]:
    return list(range(1, len(node.args)))


def _positions(*indices: int) -> Callable[[Node], list[int]]:
    def pick(node: Node) -> list[int]:
        return [i for i in indices if i < len(node.args)]

    return pick


# Arguments of these methods that are known not to be float tensors (torch.ao's table).
_NON_OBSERVABLE_ARGS: dict[tuple[str, Any], dict[Any, Callable[[Node], list[int]]]] = {
    ("call_method", "masked_fill"): {torch.bool: _positions(1), float: _positions(2)},
    ("call_method", "permute"): {int: _all_but_first},
    ("call_method", "repeat"): {int: _all_but_first},
    ("call_method", "reshape"): {int: _all_but_first},
    ("call_method", "size"): {int: _positions(1)},
    ("call_method", "transpose"): {int: _all_but_first},
    ("call_method", "unsqueeze"): {int: _positions(1)},
    ("call_method", "unsqueeze_"): {int: _positions(1)},
    ("call_method", "view"): {int: _all_but_first},
}


@dataclass(eq=False)
class PatternMatch:
    """A pattern matched at prepare (or a custom / standalone module call)."""

    anchor: Node
    node_pattern: Any
    pattern: Pattern | None
    config: BackendPatternConfig | None
    root: Node
    observation_type: ObservationType = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    is_custom: bool = False
    is_standalone: bool = False
    standalone_input_quantized: list[int] = field(default_factory=list)

    @property
    def share_observers(self) -> bool:
        return self.observation_type is ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT

    def nodes(self) -> Iterator[Node]:
        """Every node of the match's prepare-time structure (MatchAllNode inputs included)."""
        yield from _iter_nodes(self.node_pattern)


def _iter_nodes(structure: Any) -> Iterator[Node]:
    if isinstance(structure, Node):
        yield structure
    elif isinstance(structure, (list, tuple)):
        for item in structure:
            yield from _iter_nodes(item)


class NoTensorCache:
    """torch.ao's conservative "all arguments are non-tensors" test, memoized.

    ``scalars``: names of nodes the example inputs showed to hold Python numbers (a
    ``scale: float`` forward argument): never tensors, so never observed.
    """

    def __init__(self, modules: dict[str, nn.Module], scalars: Iterable[str] = ()) -> None:
        self.modules = modules
        self.scalars = frozenset(scalars)
        self.cache: dict[Node, bool] = {}

    def __call__(self, node: Any) -> bool:
        if not isinstance(node, Node):
            return True
        hit = self.cache.get(node)
        if hit is not None:
            return hit
        result = self._compute(node)
        self.cache[node] = result
        return result

    def _compute(self, node: Node) -> bool:
        op = node.op
        if node.name in self.scalars:
            return True
        if op == "placeholder" or op == "get_attr":
            return False
        if op == "call_module":
            module = self.modules.get(str(node.target))
            if is_observer_module(module):
                return self(node.args[0])
            return False
        if op == "call_function" and node.target is operator.getitem:
            return self(node.args[0])
        if node.target is getattr and len(node.args) > 1 and node.args[1] in ("ndim", "shape"):
            return True
        if op == "call_method" and node.target == "size":
            return True
        result = False
        for arg in node.args:
            if isinstance(arg, list):
                for element in arg:
                    if isinstance(element, Node) and not self(element):
                        return False
            elif isinstance(arg, int):
                pass
            elif isinstance(arg, Node):
                if not self(arg):
                    return False
            else:
                return False
            result = True
        return result


def count_tensor_args(root: Node, no_tensors: NoTensorCache) -> int:
    return sum(1 for arg in root.args if isinstance(arg, Node) and not no_tensors(arg))


def _is_reuse_input_qconfig(qconfig: QConfigAny, probe: ObserverProbe) -> bool:
    return (
        qconfig is not None
        and isinstance(probe(qconfig.activation), ReuseInputObserver)
        and isinstance(probe(qconfig.weight), NoopObserver)
    )


class _Inserter:
    """State of one observer-insertion pass."""

    def __init__(
        self,
        model: GraphModule,
        backend_config: BackendConfig,
        probe: ObserverProbe,
        scalars: Iterable[str] = (),
        float_by_mapping: Iterable[str] = (),
        float_outputs: Iterable[int] = (),
    ) -> None:
        self.model = model
        self.graph = model.graph
        self.backend_config = backend_config
        self.probe = probe
        self.modules: dict[str, nn.Module] = dict(model.named_modules(remove_duplicate=False))
        self.infos: dict[Node, TargetInfo] = {}
        self.no_tensors = NoTensorCache(self.modules, scalars)
        self.next_index = 0
        self.device = _unique_device(model)
        # nodes the QConfigMapping keeps float (qconfig None)
        self.float_by_mapping = frozenset(float_by_mapping)
        # graph outputs (by position) the PrepareCustomConfig asks to compute to float
        self.float_outputs = frozenset(float_outputs)
        # ops whose output float_output left float
        self.left_float: set[Node] = set()

    # -- target dtype info ---------------------------------------------------------------------

    def target_info(
        self, node: Node, qconfig: QConfigAny, match: PatternMatch | None
    ) -> TargetInfo:
        if self.no_tensors(node):
            return TargetInfo(None, None)
        if qconfig is None:
            return TargetInfo(FP32_CTOR, FP32_CTOR)
        act = self.probe(qconfig.activation)
        weight = self.probe(qconfig.weight)
        fp16 = (
            act.dtype == torch.float16
            and weight.dtype == torch.float16
            and not getattr(act, "is_dynamic", False)
        )
        weight_index = bias_index = None
        if node.op == "call_function":
            config = self.backend_config.complex_format_to_config.get(node.target)
            if config is not None:
                weight_index = config.input_type_to_index.get("weight")
                bias_index = config.input_type_to_index.get("bias")
        return TargetInfo(
            input_act=qconfig.activation,
            output_act=qconfig.activation,
            weight=qconfig.weight,
            bias=_BIAS_FP16 if fp16 else _BIAS_FP32,
            weight_index=weight_index,
            bias_index=bias_index,
            reuse_input=_is_reuse_input_qconfig(qconfig, self.probe),
            share_observers=match is not None and match.share_observers,
            is_standalone=match is not None and match.is_standalone,
        )

    def set_match_info(
        self, match: PatternMatch, qconfig: QConfigAny, processed: set[Node], use_match: bool
    ) -> None:
        for node in match.nodes():
            if node in processed:
                continue
            processed.add(node)
            if qconfig is None:
                continue
            self.infos[node] = self.target_info(node, qconfig, match if use_match else None)

    def propagate_known_dtypes(self, matches: dict[str, PatternMatch]) -> None:
        for node in self.graph.nodes:
            table = _NON_OBSERVABLE_ARGS.get((node.op, node.target))
            if not table:
                continue
            for pick in table.values():
                for index in pick(node):
                    arg = node.args[index]
                    for item in arg if isinstance(arg, (list, tuple)) else [arg]:
                        if isinstance(item, Node):
                            self._mark_not_float(item, matches)

    def _mark_not_float(self, node: Node, matches: dict[str, PatternMatch]) -> None:
        info = self.infos[node]
        info.input_act = None
        info.output_act = None
        match = matches.get(node.name)
        if match is not None and match.share_observers:
            prev = node.args[0] if node.args else None
            if isinstance(prev, Node):
                self._mark_not_float(prev, matches)

    # -- support check --------------------------------------------------------------------------

    def rejections(self, match: PatternMatch, qconfig: QConfigAny) -> list[str | None] | None:
        """Per DTypeConfig of the match's pattern, None (accepted) or the reason it is not.

        None when the match has no pattern (custom and standalone modules are always taken).
        """
        if match.pattern is None or match.config is None:
            return None
        output = match.node_pattern[0] if isinstance(match.node_pattern, list) else match.anchor
        return [
            dtype_config_rejection(
                dc, match.root, output, self.infos, qconfig, self.probe, FP32_CTOR
            )
            for dc in match.config.dtype_configs
        ]

    def supported(self, match: PatternMatch | None, qconfig: QConfigAny) -> bool:
        if match is None:
            return True
        result = self.rejections(match, qconfig)
        return result is None or any(r is None for r in result)

    def float_output(self, node: Node, match: PatternMatch, qconfig: QConfigAny) -> bool:
        """Whether ``node`` (a match's last node) leaves its output float: the backend
        computes the pattern from quantized inputs straight to float32 (a static DTypeConfig
        with ``output_dtype=torch.float32`` whose inputs this qconfig satisfies), and every
        user of the output is an op the QConfigMapping keeps float (qconfig None). Quantizing
        the output would then only add rounding (a transformer's residual add after its
        projections). Users that are float only because the backend has no pattern for them
        keep the quantized input torch.ao gives them (a lowering may run them on the codes)."""
        if match.config is None or match.pattern is None or match.is_standalone:
            return False
        if not node.users or not all(self._takes_float(user, node) for user in node.users):
            return False
        return any(
            dc.output_dtype == torch.float32
            and not dc.is_dynamic
            and dc.input_dtype not in (None, torch.float32, torch.float16)
            and inputs_rejection(dc, match.root, self.infos, qconfig, self.probe) is None
            for dc in match.config.dtype_configs
        )

    def observe_split_output(self, node: Node, qconfigs: dict[str, QConfigAny]) -> bool:
        """Observe an outlier split's result (its int8 Linear plus the float columns) that
        feeds a swapped attention module's core, as the Linear's own output would be
        observed: the core runs on codes when its q, k and v arrive quantized, and a
        transformer mapping keeps the split's add float. Other users keep the float result
        (a GELU after it runs in the Linear's float epilogue). Returns whether an observer
        was inserted."""
        linear = next(
            (
                a
                for a in node.args
                if isinstance(a, Node) and a in self.left_float and len(a.users) == 1
            ),
            None,
        )
        qconfig = None if linear is None else qconfigs.get(linear.name)
        if qconfig is None or not any(
            attention_core_reason(user, self.modules) and qconfigs.get(user.name) is not None
            for user in node.users
        ):
            return False
        self.infos[node] = self.target_info(node, qconfig, None)
        obs_node = self.observe_output(node)
        if obs_node is None:
            return False
        for user in list(node.users):
            if user is not obs_node:
                user.replace_input_with(node, obs_node)
        return True

    def _takes_float(self, user: Node, value: Node) -> bool:
        # graph outputs keep torch.ao's quantize / dequantize pair (a classifier's logits),
        # unless set_output_float_indexes names their position
        if user.op == "output":
            return bool(self.float_outputs & _output_positions(user, value))
        if user.op not in ("call_module", "call_method", "call_function"):
            return False
        if user.name not in self.float_by_mapping or self.no_tensors(user):
            return False
        dtype, _ = self.probe.dtype(self.input_ctor(user, value))
        return dtype == torch.float32

    # -- graph edits ------------------------------------------------------------------------------

    def insert_after(self, node: Node, observer: nn.Module) -> Node:
        if self.device is not None:
            observer.to(self.device)
        while True:
            name = f"activation_post_process_{self.next_index}"
            self.next_index += 1
            if not hasattr(self.model, name):
                break
        setattr(self.model, name, observer)
        self.modules[name] = observer
        with self.graph.inserting_after(node):
            return self.graph.create_node("call_module", name, (node,), {})

    def is_observer_node(self, node: object) -> bool:
        return (
            isinstance(node, Node)
            and node.op == "call_module"
            and is_observer_module(self.modules.get(str(node.target)))
        )

    def output_ctor(self, arg: Node) -> Any:
        """The constructor describing ``arg``'s value as produced (observers looked through)."""
        if self.is_observer_node(arg):
            observed = arg.args[0]
            assert isinstance(observed, Node)
            return self.infos[observed].output_act
        info = self.infos.get(arg)
        return info.output_act if info is not None else FP32_CTOR

    def input_ctor(self, node: Node, arg: Node) -> Any:
        info = self.infos[node]
        wi, bi = info.weight_index, info.bias_index
        if (wi is not None and wi < len(node.args) and node.args[wi] is arg) or node.kwargs.get(
            "weight"
        ) is arg:
            if node.target in _NON_QUANTIZABLE_WEIGHT_OPS:
                return None
            return info.weight
        if (bi is not None and bi < len(node.args) and node.args[bi] is arg) or node.kwargs.get(
            "bias"
        ) is arg:
            return info.bias
        return info.input_act

    def observe_input(self, node: Node, arg: Any, match: PatternMatch, qconfig: QConfigAny) -> Any:
        if isinstance(arg, (list, tuple)):
            return type(arg)(self.observe_input(node, a, match, qconfig) for a in arg)
        if not isinstance(arg, Node):
            return arg
        if not match.is_standalone:
            info = self.infos[node]
            ctor = self.input_ctor(node, arg)
            in_dtype, in_dynamic = self.probe.dtype(ctor)
            out_dtype, _ = self.probe.dtype(self.output_ctor(arg))
            needed = _needs_observer(
                out_dtype,
                in_dtype,
                in_dynamic,
                info.reuse_input,
                is_zeroth_arg=bool(node.args) and arg is node.args[0],
            )
        else:
            assert qconfig is not None
            index = next((i for i, a in enumerate(node.args) if a is arg), None)
            ctor = qconfig.activation
            in_dtype = torch.uint8 if index in match.standalone_input_quantized else torch.float32
            if index is None:
                needed = False
            else:
                out_dtype, _ = self.probe.dtype(self.output_ctor(arg))
                needed = out_dtype != in_dtype and in_dtype != torch.float32
        if not needed:
            return arg
        template = self.probe(ctor)
        for user in arg.users:
            if user.op == "call_module":
                existing = self.modules[str(user.target)]
                same_type = type(existing) is type(template)
                if same_type and getattr(existing, "dtype", None) == in_dtype:
                    return user
        return self.insert_after(arg, ctor())

    def observe_output(self, node: Node) -> Node | None:
        info = self.infos[node]
        ctor = info.output_act
        dtype, dynamic = self.probe.dtype(ctor)
        if dynamic or info.is_standalone:
            return None
        if ctor is None or not _needs_observer(torch.float32, dtype, False, False, False):
            return None
        return self.insert_after(node, ctor())

    def observe_graph_output(self, output: Node) -> None:
        def visit(value: Any) -> Any:
            if isinstance(value, Node) and value in self.left_float:
                return value
            if isinstance(value, Node):
                out_dtype, _ = self.probe.dtype(self.output_ctor(value))
                info = self.infos.get(value)
                ctor = info.input_act if info is not None else None
                in_dtype = self.probe.dtype(ctor)[0] if ctor is not None else torch.float32
                if out_dtype != in_dtype and in_dtype != torch.float32 and ctor is not None:
                    return self.insert_after(value, ctor())
                return value
            if isinstance(value, (list, tuple)):
                return type(value)(visit(v) for v in value)
            if isinstance(value, dict):
                return {k: visit(v) for k, v in value.items()}
            if value is None:
                return None
            raise FxQuantError(
                f"the model returns a {type(value).__name__} ({value!r}); prepare supports "
                "tensors, None and lists/tuples/dicts of them as outputs"
            )

        output.args = tuple(visit(a) for a in output.args)

    def share_with_input(self, node: Node) -> bool:
        """Make ``node``'s input and output observers one instance (the first input's)."""
        first_arg: Any = None
        for arg in node.args:
            if isinstance(arg, (Node, list, tuple)):
                first_arg = arg
                break
        if first_arg is None:
            return False
        current = first_arg[0] if isinstance(first_arg, (list, tuple)) else first_arg
        guard = 0
        while not self.is_observer_node(current):
            if not isinstance(current, Node) or current.op == "placeholder":
                return False
            traced = None
            for a in current.args:
                traced = a
                if isinstance(a, Node):
                    break
            if traced is None:
                return False
            current = traced
            guard += 1
            if guard > 10000:
                raise FxQuantError(f"{node.name}: cannot find the observer of its input")
        shared = self.modules[str(current.target)]
        if isinstance(first_arg, (list, tuple)):
            for other in first_arg[1:]:
                guard = 0
                while not self.is_observer_node(other):
                    if not isinstance(other, Node) or not other.args:
                        return False
                    other = other.args[0]
                    guard += 1
                    if guard > 10000:
                        raise FxQuantError(f"{node.name}: cannot find the observer of an input")
                self._point(other, shared)
        for user in node.users:
            if not self.is_observer_node(user):
                raise FxQuantError(f"{node.name}: expected only observers to use this node")
            self._point(user, shared)
        return True

    def _point(self, observer_node: Node, module: nn.Module) -> None:
        name = str(observer_node.target)
        parent, _, attr = name.rpartition(".")
        setattr(self.modules[parent], attr, module)
        self.modules[name] = module

    def remove_output_observer(self, node: Node) -> None:
        for user in list(node.users):
            if not self.is_observer_node(user):
                raise FxQuantError(f"{node.name}: expected only observers to use this node")
            user.replace_all_uses_with(node)
            self.graph.erase_node(user)


def _needs_observer(
    prev_dtype: Any,
    cur_dtype: Any,
    cur_dynamic: bool,
    reuse_input: bool,
    is_zeroth_arg: bool,
) -> bool:
    if cur_dynamic:
        if cur_dtype not in _OBS_DTYPES:
            raise FxQuantError(
                f"dynamic quantization to {cur_dtype} is not supported; use uint8/int8 or "
                "float16 activation observers with is_dynamic=True"
            )
        return is_zeroth_arg  # only the first argument is quantized dynamically
    if reuse_input:
        return False
    if cur_dtype in _OBS_DTYPES:
        observable = prev_dtype in _OBS_DTYPES or prev_dtype == torch.float32
        return bool(observable and cur_dtype != prev_dtype)
    return False


def _unique_device(model: nn.Module) -> torch.device | None:
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if len(devices) > 1:
        raise FxQuantError(
            f"the model has parameters/buffers on several devices ({sorted(map(str, devices))}); "
            "move it to one device before prepare"
        )
    return next(iter(devices)) if devices else None


@dataclass
class InsertionResult:
    observed_node_names: set[str]
    rejections: dict[int, list[str | None] | None]  # id(match) -> per-DTypeConfig verdicts
    infos: dict[Node, TargetInfo]


def insert_observers(
    model: GraphModule,
    matches: dict[str, PatternMatch],
    qconfigs: dict[str, QConfigAny],
    backend_config: BackendConfig,
    input_quantized: list[int],
    output_quantized: list[int],
    probe: ObserverProbe,
    swap_custom: Callable[[Node, QConfigAny], None],
    scalars: Iterable[str] = (),
    float_outputs: Iterable[int] = (),
    split_outputs: Iterable[str] = (),
) -> InsertionResult:
    """Insert observers into ``model`` (in place); see the module docstring.

    ``scalars``: nodes holding Python numbers (see :class:`NoTensorCache`).
    ``float_outputs``: graph outputs (by position) to compute to float where the backend can.
    ``split_outputs``: the nodes returning an outlier split's result (see
    ``_Inserter.observe_split_output``).
    """
    split_outputs = frozenset(split_outputs)
    graph = model.graph
    floats = (n.name for n in graph.nodes if qconfigs.get(n.name) is None)
    ins = _Inserter(model, backend_config, probe, scalars, floats, float_outputs)
    for node in graph.nodes:
        ins.infos[node] = TargetInfo(FP32_CTOR, FP32_CTOR)

    # Step 1: target info from each match's qconfig (first match to reach a node wins).
    processed: set[Node] = set()
    for name, match in matches.items():
        ins.set_match_info(match, qconfigs.get(name), processed, use_match=True)

    # Step 2: quantized graph inputs/outputs, tensor-free nodes, known non-float arguments.
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node in graph.nodes:
        if node.op == "placeholder" and placeholders.index(node) in input_quantized:
            ins.infos[node] = TargetInfo(UINT8_CTOR, UINT8_CTOR)
        elif node.op in ("placeholder", "call_module", "call_method", "call_function"):
            if ins.no_tensors(node):  # placeholders: only Python number inputs
                ins.infos[node] = TargetInfo(None, None)
        elif node.op == "output" and 0 in output_quantized:
            ins.infos[node] = TargetInfo(UINT8_CTOR, UINT8_CTOR)
    ins.propagate_known_dtypes(matches)

    # Step 3: patterns no DTypeConfig accepts go back to float.
    verdicts: dict[int, list[str | None] | None] = {}
    processed = set()
    fp32_qconfig = _fp32_placeholder_qconfig()
    for name, match in matches.items():
        qconfig = qconfigs.get(name)
        verdict = ins.rejections(match, qconfig)
        if id(match) not in verdicts or qconfig is not None:
            verdicts[id(match)] = verdict
        if verdict is not None and all(r is not None for r in verdict):
            ins.set_match_info(match, fp32_qconfig, processed, use_match=False)

    # Step 4: insert observers, walking the original nodes.
    observed: set[str] = set()
    swapped_custom: set[str] = set()
    for node in list(graph.nodes):
        if node.op == "placeholder":
            continue
        if node.op not in ("call_module", "call_method", "call_function", "output"):
            continue
        if node.name in split_outputs:
            if ins.observe_split_output(node, qconfigs):
                observed.add(node.name)
            continue
        found = matches.get(node.name)
        qconfig = qconfigs.get(node.name) if found is not None else None
        if (qconfig is None) and node.op != "output":
            continue
        if not ins.supported(found, qconfig):
            continue
        if node.op == "output":
            ins.observe_graph_output(node)
            continue
        assert found is not None
        match = found
        observed.update(n.name for n in match.nodes())
        if node is match.root:
            node.args = tuple(ins.observe_input(node, a, match, qconfig) for a in node.args)
            node.kwargs = {
                k: ins.observe_input(node, v, match, qconfig) for k, v in node.kwargs.items()
            }
        if node is not match.anchor:
            continue
        info = ins.infos[node]
        if ins.float_output(node, match, qconfig):
            info.output_act = FP32_CTOR
            ins.left_float.add(node)
            continue
        obs_node = ins.observe_output(node)
        if obs_node is None:
            continue
        for user in list(node.users):
            if user is not obs_node:
                user.replace_input_with(node, obs_node)
        out_dtype = probe.dtype(ins.output_ctor(node))[0]
        first = node.args[0] if node.args else None
        same_graph = not (
            out_dtype == torch.uint8 and isinstance(first, Node) and first.op == "placeholder"
        )
        wants_shared = (info.share_observers and same_graph) or info.reuse_input
        if wants_shared and not ins.share_with_input(node):
            ins.remove_output_observer(node)
        if match.is_custom and str(node.target) not in swapped_custom:
            swapped_custom.add(str(node.target))
            swap_custom(node, qconfig)
    return InsertionResult(observed, verdicts, ins.infos)


def _output_positions(output: Node, value: Node) -> set[int]:
    """Where ``value`` stands among the model's outputs: 0 for a single returned value, its
    positions in a returned tuple or list."""
    returned = output.args[0] if output.args else None
    if returned is value:
        return {0}
    if isinstance(returned, (tuple, list)):
        return {i for i, v in enumerate(returned) if v is value}
    return set()


def _fp32_placeholder_qconfig() -> QConfigAny:
    from quantbridge.qconfig import default_fp32_placeholder_qconfig

    return default_fp32_placeholder_qconfig


# -- observers fed non-float tensors ------------------------------------------------------------


def observed_value(node: Node, modules: dict[str, nn.Module]) -> Node:
    """The node whose value observer node ``node`` sees (looking through chained observers)."""
    current = node
    while (
        current.op == "call_module"
        and is_observer_module(modules.get(str(current.target)))
        and current.args
        and isinstance(current.args[0], Node)
    ):
        current = current.args[0]
    return current


def non_float_observations(
    model: GraphModule, dtypes: dict[str, torch.dtype]
) -> list[tuple[Node, Node, torch.dtype]]:
    """(observer node, observed node, dtype) for each observer that would receive a
    non-floating-point tensor, by the dtypes a run on example inputs recorded per node name."""
    modules = dict(model.named_modules(remove_duplicate=False))
    found = []
    for node in model.graph.nodes:
        if node.op != "call_module" or not is_observer_module(modules.get(str(node.target))):
            continue
        source = observed_value(node, modules)
        dtype = dtypes.get(source.name)
        if dtype is not None and not dtype.is_floating_point:
            found.append((node, source, dtype))
    return found


def describe_non_float_observations(
    model: GraphModule,
    problems: list[tuple[Node, Node, torch.dtype]],
    qconfigs: dict[str, QConfigAny],
    scope: dict[str, tuple[str, Any]],
) -> str:
    """What is observed where, and the QConfigMapping calls that keep the readers in float.

    The nodes to keep in float are the observed node and the nodes reading the observer's
    output, among those that have a qconfig: an integer tensor (mask, index, count) has no
    meaningful scale, so neither its producer nor its readers can quantize it.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    lines = []
    exclude: dict[str, Node] = {}
    for obs, source, dtype in problems:
        readers = _readers(obs, modules)
        lines.append(
            f"observer {str(obs.target)!r} ({type(modules[str(obs.target)]).__name__}) would "
            f"receive a {dtype} tensor: the output of node {source.name!r} "
            f"({_describe_node_op(source, modules)}), read by "
            + ", ".join(f"{r.name!r} ({_describe_node_op(r, modules)})" for r in readers)
        )
        for node in (source, *readers):
            if node.op.startswith("call_") and qconfigs.get(node.name) is not None:
                exclude.setdefault(node.name, node)
    calls = [_float_call(node, model, scope) for node in exclude.values()]
    advice = (
        "qconfig_mapping." + ".".join(dict.fromkeys(calls))
        if calls
        else "a qconfig of None for the nodes above"
    )
    paths = sorted({scope.get(n.name, ("", None))[0] for n in exclude.values()} - {""})
    untraced = (
        "; or keep the submodule untraced (float, run as one call): prepare_custom_config="
        f"PrepareCustomConfig().set_non_traceable_module_names({paths!r})"
        if paths
        else ""
    )
    return (
        "; ".join(lines)
        + ". Only floating-point tensors can be observed and quantized (a mask, index or count "
        f"has no scale). Keep the nodes that produce or read it in float: {advice}{untraced}"
    )


def _readers(obs: Node, modules: dict[str, nn.Module]) -> list[Node]:
    readers: list[Node] = []
    for user in obs.users:
        if user.op == "call_module" and is_observer_module(modules.get(str(user.target))):
            readers.extend(_readers(user, modules))
        elif user not in readers:
            readers.append(user)
    return readers


def _describe_node_op(node: Node, modules: dict[str, nn.Module]) -> str:
    if node.op == "placeholder":
        return "a model input"
    if node.op == "call_module":
        return f"module {node.target!r}, {type(modules[str(node.target)]).__name__}"
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "call_function":
        from quantbridge.fx_quant._prepare import _describe_callable

        return _describe_callable(node.target)
    return node.op


def _float_call(node: Node, model: GraphModule, scope: dict[str, tuple[str, Any]]) -> str:
    """The QConfigMapping setter call that gives exactly ``node`` a None qconfig."""
    if node.op == "call_module":
        return f"set_module_name({str(node.target)!r}, None)"
    if node.op == "call_method":
        return f"set_object_type({str(node.target)!r}, None)"
    from quantbridge.fx_quant._prepare import _describe_callable

    path = scope.get(node.name, ("", None))[0]
    # the call's index among the same function's calls in its module, as qconfigs count them
    index = 0
    for other in model.graph.nodes:
        if other is node:
            break
        if (
            other.op == "call_function"
            and other.target is node.target
            and scope.get(other.name, ("", None))[0] == path
        ):
            index += 1
    return (
        f"set_module_name_object_type_order({path!r}, {_describe_callable(node.target)}, "
        f"{index}, None)"
    )


def watch_observer_inputs(model: nn.Module) -> list[RemovableHandle]:
    """Forward pre-hooks on a prepared model's observers that raise FxQuantError, naming the
    observer, the observed node and the fix, when one is fed a non-float tensor.

    For calibration runs (remove the handles afterwards); a model that is not a prepared
    GraphModule gets no hooks.
    """
    state = model.meta.get(OBSERVED_KEY) if isinstance(model, GraphModule) else None
    if state is None:
        return []
    assert isinstance(model, GraphModule)
    modules = dict(model.named_modules(remove_duplicate=False))
    by_instance: dict[int, list[Node]] = {}
    for node in model.graph.nodes:
        if node.op == "call_module" and is_observer_module(modules.get(str(node.target))):
            by_instance.setdefault(id(modules[str(node.target)]), []).append(node)

    def check(nodes: list[Node], module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and not x.is_floating_point():
            problems = [(n, observed_value(n, modules), x.dtype) for n in nodes]
            raise FxQuantError(
                "calibrate: "
                + describe_non_float_observations(
                    model, problems, state.node_name_to_qconfig, state.node_name_to_scope
                )
            )

    return [
        modules[str(nodes[0].target)].register_forward_pre_hook(partial(check, nodes))
        for nodes in by_instance.values()
    ]
