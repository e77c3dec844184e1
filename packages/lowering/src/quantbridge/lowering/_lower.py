"""The lowering pass: reference graph (dequantize → float op → quantize) → kernel calls on uint8.

The pass walks the graph once in topological order. Every ``quantize_per_tensor`` node with
constant uint8 qparams over [0, 255] is a candidate: if the float op feeding it reads only
dequantized values (and constants) and the kernels can run it, the op and the quantize are
replaced by one lowered node that takes the *quantized* producers directly and returns uint8
with the quantize's qparams. Because a lowered node replaces the quantize node, the next op's
``dequantize`` now reads the lowered node, and when that op is lowered too the dequantize has
no user left: chains of quantized ops stay uint8, with one quantize at the model input and one
dequantize at its output. Ops the kernels cannot run keep their reference form
(dequantize → float op → quantize): correct, slower, and listed in the lowering report.

Dynamic linear (``choose_qparams → quantize → dequantize → Linear``, float output) and
weight-only embeddings (reference Embedding/EmbeddingBag) are matched on the module node.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from quantbridge import kernels as K
from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.fx_quant.nn import reference as nnqr
from quantbridge.lowering import _modules as lm
from quantbridge.lowering._errors import LoweringError

__all__ = ["LoweringReport", "lower_to_kernels", "lowering_report"]

_Q = torch.ops.quantbridge.quantize_per_tensor.tensor
_DQ = torch.ops.quantbridge.dequantize_per_tensor.tensor
_REPORT_KEY = "quantbridge_lowering"

QParams = tuple[float, int]


@dataclass
class LoweringReport:
    """What the pass did: lowered nodes (name → what runs them) and nodes kept as reference."""

    target: str
    lowered: list[tuple[str, str]] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)
    # lowered node name -> the reference node whose value it computes (a quantize node, or the
    # float module node for dynamic linear and embeddings); node names survive lowering
    origins: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"lowered to quantbridge.kernels (target={self.target}):"]
        lines += [f"  {n:<32} {k}" for n, k in self.lowered] or ["  (nothing)"]
        lines.append("kept as reference (dequantize -> float op -> quantize):")
        lines += [f"  {n:<32} {why}" for n, why in self.kept] or ["  (nothing)"]
        return "\n".join(lines)


def lowering_report(model: GraphModule) -> LoweringReport:
    """The report of the pass that produced ``model``."""
    rep = model.meta.get(_REPORT_KEY) if hasattr(model, "meta") else None
    if not isinstance(rep, LoweringReport):
        raise LoweringError(
            f"lowering_report: {type(model).__name__} was not produced by a quantbridge numba "
            "backend's lower(); lower a reference model first"
        )
    return rep


# --- op tables -----------------------------------------------------------------------------

_RELU_FNS: set[Any] = {F.relu, torch.relu, "relu"}
_ADD_FNS: set[Any] = {operator.add, torch.add, "add", operator.iadd}
_MUL_FNS: set[Any] = {operator.mul, torch.mul, "mul", operator.imul}
_MATMUL_FNS: set[Any] = {torch.matmul, operator.matmul, torch.bmm, "matmul", "bmm"}
_CAT_FNS: set[Any] = {torch.cat, torch.concat}
# pure data movement on the codes: run the same op on the uint8 tensor
_SHAPE_FNS: set[Any] = {
    torch.flatten, torch.reshape, torch.squeeze, torch.unsqueeze, torch.permute,
    torch.transpose, torch.narrow, torch.repeat_interleave, operator.getitem, torch.detach,
    F.pixel_shuffle, F.pixel_unshuffle, torch.pixel_shuffle, torch.pixel_unshuffle,
    "flatten", "reshape", "view", "squeeze", "unsqueeze", "permute", "transpose", "contiguous",
    "detach", "narrow", "repeat", "repeat_interleave", "squeeze_", "unsqueeze_", "detach_",
}  # fmt: skip
_SHAPE_MODULES: tuple[type[nn.Module], ...] = (
    nn.Flatten,
    nn.Identity,
    nn.Dropout,
    nn.PixelShuffle,
    nn.PixelUnshuffle,
)
_DROPOUT_FNS: set[Any] = {F.dropout}
# elementwise functions of one quantized input: lookup tables
_LUT_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Sigmoid, nn.Tanh,
    nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Mish, nn.Softplus, nn.CELU, nn.SELU,
)  # fmt: skip
_LUT_FNS: set[Any] = {
    F.relu, torch.relu, F.relu6, F.hardtanh, F.hardswish, F.hardsigmoid, torch.sigmoid,
    F.sigmoid, torch.tanh, F.tanh, F.leaky_relu, F.elu, F.gelu, F.silu, F.mish, torch.clamp,
    torch.clip, F.relu_, torch.relu_, F.hardtanh_, F.leaky_relu_, F.elu_,
    "relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "clamp", "clamp_", "clip",
    "hardtanh", "hardtanh_",
}  # fmt: skip
_MAXPOOL_FNS: set[Any] = {F.max_pool2d, torch.max_pool2d}
_AVGPOOL_FNS: set[Any] = {F.avg_pool2d, torch._C._nn.avg_pool2d}
_ADAPTIVE_FNS: set[Any] = {F.adaptive_avg_pool2d, torch._C._nn.adaptive_avg_pool2d}


def lowerable_op_names() -> dict[str, str]:
    """Readable op name → kernel, for the support table (one row per kernel family)."""
    return {
        "Linear / linear (+relu), fused LinearReLU": "kernels.linear",
        "Conv1d / Conv2d (+relu, BN folded), depthwise": "kernels.conv1d / conv2d",
        "dynamic Linear (float in/out, int8 weights)": "kernels.linear_dynamic",
        "add / mul (+relu) of two quantized tensors": "kernels.add / add_relu / mul / mul_relu",
        "matmul of two quantized tensors": "kernels.matmul",
        "MaxPool2d / max_pool2d": "kernels.max_pool2d",
        "AvgPool2d / avg_pool2d": "kernels.avg_pool2d",
        "AdaptiveAvgPool2d / adaptive_avg_pool2d": "kernels.adaptive_avg_pool2d",
        "activations of one input, scalar add/mul (lookup table)": "kernels.apply_lut",
        "cat": "torch.cat on uint8 (+kernels.requantize)",
        "flatten, reshape, view, permute, getitem, ...": "the op on uint8 (+kernels.requantize)",
        "EmbeddingBag / Embedding (8-bit weight-only)": "kernels.embedding_bag",
    }


# --- the pass ------------------------------------------------------------------------------


class _Lowerer:
    def __init__(self, gm: GraphModule, target: str) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.target = target
        self.report = LoweringReport(target)
        self._names: set[str] = {n for n, _ in gm.named_modules()}

    # helpers ---------------------------------------------------------------------------

    def _const(self, node: Any) -> torch.Tensor | None:
        if isinstance(node, Node) and node.op == "get_attr":
            obj: Any = self.gm
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
            if isinstance(obj, torch.Tensor):
                return obj
        return None

    def _static_qparams(self, node: Node) -> QParams | None:
        """Qparams of a uint8 [0, 255] quantize/dequantize node with constant scale/zp."""
        if len(node.args) < 6:
            return None
        s, z = self._const(node.args[1]), self._const(node.args[2])
        if s is None or z is None or s.numel() != 1 or z.numel() != 1:
            return None
        if node.args[3:6] != (0, 255, torch.uint8):
            return None
        return float(s), int(z)

    def _qin(self, arg: Any) -> tuple[Node, QParams] | None:
        """(quantized producer, its qparams) if ``arg`` is a static uint8 dequantize node."""
        if isinstance(arg, Node) and arg.op == "call_function" and arg.target is _DQ:
            qp = self._static_qparams(arg)
            src = arg.args[0]
            if qp is not None and isinstance(src, Node):
                return src, qp
        return None

    def _new_name(self, base: str) -> str:
        base = base.replace(".", "_")
        name, i = base, 0
        while name in self._names or hasattr(self.gm, name):
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name

    def _add_module(self, base: str, mod: lm.LoweredModule, args: tuple[Any, ...],
                    before: Node) -> Node:  # fmt: skip
        name = self._new_name(base)
        self.gm.add_submodule(name, mod)
        with self.graph.inserting_before(before):
            return self.graph.call_module(name, args)

    def _requant(self, value: Node, qp_in: QParams, qp_out: QParams, before: Node) -> Node:
        if qp_in == qp_out:
            return value
        mod = lm.Requantize(self.target, qp_in, qp_out)
        new = self._add_module(f"{value.name}_requant", mod, (value,), before)
        self.report.lowered.append((new.name, mod.kernel))
        return new

    def _submodule(self, node: Node) -> nn.Module | None:
        if node.op != "call_module":
            return None
        return self.gm.get_submodule(str(node.target))

    @staticmethod
    def _fn_key(node: Node) -> Any:
        return node.target if node.op in ("call_function", "call_method") else None

    # main loop -------------------------------------------------------------------------

    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op == "call_function" and node.target is _Q:
                self._visit_quantize(node)
            elif node.op == "call_module":
                self._visit_float_output_module(node)
        self._cleanup()

    def _visit_quantize(self, q: Node) -> None:
        out_qp = self._static_qparams(q)
        src = q.args[0]
        if out_qp is None or not isinstance(src, Node):
            return
        if src.op == "placeholder" or src.op == "get_attr":
            return  # model input: stays a quantize op
        if src.op == "call_function" and src.target is _DQ:
            qin = self._qin(src)
            if qin is not None:  # quantize(dequantize(x)): only the qparams change
                new = self._requant(qin[0], qin[1], out_qp, q)
                q.replace_all_uses_with(new)
                self.report.origins[new.name] = q.name
            return
        if len(src.users) != 1:
            self.report.kept.append((src.name, "its float output has other users"))
            return
        try:
            new = self._lower(src, out_qp, q)
        except _KeepError as why:
            self.report.kept.append((src.name, str(why)))
            return
        q.replace_all_uses_with(new)
        self.report.origins[new.name] = q.name

    def _lower(self, node: Node, out_qp: QParams, before: Node) -> Node:
        mod = self._submodule(node)
        fn = self._fn_key(node)
        if mod is not None:
            weighted = self._weighted(node, mod, out_qp, before)
            if weighted is not None:
                return weighted
            if isinstance(mod, nn.ReLU):
                fused = self._fused_binary_relu(node, out_qp, before)
                if fused is not None:
                    return fused
            if isinstance(mod, _LUT_MODULES):
                return self._lut(node, lambda t: mod(t), type(mod).__name__, out_qp, before)
            if isinstance(mod, nn.MaxPool2d):
                return self._maxpool(node, mod.kernel_size, mod.stride, mod.padding,
                                     mod.dilation, mod.ceil_mode, out_qp, before)  # fmt: skip
            if isinstance(mod, nn.AvgPool2d):
                return self._avgpool(node, mod.kernel_size, mod.stride, mod.padding,
                                     mod.ceil_mode, mod.count_include_pad, mod.divisor_override,
                                     out_qp, before)  # fmt: skip
            if isinstance(mod, nn.AdaptiveAvgPool2d):
                return self._adaptive(node, mod.output_size, out_qp, before)
            if isinstance(mod, _SHAPE_MODULES):
                return self._shape(node, out_qp, before)
            raise _KeepError(f"no kernel for module {type(mod).__name__}")
        if fn is None:
            raise _KeepError(f"{node.op} nodes are not lowered")
        if fn in _MATMUL_FNS:
            return self._binary(node, "matmul", out_qp, before)
        if fn in _ADD_FNS or fn in _MUL_FNS:
            return self._binary(node, "add" if fn in _ADD_FNS else "mul", out_qp, before)
        if fn in _RELU_FNS:
            fused = self._fused_binary_relu(node, out_qp, before)
            if fused is not None:
                return fused
        if fn in _LUT_FNS:
            return self._lut_fn(node, out_qp, before)
        if fn in _MAXPOOL_FNS:
            a = _fn_args(node, ["input", "kernel_size", "stride", "padding", "dilation",
                                "ceil_mode", "return_indices"],
                         [None, None, None, 0, 1, False, False])  # fmt: skip
            if a["return_indices"]:
                raise _KeepError("max_pool2d with return_indices=True")
            stride = a["stride"] if a["stride"] not in (None, []) else a["kernel_size"]
            return self._maxpool(node, a["kernel_size"], stride, a["padding"], a["dilation"],
                                 a["ceil_mode"], out_qp, before)  # fmt: skip
        if fn in _AVGPOOL_FNS:
            a = _fn_args(node, ["input", "kernel_size", "stride", "padding", "ceil_mode",
                                "count_include_pad", "divisor_override"],
                         [None, None, None, 0, False, True, None])  # fmt: skip
            stride = a["stride"] if a["stride"] not in (None, []) else a["kernel_size"]
            return self._avgpool(node, a["kernel_size"], stride, a["padding"], a["ceil_mode"],
                                 a["count_include_pad"], a["divisor_override"], out_qp,
                                 before)  # fmt: skip
        if fn in _ADAPTIVE_FNS:
            a = _fn_args(node, ["input", "output_size"], [None, None])
            return self._adaptive(node, a["output_size"], out_qp, before)
        if fn in _CAT_FNS:
            return self._cat(node, out_qp, before)
        if fn in _SHAPE_FNS or fn in _DROPOUT_FNS:
            return self._shape(node, out_qp, before)
        raise _KeepError(f"no kernel for {getattr(fn, '__name__', fn)}")

    # weighted modules --------------------------------------------------------------------

    def _weighted(self, node: Node, mod: nn.Module, out_qp: QParams, before: Node) -> Node | None:
        relu = False
        inner = mod
        if isinstance(mod, (nni.LinearReLU, nni.ConvReLU1d, nni.ConvReLU2d)):
            inner, relu = mod[0], True
            if not isinstance(mod[1], nn.ReLU) and mod[1] not in (F.relu, torch.relu):
                raise _KeepError(f"fused activation {type(mod[1]).__name__} is not relu")
        if not isinstance(inner, (nnqr.Linear, nnqr.Conv1d, nnqr.Conv2d)):
            if isinstance(inner, (nn.Linear, nn.Conv1d, nn.Conv2d)) and inner is not mod:
                raise _KeepError("fused module holds a float (not reference) weighted module")
            return None
        if len(node.args) != 1 or node.kwargs:
            raise _KeepError("weighted module called with extra arguments")
        qin = self._qin(node.args[0])
        if qin is None:
            raise _KeepError("input is not a static uint8 quantized value")
        w, ws, wz = _int8_weight(inner, node.name)
        bias = inner.bias
        if isinstance(inner, nnqr.Linear):
            new_mod: lm.LoweredModule = lm.QuantizedLinear(
                w, ws, wz, bias, self.target, qin[1], out_qp, relu=relu
            )
        else:
            assert isinstance(inner, (nnqr.Conv1d, nnqr.Conv2d))
            if inner.padding_mode != "zeros" or isinstance(inner.padding, str):
                raise _KeepError(
                    f"conv padding={inner.padding!r}, padding_mode={inner.padding_mode!r} "
                    "(kernels take explicit zero padding)"
                )
            new_mod = lm.QuantizedConv(
                w, ws, wz, bias, self.target, qin[1], out_qp,
                stride=tuple(inner.stride), padding=tuple(int(p) for p in inner.padding),
                dilation=tuple(inner.dilation), groups=inner.groups, relu=relu,
            )  # fmt: skip
        new = self._add_module(f"{node.target}", new_mod, (qin[0],), before)
        self.report.lowered.append((new.name, f"{new_mod.kernel} ({self.target})"))
        return new

    def _visit_float_output_module(self, node: Node) -> None:
        mod = self._submodule(node)
        if isinstance(mod, nnqr.Linear):
            self._dynamic_linear(node, mod)
        elif isinstance(mod, (nnqr.EmbeddingBag, nnqr.Embedding)):
            self._embedding(node, mod)

    def _dynamic_linear(self, node: Node, mod: nnqr.Linear) -> None:
        if len(node.args) != 1 or node.kwargs:
            return
        dq = node.args[0]
        if not (isinstance(dq, Node) and dq.op == "call_function" and dq.target is _DQ):
            return
        if self._static_qparams(dq) is not None:
            return  # static: handled from its quantize node
        q = dq.args[0]
        if not (isinstance(q, Node) and q.op == "call_function" and q.target is _Q):
            return
        x = q.args[0]
        if not isinstance(x, Node):
            return
        try:
            w, ws, wz = _int8_weight(mod, node.name)
        except _KeepError as why:
            self.report.kept.append((node.name, str(why)))
            return
        new_mod = lm.QuantizedDynamicLinear(w, ws, wz, mod.bias, self.target, None, None)
        new = self._add_module(f"{node.target}_dynamic", new_mod, (x,), node)
        node.replace_all_uses_with(new)
        self.report.origins[new.name] = node.name
        self.report.lowered.append((new.name, f"{new_mod.kernel} ({self.target})"))

    def _embedding(self, node: Node, mod: nnqr.EmbeddingBag | nnqr.Embedding) -> None:
        qw = mod.get_quantized_weight()
        why = ""
        if (
            qw.dtype != torch.uint8
            or qw.axis != 0
            or qw.zero_point.dtype.is_floating_point is False
        ):
            why = f"weight {qw.dtype} {qw.qscheme} (8-bit per-row float-qparams only)"
        elif mod.max_norm is not None or mod.padding_idx is not None:
            why = "max_norm / padding_idx are not supported by kernels.embedding_bag"
        elif isinstance(mod, nnqr.EmbeddingBag) and mod.mode not in ("sum", "mean", "max"):
            why = f"mode {mod.mode!r}"
        if why:
            self.report.kept.append((node.name, why))
            return
        scale = qw.scale.to(torch.float32)
        row_bias = -qw.zero_point.to(torch.float32) * scale
        if isinstance(mod, nnqr.EmbeddingBag):
            new_mod: lm.LoweredModule = lm.QuantizedEmbeddingBag(
                qw.values, scale, row_bias, mod.mode, mod.include_last_offset, self.target
            )
        else:
            new_mod = lm.QuantizedEmbedding(qw.values, scale, row_bias, self.target)
        name = self._new_name(f"{node.target}_lowered")
        self.gm.add_submodule(name, new_mod)
        with self.graph.inserting_before(node):
            new = self.graph.call_module(name, node.args, node.kwargs)
        node.replace_all_uses_with(new)
        self.report.origins[new.name] = node.name
        self.report.lowered.append((new.name, f"{new_mod.kernel} ({self.target})"))

    # elementwise / pools / shapes -----------------------------------------------------------

    def _single_input(self, node: Node, sizes_ok: bool = False) -> tuple[Node, QParams]:
        """The one quantized input (first argument); other node arguments are refused unless
        ``sizes_ok`` (shape ops take sizes computed in the graph, e.g. ``x.shape[0]``)."""
        first = node.args[0] if node.args else node.kwargs.get("input")
        qin = self._qin(first)
        if qin is None:
            raise _KeepError("input is not a static uint8 quantized value")
        for a in _flat_args(node)[1:]:
            for n in _nodes_in(a):
                if not sizes_ok or (n.op == "call_function" and n.target is _DQ):
                    raise _KeepError("more than one tensor input")
        return qin

    def _lut(self, node: Node, fn: Callable[[torch.Tensor], torch.Tensor], what: str,
             out_qp: QParams, before: Node) -> Node:  # fmt: skip
        if len(node.args) != 1 or node.kwargs:
            raise _KeepError("module called with extra arguments")
        x, in_qp = self._single_input(node)
        return self._emit_lut(node, x, fn, what, in_qp, out_qp, before)

    def _emit_lut(self, node: Node, x: Node, fn: Callable[[torch.Tensor], torch.Tensor],
                  what: str, in_qp: QParams, out_qp: QParams, before: Node) -> Node:  # fmt: skip
        def table_fn(v: Any) -> Any:
            with torch.no_grad():
                return fn(torch.from_numpy(np.array(v, dtype=np.float32))).numpy()

        table = K.build_lut(table_fn, in_qp[0], in_qp[1], out_qp[0], out_qp[1])
        mod = lm.QuantizedLookupTable(torch.from_numpy(np.array(table)), what, self.target,
                                      in_qp, out_qp)  # fmt: skip
        new = self._add_module(f"{node.name}_lut", mod, (x,), before)
        self.report.lowered.append((new.name, f"{mod.kernel} ({what})"))
        return new

    def _lut_fn(self, node: Node, out_qp: QParams, before: Node) -> Node:
        x, in_qp = self._single_input(node)
        target = node.target
        rest, kwargs = node.args[1:], dict(node.kwargs)
        kwargs.pop("inplace", None)
        if node.op == "call_method":
            name = str(target).rstrip("_")
            return self._emit_lut(
                node, x, lambda t: getattr(t, name)(*rest, **kwargs), name, in_qp, out_qp,
                before,
            )  # fmt: skip
        f: Any = target
        what = getattr(f, "__name__", str(f))
        return self._emit_lut(node, x, lambda t: f(t.clone(), *rest, **kwargs), what, in_qp,
                              out_qp, before)  # fmt: skip

    def _binary(self, node: Node, kind: str, out_qp: QParams, before: Node, relu: bool = False
                ) -> Node:  # fmt: skip
        if node.kwargs and set(node.kwargs) - {"other", "input"}:
            raise _KeepError(f"{kind} with keyword arguments {sorted(node.kwargs)}")
        args = list(node.args) + [node.kwargs[k] for k in ("input", "other") if k in node.kwargs]
        if len(args) != 2:
            raise _KeepError(f"{kind} with {len(args)} arguments")
        qa, qb = self._qin(args[0]), self._qin(args[1])
        if qa is not None and qb is not None:
            mod: lm.LoweredModule
            if kind == "matmul":
                mod = lm.QuantizedMatmul(self.target, qa[1], qb[1], out_qp)
            else:
                full = f"{kind}_relu" if relu else kind
                mod = lm.QuantizedBinary(full, self.target, qa[1], qb[1], out_qp)
            new = self._add_module(f"{node.name}_q", mod, (qa[0], qb[0]), before)
            self.report.lowered.append((new.name, mod.kernel))
            return new
        if kind == "matmul":
            raise _KeepError("matmul needs two static uint8 quantized inputs")
        # one quantized input and a Python scalar: an elementwise function, as a table
        scalar_i = 1 if qa is not None else 0
        qin = qa if qa is not None else qb
        c = args[scalar_i]
        if qin is None or not isinstance(c, (int, float)) or isinstance(c, bool):
            raise _KeepError(f"{kind} operands are not two quantized tensors or tensor and scalar")
        op = operator.add if kind == "add" else operator.mul

        def fn(t: torch.Tensor) -> torch.Tensor:
            y = op(t, c)
            return torch.relu(y) if relu else y

        return self._emit_lut(node, qin[0], fn, f"{kind} {c!r}" + (" + relu" if relu else ""),
                              qin[1], out_qp, before)  # fmt: skip

    def _fused_binary_relu(self, node: Node, out_qp: QParams, before: Node) -> Node | None:
        """relu(add(a, b)) / relu(mul(a, b)) in the reference graph → add_relu / mul_relu."""
        inner = node.args[0] if node.args else None
        if not isinstance(inner, Node) or len(inner.users) != 1:
            return None
        key = self._fn_key(inner)
        if key in _ADD_FNS:
            kind = "add"
        elif key in _MUL_FNS:
            kind = "mul"
        else:
            return None
        return self._binary(inner, kind, out_qp, before, relu=True)

    def _maxpool(self, node: Node, ks: Any, stride: Any, padding: Any, dilation: Any,
                 ceil_mode: bool, out_qp: QParams, before: Node) -> Node:  # fmt: skip
        x, in_qp = self._single_input(node)
        mod = lm.QuantizedMaxPool2d(_pair(ks), _pair(stride if stride else ks), _pair(padding),
                                    _pair(dilation), bool(ceil_mode), self.target)  # fmt: skip
        new = self._add_module(f"{node.name}_q", mod, (x,), before)
        self.report.lowered.append((new.name, mod.kernel))
        return self._requant(new, in_qp, out_qp, before)

    def _avgpool(self, node: Node, ks: Any, stride: Any, padding: Any, ceil_mode: bool,
                 count_include_pad: bool, divisor_override: Any, out_qp: QParams,
                 before: Node) -> Node:  # fmt: skip
        x, in_qp = self._single_input(node)
        mod = lm.QuantizedAvgPool2d(_pair(ks), _pair(stride if stride else ks), _pair(padding),
                                    bool(ceil_mode), bool(count_include_pad), divisor_override,
                                    self.target, in_qp, out_qp)  # fmt: skip
        new = self._add_module(f"{node.name}_q", mod, (x,), before)
        self.report.lowered.append((new.name, mod.kernel))
        return new

    def _adaptive(self, node: Node, output_size: Any, out_qp: QParams, before: Node) -> Node:
        x, in_qp = self._single_input(node)
        size = _pair(output_size)
        if any(s is None for s in size):
            raise _KeepError("adaptive pool output size with None")
        mod = lm.QuantizedAdaptiveAvgPool2d(size, self.target)
        new = self._add_module(f"{node.name}_q", mod, (x,), before)
        self.report.lowered.append((new.name, mod.kernel))
        return self._requant(new, in_qp, out_qp, before)

    def _cat(self, node: Node, out_qp: QParams, before: Node) -> Node:
        tensors = node.args[0] if node.args else node.kwargs.get("tensors")
        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise _KeepError("cat of a non-literal list")
        new_inputs = []
        for t in tensors:
            qin = self._qin(t)
            if qin is None:
                raise _KeepError("cat input is not a static uint8 quantized value")
            new_inputs.append(self._requant(qin[0], qin[1], out_qp, before))
        with self.graph.inserting_before(before):
            new = self.graph.call_function(
                node.target,  # type: ignore[arg-type]
                (new_inputs, *node.args[1:]),
                {k: v for k, v in node.kwargs.items() if k != "tensors"},
            )
        self.report.lowered.append((new.name, "torch.cat on uint8 codes"))
        return new

    def _shape(self, node: Node, out_qp: QParams, before: Node) -> Node:
        x, in_qp = self._single_input(node, sizes_ok=True)
        dq = node.args[0]
        assert isinstance(dq, Node)
        with self.graph.inserting_before(before):
            new = self.graph.create_node(
                node.op, node.target, (x, *node.args[1:]), dict(node.kwargs)
            )
        what = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        self.report.lowered.append((new.name, f"{what} on uint8 codes"))
        return self._requant(new, in_qp, out_qp, before)

    # cleanup -----------------------------------------------------------------------------

    def _boundaries(self) -> None:
        """Remaining static uint8 quantize/dequantize ops → kernel-backed modules (the
        reference ops are exact but slow); ones on dynamic qparams stay as they are."""
        for node in list(self.graph.nodes):
            if node.op != "call_function" or node.target not in (_Q, _DQ) or not node.users:
                continue
            qp = self._static_qparams(node)
            if qp is None or not isinstance(node.args[0], Node):
                continue
            if node.target is _Q:
                mod: lm.LoweredModule = lm.Quantize(self.target, None, qp)
                base = f"{node.args[0].name}_quantize"
            else:
                mod = lm.Dequantize(self.target, qp, None)
                base = f"{node.args[0].name}_dequantize"
            new = self._add_module(base, mod, (node.args[0],), node)
            node.replace_all_uses_with(new)
            self.report.origins[new.name] = node.name

    def _cleanup(self) -> None:
        before = {n.target for n in self.graph.nodes if n.op == "get_attr"}
        self.graph.eliminate_dead_code()  # first: dequantizes read only by replaced ops go
        self._boundaries()
        self.graph.eliminate_dead_code()
        after = {n.target for n in self.graph.nodes if n.op == "get_attr"}
        for t in before - after:
            path = str(t)
            if "." not in path and hasattr(self.gm, path):
                delattr(self.gm, path)
        self.gm.delete_all_unused_submodules()
        self.graph.lint()
        self.gm.recompile()


class _KeepError(Exception):
    """Raised inside the pass: this node stays in its reference form (message says why)."""


def _flat_args(node: Node) -> list[Any]:
    return [*node.args, *node.kwargs.values()]


def _nodes_in(value: Any) -> list[Node]:
    if isinstance(value, Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _nodes_in(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _nodes_in(v)]
    return []


def _fn_args(node: Node, names: list[str], defaults: list[Any]) -> dict[str, Any]:
    out = dict(zip(names, defaults, strict=True))
    for name, value in zip(names, node.args, strict=False):
        out[name] = value
    for k, v in node.kwargs.items():
        if k not in out:
            raise _KeepError(f"unsupported keyword argument {k!r}")
        out[k] = v
    return out


def _pair(v: Any) -> tuple[Any, Any]:
    if isinstance(v, (list, tuple)):
        if len(v) == 1:
            return (v[0], v[0])
        if len(v) != 2:
            raise _KeepError(f"expected 1 or 2 values, got {v!r}")
        return (v[0], v[1])
    return (v, v)


def _int8_weight(mod: nn.Module, where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    assert isinstance(mod, nnqr.ReferenceQuantizedModule)
    qw = mod.get_quantized_weight()
    if qw.dtype != torch.int8:
        raise _KeepError(f"weight dtype {qw.dtype} (kernels take int8 weights)")
    if qw.axis not in (None, 0):
        raise _KeepError(f"per-channel weight axis {qw.axis} (kernels take axis 0)")
    if qw.zero_point.dtype.is_floating_point:
        raise _KeepError("float weight zero points")
    zp = qw.zero_point.reshape(-1)
    if bool(((zp < -128) | (zp > 127)).any()):
        raise _KeepError("weight zero point outside [-128, 127]")
    return qw.values, qw.scale.reshape(-1), zp


def lower_to_kernels(reference_model: GraphModule, target: str) -> GraphModule:
    """Lower ``reference_model`` in place for kernel ``target``; returns it (report in meta)."""
    if not isinstance(reference_model, GraphModule):
        raise LoweringError(
            f"lower: expected the GraphModule returned by convert_to_reference_fx, got "
            f"{type(reference_model).__name__}"
        )
    lowerer = _Lowerer(reference_model, target)
    lowerer.run()
    reference_model.meta[_REPORT_KEY] = lowerer.report
    return reference_model
