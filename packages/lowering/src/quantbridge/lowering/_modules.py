"""Lowered modules: what the nodes of a lowered graph call.

Every module takes and returns plain ``torch.uint8`` tensors (dynamic linear and embedding_bag:
float32). Quantization parameters are buffers (``input_scale``/``input_zero_point``,
``scale``/``zero_point`` for the output, float64/int64 scalars) mirrored into Python numbers.

Each module runs one op object (``_prepared``: a ``kernels.Prepared*`` call or one of
``_lowered_ops``), built in ``_sync`` from its buffers and settings and rebuilt whenever they
change. ``forward_arrays``, the eager ``forward`` and, while torch.export traces, the module's
custom op (``_custom_ops``, which builds the same object) all call it.

How weights are stored: the int8 weight, its scale/zero point (per tensor or per output
channel) and the float bias are buffers, so ``state_dict()`` holds only plain tensors and loads
with ``torch.load(weights_only=True)``. The packed layout (target specific, padded) is never
saved: it is built once when the module is created and rebuilt after ``load_state_dict`` and
unpickling. ``load_state_dict`` casts nothing: an entry of another dtype or shape, or a value
the kernels cannot use, raises a LoweringError naming its key (``_state_dict.py``).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from quantbridge import kernels as K
from quantbridge.lowering import _custom_ops as ops
from quantbridge.lowering import _lowered_ops as lowered
from quantbridge.lowering._custom_ops import is_tracing
from quantbridge.lowering._errors import LoweringError
from quantbridge.lowering._state_dict import check_state_entry

__all__ = [
    "LoweredModule",
    "WeightOnlyLinear",
    "QuantizedAdaptiveAvgPool2d",
    "QuantizedAvgPool2d",
    "QuantizedBinary",
    "QuantizedConv",
    "QuantizedConvAdd",
    "QuantizedDynamicLinear",
    "QuantizedLinearFloat",
    "FloatLayerNorm",
    "FloatSoftmax",
    "QuantizedEmbedding",
    "QuantizedEmbeddingBag",
    "QuantizedLinear",
    "QuantizedLookupTable",
    "QuantizedMatmul",
    "QuantizedMaxPool2d",
    "Dequantize",
    "Quantize",
    "Requantize",
]


def _as_tensor(value: Any) -> torch.Tensor:
    """Custom ops are typed loosely by torch.library; their results are tensors."""
    return value  # type: ignore[no-any-return]


def _qp(qparams: tuple[float, int]) -> str:
    return f"({qparams[0]:.6g}, {qparams[1]})"


class LoweredModule(nn.Module):
    """Base: target, kernel name, input/output qparam buffers and their Python mirrors."""

    kernel: str = ""
    # how ``forward_arrays`` takes its inputs (``_lowered_ops.as_array``); None: the module
    # has no array form
    array_input: str | None = None
    # mirrors of the second input's buffers, set by two-input modules' _sync
    _other_scale: float
    _other_zero_point: int

    def __init__(
        self,
        target: str,
        in_qparams: tuple[float, int] | None,
        out_qparams: tuple[float, int] | None,
    ) -> None:
        if "_buffers" not in self.__dict__:  # subclasses may have registered buffers already
            super().__init__()
        self.target = target
        for prefix, qp in (("input_", in_qparams), ("", out_qparams)):
            if qp is not None:
                self.register_buffer(prefix + "scale", torch.tensor(qp[0], dtype=torch.float64))
                self.register_buffer(prefix + "zero_point", torch.tensor(qp[1], dtype=torch.int64))
        self._sync()

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Check this module's entries (exact dtype, shape, kernel-safe values), load, repack.

        Repacking here rather than in a post-load hook keeps each module consistent even
        when a later module's entry is refused, and leaves no closure that pickle refuses.
        """
        for name, current in self._buffers.items():
            if current is not None and prefix + name in state_dict:
                check_state_entry(prefix + name, name, state_dict[prefix + name], current)
        super()._load_from_state_dict(state_dict, prefix, *args)
        self._sync()

    def __getstate__(self) -> dict[str, Any]:
        # the packed layout is target specific and derived: rebuilt by __setstate__
        state: dict[str, Any] = super().__getstate__()  # type: ignore[no-untyped-call]
        state.pop("_packed", None)
        state.pop("_prepared", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        if not K.target_supported(self.target):
            # saved on a CPU with a better target: every target computes the same bytes, so
            # repacking for the best one here loses nothing
            best = K.best_target()
            warnings.warn(
                f"{type(self).__name__}: lowered for kernel target {self.target!r}, which this "
                f"CPU cannot run; repacked for {best!r} (same results)",
                RuntimeWarning,
                stacklevel=2,
            )
            self.target = best
        self._sync()

    # the op object (a kernels.Prepared* call or one of _lowered_ops) every path of the
    # module calls: built by _sync from the buffers and settings, not pickled
    _prepared: Any = None
    # the settings (plain attributes) the op object is built from: assigning one after
    # construction rebuilds it, so the op's calls never check them
    _settings: tuple[str, ...] = ("target",)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in self._settings and "_prepared" in self.__dict__:
            self._sync()

    def _sync(self) -> None:
        """Refresh the Python mirrors of the buffers; subclasses then build their op object
        (packing weights) from them."""
        self._prepared = None
        b = dict(self.named_buffers(recurse=False))
        self._in_scale = float(b["input_scale"]) if "input_scale" in b else 1.0
        self._in_zero_point = int(b["input_zero_point"]) if "input_zero_point" in b else 0
        self._out_scale = float(b["scale"]) if "scale" in b else 1.0
        self._out_zero_point = int(b["zero_point"]) if "zero_point" in b else 0

    @property
    def input_qparams(self) -> tuple[float, int]:
        """(scale, zero point) of the first input's codes ((1.0, 0) when it has none)."""
        return (self._in_scale, self._in_zero_point)

    @property
    def output_qparams(self) -> tuple[float, int]:
        """(scale, zero point) of the output codes ((1.0, 0) for a float output)."""
        return (self._out_scale, self._out_zero_point)

    @property
    def other_qparams(self) -> tuple[float, int]:
        """(scale, zero point) of the second input's codes (two-input modules only)."""
        return (self._other_scale, self._other_zero_point)

    def _qparams_repr(self) -> str:
        b = dict(self.named_buffers(recurse=False))
        parts = []
        if "input_scale" in b:
            parts.append(f"in=({self._in_scale:.6g}, {self._in_zero_point})")
        if "scale" in b:
            parts.append(f"out=({self._out_scale:.6g}, {self._out_zero_point})")
        return ", ".join(parts)

    def extra_repr(self) -> str:
        details = self._details()
        qp = self._qparams_repr()
        items = [f"kernel={self.kernel}", f"target={self.target}"]
        items += [s for s in (details, qp) if s]
        return ", ".join(items)

    def _details(self) -> str:
        return ""

    def forward_arrays(self, *arrays: Any) -> Any:
        """The eager forward on numpy arrays (in the form ``array_input`` names), returning
        the array the eager forward wraps as a tensor: a lowered model passes arrays from one
        such module to the next (``lowering._array_forward``)."""
        raise NotImplementedError(f"{type(self).__name__} has no array form")

    def _eager(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The eager forward: ``forward_arrays`` between array views and a tensor."""
        how = self.array_input
        assert how is not None
        return torch.from_numpy(self.forward_arrays(*(lowered.as_array(t, how) for t in inputs)))


_W = TypeVar("_W", bound="_WeightedBase")


class _WeightedBase(LoweredModule):
    """Holds int8 weight, weight qparams and bias as buffers; packs on creation and load."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_zero_point: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_zero_point: torch.Tensor,
        bias: torch.Tensor | None,
        target: str,
        in_qparams: tuple[float, int] | None,
        out_qparams: tuple[float, int] | None,
    ) -> None:
        nn.Module.__init__(self)
        self.register_buffer("weight", weight.detach().to(torch.int8).contiguous())
        self.register_buffer(
            "weight_scale", weight_scale.detach().to(torch.float64).reshape(-1).contiguous()
        )
        self.register_buffer(
            "weight_zero_point",
            weight_zero_point.detach().to(torch.int64).reshape(-1).contiguous(),
        )
        self.register_buffer(
            "bias", None if bias is None else bias.detach().to(torch.float32).contiguous()
        )
        LoweredModule.__init__(self, target, in_qparams, out_qparams)

    # an activation fused into the kernel's epilogue (a lookup table on the output codes):
    # its name, and the table / output qparams as buffers, set by ``with_activation``
    activation: str | None = None
    _act_table: Any = None
    _act_qparams: tuple[float, int] | None = None

    def with_activation(
        self: _W, table: torch.Tensor, what: str, out_qparams: tuple[float, int]
    ) -> _W:
        """A copy of this module that runs ``table`` (uint8[256]:
        ``quantize(act(dequantize(q)))`` from this module's output qparams to
        ``out_qparams``) on the output codes inside the kernel, and returns the activation's
        codes: exactly the two modules it replaces. This module is left as it is."""
        if self.activation is not None:
            raise LoweringError(f"{type(self).__name__} already runs {self.activation!r}")
        fused = copy.deepcopy(self)
        fused.register_buffer("activation_table", table.detach().to(torch.uint8).contiguous())
        fused.register_buffer("activation_scale", torch.tensor(out_qparams[0], dtype=torch.float64))
        fused.register_buffer(
            "activation_zero_point", torch.tensor(out_qparams[1], dtype=torch.int64)
        )
        fused.activation = what
        fused._sync()
        return fused

    def _sync_activation(self) -> None:
        b = dict(self.named_buffers(recurse=False))
        if "activation_table" in b:
            self._act_table = lowered.numpy_view(b["activation_table"])
            self._act_qparams = (
                float(b["activation_scale"]),
                int(b["activation_zero_point"]),
            )

    def _activation_output(self, out: torch.Tensor, traced: bool) -> torch.Tensor:
        """The fused table on ``out`` when tracing (torch.export sees the lookup-table op);
        in eager mode the kernel applied it already."""
        if traced and self.activation is not None:
            return _as_tensor(ops.lut_op(out, self.activation_table, self.target))
        return out

    @property
    def output_qparams(self) -> tuple[float, int]:
        """(scale, zero point) of the output codes: the fused activation's if any."""
        if self._act_qparams is not None:
            return self._act_qparams
        return (self._out_scale, self._out_zero_point)

    def _activation_details(self) -> str:
        if self.activation is None:
            return ""
        return f", then {self.activation} (lookup table in the epilogue)"

    def _qparams_repr(self) -> str:
        base = super()._qparams_repr()
        if self._act_qparams is None:
            return base
        return f"{base}, activation_out={_qp(self._act_qparams)}"

    def _pack_linear(self) -> K.PackedLinearWeight:
        return lowered.pack_linear(
            self.weight, self.weight_scale, self.weight_zero_point, self.bias, self.target
        )

    @property
    def _packed(self) -> Any:
        """The packed weight the op object holds."""
        return self._prepared.packed

    def _pack_details(self) -> str:
        per = "per_channel" if self.weight_scale.numel() > 1 else "per_tensor"
        return f"weight={tuple(self.weight.shape)} int8 {per}, packed once"


class QuantizedLinear(_WeightedBase):
    """uint8 ``[..., K]`` → uint8 ``[..., N]``: ``kernels.linear`` (relu fused if asked)."""

    kernel = "kernels.linear"
    array_input = "c"
    _settings = (*_WeightedBase._settings, "relu")

    def __init__(self, *args: Any, relu: bool = False, **kwargs: Any) -> None:
        self.relu = relu
        super().__init__(*args, **kwargs)

    def _sync(self) -> None:
        super()._sync()
        self._sync_activation()
        self._prepared = lowered.LinearOp(
            self._pack_linear(), self.input_qparams, (self._out_scale, self._out_zero_point),
            relu=self.relu, lut=self._act_table,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_tracing(x):
            return self._activation_output(_as_tensor(ops.linear_op(
                x, self.weight, self.weight_scale, self.weight_zero_point, self.bias,
                self._in_scale, self._in_zero_point, self._out_scale, self._out_zero_point,
                self.relu, self.target,
            )), True)  # fmt: skip
        return self._eager(x)

    def forward_arrays(self, *arrays: Any) -> Any:
        return self._prepared(arrays[0])

    def _details(self) -> str:
        return f"relu={self.relu}{self._activation_details()}, {self._pack_details()}"


class QuantizedLinearFloat(_WeightedBase):
    """uint8 ``[..., K]`` → float32 ``[..., N]``: ``kernels.linear_float``, no output
    quantization (the layer's consumer runs in float). ``activation`` (``"none"``,
    ``"relu"``, ``"gelu"``, ``"gelu_tanh"``) runs in the kernel's float epilogue.

    With float columns (an outlier split, ``add_float_columns``) it takes ``(codes, x)`` and
    also adds ``x[..., channels] @ side_weight.T``, before the activation. With
    ``out_qparams`` (a quantize after it fused) it returns ``(float result, its codes)``.
    """

    kernel = "kernels.linear_float"
    array_input = "c"
    _settings = (*_WeightedBase._settings, "epilogue")

    side_channels: torch.Tensor | None
    side_weight: torch.Tensor | None

    def __init__(self, *args: Any, activation: str = "none", **kwargs: Any) -> None:
        self.epilogue = activation
        super().__init__(*args, **kwargs)
        self.register_buffer("side_channels", None)
        self.register_buffer("side_weight", None)

    def add_float_columns(self, channels: torch.Tensor, weight: torch.Tensor) -> None:
        """Also add ``x[..., channels] @ weight.T`` in float, ``x`` the float value the codes
        came from (an outlier split's float columns): ``forward(codes, x)``."""
        self.register_buffer("side_channels", channels.detach().to(torch.int64).contiguous())
        self.register_buffer("side_weight", weight.detach().to(torch.float32).contiguous())
        self._sync()

    def _sync(self) -> None:
        super()._sync()
        side, channels = getattr(self, "side_weight", None), getattr(self, "side_channels", None)
        columns = None
        if side is not None and channels is not None:
            columns = K.FloatColumns(lowered.numpy_view(channels), lowered.numpy_view(side))
        names = dict(self.named_buffers(recurse=False))
        self._codes_qp = self.output_qparams if "scale" in names else None
        self._prepared = lowered.LinearFloatOp(
            self._pack_linear(), self.input_qparams, activation=self.epilogue, columns=columns,
            codes_qparams=self._codes_qp,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, floats: torch.Tensor | None = None) -> Any:
        if is_tracing(x) if floats is None else is_tracing(x, floats):
            codes_qp = None if self._codes_qp is None else [float(v) for v in self._codes_qp]
            with_columns = floats is not None and self._prepared.columns is not None
            out, codes = ops.linear_float_op(
                x, self.weight, self.weight_scale, self.weight_zero_point, self.bias,
                self._in_scale, self._in_zero_point, self.target, self.epilogue,
                floats if with_columns else None,
                self.side_channels if with_columns else None,
                self.side_weight if with_columns else None,
                codes_qp,
            )  # fmt: skip
            return out if self._codes_qp is None else (out, codes)
        arrays = (x,) if floats is None else (x, floats)
        got = self.forward_arrays(*(lowered.as_array(t, "c") for t in arrays))
        if self._codes_qp is None:
            return torch.from_numpy(got)
        return torch.from_numpy(got[0]), torch.from_numpy(got[1])

    def forward_arrays(self, *arrays: Any) -> Any:
        return self._prepared(*arrays)

    def _details(self) -> str:
        extra = "" if self.epilogue == "none" else f"activation={self.epilogue}, "
        if self.side_channels is not None:
            extra += f"float columns {self.side_channels.tolist()}, "
        if self._codes_qp is not None:
            extra += f"also returns codes {_qp(self._codes_qp)}, "
        return f"{extra}float output, {self._pack_details()}"


class QuantizedDynamicLinear(_WeightedBase):
    """float32 ``[..., K]`` → float32: per-call uint8 quantization of x (``linear_dynamic``).

    ``activation`` (``"none"``, ``"relu"``, ``"gelu"``, ``"gelu_tanh"``) runs in the kernel's
    float epilogue; ``per_row`` quantizes each row (token) with its own scale.
    """

    kernel = "kernels.linear_dynamic"
    _settings = (*_WeightedBase._settings, "epilogue", "per_row")

    def __init__(
        self, *args: Any, activation: str = "none", per_row: bool = False, **kwargs: Any
    ) -> None:
        # (not ``activation``: on the static modules that names a fused lookup table)
        self.epilogue = activation
        self.per_row = per_row
        super().__init__(*args, **kwargs)

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("epilogue", "none")  # pickles made before these options existed
        state.setdefault("per_row", False)
        super().__setstate__(state)

    def _sync(self) -> None:
        super()._sync()
        self._prepared = lowered.DynamicLinearOp(
            self._pack_linear(), activation=self.epilogue, per_row=self.per_row
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_tracing(x):
            return _as_tensor(ops.linear_dynamic_op(
                x, self.weight, self.weight_scale, self.weight_zero_point, self.bias, self.target,
                self.epilogue, self.per_row,
            ))  # fmt: skip
        if x.dtype != torch.float32:
            x = x.to(torch.float32)
        return torch.from_numpy(self._prepared(lowered.numpy_view(x)))

    def _details(self) -> str:
        extra = "" if self.epilogue == "none" else f"activation={self.epilogue}, "
        rows = "per_row, " if self.per_row else ""
        return f"{rows}{extra}{self._pack_details()}"


class WeightOnlyLinear(LoweredModule):
    """float32 ``[..., K]`` → float32 ``[..., N]`` with a per-group int4 / int8 weight
    (``kernels.linear_weight_only``: each row of x quantized per group to int8 inside the
    call, integer dot products, one scale per group).

    Buffers: the kernels' target-independent packed form (``PackedGroupWeight.to_arrays``):
    ``weight_codes`` uint8 ``[N, K * bits / 8]`` (4-bit: two codes a byte), ``weight_scale``
    float32 ``[N, K / group_size]``, ``group_zero_point`` uint8 (asymmetric weights only),
    ``bias``; ``bits`` and ``group_size`` are extra state. Inputs the kernel does not take
    (not float32, needing gradients, traced) run ``F.linear`` on the dequantized weight.
    """

    kernel = "kernels.linear_weight_only"
    weight_codes: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None
    # a packed weight already made from the buffers _sync is about to read (construction,
    # or the check of a state dict being loaded): _sync takes it instead of packing again
    _packed_ahead: K.PackedGroupWeight | None = None

    def __init__(self, packed: K.PackedGroupWeight, bias: torch.Tensor | None) -> None:
        nn.Module.__init__(self)
        arrays = packed.to_arrays()
        self.bits, self.group_size = packed.bits, packed.group_size
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.register_buffer("weight_codes", torch.from_numpy(arrays["codes"].copy()))
        self.register_buffer("weight_scale", torch.from_numpy(arrays["scales"].copy()))
        if "zero_points" in arrays:
            self.register_buffer("group_zero_point", torch.from_numpy(arrays["zero_points"].copy()))
        value = None if bias is None else bias.detach().to(torch.float32).contiguous().clone()
        self.register_buffer("bias", value)
        self._packed_ahead = packed
        super().__init__(packed.target, None, None)

    def _arrays(self, source: dict[str, torch.Tensor]) -> dict[str, Any]:
        arrays: dict[str, Any] = {
            "codes": source["weight_codes"].numpy(),
            "scales": source["weight_scale"].numpy(),
            "bits": np.array(self.bits, np.int64),
            "group_size": np.array(self.group_size, np.int64),
        }
        if "group_zero_point" in source:
            arrays["zero_points"] = source["group_zero_point"].numpy()
        return arrays

    def _sync(self) -> None:
        super()._sync()
        packed, self._packed_ahead = self._packed_ahead, None
        if packed is None or packed.target != self.target:
            buffers = {k: v for k, v in self.named_buffers(recurse=False) if v is not None}
            packed = K.PackedGroupWeight.from_arrays(self._arrays(buffers), target=self.target)
        bias = None if self.bias is None else lowered.numpy_view(self.bias)
        self._prepared = lowered.WeightOnlyLinearOp(packed, bias)

    @property
    def _packed(self) -> K.PackedGroupWeight:
        packed: K.PackedGroupWeight = self._prepared.packed
        return packed

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # the entries, then the kernels' rules for codes, scales and zero points together,
        # are checked before anything loads
        incoming = {}
        for name, current in self.named_buffers(recurse=False):
            if current is not None:
                value = state_dict.get(prefix + name, current)
                check_state_entry(prefix + name, name, value, current)
                incoming[name] = value
        try:
            checked = K.PackedGroupWeight.from_arrays(self._arrays(incoming), target=self.target)
        except K.KernelError as e:
            raise LoweringError(f"load_state_dict: '{prefix}': {e}") from None
        self._packed_ahead = checked
        try:
            super()._load_from_state_dict(state_dict, prefix, *args)
        finally:
            self._packed_ahead = None

    def get_extra_state(self) -> dict[str, int]:
        return {"bits": self.bits, "group_size": self.group_size}

    def set_extra_state(self, state: Any) -> None:
        if state != self.get_extra_state():
            raise LoweringError(
                f"load_state_dict: {type(self).__name__} holds bits={self.bits}, group_size="
                f"{self.group_size}; the state dict has {state!r}: load it into a model "
                "quantized with the same settings"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel_input = x.dtype == torch.float32 and x.device.type == "cpu"
        if not kernel_input or (x.requires_grad and torch.is_grad_enabled()) or is_tracing(x):
            weight = torch.from_numpy(self._packed.dequantize()).to(x.device, x.dtype)
            bias = None if self.bias is None else self.bias.to(x.device, x.dtype)
            return torch.nn.functional.linear(x, weight, bias)
        return torch.from_numpy(self._prepared(x.detach().numpy()))

    def _details(self) -> str:
        kind = "symmetric" if self._packed.symmetric else "asymmetric"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group_size={self.group_size}, {kind}"
        )


class FloatLayerNorm(LoweredModule):
    """float32 ``LayerNorm(x [+ residual])`` over the last dimension (``kernels.layer_norm``).

    With ``in_qparams`` ``x`` is uint8 codes (the dequantize before it fused); with
    ``out_qparams`` it returns ``(float result, its codes)``, the quantize after it fused. The
    same bytes as those ops around the float LayerNorm.
    """

    kernel = "kernels.layer_norm"
    array_input = "strided"  # the prepared call takes any layout (a copy when not C-contiguous)
    _settings = (*LoweredModule._settings, "eps")
    weight: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        residual: bool,
        target: str,
        in_qparams: tuple[float, int] | None = None,
        out_qparams: tuple[float, int] | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.eps, self.residual = float(eps), residual
        for name, t in (("weight", weight), ("bias", bias)):
            value = None if t is None else t.detach().to(torch.float32).contiguous()
            self.register_buffer(name, value)
        super().__init__(target, in_qparams, out_qparams)

    def _sync(self) -> None:
        super()._sync()
        self._w = None if self.weight is None else lowered.numpy_view(self.weight)
        self._b = None if self.bias is None else lowered.numpy_view(self.bias)
        names = dict(self.named_buffers(recurse=False))
        self._x_qp = self.input_qparams if "input_scale" in names else None
        self._codes_qp = self.output_qparams if "scale" in names else None
        # everything but the inputs checked once: a layer's calls skip layer_norm's checks
        self._prepared = K.PreparedLayerNorm(
            self._w, self._b, self.eps, x_qparams=self._x_qp, codes_qparams=self._codes_qp
        )

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> Any:
        if self._x_qp is None and self._codes_qp is None:
            return self._float(x, other)
        if other is not None and other.shape != x.shape:  # broadcasting add: the plain path
            if self._x_qp is not None:
                x = torch.from_numpy(K.dequantize_per_tensor(lowered.numpy_view(x), *self._x_qp))
            out = self._float(x, other)
            if self._codes_qp is None:
                return out
            return out, torch.from_numpy(
                K.quantize_per_tensor(lowered.numpy_view(out), *self._codes_qp)
            )
        if is_tracing(x) if other is None else is_tracing(x, other):
            x_qp = None if self._x_qp is None else [float(v) for v in self._x_qp]
            c_qp = None if self._codes_qp is None else [float(v) for v in self._codes_qp]
            out, codes = ops.layer_norm_codes_op(
                x, other, self.weight, self.bias, self.eps, x_qp, c_qp
            )
        else:
            o, c = self._prepared_call(x, other)
            out, codes = torch.from_numpy(o), None if c is None else torch.from_numpy(c)
        return out if self._codes_qp is None else (out, codes)

    def forward_arrays(self, *arrays: Any) -> Any:
        x, other = arrays[0], (arrays[1] if len(arrays) > 1 else None)
        want = np.uint8 if self._x_qp is not None else np.float32
        if (
            (self._x_qp is None and self._codes_qp is None)
            or x.dtype != want
            or (other is not None and other.shape != x.shape)
        ):  # the float-only, other-dtype and broadcasting paths: as forward runs them
            out = self.forward(*(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays))
            if isinstance(out, tuple):
                return tuple(t.detach().numpy() for t in out)
            return out.detach().numpy()
        if other is not None and other.dtype != np.float32:
            other = other.astype(np.float32)
        # a transposed view (attention heads merged in float) is copied: the kernel reads rows
        x = np.ascontiguousarray(x)
        other = None if other is None else np.ascontiguousarray(other)
        out, codes = self._prepared(x, other)
        return out if self._codes_qp is None else (out, codes)

    def _prepared_call(self, x: torch.Tensor, other: torch.Tensor | None) -> Any:
        r = None if other is None else lowered.numpy_view(other.to(torch.float32))
        return self._prepared(lowered.numpy_view(x), r)

    def _float(self, x: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
        if other is not None and other.shape != x.shape:
            x, other = x + other, None  # broadcasting add: torch does it, the kernel the rest
        if x.dtype != torch.float32 or x.requires_grad:
            h = x if other is None else x + other
            n = (h.shape[-1],)
            return torch.nn.functional.layer_norm(h, n, self.weight, self.bias, self.eps)
        if is_tracing(x) if other is None else is_tracing(x, other):
            return _as_tensor(ops.layer_norm_op(x, other, self.weight, self.bias, self.eps))
        if self._x_qp is None and self._codes_qp is None:  # the prepared call is this one
            return torch.from_numpy(self._prepared_call(x, other)[0])
        # a module on codes whose residual broadcast: x is that sum, dequantized, here
        return torch.from_numpy(K.layer_norm(lowered.numpy_view(x), self._w, self._b, self.eps))

    def _details(self) -> str:
        parts = [f"eps={self.eps:g}"]
        if self.residual:
            parts.append("residual add fused")
        if self._x_qp is not None:
            parts.append(f"reads codes {_qp(self._x_qp)}")
        if self._codes_qp is not None:
            parts.append(f"also returns codes {_qp(self._codes_qp)}")
        return ", ".join(parts)


class FloatSoftmax(LoweredModule):
    """float32 ``softmax(x * scale + mask)`` over the last dimension (``kernels.softmax``)."""

    kernel = "kernels.softmax"
    _settings = (*LoweredModule._settings, "scale", "divide")

    def __init__(self, scale: float, divide: bool, masked: bool, target: str) -> None:
        nn.Module.__init__(self)
        # a graph's ``x / c`` becomes ``x * float32(1 / c)``: the kernel multiplies
        self.scale, self.divide, self.masked = float(scale), divide, masked
        super().__init__(target, None, None)

    def _sync(self) -> None:
        super()._sync()
        self._prepared = lowered.SoftmaxOp(1.0 / self.scale if self.divide else self.scale)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        ok = mask is None or (
            mask.dtype == torch.float32
            and mask.dim() <= 4
            and mask.shape[-1] == x.shape[-1]
            and all(m in (1, d) for m, d in zip(mask.shape[::-1], x.shape[::-1], strict=False))
        )
        if x.dtype != torch.float32 or x.dim() > 4 or not ok or x.requires_grad:
            v = x / self.scale if self.divide else x * self.scale
            return torch.softmax(v if mask is None else v + mask, -1)
        if is_tracing(x) if mask is None else is_tracing(x, mask):
            return _as_tensor(ops.softmax_op(x, self._prepared.scale, mask))
        m = None if mask is None else mask.detach().numpy()  # strided views are fine: it is copied
        return torch.from_numpy(self._prepared(lowered.numpy_view(x), m))

    def _details(self) -> str:
        op = "/" if self.divide else "*"
        return f"x {op} {self.scale:g}" + (" + mask" if self.masked else "")


class QuantizedAttention(LoweredModule):
    """uint8 q, k, v [B, H, S, D] → ``scaled_dot_product_attention`` → uint8 codes, or float32
    when nothing quantizes the result (``kernels.attention``).

    The dequantize of each input and the quantize of the output run inside the kernel, which
    reads the codes where the projections wrote them (the per-head view of [B, S, H * D]) and
    writes [B, S, H, Dv] memory, so merging the heads back copies nothing.
    """

    kernel = "kernels.attention"
    array_input = "strided"  # per-head views of the projections' rows, read in place
    _settings = (*LoweredModule._settings, "attention_scale", "causal")

    def __init__(
        self,
        qparams: tuple[tuple[float, int], tuple[float, int], tuple[float, int]],
        out_qparams: tuple[float, int] | None,
        scale: float | None,
        masked: bool,
        target: str,
        causal: bool = False,
        heads: int = 0,
    ) -> None:
        nn.Module.__init__(self)
        for prefix, (s, zp) in (("input2_", qparams[1]), ("input3_", qparams[2])):
            self.register_buffer(prefix + "scale", torch.tensor(s, dtype=torch.float64))
            self.register_buffer(prefix + "zero_point", torch.tensor(zp, dtype=torch.int64))
        self.attention_scale, self.masked, self.causal = scale, masked, causal
        # > 0: q, k, v and the result are [B, S, heads * D] (nn.MultiheadAttention's layout,
        # batch first), split into heads and merged back as views
        self.heads = heads
        super().__init__(target, qparams[0], out_qparams)

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("heads", 0)  # pickles made before this option existed
        super().__setstate__(state)

    def _split(self, x: Any) -> Any:
        """[B, S, H * D] → the [B, H, S, D] view (a tensor or an array)."""
        b, s, e = x.shape
        heads = x.reshape(b, s, self.heads, e // self.heads)
        return heads.transpose(1, 2) if isinstance(x, torch.Tensor) else heads.transpose(0, 2, 1, 3)

    def _merge(self, out: Any) -> Any:
        """[B, H, S, D] (the kernel writes [B, S, H, D] memory) → [B, S, H * D]."""
        b, h, s, d = out.shape
        merged = out.transpose(1, 2) if isinstance(out, torch.Tensor) else out.transpose(0, 2, 1, 3)
        return merged.reshape(b, s, h * d)

    def _sync(self) -> None:
        super()._sync()
        b = dict(self.named_buffers(recurse=False))
        self._qparams = (
            self.input_qparams,
            (float(b["input2_scale"]), int(b["input2_zero_point"])),
            (float(b["input3_scale"]), int(b["input3_zero_point"])),
        )
        self._out_qp = (self._out_scale, self._out_zero_point) if "scale" in b else None
        self._prepared = lowered.AttentionOp(
            self._qparams, self._out_qp, self.attention_scale, self.causal, self.target
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.heads:
            if not (q.dim() == k.dim() == v.dim() == 3 and q.shape[-1] % self.heads == 0):
                raise LoweringError(
                    f"QuantizedAttention: expected q, k, v as [batch, length, {self.heads} heads "
                    f"* head size], got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                    f"{tuple(v.shape)}"
                )
            merged: torch.Tensor = self._merge(
                self._attend(self._split(q), self._split(k), self._split(v), mask)
            )
            return merged
        return self._attend(q, k, v, mask)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``forward`` on q, k, v [B, H, S, D]."""
        if not (q.dim() == k.dim() == v.dim() == 4) or (q.shape[:2] != k.shape[:2]):
            return self._reference(q, k, v, mask)  # 3-D or 5-D inputs, grouped-query heads
        if mask is not None and mask.dtype not in (torch.bool, torch.float32):
            mask = mask.to(torch.float32)  # an additive float16 / bfloat16 mask: same values
        if is_tracing(q, k, v) if mask is None else is_tracing(q, k, v, mask):
            flat = [float(x) for qp in self._qparams for x in qp]
            out_qp = None if self._out_qp is None else [float(x) for x in self._out_qp]
            return _as_tensor(
                ops.attention_op(
                    q, k, v, flat, out_qp, self.attention_scale, mask, self.target, self.causal
                )
            )
        return self._eager(q, k, v) if mask is None else self._eager(q, k, v, mask)

    def forward_arrays(self, *arrays: Any) -> Any:
        q, k, v = arrays[:3]
        mask = arrays[3] if len(arrays) > 3 else None
        if self.heads and q.ndim != 4:  # [B, S, H * D] (4-D: the per-head views of _attend)
            if not (q.ndim == k.ndim == v.ndim == 3 and q.shape[-1] % self.heads == 0):
                return self.forward(*(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays))
            return self._merge(self._prepared(self._split(q), self._split(k), self._split(v), mask))
        if not (q.ndim == k.ndim == v.ndim == 4) or q.shape[:2] != k.shape[:2]:
            return self._reference(*(torch.from_numpy(a) for a in arrays)).numpy()
        if mask is not None and mask.dtype not in (np.bool_, np.float32):
            mask = mask.astype(np.float32)  # (as forward: an additive mask of other floats)
        return self._prepared(q, k, v, mask)

    def _reference(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """What the reference model computes, for shapes the kernel does not take: dequantize,
        torch's attention, quantize."""
        deq = [
            torch.ops.quantbridge.dequantize_per_tensor.default(x, s, zp, 0, 255, torch.uint8)
            for x, (s, zp) in zip((q, k, v), self._qparams, strict=True)
        ]
        out: torch.Tensor = torch.nn.functional.scaled_dot_product_attention(
            deq[0], deq[1], deq[2], attn_mask=mask, is_causal=self.causal,
            scale=self.attention_scale, enable_gqa=q.dim() >= 3 and q.shape[-3] != k.shape[-3],
        )  # fmt: skip
        if self._out_qp is None:
            return out
        return _as_tensor(
            torch.ops.quantbridge.quantize_per_tensor.default(
                out, *self._out_qp, 0, 255, torch.uint8
            )
        )

    def _details(self) -> str:
        scale = "1/sqrt(D)" if self.attention_scale is None else f"{self.attention_scale:g}"
        out = "float" if self._out_qp is None else _qp(self._out_qp)
        extra = " + mask" if self.masked else (", causal" if self.causal else "")
        heads = f", {self.heads} heads split and merged" if self.heads else ""
        return f"scale={scale}{extra}{heads}, out={out}"


class QuantizedConv(_WeightedBase):
    """uint8 NCL/NCHW → uint8: ``kernels.conv1d``/``conv2d`` (depthwise via groups).

    Returns channels-last data (NHWC in memory, NCHW shape), like torch's quantized conv: the
    next conv, add, relu or lookup table reads it in place, so a CNN transposes only its input.
    """

    array_input = "dense"
    _settings = (*_WeightedBase._settings, "relu", "stride", "padding", "dilation", "groups")

    def __init__(
        self,
        *args: Any,
        stride: tuple[int, ...],
        padding: tuple[int, ...],
        dilation: tuple[int, ...],
        groups: int,
        relu: bool = False,
        **kwargs: Any,
    ) -> None:
        self.stride, self.padding, self.dilation = list(stride), list(padding), list(dilation)
        self.groups = groups
        self.relu = relu
        super().__init__(*args, **kwargs)
        self.kernel = "kernels.conv2d" if self.weight.dim() == 4 else "kernels.conv1d"

    def _sync(self) -> None:
        super()._sync()
        self._sync_activation()
        self._prepared = self._prepare(lowered.pack_conv(
            self.weight, self.weight_scale, self.weight_zero_point, self.bias, self.stride,
            self.padding, self.dilation, self.groups, self.target,
        ))  # fmt: skip

    def _prepare(self, packed: K.PackedConvWeight) -> Any:
        """The op object around the packed weight: everything but the input fixed; it plans
        the call for the input layout a model gives it, once."""
        return K.PreparedConv(
            packed, self.input_qparams, self.conv_qparams, relu=self.relu, channels_last=True,
            lut=self._act_table,
        )  # fmt: skip

    @property
    def conv_qparams(self) -> tuple[float, int]:
        """(scale, zero point) of the conv's own output codes (its rounding point)."""
        return (self._out_scale, self._out_zero_point)

    def _conv_op(self, x: torch.Tensor) -> torch.Tensor:
        """The conv alone as the traced custom op (its own output codes)."""
        return _as_tensor(ops.conv_op(
            x, self.weight, self.weight_scale, self.weight_zero_point, self.bias, self.stride,
            self.padding, self.dilation, self.groups, self._in_scale, self._in_zero_point,
            self._out_scale, self._out_zero_point, self.relu, self.target,
        ))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_tracing(x):
            return self._activation_output(self._conv_op(x), True)
        return self._eager(x)

    def forward_arrays(self, *arrays: Any) -> Any:
        return self._prepared(arrays[0])

    def _details(self) -> str:
        dw = ", depthwise" if self.groups > 1 and self.groups == self.weight.shape[0] else ""
        return (
            f"stride={tuple(self.stride)}, padding={tuple(self.padding)}, groups={self.groups}"
            f"{dw}, relu={self.relu}{self._epilogue_details()}, {self._pack_details()}"
        )

    def _epilogue_details(self) -> str:
        return self._activation_details()


class QuantizedConvAdd(QuantizedConv):
    """A residual block's conv → add (+relu) in one kernel call: ``kernels.conv2d_add``.

    Made by the lowering pass from a lowered 2-D conv whose only user is a lowered add. Holds
    the conv's buffers (``scale``/``zero_point`` are the conv output's qparams, still the
    rounding point of the computation) plus the other operand's (``input2_*``) and the add's
    output qparams (``add_scale``/``add_zero_point``). Exactly the two modules it replaces.
    """

    kernel = "kernels.conv2d_add"
    _settings = (*QuantizedConv._settings, "add_relu")
    input2_scale: torch.Tensor
    input2_zero_point: torch.Tensor
    add_scale: torch.Tensor
    add_zero_point: torch.Tensor

    def __init__(
        self,
        conv: QuantizedConv,
        other_qparams: tuple[float, int],
        out_qparams: tuple[float, int],
        add_relu: bool,
    ) -> None:
        self.add_relu = add_relu
        super().__init__(
            conv.weight,
            conv.weight_scale,
            conv.weight_zero_point,
            conv.bias,
            conv.target,
            conv.input_qparams,
            conv.output_qparams,
            stride=tuple(conv.stride),
            padding=tuple(conv.padding),
            dilation=tuple(conv.dilation),
            groups=conv.groups,
            relu=conv.relu,
        )
        self.kernel = "kernels.conv2d_add"
        # registered after the base init (which resets the module), then mirrored
        for name, value, dtype in (
            ("input2_scale", other_qparams[0], torch.float64),
            ("input2_zero_point", other_qparams[1], torch.int64),
            ("add_scale", out_qparams[0], torch.float64),
            ("add_zero_point", out_qparams[1], torch.int64),
        ):
            self.register_buffer(name, torch.tensor(value, dtype=dtype))
        self._sync()

    def _sync(self) -> None:
        b = dict(self.named_buffers(recurse=False))
        if "add_scale" in b:  # absent while the base class initializes
            self._other_scale, self._other_zero_point = (
                float(b["input2_scale"]),
                int(b["input2_zero_point"]),
            )
            self._add_scale, self._add_zero_point = float(b["add_scale"]), int(b["add_zero_point"])
        super()._sync()

    def _prepare(self, packed: K.PackedConvWeight) -> Any:
        if "add_scale" not in self._buffers:  # the base class initializing: the conv alone
            return super()._prepare(packed)
        return K.PreparedConvAdd(
            packed, self.input_qparams, self.conv_qparams, self.other_qparams, self.add_qparams,
            relu_conv=self.relu, relu=self.add_relu, lut=self._act_table,
        )  # fmt: skip

    @property
    def output_qparams(self) -> tuple[float, int]:
        """(scale, zero point) of the output codes: the add's, or a fused activation's."""
        if self._act_qparams is not None:
            return self._act_qparams
        return self.add_qparams

    @property
    def add_qparams(self) -> tuple[float, int]:
        """(scale, zero point) of the add's output codes."""
        return (self._add_scale, self._add_zero_point)

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if is_tracing(x, other):
            kind = "add_relu" if self.add_relu else "add"
            return self._activation_output(_as_tensor(ops.binary_op(
                self._conv_op(x), self._out_scale, self._out_zero_point, other,
                self._other_scale, self._other_zero_point, self._add_scale, self._add_zero_point,
                kind, self.target,
            )), True)  # fmt: skip
        return self._eager(x, other)

    def forward_arrays(self, *arrays: Any) -> Any:
        return self._prepared(arrays[0], arrays[1])

    def _qparams_repr(self) -> str:
        act = "" if self._act_qparams is None else f", activation_out={_qp(self._act_qparams)}"
        return (
            f"in={_qp(self.input_qparams)}, conv={_qp((self._out_scale, self._out_zero_point))}, "
            f"other={_qp(self.other_qparams)}, add={_qp(self.add_qparams)}{act}"
        )

    def _epilogue_details(self) -> str:
        return f", then {'add_relu' if self.add_relu else 'add'}{self._activation_details()}"


class QuantizedBinary(LoweredModule):
    """Two uint8 tensors → uint8: add, add_relu, mul or mul_relu (``lowered_ops.BinaryOp``:
    shapes broadcast, a squeeze-excite mul runs without the broadcast)."""

    array_input: str | None = "dense"
    _settings = (*LoweredModule._settings, "kind")

    input2_scale: torch.Tensor
    input2_zero_point: torch.Tensor

    def __init__(
        self,
        kind: str,
        target: str,
        a_qparams: tuple[float, int],
        b_qparams: tuple[float, int],
        out_qparams: tuple[float, int],
    ) -> None:
        nn.Module.__init__(self)
        self.kind = kind
        self.kernel = f"kernels.{kind}"
        self.register_buffer("input2_scale", torch.tensor(b_qparams[0], dtype=torch.float64))
        self.register_buffer("input2_zero_point", torch.tensor(b_qparams[1], dtype=torch.int64))
        super().__init__(target, a_qparams, out_qparams)

    def _sync(self) -> None:
        super()._sync()
        self._other_scale, self._other_zero_point = (
            float(self.input2_scale),
            int(self.input2_zero_point),
        )
        self._prepared = self._make_op()

    def _make_op(self) -> Any:
        return lowered.BinaryOp(
            self.kind, self.input_qparams, self.other_qparams, self.output_qparams, self.target
        )

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if is_tracing(a, b):
            return _as_tensor(ops.binary_op(
                a, self._in_scale, self._in_zero_point, b, self._other_scale,
                self._other_zero_point, self._out_scale, self._out_zero_point, self.kind,
                self.target,
            ))  # fmt: skip
        return self._eager(a, b)

    def forward_arrays(self, *arrays: Any) -> Any:
        return self._prepared(arrays[0], arrays[1])

    def _qparams_repr(self) -> str:
        return (
            f"a={_qp(self.input_qparams)}, b={_qp(self.other_qparams)}, "
            f"out={_qp(self.output_qparams)}"
        )


class QuantizedMatmul(QuantizedBinary):
    """uint8 ``a @ b`` (2-D, or batched with broadcast leading dims): ``kernels.matmul``."""

    array_input = "c"

    def __init__(
        self,
        target: str,
        a_qparams: tuple[float, int],
        b_qparams: tuple[float, int],
        out_qparams: tuple[float, int],
    ) -> None:
        super().__init__("matmul", target, a_qparams, b_qparams, out_qparams)

    def _make_op(self) -> Any:
        return lowered.MatmulOp(
            self.input_qparams, self.other_qparams, self.output_qparams, self.target
        )

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if is_tracing(a, b):
            return _as_tensor(ops.matmul_op(
                a, self._in_scale, self._in_zero_point, b, self._other_scale,
                self._other_zero_point, self._out_scale, self._out_zero_point, self.target,
            ))  # fmt: skip
        return self._eager(a, b)


class QuantizedLookupTable(LoweredModule):
    """uint8 → uint8 through a 256-entry table ``quantize(fn(dequantize(q)))``.

    Serves every elementwise op of one quantized input: fixed-qparams activations (sigmoid,
    tanh, hardsigmoid), hardswish, relu/relu6/hardtanh/leaky_relu/elu, scalar add/mul.
    """

    kernel = "kernels.apply_lut"
    array_input = "dense"
    table: torch.Tensor

    def __init__(
        self,
        table: torch.Tensor,
        what: str,
        target: str,
        in_qparams: tuple[float, int],
        out_qparams: tuple[float, int],
    ) -> None:
        nn.Module.__init__(self)
        self.what = what
        self.register_buffer("table", table.detach().to(torch.uint8).contiguous())
        super().__init__(target, in_qparams, out_qparams)

    def _sync(self) -> None:
        super()._sync()
        self._prepared = lowered.LookupTableOp(lowered.numpy_view(self.table), self.target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_tracing(x):
            return _as_tensor(ops.lut_op(x, self.table, self.target))
        return self._eager(x)

    def forward_arrays(self, *arrays: Any) -> Any:
        return self._prepared(arrays[0])

    def _details(self) -> str:
        return f"fn={self.what}"


class _PreparedConversion(LoweredModule):
    """A per-tensor conversion: its op object is a kernels prepared call (the checks and plan
    made once per input layout)."""

    def _make_prepared(self) -> Any:
        raise NotImplementedError

    def _sync(self) -> None:
        super()._sync()
        self._prepared = self._make_prepared()

    def forward_arrays(self, *arrays: Any) -> Any:
        return self._prepared(arrays[0])


class Quantize(_PreparedConversion):
    """float32 → uint8 where a float value enters a quantized chain (``quantize_per_tensor``).

    Same numbers as the reference ``quantbridge::quantize_per_tensor`` op (both follow
    torch.quantize_per_tensor), at kernel speed.
    """

    kernel = "kernels.quantize_per_tensor"
    array_input = "float"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_tracing(x):
            return _as_tensor(
                torch.ops.quantbridge.quantize_per_tensor.tensor(
                    x, self.scale, self.zero_point, 0, 255, torch.uint8
                )
            )
        return self._eager(x)

    def _make_prepared(self) -> Any:
        return K.PreparedQuantize(self._out_scale, self._out_zero_point, target=self.target)


class Dequantize(_PreparedConversion):
    """uint8 → float32 where a quantized chain ends (``dequantize_per_tensor``).

    The result is C-contiguous whatever the layout of the codes, as the reference model's is.
    """

    kernel = "kernels.dequantize_per_tensor"
    # C-contiguous like the reference model's float values (lowered convs return channels-last
    # codes; user code may ``view`` a model output)
    array_input = "c"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_tracing(x):
            return _as_tensor(
                torch.ops.quantbridge.dequantize_per_tensor.tensor(
                    x, self.input_scale, self.input_zero_point, 0, 255, torch.uint8
                )
            )
        return self._eager(x)

    def _make_prepared(self) -> Any:
        return K.PreparedDequantize(self._in_scale, self._in_zero_point, target=self.target)


class Requantize(_PreparedConversion):
    """uint8 → uint8 between two sets of qparams (when consecutive ops disagree)."""

    kernel = "kernels.requantize"
    array_input = "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_tracing(x):
            return _as_tensor(ops.requantize_op(
                x, self._in_scale, self._in_zero_point, self._out_scale, self._out_zero_point,
                self.target,
            ))  # fmt: skip
        return self._eager(x)

    def _make_prepared(self) -> Any:
        return K.PreparedRequantize(self.input_qparams, self.output_qparams, target=self.target)


class QuantizedMaxPool2d(LoweredModule):
    """uint8 NCHW max pooling (qparams unchanged), C-contiguous or channels-last."""

    kernel = "kernels.max_pool2d"
    array_input = "dense"
    _settings = (*LoweredModule._settings, "kernel_size", "stride", "padding", "dilation",
                 "ceil_mode")  # fmt: skip

    def __init__(
        self,
        kernel_size: tuple[int, int],
        stride: tuple[int, int],
        padding: tuple[int, int],
        dilation: tuple[int, int],
        ceil_mode: bool,
        target: str,
    ) -> None:
        self.kernel_size, self.stride = list(kernel_size), list(stride)
        self.padding, self.dilation, self.ceil_mode = list(padding), list(dilation), ceil_mode
        super().__init__(target, None, None)

    def _sync(self) -> None:
        super()._sync()
        self._prepared = lowered.MaxPool2dOp(
            self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode, self.target
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_tracing(x):
            return _as_tensor(ops.max_pool2d_op(
                x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode,
                self.target,
            ))  # fmt: skip
        return self._eager(x)

    def forward_arrays(self, *arrays: Any) -> Any:
        return self._prepared(arrays[0])

    def _details(self) -> str:
        return f"kernel_size={tuple(self.kernel_size)}, stride={tuple(self.stride)}"


class QuantizedAvgPool2d(LoweredModule):
    """uint8 NCHW average pooling (torch's quantized avg_pool2d numerics), either layout."""

    kernel = "kernels.avg_pool2d"
    array_input = "dense"
    _settings = (*LoweredModule._settings, "kernel_size", "stride", "padding", "ceil_mode",
                 "count_include_pad", "divisor_override")  # fmt: skip

    def __init__(
        self,
        kernel_size: tuple[int, int],
        stride: tuple[int, int],
        padding: tuple[int, int],
        ceil_mode: bool,
        count_include_pad: bool,
        divisor_override: int | None,
        target: str,
        in_qparams: tuple[float, int],
        out_qparams: tuple[float, int],
    ) -> None:
        self.kernel_size, self.stride, self.padding = (
            list(kernel_size),
            list(stride),
            list(padding),
        )
        self.ceil_mode, self.count_include_pad = ceil_mode, count_include_pad
        self.divisor_override = divisor_override
        super().__init__(target, in_qparams, out_qparams)

    def _sync(self) -> None:
        super()._sync()
        self._prepared = lowered.AvgPool2dOp(
            self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad,
            self.divisor_override, self.input_qparams, self.output_qparams, self.target,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_tracing(x):
            return _as_tensor(ops.avg_pool2d_op(
                x, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                self.count_include_pad, self.divisor_override, self._in_scale,
                self._in_zero_point, self._out_scale, self._out_zero_point, self.target,
            ))  # fmt: skip
        return self._eager(x)

    def forward_arrays(self, *arrays: Any) -> Any:
        return self._prepared(arrays[0])

    def _details(self) -> str:
        return f"kernel_size={tuple(self.kernel_size)}, stride={tuple(self.stride)}"


class QuantizedAdaptiveAvgPool2d(LoweredModule):
    """uint8 NCHW adaptive average pooling, either layout: the input's qparams kept, or with
    qparams of its own, the mean requantized in the same pass."""

    kernel = "kernels.adaptive_avg_pool2d"
    array_input = "dense"
    _settings = (*LoweredModule._settings, "output_size")

    def __init__(
        self,
        output_size: tuple[int, int],
        target: str,
        in_qparams: tuple[float, int] | None = None,
        out_qparams: tuple[float, int] | None = None,
    ) -> None:
        self.output_size = list(output_size)
        if in_qparams == out_qparams:  # kept: no buffers, torch's kernel
            in_qparams = out_qparams = None
        super().__init__(target, in_qparams, out_qparams)

    def _sync(self) -> None:
        super()._sync()
        self._prepared = lowered.adaptive_avg_pool2d_op(
            self.output_size, self.input_qparams, self.output_qparams, self.target
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_tracing(x):
            return _as_tensor(ops.adaptive_avg_pool2d_op(
                x, self.output_size, self._in_scale, self._in_zero_point, self._out_scale,
                self._out_zero_point, self.target,
            ))  # fmt: skip
        return self._eager(x)

    def forward_arrays(self, *arrays: Any) -> Any:
        return self._prepared(arrays[0])

    def _details(self) -> str:
        return f"output_size={tuple(self.output_size)}"


class QuantizedEmbeddingBag(LoweredModule):
    """Weight-only 8-bit EmbeddingBag: float32 bags from uint8 rows (``kernels.embedding_bag``).

    Rows are stored as uint8 codes with a float32 scale and bias per row
    (``value = code * scale + bias``), the weight's own per-row qparams.
    """

    kernel = "kernels.embedding_bag"
    _settings = (*LoweredModule._settings, "mode", "include_last_offset")
    weight: torch.Tensor
    row_scale: torch.Tensor
    row_bias: torch.Tensor

    def __init__(
        self,
        codes: torch.Tensor,
        row_scale: torch.Tensor,
        row_bias: torch.Tensor,
        mode: str,
        include_last_offset: bool,
        target: str,
    ) -> None:
        nn.Module.__init__(self)
        self.mode, self.include_last_offset = mode, include_last_offset
        self.register_buffer("weight", codes.detach().to(torch.uint8).contiguous())
        self.register_buffer("row_scale", row_scale.detach().to(torch.float32).contiguous())
        self.register_buffer("row_bias", row_bias.detach().to(torch.float32).contiguous())
        super().__init__(target, None, None)

    def _sync(self) -> None:
        super()._sync()
        self._prepared = lowered.EmbeddingBagOp(
            lowered.pack_embedding(self.weight, self.row_scale, self.row_bias), self.mode,
            self.include_last_offset, self.target,
        )  # fmt: skip

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if is_tracing(indices):
            return _as_tensor(ops.embedding_bag_op(
                self.weight, self.row_scale, self.row_bias, indices, offsets, per_sample_weights,
                self.mode, self.include_last_offset, self.target,
            ))  # fmt: skip
        arrays = (None if t is None else lowered.numpy_view(t)
                  for t in (indices, offsets, per_sample_weights))  # fmt: skip
        return torch.from_numpy(self._prepared(*arrays))

    def _details(self) -> str:
        return f"mode={self.mode}, weight={tuple(self.weight.shape)} uint8 per-row"


class QuantizedEmbedding(QuantizedEmbeddingBag):
    """Weight-only 8-bit Embedding: each index is a bag of one row (``kernels.embedding_bag``)."""

    def __init__(
        self, codes: torch.Tensor, row_scale: torch.Tensor, row_bias: torch.Tensor, target: str
    ) -> None:
        super().__init__(codes, row_scale, row_bias, "sum", False, target)

    def forward(  # type: ignore[override]
        self, indices: torch.Tensor
    ) -> torch.Tensor:
        flat = indices.reshape(-1)
        offsets = torch.arange(flat.numel(), dtype=flat.dtype)
        out = super().forward(flat, offsets)
        return out.reshape(*indices.shape, out.shape[-1])

    def _details(self) -> str:
        return f"weight={tuple(self.weight.shape)} uint8 per-row"
