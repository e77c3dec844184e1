"""The ``torch_native`` backend: lowers reference models to torch's own x86 quantized engine.

This is the one runtime module of quantbridge allowed to create and consume torch's quantized
tensors (``torch.quint8``/``qint8``) and to call ``torch.ops.quantized.*`` (ARCHITECTURE rule 2's
single exception); the architecture test skips exactly this file. It exists as a comparison
baseline while torch still ships the engine, and :func:`is_available` turns it off once torch
drops it, so ``quantbridge.lowering`` registers it only when it can run.

What it lowers (everything else stays reference: dequantize -> float op -> quantize):

* static uint8 linear and conv1d/conv2d, alone or fused with ReLU (per-tensor or per-channel
  int8 weights, packed once at lower time with the x86 engine);
* add (+ReLU), mul (+ReLU) and cat of uint8 tensors, with their own output qparams;
* ops that run on quantized tensors as they are (pools, flatten/reshape/view, ReLU, ...),
  with a requantize when the output qparams differ from the input's;
* dynamic linear (+ReLU) with int8 weights (``quantized::linear_dynamic``).

A quantize node whose value is consumed only by dequantize nodes becomes
``torch.quantize_per_tensor`` and those dequantize nodes become ``Tensor.dequantize()``, so a
chain of lowered ops passes quantized tensors from one to the next without round trips.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from quantbridge.fx_quant import get_x86_backend_config
from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.fx_quant.nn import reference as nnqr
from quantbridge.lowering._backend import Backend, SupportedOp, _pattern_name
from quantbridge.lowering._errors import LoweringError
from quantbridge.qconfig import (
    QConfigMapping,
    get_default_qat_qconfig_mapping,
    get_default_qconfig_mapping,
)

__all__ = ["TorchNativeBackend", "is_available", "torch_native", "unavailable_reason"]

_ENGINE = "x86"
_OPS_NEEDED = (
    "linear",
    "linear_relu",
    "linear_dynamic",
    "linear_relu_dynamic",
    "linear_prepack",
    "conv1d",
    "conv1d_relu",
    "conv2d",
    "conv2d_relu",
    "conv1d_prepack",
    "conv2d_prepack",
    "add",
    "add_relu",
    "mul",
    "mul_relu",
    "cat",
)


def unavailable_reason() -> str:
    """Why torch's x86 quantized engine cannot be used here ('' when it can)."""
    try:
        engines = list(torch.backends.quantized.supported_engines)
    except Exception as e:  # torch without the quantized backends module at all
        return f"torch.backends.quantized is unusable ({type(e).__name__}: {e})"
    if _ENGINE not in engines:
        return f"torch {torch.__version__} has no {_ENGINE!r} quantized engine (has {engines})"
    if not hasattr(torch, "quantize_per_tensor"):
        return f"torch {torch.__version__} has no torch.quantize_per_tensor"
    missing = []
    for name in _OPS_NEEDED:
        try:
            getattr(torch.ops.quantized, name)
        except (AttributeError, RuntimeError):
            missing.append(name)
    if missing:
        return f"torch {torch.__version__} lacks torch.ops.quantized.{{{', '.join(missing)}}}"
    return ""


def is_available() -> bool:
    """True when the installed torch has the x86 quantized engine and the ops lowered to."""
    return unavailable_reason() == ""


_DEPRECATION = r"torch\.quantize_per_tensor, torch\.quantize_per_channel and other quantized"


@contextmanager
def _x86_engine() -> Iterator[None]:
    # Prepacking picks the packed-weight layout from the global engine; restore it afterwards.
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = _ENGINE
    try:
        with warnings.catch_warnings():
            # this backend exists to measure the deprecated engine; its warning is expected
            warnings.filterwarnings("ignore", message=_DEPRECATION, category=UserWarning)
            yield
    finally:
        torch.backends.quantized.engine = previous


_TORCH_QDTYPE = {torch.uint8: torch.quint8, torch.int8: torch.qint8}


# --- lowered modules -----------------------------------------------------------------------


