"""Capture with ``torch.export`` and lift the ATen graph to the operators BackendConfigs name.

``torch.export`` captures models that ``torch.fx.symbolic_trace`` cannot (data-dependent
Python, decorators, dataclass outputs), but its graph speaks ATen (``aten.linear``,
``aten.conv2d``, ``aten.add.Tensor``) while a BackendConfig speaks modules, functionals and
method names (``nn.Linear``, ``F.relu``, ``operator.add``, ``"view"``). The lift rewrites each
ATen call into the form ``symbolic_trace`` would have recorded for the same source line:

- an op whose innermost ``nn_module_stack`` entry is a torch.nn module of the matching kind
  (``aten.conv2d`` inside an ``nn.Conv2d`` whose ``weight`` it reads) becomes a call of a
  module registered under that module's qualified name, sharing its parameters; a module
  called twice (a reused ReLU) is one module called twice;
- any other op in :data:`OPERATOR_EQUIVALENTS` becomes its functional / operator / method
  form (``aten.linear`` -> ``F.linear``, ``aten.add.Tensor`` -> ``operator.add``);
- everything else (shape arithmetic, slicing, ops no BackendConfig names) stays as it is
  and stays float.

After the lift, fusion, qconfig resolution (module names come from ``nn_module_stack``),
prepare, convert and lowering run exactly as on a traced model.
"""

from __future__ import annotations

import operator
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Graph, GraphModule, Node

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._tracer import user_frame

__all__ = [
    "CAPTURES",
    "OPERATOR_EQUIVALENTS",
    "ExportCaptureError",
    "LiftedGraph",
    "capture_export",
    "equivalence_table",
    "exported_mode",
    "is_exported_module",
    "lift_exported",
]

CAPTURES = ("fx", "export")
_aten = torch.ops.aten


class ExportCaptureError(FxQuantError):
    """``torch.export`` cannot capture the model, or its graph cannot be quantized."""


