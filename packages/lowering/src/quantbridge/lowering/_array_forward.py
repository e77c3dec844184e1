"""A lowered model's forward that passes numpy arrays from kernel module to kernel module.

A lowered GraphModule's generated forward calls every lowered module as a torch module: the
module call, the tracing check, the tensor → array view and the array → tensor wrap cost
~10-40 µs per node, a tenth of a MobileNet's batch-1 time. ``ArrayForward`` runs the same
graph node by node: a lowered module with an array form (``LoweredModule.forward_arrays``)
gets arrays and returns one; every other node (float ops, getitem, modules without an array
form) runs as the generated code would run it, on tensors made from the arrays it reads. The
numbers are the eager forward's: each array form is that forward between its array views and
``torch.from_numpy``. The nodes run as one generated function of straight-line code (a local
per value), built once per graph: a loop over the nodes rebuilding each node's arguments cost
~3 % of a BERT forward at batch 1.

The generated forward runs instead while torch.export, torch.compile or the JIT tracer
traces the model, when any module has forward hooks (they must see their calls), and with
keyword arguments. ``install`` puts it on a GraphModule as its ``forward`` (an instance
attribute, so ``type(gm).forward`` stays the generated one) and keeps it there through
``copy.deepcopy``. A pickled model loads with the generated forward (GraphModule pickles its
code); ``quantbridge.lowering.use_array_forward`` puts the array forward back.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch
from torch.fx import GraphModule, Node
from torch.fx.graph import CodeGen
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.fx.node import map_aggregate, map_arg

from quantbridge.lowering import _lowered_ops as lowered
from quantbridge.lowering._custom_ops import is_tracing
from quantbridge.lowering._modules import LoweredModule
from quantbridge.lowering._static_values import StaticCache, attr, partition

# step kinds: a kernel module on arrays, a call (function or module), a method, an attribute,
# a shape method (``_SHAPE_METHODS``) on its receiver as it is
_ARRAY, _CALL, _METHOD, _ATTR, _SHAPE = range(5)


def _tensor(value: Any) -> Any:
    return torch.from_numpy(value) if isinstance(value, np.ndarray) else value


def _global_hooks() -> bool:
    """Module hooks registered for every module (torch keeps them module-level)."""
    from torch.nn.modules import module as torch_module

    return any(
        getattr(torch_module, name, None)
        for name in (
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_forward_hooks_always_called",
        )
    )


class _Plan:
    """The graph of one generated forward, as steps over value slots."""

    def __init__(self, gm: GraphModule) -> None:
        nodes = list(gm.graph.nodes)
        index = {node: i for i, node in enumerate(nodes)}
        # node -> its slot, inside arguments (typed Any: fx types what map_arg returns)
        slot: Any = lambda n: _Slot(index[n])  # noqa: E731
        self.code = gm.code
        self.inputs: list[int] = []
        self.steps: list[tuple[int, int, Any, Any, Any, list[int]]] = []
        self.modules: list[torch.nn.Module] = []  # every module called: hooks are checked
        self.output: Any = None
        last_use: dict[Node, int] = {}
        for i, node in enumerate(nodes):
            for used in node.all_input_nodes:
                last_use[used] = i
        for i, node in enumerate(nodes):
            # slots whose last reader is this node: dropped after it, as the generated code does
            free = list(dict.fromkeys(index[u] for u in node.all_input_nodes if last_use[u] == i))
            if node.op == "placeholder":
                self.inputs.append(i)
            elif node.op == "output":
                self.output = map_arg(node.args[0], slot)
            elif node.op == "get_attr":
                self.steps.append((i, _ATTR, node.target, None, None, free))
            elif node.op == "call_module":
                mod = gm.get_submodule(str(node.target))
                self.modules.append(mod)
                args = map_arg(node.args, slot)
                kwargs = map_arg(node.kwargs, slot)
                arrays = (
                    isinstance(mod, LoweredModule)
                    and mod.array_input is not None
                    and not kwargs
                    and all(isinstance(a, _Slot) for a in args)
                )
                if arrays:
                    self.steps.append((i, _ARRAY, mod, args, None, free))
                else:
                    self.steps.append((i, _CALL, mod, args, kwargs, free))
            elif (
                node.op == "call_method"
                and node.target in _SHAPE_METHODS
                and not node.kwargs
                and node.args
                and isinstance(node.args[0], Node)
            ):
                args = map_arg(node.args, slot)
                self.steps.append((i, _SHAPE, _SHAPE_METHODS[node.target], args, None, free))
            else:
                kind = _CALL if node.op == "call_function" else _METHOD
                args = map_arg(node.args, slot)
                kwargs = map_arg(node.kwargs, slot)
                self.steps.append((i, kind, node.target, args, kwargs, free))
        self.size = len(nodes)
        # values that depend only on the inputs' sizes: computed once per size (_static_values)
        part = partition(gm)
        self.keys = [index[n] for n in part.keys]
        self.static = {index[n] for n in part.static}
        self.kept = [index[n] for n in part.kept]
        self.cache = StaticCache(part.attrs, part.modules) if self.kept else None

        self.run = _compile(self)

    def run_steps(self, gm: GraphModule, args: tuple[Any, ...]) -> Any:
        """The steps run one by one in a loop: what the compiled ``run`` does (the tests
        compare the two)."""
        env: list[Any] = [None] * self.size
        for slot, value in zip(self.inputs, args, strict=True):
            env[slot] = value

        def load(value: Any) -> Any:
            return _tensor(env[value.index]) if isinstance(value, _Slot) else value

        for i, kind, what, args_, kwargs, free in self.steps:
            if kind == _ARRAY:
                values = [env[a.index] for a in args_]
                if all(isinstance(v, _CODES) for v in values):
                    how = what.array_input
                    env[i] = what.forward_arrays(*[lowered.as_array(v, how) for v in values])
                else:  # e.g. a Python number where codes were expected: the module decides
                    env[i] = what(*[_tensor(v) for v in values])
            elif kind == _ATTR:
                env[i] = attr(gm, what)
            elif kind == _SHAPE:
                env[i] = what(env[args_[0].index], *map_aggregate(args_[1:], load))
            else:
                a = map_aggregate(args_, load)
                kw = map_aggregate(kwargs, load)
                if kind == _METHOD:
                    env[i] = getattr(a[0], what)(*a[1:], **kw)
                else:  # a module without an array form, or a function
                    env[i] = what(*a, **kw)
            for s in free:
                env[s] = None
        return map_aggregate(self.output, load)


def _compile(plan: _Plan) -> Any:
    """``plan``'s steps as one generated function ``run(gm, args)``: straight-line code with a
    local per value, where ``run_steps`` loops over the steps and rebuilds every argument
    structure with ``map_aggregate``. Modules, functions, method names and constants are bound
    by name in the function's globals; lists and dicts are built anew at each call, as
    ``map_aggregate`` builds them."""
    scope: dict[str, Any] = {"_t": _tensor, "_as": lowered.as_array, "_CODES": _CODES,
                             "attr": attr, "immutable_list": immutable_list,
                             "immutable_dict": immutable_dict}  # fmt: skip

    def bind(value: Any) -> str:
        name = f"c{len(scope)}"
        scope[name] = value
        return name

    def render(value: Any) -> str:
        if isinstance(value, _Slot):
            return f"_t(v{value.index})"
        if isinstance(value, (tuple, list)):
            items = "".join(f"{render(v)}, " for v in value)
            if isinstance(value, list):
                return f"immutable_list([{items}])"
            if type(value) is tuple:
                return f"({items})"
            return f"{bind(type(value))}({items})"  # a named tuple
        if isinstance(value, dict):
            items = "".join(f"{bind(k)}: {render(v)}, " for k, v in value.items())
            return f"immutable_dict({{{items}}})"
        if isinstance(value, slice):
            return f"slice({render(value.start)}, {render(value.stop)}, {render(value.step)})"
        if value is None or type(value) in (bool, int):
            return repr(value)
        return bind(value)

    def emit(step: tuple[int, int, Any, Any, Any, list[int]], frees: bool) -> list[str]:
        i, kind, what, args_, kwargs, free = step
        if kind == _ARRAY:
            names = [f"v{a.index}" for a in args_]
            mod, how = bind(what), repr(what.array_input)
            codes = " and ".join(f"isinstance({n}, _CODES)" for n in names)
            arrays = ", ".join(f"_as({n}, {how})" for n in names)
            tensors = ", ".join(f"_t({n})" for n in names)
            line = f"    v{i} = {mod}.forward_arrays({arrays}) if {codes} else {mod}({tensors})"
        elif kind == _ATTR:
            line = f"    v{i} = attr(gm, {bind(what)})"
        elif kind == _SHAPE:  # the receiver as it is: an array stays an array
            rest = "".join(f", {render(a)}" for a in args_[1:])
            line = f"    v{i} = {bind(what)}(v{args_[0].index}{rest})"
        else:
            parts = [render(a) for a in args_]
            if kwargs:
                parts.append(f"**{render(kwargs)}")
            if kind == _METHOD:
                call = f"getattr({parts[0]}, {bind(what)})({', '.join(parts[1:])})"
            else:
                call = f"{bind(what)}({', '.join(parts)})"
            line = f"    v{i} = {call}"
        return [line, *(f"    v{s} = None" for s in (free if frees else ()))]

    keys = set(plan.keys)
    lines = ["def run(gm, args):"]
    if plan.inputs:
        lines.append(f"    {''.join(f'v{i}, ' for i in plan.inputs)}= args")
    if plan.cache is not None:
        # the sizes first, then the static values of those sizes: cached, or computed by fill
        sizes = "".join(f"v{k}, " for k in plan.keys)
        for step in plan.steps:
            if step[0] in keys:
                lines.extend(emit(step, frees=False))
        fill = [f"def fill(gm, {sizes}):"]
        for step in plan.steps:
            if step[0] in plan.static:
                fill.extend(emit(step, frees=False))
        fill.append(f"    return ({''.join(f'v{k}, ' for k in plan.kept)})")
        exec(compile("\n".join(fill) + "\n", f"<quantbridge static values {id(plan):#x}>", "exec"),
             scope)  # fmt: skip
        cache, fill_fn = bind(plan.cache), bind(scope["fill"])
        lines += [
            f"    key = {cache}.key(gm, ({sizes}))",
            f"    kept = {cache}.get(key)",
            "    if kept is None:",
            f"        kept = {cache}.put(key, {fill_fn}(gm, {sizes}))",
            f"    {''.join(f'v{k}, ' for k in plan.kept)}= kept",
        ]
    for step in plan.steps:
        if plan.cache is not None and (step[0] in keys or step[0] in plan.static):
            lines.extend(f"    v{s} = None" for s in step[5])  # computed above
        else:
            lines.extend(emit(step, frees=True))
    lines.append(f"    return {render(plan.output)}")
    code = compile("\n".join(lines) + "\n", f"<quantbridge array forward {id(plan):#x}>", "exec")
    # the source holds only names made above (v<n>, c<n>) and int / bool / None literals:
    # every target, method name and constant of the graph is bound as an object, never
    # spliced into the text
    exec(code, scope)
    return scope["run"]


_CODES = (np.ndarray, torch.Tensor)


# Shape methods between kernel modules (a transformer's head split and merge: reshape,
# transpose, reshape, ~10 per layer) run on numpy arrays as numpy views: the same values,
# shape, strides and aliasing as torch's methods on a tensor view of the array, without
# making that tensor (~10 us a node in a BERT forward at batch 1). A tensor, or arguments
# numpy would read differently (a dtype, a tensor), take torch's method; so does anything
# numpy refuses, so that the error is torch's.
def _ints(values: tuple[Any, ...]) -> tuple[int, ...] | None:
    if len(values) == 1 and isinstance(values[0], (tuple, list)):  # reshape((2, 3))
        values = tuple(values[0])
    for v in values:  # a loop: all() over a generator costs a few times more per call
        if type(v) is not int:
            return None
    return values


def _torch_method(name: str, x: Any, args: tuple[Any, ...]) -> Any:
    return getattr(_tensor(x), name)(*args)


def _reshape(x: Any, *shape: Any) -> Any:
    dims = _ints(shape) if type(x) is np.ndarray else None
    if dims is None:
        return _torch_method("reshape", x, shape)
    try:
        return x.reshape(dims)
    except ValueError:
        return _torch_method("reshape", x, shape)


def _view(x: Any, *shape: Any) -> Any:
    # torch's view never copies: numpy's reshape may, so only a result sharing x's memory
    # is taken (a view numpy cannot make goes to torch, which refuses it as it would)
    dims = _ints(shape) if type(x) is np.ndarray else None
    if dims is not None:
        try:
            out = x.reshape(dims)
        except ValueError:
            out = None
        if out is not None and (out.size == 0 or np.shares_memory(out, x)):
            return out
    return _torch_method("view", x, shape)


def _transpose(x: Any, *dims: Any) -> Any:
    if type(x) is np.ndarray and len(dims) == 2:
        d0, d1 = dims
        n = x.ndim
        if type(d0) is int and type(d1) is int and -n <= d0 < n and -n <= d1 < n:
            return x.swapaxes(d0, d1)  # the method: np.swapaxes adds a Python-level wrapper
    return _torch_method("transpose", x, dims)


def _permute(x: Any, *dims: Any) -> Any:
    order = _ints(dims) if type(x) is np.ndarray else None
    if order is not None and len(order) == x.ndim:
        try:
            return np.transpose(x, order)
        except ValueError:
            pass
    return _torch_method("permute", x, dims)


def _unsqueeze(x: Any, *dims: Any) -> Any:
    one = _ints(dims) if type(x) is np.ndarray else None
    if one is not None and len(one) == 1 and -x.ndim - 1 <= one[0] <= x.ndim:
        return np.expand_dims(x, one[0])
    return _torch_method("unsqueeze", x, dims)


def _contiguous(x: Any, *args: Any) -> Any:
    if type(x) is np.ndarray and not args:
        return x if x.flags.c_contiguous else x.copy(order="C")  # (0-d stays 0-d)
    return _torch_method("contiguous", x, args)


_SHAPE_METHODS = {
    "reshape": _reshape,
    "view": _view,
    "transpose": _transpose,
    "permute": _permute,
    "unsqueeze": _unsqueeze,
    "contiguous": _contiguous,
}


class _Slot:
    """A value slot of the plan (a node's result), inside a node's arguments."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class ArrayForward:
    """A lowered GraphModule's ``forward``, run on arrays where its modules allow (see the
    module docstring). Holds its model weakly; a copy or pickle of it holds nothing."""

    def __init__(self, gm: GraphModule) -> None:
        self._gm = weakref.ref(gm)
        self._plan: _Plan | None = None

    @property
    def __wrapped__(self) -> Any:
        """The generated forward, bound: ``inspect.signature`` (torch.export) reads it."""
        gm = self._gm()
        return None if gm is None else type(gm).forward.__get__(gm)

    @property
    def __code__(self) -> Any:
        """The generated forward's code object (torch.export names its traces after it)."""
        return self.__wrapped__.__code__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        gm = self._gm()
        if gm is None:
            raise RuntimeError("the lowered model of this forward no longer exists")
        generated = type(gm).forward
        if kwargs or _traced(args) or _global_hooks():
            return generated(gm, *args, **kwargs)
        plan = self._plan
        if plan is None or plan.code is not gm.code:  # first call, or recompiled since
            plan = self._plan = _Plan(gm)
        codegen = gm.graph._codegen
        # a captured program's graph takes its inputs flattened and returns a flat tuple
        # (pytree codegen): flattened and rebuilt as its generated code does
        plain = type(codegen) is CodeGen
        flat = args if plain else tuple(codegen.process_inputs(*args))
        if len(flat) != len(plan.inputs) or any(
            m._forward_hooks or m._forward_pre_hooks for m in plan.modules
        ):
            return generated(gm, *args)
        out = plan.run(gm, flat)
        return out if plain else codegen.process_outputs(out)

    def __reduce__(self) -> Any:
        # nothing to keep (its model is pickled apart from it): unpickles as a placeholder
        return (_Detached, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return _Detached()


class _Detached:
    """What a copied ``ArrayForward`` becomes (GraphModule copies drop it)."""


def _traced(args: tuple[Any, ...]) -> bool:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return is_tracing(*tensors) or torch._C._get_tracing_state() is not None


def _install_on_copy(copy: GraphModule) -> None:
    install(copy)


def install(gm: GraphModule) -> GraphModule:
    """Make ``gm`` (a lowered model) run through ``ArrayForward``; returns it."""
    gm.forward = ArrayForward(gm)
    hooks = gm._deepcopy_hooks
    if _install_on_copy not in hooks:
        gm._register_deepcopy_hook(_install_on_copy)
    return gm