class NativeModule(nn.Module):
    """Base of the modules a ``torch_native`` lowered graph calls (what ``print`` shows)."""

    runs_on = "torch x86 quantized engine"
    # plain attributes saved as extra state, so state_dict carries the output qparams
    _state_attrs: tuple[str, ...] = ("scale", "zero_point")

    def get_extra_state(self) -> dict[str, Any]:
        return {a: getattr(self, a) for a in self._state_attrs if hasattr(self, a)}

    def set_extra_state(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise LoweringError(
                f"torch_native {type(self).__name__}: extra state must be a dict, got "
                f"{type(state).__name__} (state_dict of another backend?)"
            )
        for key, value in state.items():
            if key in self._state_attrs:
                setattr(self, key, value)


class NativeQuantize(NativeModule):
    """float -> torch quantized tensor with fixed qparams (``torch.quantize_per_tensor``)."""

    def __init__(self, scale: float, zero_point: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = scale
        self.zero_point = zero_point
        self.dtype = dtype
        self._qdtype = _TORCH_QDTYPE[dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.quantize_per_tensor(x, self.scale, self.zero_point, self._qdtype)

    def extra_repr(self) -> str:
        return (
            f"torch.quantize_per_tensor, scale={self.scale:.6g}, zero_point={self.zero_point}, "
            f"dtype={self.dtype}"
        )


class NativeRequantize(NativeQuantize):
    """A quantized tensor re-expressed with other qparams (dequantize, then quantize)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.quantize_per_tensor(x.dequantize(), self.scale, self.zero_point, self._qdtype)

    def extra_repr(self) -> str:
        return "requantize: " + super().extra_repr()


def _quantized_weight(ref: nn.Module) -> torch.Tensor:
    """The reference module's weight as a torch qint8 tensor with exactly its int8 values."""
    qw = ref.get_quantized_weight()  # type: ignore[operator]
    if qw.dtype != torch.int8:
        raise LoweringError(
            f"torch_native: {type(ref).__name__} has {qw.dtype} weights; torch's x86 engine "
            "takes int8 weights only (use an int8 weight observer, e.g. the backend's "
            "qconfig_mapping())"
        )
    values = qw.values.detach().contiguous()
    if qw.axis is None:
        return torch._make_per_tensor_quantized_tensor(
            values, float(qw.scale.reshape(-1)[0]), int(qw.zero_point.reshape(-1)[0])
        )
    return torch._make_per_channel_quantized_tensor(
        values, qw.scale.detach().double(), qw.zero_point.detach().long(), qw.axis
    )


class _PackedWeightModule(NativeModule):
    """Keeps the int8 weight as a (torch quantized) buffer-like attribute and its packed form.

    The packed weight is an opaque torch script object; it is rebuilt from the weight and bias
    saved in ``state_dict`` (``weight`` as a torch qint8 tensor, ``bias`` as float) on load.
    """

    packed: Any
    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, qweight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", qweight)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self._repack()

    def _pack(self, qweight: torch.Tensor, bias: torch.Tensor | None) -> Any:
        raise NotImplementedError

    def _repack(self) -> None:
        with _x86_engine():
            self.packed = self._pack(self.weight, self.bias)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._repack()


class NativeLinear(_PackedWeightModule):
    """``quantized::linear`` / ``linear_relu``: quint8 in, quint8 out."""

    def __init__(
        self,
        qweight: torch.Tensor,
        bias: torch.Tensor | None,
        scale: float,
        zero_point: int,
        relu: bool,
    ) -> None:
        super().__init__(qweight, bias)
        self.scale = scale
        self.zero_point = zero_point
        self.relu = relu
        self._op = torch.ops.quantized.linear_relu if relu else torch.ops.quantized.linear

    def _pack(self, qweight: torch.Tensor, bias: torch.Tensor | None) -> Any:
        return torch.ops.quantized.linear_prepack(qweight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.packed, self.scale, self.zero_point)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        op = "linear_relu" if self.relu else "linear"
        out, inp = self.weight.shape
        return (
            f"torch.ops.quantized.{op}, in={inp}, out={out}, scale={self.scale:.6g}, "
            f"zero_point={self.zero_point}"
        )


class NativeDynamicLinear(_PackedWeightModule):
    """``quantized::linear_dynamic`` / ``linear_relu_dynamic``: float in, float out."""

    _state_attrs = ("reduce_range",)

    def __init__(
        self, qweight: torch.Tensor, bias: torch.Tensor | None, reduce_range: bool, relu: bool
    ) -> None:
        super().__init__(qweight, bias)
        self.reduce_range = reduce_range
        self.relu = relu
        q = torch.ops.quantized
        self._op = q.linear_relu_dynamic if relu else q.linear_dynamic

    def _pack(self, qweight: torch.Tensor, bias: torch.Tensor | None) -> Any:
        return torch.ops.quantized.linear_prepack(qweight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.packed, self.reduce_range)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        op = "linear_relu_dynamic" if self.relu else "linear_dynamic"
        out, inp = self.weight.shape
        return f"torch.ops.quantized.{op}, in={inp}, out={out}, reduce_range={self.reduce_range}"


class NativeConv(_PackedWeightModule):
    """``quantized::conv1d``/``conv2d`` (+ ``_relu``): quint8 in, quint8 out."""

    def __init__(
        self,
        conv: nn.Module,
        qweight: torch.Tensor,
        scale: float,
        zero_point: int,
        relu: bool,
    ) -> None:
        self.dim = qweight.dim() - 2
        self.stride = list(conv.stride)  # type: ignore[arg-type]
        self.padding = list(conv.padding)  # type: ignore[arg-type]
        self.dilation = list(conv.dilation)  # type: ignore[arg-type]
        self.groups = int(conv.groups)  # type: ignore[arg-type]
        super().__init__(qweight, conv.bias)  # type: ignore[arg-type]
        self.scale = scale
        self.zero_point = zero_point
        self.relu = relu
        name = f"conv{self.dim}d" + ("_relu" if relu else "")
        self._op = getattr(torch.ops.quantized, name)

    def _pack(self, qweight: torch.Tensor, bias: torch.Tensor | None) -> Any:
        prepack = getattr(torch.ops.quantized, f"conv{self.dim}d_prepack")
        return prepack(qweight, bias, self.stride, self.padding, self.dilation, self.groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.packed, self.scale, self.zero_point)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        op = f"conv{self.dim}d" + ("_relu" if self.relu else "")
        out, inp = self.weight.shape[:2]
        return (
            f"torch.ops.quantized.{op}, {inp * self.groups}->{out}, "
            f"kernel={tuple(self.weight.shape[2:])}, stride={self.stride}, "
            f"padding={self.padding}, groups={self.groups}, scale={self.scale:.6g}, "
            f"zero_point={self.zero_point}"
        )


class NativeBinary(NativeModule):
    """``quantized::add``/``mul`` (+ ``_relu``) of two quantized tensors."""

    def __init__(self, kind: str, scale: float, zero_point: int, relu: bool) -> None:
        super().__init__()
        self.kind = kind
        self.scale = scale
        self.zero_point = zero_point
        self.relu = relu
        self._op = getattr(torch.ops.quantized, kind + ("_relu" if relu else ""))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self._op(a, b, self.scale, self.zero_point)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        op = self.kind + ("_relu" if self.relu else "")
        return f"torch.ops.quantized.{op}, scale={self.scale:.6g}, zero_point={self.zero_point}"


class NativeCat(NativeModule):
    """``quantized::cat`` of quantized tensors into the output qparams."""

    def __init__(self, dim: int, scale: float, zero_point: int) -> None:
        super().__init__()
        self.dim = dim
        self.scale = scale
        self.zero_point = zero_point

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        out = torch.ops.quantized.cat(list(xs), self.dim, self.scale, self.zero_point)
        return out  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return (
            f"torch.ops.quantized.cat, dim={self.dim}, scale={self.scale:.6g}, "
            f"zero_point={self.zero_point}"
        )


# --- the lowering pass ----------------------------------------------------------------------

_q = torch.ops.quantbridge
_QUANTIZE = {_q.quantize_per_tensor.tensor, _q.quantize_per_tensor.default}
_DEQUANTIZE = {_q.dequantize_per_tensor.tensor, _q.dequantize_per_tensor.default}
_CHOOSE_QPARAMS = {_q.choose_qparams_per_tensor.default}

_RELU_FUNCS: set[Any] = {torch.relu, F.relu}
_ADD_FUNCS: set[Any] = {operator.add, torch.add}
_MUL_FUNCS: set[Any] = {operator.mul, torch.mul}

# Ops torch runs on quantized tensors directly, keeping the input's qparams.
_SHARED_MODULES: tuple[type[nn.Module], ...] = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.Flatten,
    nn.ReLU,
    nn.Identity,
    nn.Dropout,
)
_SHARED_FUNCS: set[Any] = {
    torch.flatten,
    torch.reshape,
    torch.transpose,
    torch.squeeze,
    torch.unsqueeze,
    torch.relu,
    F.relu,
    F.max_pool1d,
    F.max_pool2d,
    F.avg_pool1d,
    F.avg_pool2d,
    F.adaptive_avg_pool1d,
    F.adaptive_avg_pool2d,
    torch.nn.functional.dropout,
}
_SHARED_METHODS = {
    "reshape",
    "view",
    "flatten",
    "permute",
    "transpose",
    "contiguous",
    "squeeze",
    "unsqueeze",
    "relu",
}


def _is_call(node: object, targets: set[Any]) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


class _Lowerer:
    def __init__(self, gm: GraphModule) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.modules = dict(gm.named_modules(remove_duplicate=False))
        # node of the lowered graph whose value is a torch quantized tensor -> its qparams
        self.qparams: dict[Node, tuple[float, int, torch.dtype]] = {}
        self.count = 0

    # -- helpers
    def _constant(self, arg: object) -> float | int | None:
        if isinstance(arg, (int, float)) and not isinstance(arg, bool):
            return arg
        if isinstance(arg, Node) and arg.op == "get_attr":
            value: Any = self.gm
            for part in str(arg.target).split("."):
                value = getattr(value, part)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                return value.item()
        return None

    def _static_qparams(self, node: Node) -> tuple[float, int, torch.dtype] | None:
        """Fixed (scale, zero_point, dtype) of a per-tensor uint8/int8 quantize node."""
        if not _is_call(node, _QUANTIZE) or len(node.args) < 6:
            return None
        dtype = node.args[5]
        if dtype not in _TORCH_QDTYPE:
            return None
        scale = self._constant(node.args[1])
        zp = self._constant(node.args[2])
        qmin, qmax = node.args[3], node.args[4]
        lo, hi = (0, 255) if dtype == torch.uint8 else (-128, 127)
        if scale is None or zp is None or (qmin, qmax) != (lo, hi):
            return None  # restricted ranges (e.g. reduce_range outputs) stay reference
        return float(scale), int(zp), dtype  # type: ignore[return-value]

    def _add_module(self, kind: str, module: nn.Module) -> str:
        name = f"_torch_native_{kind}_{self.count}"
        self.count += 1
        self.gm.add_module(name, module)
        return name

    def _native_input(self, arg: object) -> Node | None:
        """The quantized-tensor node behind ``arg`` if ``arg`` is a dequantize of one."""
        if isinstance(arg, Node) and arg.op == "call_method" and arg.target == "dequantize":
            src = arg.args[0]
            if isinstance(src, Node) and src in self.qparams:
                return src
        return None

    def _module(self, node: Node) -> nn.Module | None:
        if node.op == "call_module":
            return self.modules.get(str(node.target))
        return None

    # -- matching a float op whose result a static quantize node consumes
    def _lower_static(
        self, op: Node, out: tuple[float, int, torch.dtype]
    ) -> tuple[str, nn.Module, list[Node]] | None:
        scale, zp, dtype = out
        if len(op.users) != 1:
            return None
        relu = False
        inner = op
        mod = self._module(op)
        is_relu = isinstance(mod, nn.ReLU) or _is_call(op, _RELU_FUNCS)
        candidate = op.args[0] if op.args else None
        if (
            is_relu
            and isinstance(candidate, Node)
            and len(candidate.users) == 1
            and (
                self._weighted(candidate) is not None
                or _is_call(candidate, _ADD_FUNCS | _MUL_FUNCS)
            )
        ):
            inner, relu = candidate, True
        weighted = self._weighted(inner)
        if weighted is not None and dtype == torch.uint8:
            ref, fused_relu = weighted
            x = self._native_input(inner.args[0]) if len(inner.args) == 1 else None
            if x is None or self.qparams[x][2] != torch.uint8 or inner.kwargs:
                return None
            relu = relu or fused_relu
            qweight = _quantized_weight(ref)
            if isinstance(ref, nnqr.Linear):
                return "linear", NativeLinear(qweight, ref.bias, scale, zp, relu), [x]
            if getattr(ref, "padding_mode", "zeros") != "zeros":
                return None
            return "conv", NativeConv(ref, qweight, scale, zp, relu), [x]
        if _is_call(inner, _ADD_FUNCS | _MUL_FUNCS) and dtype == torch.uint8:
            if len(inner.args) != 2 or inner.kwargs:
                return None
            a, b = (self._native_input(arg) for arg in inner.args)
            if a is None or b is None:
                return None
            if self.qparams[a][2] != torch.uint8 or self.qparams[b][2] != torch.uint8:
                return None
            kind = "add" if inner.target in _ADD_FUNCS else "mul"
            return kind, NativeBinary(kind, scale, zp, relu), [a, b]
        if op.target is torch.cat and op.op == "call_function":
            tensors = op.args[0]
            dim = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim", 0)
            if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int):
                return None
            xs = [self._native_input(t) for t in tensors]
            if any(x is None for x in xs) or any(self.qparams[x][2] != dtype for x in xs if x):
                return None
            return "cat", NativeCat(dim, scale, zp), [x for x in xs if x is not None]
        return None

    def _weighted(self, node: Node) -> tuple[nn.Module, bool] | None:
        """(reference linear/conv1d/conv2d module, fused relu) called by ``node``."""
        mod = self._module(node)
        fused_relu = False
        if isinstance(mod, (nni.LinearReLU, nni.ConvReLU1d, nni.ConvReLU2d)):
            mod, fused_relu = mod[0], True
        if (
            isinstance(mod, (nnqr.Linear, nnqr.Conv1d, nnqr.Conv2d))
            and mod.weight_dtype == torch.int8
        ):
            return mod, fused_relu
        return None

    def _shared(self, op: Node) -> bool:
        """Whether ``op`` runs as is on a quantized tensor (its only tensor input dequantized)."""
        mod = self._module(op)
        if op.op == "call_module":
            ok = isinstance(mod, _SHARED_MODULES)
        elif op.op == "call_function":
            ok = op.target in _SHARED_FUNCS
        elif op.op == "call_method":
            ok = op.target in _SHARED_METHODS
        else:
            return False
        if not ok or len(op.users) != 1 or not op.args:
            return False
        if self._native_input(op.args[0]) is None:
            return False
        rest = list(op.args[1:]) + list(op.kwargs.values())
        return not any(isinstance(a, Node) for a in rest)

    # -- the pass
    def run(self) -> GraphModule:
        for node in list(self.graph.nodes):
            if _is_call(node, _QUANTIZE):
                self._visit_quantize(node)
            elif _is_call(node, _DEQUANTIZE):
                src = node.args[0]
                if isinstance(src, Node) and src in self.qparams:
                    with self.graph.inserting_before(node):
                        new = self.graph.call_method("dequantize", (src,))
                    node.replace_all_uses_with(new)
                    self.graph.erase_node(node)
            elif node.op == "call_module":
                self._visit_dynamic(node)
        self.graph.eliminate_dead_code()
        self.graph.lint()
        self.gm.recompile()
        self.gm.delete_all_unused_submodules()
        return self.gm

    def _visit_quantize(self, node: Node) -> None:
        out = self._static_qparams(node)
        if out is None or not node.users:
            return
        # its users must all be dequantize nodes; they become Tensor.dequantize()
        if not all(_is_call(u, _DEQUANTIZE) for u in node.users):
            return
        src = node.args[0]
        new: Node
        if isinstance(src, Node):
            lowered = self._lower_static(src, out)
            if lowered is not None:
                kind, module, inputs = lowered
                name = self._add_module(kind, module)
                with self.graph.inserting_before(node):
                    new = self.graph.call_module(name, tuple(inputs))
                self._finish(node, new, out)
                return
            if self._shared(src):
                x = self._native_input(src.args[0])
                assert x is not None
                with self.graph.inserting_before(node):
                    new = self.graph.node_copy(src, lambda n: x if n is src.args[0] else n)
                    if self.qparams[x] != out:
                        name = self._add_module("requantize", NativeRequantize(*out))
                        new = self.graph.call_module(name, (new,))
                self._finish(node, new, out)
                return
        name = self._add_module("quantize", NativeQuantize(*out))
        with self.graph.inserting_before(node):
            new = self.graph.call_module(name, (src,))
        self._finish(node, new, out)

    def _finish(self, old: Node, new: Node, out: tuple[float, int, torch.dtype]) -> None:
        self.qparams[new] = out
        old.replace_all_uses_with(new)
        self.graph.erase_node(old)

    def _visit_dynamic(self, node: Node) -> None:
        """ref linear(dequantize(quantize(x, choose_qparams(x)))) -> quantized::linear_dynamic."""
        weighted = self._weighted(node)
        if weighted is None or len(node.args) != 1 or node.kwargs:
            return
        ref, relu = weighted
        if not isinstance(ref, nnqr.Linear):
            return
        deq = node.args[0]
        if not _is_call(deq, _DEQUANTIZE):
            return
        assert isinstance(deq, Node)
        quant = deq.args[0]
        if not _is_call(quant, _QUANTIZE):
            return
        assert isinstance(quant, Node)
        scale = quant.args[1]
        if not (isinstance(scale, Node) and scale.target is operator.getitem):
            return
        choose = scale.args[0]
        if not _is_call(choose, _CHOOSE_QPARAMS):
            return
        assert isinstance(choose, Node)
        x = choose.args[0]
        if x is not quant.args[0] or tuple(choose.args[1:3]) != (0, 255):
            return
        reduce_range = bool(choose.args[3]) if len(choose.args) > 3 else False
        module = NativeDynamicLinear(_quantized_weight(ref), ref.bias, reduce_range, relu)
        name = self._add_module("dynamic_linear", module)
        with self.graph.inserting_before(node):
            new = self.graph.call_module(name, (x,))
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)