@dataclass(frozen=True)
class _Equivalent:
    """How one ATen op is written at the level BackendConfigs name.

    ``function``: the functional / operator / torch form (a callable), or a method name.
    ``args``: builds its positional args and kwargs from the ATen op's bound arguments.
    ``module``: the torch.nn class whose forward makes this call, and ``build`` makes that
    module from the bound arguments and parameters (None: the op is never lifted to a module).
    """

    function: Callable[..., Any] | str
    args: Callable[[dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]
    module: tuple[type[nn.Module], ...] = ()
    build: Callable[[dict[str, Any], type[nn.Module]], nn.Module] | None = None
    data_arg: str = "input"  # the argument the module is called with
    # The op is in place but ``function`` is not (symbolic tracing records ``x += y`` as
    # ``operator.add``): the function form is used only where nothing reads the overwritten
    # tensor afterwards.
    in_place: bool = False


def _first(name: str) -> Callable[[dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]:
    return lambda a: ((a[name],), {})


def _pos(*names: str) -> Callable[[dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]:
    return lambda a: (tuple(a[n] for n in names), {})


def _no_args_module(a: dict[str, Any], cls: type[nn.Module]) -> nn.Module:
    return cls()


def _inplace_module(inplace: bool) -> Callable[[dict[str, Any], type[nn.Module]], nn.Module]:
    def build(a: dict[str, Any], cls: type[nn.Module]) -> nn.Module:
        return cls(inplace=inplace) if inplace else cls()

    return build


def _conv_module(a: dict[str, Any], cls: type[nn.Module]) -> nn.Module:
    weight: torch.Tensor = a["weight"]
    groups = int(a["groups"])
    transposed = issubclass(cls, nn.modules.conv._ConvTransposeNd)
    out_c = weight.shape[1] * groups if transposed else weight.shape[0]
    in_c = weight.shape[0] if transposed else weight.shape[1] * groups
    kwargs: dict[str, Any] = dict(
        stride=tuple(a["stride"]),
        padding=a["padding"] if isinstance(a["padding"], str) else tuple(a["padding"]),
        dilation=tuple(a["dilation"]),
        groups=groups,
        bias=a["bias"] is not None,
        device="meta",
    )
    if transposed:
        kwargs["output_padding"] = tuple(a["output_padding"])
    module = cls(in_c, out_c, tuple(weight.shape[2:]), **kwargs)
    return module


def _linear_module(a: dict[str, Any], cls: type[nn.Module]) -> nn.Module:
    weight: torch.Tensor = a["weight"]
    return nn.Linear(weight.shape[1], weight.shape[0], bias=a["bias"] is not None, device="meta")


def _batch_norm_module(a: dict[str, Any], cls: type[nn.Module]) -> nn.Module:
    mean = a["running_mean"]
    features = int(mean.shape[0] if mean is not None else a["weight"].shape[0])
    return cls(
        features,
        eps=float(a["eps"]),
        momentum=float(a["momentum"]),
        affine=a["weight"] is not None,
        track_running_stats=mean is not None,
        device="meta",
    )


def _layer_norm_module(a: dict[str, Any], cls: type[nn.Module]) -> nn.Module:
    return nn.LayerNorm(
        list(a["normalized_shape"]),
        eps=float(a["eps"]),
        elementwise_affine=a["weight"] is not None,
        bias=a["bias"] is not None,
        device="meta",
    )


def _embedding_module(a: dict[str, Any], cls: type[nn.Module]) -> nn.Module:
    weight: torch.Tensor = a["weight"]
    padding = int(a["padding_idx"])
    return nn.Embedding(
        weight.shape[0], weight.shape[1], padding_idx=None if padding < 0 else padding,
        device="meta",
    )  # fmt: skip


def _hardtanh_module(inplace: bool) -> Callable[[dict[str, Any], type[nn.Module]], nn.Module]:
    def build(a: dict[str, Any], cls: type[nn.Module]) -> nn.Module:
        if cls is nn.ReLU6:
            return nn.ReLU6(inplace=inplace)
        return nn.Hardtanh(float(a["min_val"]), float(a["max_val"]), inplace=inplace)

    return build


def _pool_module(keys: Sequence[str]) -> Callable[[dict[str, Any], type[nn.Module]], nn.Module]:
    def build(a: dict[str, Any], cls: type[nn.Module]) -> nn.Module:
        values = {k: a[k] for k in keys}
        if "stride" in values and not values["stride"]:
            values["stride"] = None  # an empty stride means "the kernel size"
        for k, v in list(values.items()):
            if isinstance(v, list):
                values[k] = tuple(v)
        return cls(**values)

    return build


def _conv_args(a: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (a["input"], a["weight"], a["bias"], a["stride"], a["padding"], a["dilation"]), {
        "groups": a["groups"]
    }


def _conv_t_args(a: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    names = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups")
    return (*(a[n] for n in names), a["dilation"]), {}


def _add_args(a: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if a.get("alpha", 1) != 1:
        raise _KeepAtenError
    return (a["self"], a["other"]), {}


def _rsub_args(a: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``rsub(x, c)`` is ``c - x``: what ``1.0 - x`` traces to."""
    if a.get("alpha", 1) != 1:
        raise _KeepAtenError
    return (a["other"], a["self"]), {}


class _KeepAtenError(Exception):
    """Raised by an args builder when this call has no torch-level equivalent."""


def _bn_fn_args(a: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum")
    return (*(a[n] for n in names), a["eps"]), {}


def _layer_norm_args(a: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (a["input"], a["normalized_shape"], a["weight"], a["bias"], a["eps"]), {}


def _embedding_args(a: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    padding = a["padding_idx"]
    return (a["indices"], a["weight"]), {"padding_idx": None if padding < 0 else padding}


def _softmax_args(a: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if a.get("dtype") is not None or a.get("half_to_float"):
        raise _KeepAtenError
    return (a["self"], a["dim"]), {}


def _method(name: str, *rest: str) -> _Equivalent:
    return _Equivalent(name, _pos("self", *rest))


_ACT = nn.modules.activation
# the pooling ops' arguments, in the order of both the functions and the module constructors
_MAX_POOL = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")
_AVG_POOL = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
             "divisor_override")  # fmt: skip
# ATen op -> its torch-level form. Keys are OpOverloadPackets: every overload maps alike.
OPERATOR_EQUIVALENTS: dict[Any, _Equivalent] = {
    _aten.linear: _Equivalent(
        F.linear, _pos("input", "weight", "bias"), (nn.Linear,), _linear_module
    ),
    _aten.conv1d: _Equivalent(F.conv1d, _conv_args, (nn.Conv1d,), _conv_module),
    _aten.conv2d: _Equivalent(F.conv2d, _conv_args, (nn.Conv2d,), _conv_module),
    _aten.conv3d: _Equivalent(F.conv3d, _conv_args, (nn.Conv3d,), _conv_module),
    _aten.conv_transpose1d: _Equivalent(
        F.conv_transpose1d, _conv_t_args, (nn.ConvTranspose1d,), _conv_module
    ),
    _aten.conv_transpose2d: _Equivalent(
        F.conv_transpose2d, _conv_t_args, (nn.ConvTranspose2d,), _conv_module
    ),
    _aten.conv_transpose3d: _Equivalent(
        F.conv_transpose3d, _conv_t_args, (nn.ConvTranspose3d,), _conv_module
    ),
    _aten.batch_norm: _Equivalent(
        F.batch_norm,
        _bn_fn_args,
        (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d),
        _batch_norm_module,
    ),
    _aten.layer_norm: _Equivalent(
        F.layer_norm, _layer_norm_args, (nn.LayerNorm,), _layer_norm_module
    ),
    _aten.embedding: _Equivalent(
        F.embedding, _embedding_args, (nn.Embedding,), _embedding_module, data_arg="indices"
    ),
    _aten.relu: _Equivalent(F.relu, _first("self"), (nn.ReLU,), _inplace_module(False)),
    _aten.relu_: _Equivalent(torch.relu_, _first("self"), (nn.ReLU,), _inplace_module(True)),
    _aten.relu6: _Equivalent(F.relu6, _first("self"), (nn.ReLU6,), _no_args_module),
    _aten.hardtanh: _Equivalent(
        F.hardtanh,
        _pos("self", "min_val", "max_val"),
        (nn.ReLU6, nn.Hardtanh),
        _hardtanh_module(False),
    ),
    _aten.hardtanh_: _Equivalent(
        F.hardtanh_,
        _pos("self", "min_val", "max_val"),
        (nn.ReLU6, nn.Hardtanh),
        _hardtanh_module(True),
    ),
    _aten.hardswish: _Equivalent(F.hardswish, _first("self"), (nn.Hardswish,), _no_args_module),
    _aten.hardswish_: _Equivalent(
        F.hardswish, _first("self"), (nn.Hardswish,), _inplace_module(True), in_place=True
    ),
    _aten.hardsigmoid: _Equivalent(
        F.hardsigmoid, _first("self"), (nn.Hardsigmoid,), _no_args_module
    ),
    _aten.hardsigmoid_: _Equivalent(
        F.hardsigmoid, _first("self"), (nn.Hardsigmoid,), _inplace_module(True), in_place=True
    ),
    _aten.sigmoid: _Equivalent(torch.sigmoid, _first("self"), (nn.Sigmoid,), _no_args_module),
    _aten.tanh: _Equivalent(torch.tanh, _first("self"), (nn.Tanh,), _no_args_module),
    _aten.silu: _Equivalent(F.silu, _first("self"), (nn.SiLU,), _no_args_module),
    _aten.silu_: _Equivalent(
        F.silu, _first("self"), (nn.SiLU,), _inplace_module(True), in_place=True
    ),
    _aten.mish: _Equivalent(F.mish, _first("self"), (nn.Mish,), _no_args_module),
    _aten.gelu: _Equivalent(
        F.gelu,
        lambda a: ((a["self"],), {"approximate": a["approximate"]}),
        (nn.GELU,),
        lambda a, cls: nn.GELU(approximate=a["approximate"]),
    ),
    _aten.leaky_relu: _Equivalent(
        F.leaky_relu,
        _pos("self", "negative_slope"),
        (_ACT.LeakyReLU,),
        lambda a, cls: nn.LeakyReLU(float(a["negative_slope"])),
    ),
    _aten.softmax: _Equivalent(
        F.softmax, _softmax_args, (nn.Softmax,), lambda a, cls: nn.Softmax(int(a["dim"]))
    ),
    _aten._softmax: _Equivalent(F.softmax, _softmax_args),
    _aten.dropout_: _Equivalent(
        F.dropout,
        lambda a: ((a["self"], a["p"], a["train"]), {"inplace": True}),
        (nn.Dropout,),
        lambda a, cls: nn.Dropout(a["p"], inplace=True),
        data_arg="self",
    ),
    _aten.dropout: _Equivalent(
        F.dropout, _pos("input", "p", "train"), (nn.Dropout,), lambda a, cls: nn.Dropout(a["p"])
    ),
    _aten.max_pool2d: _Equivalent(
        F.max_pool2d, _pos("self", *_MAX_POOL), (nn.MaxPool2d,), _pool_module(_MAX_POOL)
    ),
    _aten.avg_pool2d: _Equivalent(
        F.avg_pool2d, _pos("self", *_AVG_POOL), (nn.AvgPool2d,), _pool_module(_AVG_POOL)
    ),
    _aten.adaptive_avg_pool2d: _Equivalent(
        F.adaptive_avg_pool2d,
        _pos("self", "output_size"),
        (nn.AdaptiveAvgPool2d,),
        _pool_module(("output_size",)),
    ),
    _aten.add: _Equivalent(operator.add, _add_args),
    _aten.add_: _Equivalent(operator.add, _add_args, in_place=True),
    _aten.sub: _Equivalent(operator.sub, _add_args),
    _aten.rsub: _Equivalent(operator.sub, _rsub_args),
    _aten.mul: _Equivalent(operator.mul, _pos("self", "other")),
    _aten.mul_: _Equivalent(operator.mul, _pos("self", "other"), in_place=True),
    _aten.div: _Equivalent(operator.truediv, _pos("self", "other")),
    _aten.matmul: _Equivalent(torch.matmul, _pos("self", "other")),
    _aten.bmm: _Equivalent(torch.bmm, _pos("self", "mat2")),
    _aten.cat: _Equivalent(torch.cat, _pos("tensors", "dim")),
    _aten.clamp: _Equivalent(torch.clamp, _pos("self", "min", "max")),
    _aten.mean: _Equivalent("mean", lambda a: ((a["self"], a["dim"], a["keepdim"]), {})),
    _aten.flatten: _Equivalent(
        torch.flatten,
        _pos("self", "start_dim", "end_dim"),
        (nn.Flatten,),
        lambda a, cls: nn.Flatten(int(a["start_dim"]), int(a["end_dim"])),
    ),
    _aten.view: _method("view", "size"),
    _aten.reshape: _method("reshape", "shape"),
    _aten.permute: _method("permute", "dims"),
    _aten.transpose: _method("transpose", "dim0", "dim1"),
    _aten.unsqueeze: _method("unsqueeze", "dim"),
    _aten.contiguous: _Equivalent("contiguous", _first("self")),
}


def _describe(fn: Callable[..., Any] | str) -> str:
    if isinstance(fn, str):
        return f"Tensor.{fn}"
    module = getattr(fn, "__module__", "") or ""
    name = getattr(fn, "__name__", repr(fn))
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    if module in ("torch.nn.functional", "torch._C._nn"):
        return f"F.{name}"
    return f"torch.{name}"


def equivalence_table() -> list[tuple[str, str, str]]:
    """How ``capture="export"`` reads ATen ops: rows of (ATen op, the module it becomes when
    ``nn_module_stack`` says that module made the call, else the function it becomes)."""
    rows = []
    for packet, eq in OPERATOR_EQUIVALENTS.items():
        modules = ", ".join(f"nn.{m.__name__}" for m in eq.module) or "-"
        rows.append((f"aten.{packet.__name__}", modules, _describe(eq.function)))
    return rows


def _overload_packet(target: object) -> object:
    return getattr(target, "overloadpacket", None)


def _bind(node: Node) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in."""
    schema = node.target._schema  # type: ignore[union-attr]
    bound: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
        else:
            bound[arg.name] = None
    return bound


def is_exported_module(model: object) -> bool:
    """True for the GraphModule of ``torch.export.export(...).module()`` (an ATen graph)."""
    if not isinstance(model, GraphModule):
        return False
    return any(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
        and "nn_module_stack" in n.meta
        for n in model.graph.nodes
    )  # fmt: skip


def exported_mode(gm: GraphModule) -> tuple[bool | None, str]:
    """The mode ``gm`` was exported in: (True for train, False for eval, None if no op says),
    and the node that says so."""
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        packet = _overload_packet(n.target)
        if packet is _aten.batch_norm:
            return bool(_bind(n)["training"]), n.name
        if packet is _aten.dropout:
            return bool(_bind(n)["train"]), n.name
        if packet in (_aten._native_batch_norm_legit_no_training,):
            return False, n.name
        if packet in (_aten._native_batch_norm_legit, _aten._native_batch_norm_legit_functional):
            return bool(_bind(n)["training"]), n.name
    return None, ""


def _is_module_kind(kind: type, classes: tuple[type[nn.Module], ...]) -> bool:
    """``kind`` is one of ``classes``, or a subclass that only renames it (same forward)."""
    return any(kind is c or (issubclass(kind, c) and kind.forward is c.forward) for c in classes)


def _resolve_class(qualified: object) -> type | None:
    """The class an ``nn_module_stack`` entry names (already imported; never imports)."""
    if isinstance(qualified, type):
        return qualified
    if not isinstance(qualified, str):
        return None
    module_name, _, name = qualified.rpartition(".")
    obj: Any = sys.modules.get(module_name)
    for part in name.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


def _innermost(node: Node) -> tuple[str, type | None]:
    stack = node.meta.get("nn_module_stack") or {}
    for path, kind in reversed(list(stack.values())):
        if path == "_empty_nn_module_stack_from_metadata_hook":
            continue
        return str(path), _resolve_class(kind)
    return "", None


@dataclass
class LiftedGraph:
    """The lifted model and what prepare needs from the capture."""

    graph_module: GraphModule
    # node name -> (qualified name, class) of the module whose forward made the call
    scope: dict[str, tuple[str, Any]]
    module_classes: dict[str, type]  # qualified module name -> class, from nn_module_stack
    guards: list[str]  # modules that check the inputs against what export assumed


def _set_attr(root: nn.Module, path: str, value: Any) -> None:
    """Register ``value`` at dotted ``path`` under ``root``, creating plain parents."""
    *parents, name = path.split(".")
    owner = root
    for p in parents:
        child = owner._modules.get(p)
        if child is None:
            child = nn.Module()
            owner.add_module(p, child)
        owner = child
    if isinstance(value, nn.Module):
        owner.add_module(name, value)
    elif isinstance(value, nn.Parameter):
        owner.register_parameter(name, value)
    elif isinstance(value, torch.Tensor):
        owner.register_buffer(name, value)
    else:
        setattr(owner, name, value)


def _fetch(gm: nn.Module, target: str) -> Any:
    owner: Any = gm
    for part in target.split("."):
        owner = getattr(owner, part)
    return owner


_MODULE_TENSORS = ("weight", "bias", "running_mean", "running_var")


def _reads_module_tensors(bound: dict[str, Any], path: str) -> bool:
    """The op reads the module's own tensors (weight, bias, running statistics): each is
    absent or the module's attribute itself, never a slice or another module's."""
    for name in _MODULE_TENSORS:
        value = bound.get(name)
        if value is None:
            continue
        if not (isinstance(value, Node) and value.op == "get_attr"
                and str(value.target) == f"{path}.{name}"):  # fmt: skip
            return False
    return True


def _has(root: nn.Module, target: str) -> bool:
    try:
        _fetch(root, target)
    except AttributeError:
        return False
    return True


def lift_exported(gm: GraphModule, training: bool) -> LiftedGraph:
    """Rewrite the ATen graph of an exported module at BackendConfig level (module docstring).

    The result shares parameters and buffers with ``gm``; its forward takes the same inputs
    and returns the same structure (the exported input/output specs are kept).
    """
    root = nn.Module()
    graph = Graph()
    graph._codegen = gm.graph._codegen  # same inputs and output structure as the export
    env: dict[Node, Node] = {}
    scope: dict[str, tuple[str, Any]] = {}
    classes: dict[str, type] = {}
    lifted_modules: dict[str, nn.Module] = {}

    def arg(a: Any) -> Any:
        return torch.fx.node.map_arg(a, lambda n: env[n])

    def lift_module(node: Node, eq: _Equivalent, bound: dict[str, Any], path: str,
                    kind: type) -> Node | None:  # fmt: skip
        if not _reads_module_tensors(bound, path):
            return None  # e.g. a slice of the weight, or another module's bias
        module = lifted_modules.get(path)
        if module is None:
            assert eq.build is not None
            real = {k: _fetch(gm, str(v.target)) if isinstance(v, Node) and v.op == "get_attr"
                    else v for k, v in bound.items()}  # fmt: skip
            module = eq.build(real, kind)
            for name, _ in list(module.named_parameters()) + list(module.named_buffers()):
                source = f"{path}.{name}"
                if _has(gm, source):  # share the exported module's own tensors
                    _replace_tensor(module, name, _fetch(gm, source))
                elif name == "num_batches_tracked":
                    _replace_tensor(module, name, torch.zeros((), dtype=torch.long))
            if any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
                return None  # a tensor the module needs is not the exported module's
            module.train(training)
            _set_attr(root, path, module)
            lifted_modules[path] = module
        data = bound[eq.data_arg] if eq.data_arg in bound else bound["self"]
        return graph.create_node("call_module", path, (arg(data),), name=node.name)

    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def _lift_call(node: Node, path: str, kind: type | None) -> Node | None:
        eq = OPERATOR_EQUIVALENTS.get(_overload_packet(node.target))
        if eq is None:
            return None
        bound = _bind(node)
        if kind is not None and path and _is_module_kind(kind, eq.module):
            new = lift_module(node, eq, bound, path, kind)
            if new is not None:
                return new
        if eq.in_place and any(order[u] > order[node] for u in _users(bound["self"])):
            return None  # the overwritten tensor is read later: keep the in-place op
        try:
            args, kwargs = eq.args(bound)
        except _KeepAtenError:
            return None
        op = "call_method" if isinstance(eq.function, str) else "call_function"
        return graph.create_node(op, eq.function, arg(args), arg(kwargs), name=node.name)

    for node in gm.graph.nodes:
        if node.op == "call_module":  # export's input guards (the only module it calls)
            _set_attr(root, str(node.target), _fetch(gm, str(node.target)))
        for entry_path, entry_kind in (node.meta.get("nn_module_stack") or {}).values():
            resolved = _resolve_class(entry_kind)
            if resolved is not None and entry_path:
                classes[str(entry_path)] = resolved
        path, kind = _innermost(node)
        new = _lift_call(node, path, kind) if node.op == "call_function" else None
        if new is None:
            if node.op == "get_attr":
                _copy_attr(gm, root, str(node.target))
            new = graph.node_copy(node, lambda n: env[n])
        else:
            new.meta = dict(node.meta)
        env[node] = new
        if new.op == "call_module":
            scope[new.name] = (str(new.target), type(_fetch(root, str(new.target))))
        elif new.op in ("call_function", "call_method"):
            scope[new.name] = (path, kind)
    graph.eliminate_dead_code(is_impure_node=lambda n: n.op in ("placeholder", "output") or (
        n.op == "call_function" and getattr(n.target, "_schema", None) is not None
        and n.target._schema.is_mutable  # type: ignore[union-attr]
    ))  # fmt: skip
    lifted = _ExportedGraphModule(root, graph, type(gm).__name__)
    lifted.train(training)
    for module in lifted_modules.values():
        module.train(training)
    guards = [str(n.target) for n in graph.nodes if n.op == "call_module"
              and str(n.target) not in lifted_modules]  # fmt: skip
    return LiftedGraph(lifted, scope, classes, guards)


def _users(value: object) -> list[Node]:
    return list(value.users) if isinstance(value, Node) else []


class _ExportedGraphModule(GraphModule):
    """A lifted graph. Its forward keeps torch.export's input/output specs, whose leaves are
    a pytree class torch 2.13 deprecates: copying one warns, though nothing is wrong. Copies
    (which convert and lowering make) are made without that warning."""

    def __deepcopy__(self, memo: dict[int, Any]) -> GraphModule:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
            return super().__deepcopy__(memo)


def _replace_tensor(module: nn.Module, name: str, tensor: Any) -> None:
    if name in module._parameters:
        if not isinstance(tensor, nn.Parameter):
            tensor = nn.Parameter(tensor, requires_grad=tensor.requires_grad)
        module._parameters[name] = tensor
    else:
        module._buffers[name] = tensor


def _copy_attr(gm: GraphModule, root: nn.Module, target: str) -> None:
    if not _has(root, target):
        _set_attr(root, target, _fetch(gm, target))


def _auto_dynamic_shapes(example_inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Every dimension of every tensor input may vary; export keeps fixed what must be."""
    auto = torch.export.Dim.AUTO

    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {i: auto for i in range(value.dim())} or None
        if isinstance(value, (list, tuple)):
            return type(value)(spec(v) for v in value)
        if isinstance(value, dict):
            return {k: spec(v) for k, v in value.items()}
        return None

    return tuple(spec(v) for v in example_inputs)


def capture_export(
    model: nn.Module, example_inputs: tuple[Any, ...], *, dynamic: bool = True
) -> GraphModule:
    """``torch.export.export(model, example_inputs)`` (non-strict), dimensions dynamic where
    the model allows; returns the exported module (an ATen graph).

    A size-1 dimension in ``example_inputs`` is treated like any other (not fixed to 1), so
    a model calibrated on batch 8 also runs on batch 1 and the other way around.
    """
    shapes = _auto_dynamic_shapes(example_inputs) if dynamic else None
    try:
        with _SizeOblivious():
            program = torch.export.export(
                model, example_inputs, dynamic_shapes=shapes, strict=False
            )
    except Exception as e:  # export runs arbitrary user code
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        fix = (
            "make that line exportable (see torch.export's message above), or try "
            "capture='fx' with PrepareCustomConfig().set_non_traceable_module_names([...]) for "
            "the part that fails"
        )
        if _returns_a_kv_cache(first_line):
            fix = (
                "the model returns its key/value cache, an object torch.export cannot flatten "
                "(a generating model's default); quantize it without one: set "
                "model.config.use_cache = False (Hugging Face models), or pass use_cache=False "
                "with the inputs"
            )
        raise ExportCaptureError(
            f"torch.export cannot capture the model ({type(model).__name__}): "
            f"{type(e).__name__}: {first_line}\n"
            f"  at {user_frame(e.__traceback__)}\n"
            f"  fix: {fix}"
        ) from e
    return program.module()


def _returns_a_kv_cache(message: str) -> bool:
    """torch.export's refusal of a Hugging Face ``Cache`` (``DynamicCache``, ...) in the
    output: a class it has no pytree for, named ``...Cache``."""
    return "in output, which is not a known type" in message and "Cache'>" in message


class _SizeOblivious:
    """Export without fixing size-1 dimensions to 1 (torch's default for backed sizes)."""

    def __enter__(self) -> None:
        import torch.fx.experimental._config as fx_config

        self._config = fx_config
        self._old = fx_config.backed_size_oblivious
        fx_config.backed_size_oblivious = True

    def __exit__(self, *exc: object) -> None:
        self._config.backed_size_oblivious = self._old