class TorchNativeBackend(Backend):
    """Lowers to torch's own x86 quantized engine; the comparison baseline.

    Its BackendConfig is fx_quant's x86 config named ``"torch_native"``; its default qconfigs
    are torch.ao's x86 defaults, whose activations use ``reduce_range=True`` because the engine
    accumulates pairs of uint8 x int8 products in 16 bits (vpmaddubsw) and would saturate.
    """

    def __init__(self) -> None:
        super().__init__(
            "torch_native",
            get_x86_backend_config().set_name("torch_native"),
            description="torch's own x86 quantized engine (torch.ops.quantized.*)",
        )

    def is_available(self) -> bool:
        return is_available()

    def unavailable_reason(self) -> str:
        return unavailable_reason()

    def qconfig_mapping(self, qat: bool = False) -> QConfigMapping:
        """torch.ao's x86 defaults: per-channel int8 weights, ``reduce_range=True`` activations."""
        if qat:
            return get_default_qat_qconfig_mapping("x86")
        return get_default_qconfig_mapping("x86")

    def lower(self, reference_model: GraphModule) -> GraphModule:
        """Replace the supported reference patterns with torch quantized ops (in place)."""
        self._check_lowerable(reference_model)
        with _x86_engine():
            return _Lowerer(reference_model).run()

    def supported_ops(self) -> list[SupportedOp]:
        """The x86 config's rows, each with the torch op it lowers to or ``reference``."""
        runs_on: dict[str, str] = {}
        for cfg in self.backend_config.configs:
            pattern = cfg.pattern if cfg.pattern is not None else cfg.complex_pattern
            runs_on.setdefault(_pattern_name(pattern), _runs_on(pattern))
        return [
            SupportedOp(o.op, o.modes, runs_on.get(o.op, "reference"))
            for o in super().supported_ops()
        ]


_LINEAR_NAMES = {"Linear", "LinearReLU", "LinearBn1d"}
_CONV_NAMES = {f"Conv{suffix}{d}d" for suffix in ("", "ReLU", "Bn", "BnReLU") for d in (1, 2)}


def _runs_on(pattern: object) -> str:
    """What a BackendConfig pattern runs on after this backend's lowering."""
    parts = list(pattern) if isinstance(pattern, tuple) else [pattern]
    root, rest = parts[0], parts[1:]
    relu = any(p is nn.ReLU or p in _RELU_FUNCS for p in rest)
    if isinstance(root, type) and root.__name__ in _LINEAR_NAMES and issubclass(root, nn.Module):
        fused = relu or "ReLU" in root.__name__
        op = "quantized::linear" + ("_relu" if fused else "")
        return f"{op}; dynamic int8: {op}_dynamic; fp16: reference"
    if isinstance(root, type) and root.__name__ in _CONV_NAMES and issubclass(root, nn.Module):
        dim = root.__name__[-2]
        fused = relu or "ReLU" in root.__name__
        return f"quantized::conv{dim}d" + ("_relu" if fused else "")
    if root in _ADD_FUNCS or root in _MUL_FUNCS:
        kind = "add" if root in _ADD_FUNCS else "mul"
        return f"quantized::{kind}" + ("_relu" if relu else "")
    if root is torch.cat:
        return "quantized::cat"
    if rest:
        return "reference"
    if (isinstance(root, type) and issubclass(root, _SHARED_MODULES)) or (
        root in _SHARED_FUNCS or root in _SHARED_METHODS
    ):
        return "torch op on the quantized tensor"
    return "reference"


torch_native = TorchNativeBackend()
