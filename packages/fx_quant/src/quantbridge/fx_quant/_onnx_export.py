"""ONNX export in QDQ form: QuantizeLinear / DequantizeLinear around standard float ops.

The reference model says exactly what a quantized model computes, so the file is the
reference model written in ONNX:

1. the reference model is captured once more with ``torch.export`` (ATen ops; every
   dimension dynamic where the model allows it), which inlines the reference modules' weight
   round trips into the graph;
2. on that graph, every quantize of a constant (a weight) is computed here, with the
   reference's own op, and stored as an integer constant: the file holds int8 weights whose
   bytes are the reference model's codes;
3. activation quantizers are checked against the profile; a quant range narrower than its
   dtype (a hand-written reference graph; convert always uses the dtype's) gets a float
   clamp at the range's ends, since ONNX's QuantizeLinear saturates at its dtype's limits;
   a clamp before a quantize whose range it cannot change is dropped (exact: quantizing is
   monotonic);
4. ``torch.onnx.export`` translates the graph, with this module's translations of the
   ``torch.ops.quantbridge`` ops.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import math
import operator
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import fx, nn
from torch.export import Dim
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._export_capture import _auto_dynamic_shapes, _fetch, _SizeOblivious
from quantbridge.fx_quant._ops import QUANT_DTYPE_RANGES
from quantbridge.fx_quant._state import OBSERVED_KEY

__all__ = ["ONNX_OPSETS", "OnnxExportError", "OnnxExportReport", "export_onnx"]

# torch.onnx's exporter writes opset 18 and later; QuantizeLinear takes 16-bit types from 21.
ONNX_OPSETS = range(18, 24)
_DEFAULT_OPSET = 21
_OPSET_16_BIT = 21

Profile = Literal["ort", "tensorrt"]

_Q = torch.ops.quantbridge
_QUANTIZE = (
    _Q.quantize_per_tensor.default,
    _Q.quantize_per_tensor.tensor,
    _Q.quantize_per_channel.default,
)
_DEQUANTIZE = (
    _Q.dequantize_per_tensor.default,
    _Q.dequantize_per_tensor.tensor,
    _Q.dequantize_per_channel.default,
)
# ATen clamps a quantize can make redundant: (op, positions of its min and max arguments).
_CLAMPS: dict[Any, tuple[int | None, int | None]] = {
    torch.ops.aten.relu.default: (None, None),
    torch.ops.aten.relu_.default: (None, None),
    torch.ops.aten.hardtanh.default: (1, 2),
    torch.ops.aten.hardtanh_.default: (1, 2),
    torch.ops.aten.clamp.default: (1, 2),
    torch.ops.aten.clamp_.default: (1, 2),
}
_EMBEDDING_BAGS = (
    torch.ops.aten._embedding_bag.default,
    torch.ops.aten.embedding_bag.default,
    torch.ops.aten.embedding_bag.padding_idx,
)
_RELUS = (torch.ops.aten.relu.default, torch.ops.aten.relu_.default)
_HARDTANHS = (torch.ops.aten.hardtanh.default, torch.ops.aten.hardtanh_.default)
_ONNX_DTYPE = {torch.uint8: 2, torch.int8: 3, torch.uint16: 4, torch.int16: 5}

_TENSORRT_FIX = (
    "quantize the model for TensorRT: prepare_fx(model, "
    "quantbridge.qconfig.get_tensorrt_qconfig_mapping(), example_inputs, "
    "backend_config=quantbridge.fx_quant.get_tensorrt_backend_config())"
)


class OnnxExportError(FxQuantError):
    """A model, argument or node that has no faithful ONNX QDQ form."""


@dataclass(frozen=True)
class OnnxExportReport:
    """What :func:`export_onnx` wrote.

    ``weights``: the modules whose weights are stored as integer initializers.
    ``activation_quantizers``: QuantizeLinear nodes on activations.
    ``clipped``: activation quantizers given a float ``Clip`` because their range is narrower
    than their dtype, named by their scale attribute on the reference model.
    ``removed_clamps``: ReLU / clamp nodes dropped because the quantize after them already
    clamps to the same codes.
    ``dynamic_axes``: per ONNX input, the axes whose size may vary.
    """

    path: Path
    opset: int
    profile: str
    weights: tuple[str, ...]
    activation_quantizers: int
    clipped: tuple[str, ...]
    removed_clamps: int
    dynamic_axes: dict[str, tuple[int, ...]]


def export_onnx(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    path: str | Path,
    *,
    opset: int | None = None,
    profile: Profile = "ort",
    dynamic: bool = True,
) -> OnnxExportReport:
    """Write ``model`` as a QDQ ONNX file that ONNX Runtime, OpenVINO and TensorRT read.

    ``model`` is a prepared and calibrated model (it is converted to its reference model on a
    copy) or a reference model (``convert_to_reference_fx``), from either capture.
    Activations are quantized per tensor and weights per tensor or per channel, exactly as the
    reference model does; weights are stored as integer initializers.

    ``opset``: 18 to 23 (default 21; 16-bit activations need 21).
    ``profile``:

    * ``"ort"``: whatever the reference model uses (uint8 or int8, any zero point), for ONNX
      Runtime and OpenVINO;
    * ``"tensorrt"``: refuses unless every quantizer is int8 with zero point 0 and weights lie
      in [-127, 127], which is what TensorRT's explicit quantization takes.

    ``dynamic``: every input dimension the model allows stays dynamic (else the example
    inputs' sizes are fixed).
    """
    if profile not in ("ort", "tensorrt"):
        raise OnnxExportError(f"export_onnx: profile={profile!r}; use 'ort' or 'tensorrt'")
    opset = _DEFAULT_OPSET if opset is None else opset
    if opset not in ONNX_OPSETS:
        raise OnnxExportError(
            f"export_onnx: opset={opset} is not supported; use {ONNX_OPSETS.start} to "
            f"{ONNX_OPSETS.stop - 1}"
        )
    if not isinstance(example_inputs, tuple):
        raise OnnxExportError(
            f"export_onnx: example_inputs must be a tuple of the model's inputs, got "
            f"{type(example_inputs).__name__}; wrap a single tensor as (x,)"
        )
    onnx = _import_onnx()
    reference = _reference_model(model)
    graph, shapes = _aten_graph(reference, example_inputs, dynamic)
    _check_dtypes(graph, opset)
    if profile == "tensorrt":
        _check_tensorrt(graph)
    _functional_in_place_ops(graph)
    _reductions_as_matrices(graph)
    _linear_biases_added_after(graph)
    _embedding_bags_without_loops(graph)
    weights = _fold_weight_quantizers(graph)
    removed = _drop_redundant_clamps(graph)
    clipped = _clip_narrow_ranges(graph)
    activations = sum(1 for n in graph.graph.nodes if n.target in _QUANTIZE)
    _rename_clashing_constants(graph)
    graph.graph.lint()
    graph.recompile()

    path = Path(path)
    saved = _translate(graph, example_inputs, shapes, opset, path, onnx)
    return OnnxExportReport(
        path=path,
        opset=opset,
        profile=profile,
        weights=weights,
        activation_quantizers=activations,
        clipped=clipped,
        removed_clamps=removed,
        dynamic_axes=_dynamic_axes(saved),
    )


# --- the model to export -------------------------------------------------------------------


def _translate(
    graph: fx.GraphModule,
    example_inputs: tuple[Any, ...],
    shapes: Any,
    opset: int,
    path: Path,
    onnx: Any,
) -> Any:
    """``torch.onnx.export`` of the prepared ATen graph to ``path``, checked; returns the
    saved model's proto (initializer data not loaded)."""
    try:
        with _SizeOblivious(), _quiet_exporter():
            program = torch.onnx.export(
                graph,
                example_inputs,
                dynamo=True,
                dynamic_shapes=shapes,
                custom_translation_table=_translations(opset),
                opset_version=opset,
                optimize=True,
                verbose=False,
            )
    except Exception as e:  # the exporter runs the whole model
        raise OnnxExportError(
            f"export_onnx: torch.onnx cannot translate the reference model: {_root_cause(e)}\n"
            "  fix: if the op named above has no ONNX translation in torch "
            f"{torch.__version__}, keep it float (QConfigMapping: set_object_type(op, None)) "
            "or replace it"
        ) from e
    assert program is not None
    program.save(str(path))  # weights in a file beside it past protobuf's 2 GB
    saved = onnx.load(str(path), load_external_data=False)
    _check_weights_are_integers(saved)
    onnx.checker.check_model(str(path), full_check=True)
    return saved


def _import_onnx() -> Any:
    try:
        onnx = importlib.import_module("onnx")
        importlib.import_module("onnxscript")  # torch.onnx's exporter needs it
    except ImportError as e:
        raise OnnxExportError(
            f"export_onnx needs the onnx and onnxscript packages ({e}); install them with "
            "pip install 'quantbridge-fx-quant[onnx]'"
        ) from e
    return onnx


def _reference_model(model: nn.Module) -> nn.Module:
    from quantbridge.fx_quant._api import convert_to_reference_fx

    if isinstance(model, fx.GraphModule) and OBSERVED_KEY in model.meta:
        return convert_to_reference_fx(copy.deepcopy(model))
    if isinstance(model, fx.GraphModule) and (
        any(n.target in _QUANTIZE or n.target in _DEQUANTIZE for n in model.graph.nodes)
        or any(_is_reference_module(m) for m in model.modules())
    ):
        return model
    raise OnnxExportError(
        f"export_onnx: {type(model).__name__} holds no quantize or dequantize op, so it is "
        "not a quantized model's reference form; pass the prepared and calibrated model "
        "(prepare_fx + calibration) or convert_to_reference_fx(prepared), not the float model "
        "or a lowered one"
    )


def _is_reference_module(module: nn.Module) -> bool:
    return type(module).__module__.startswith("quantbridge.fx_quant.nn.reference")


def _aten_graph(
    reference: nn.Module, example_inputs: tuple[Any, ...], dynamic: bool
) -> tuple[fx.GraphModule, Any]:
    """The reference model as an ATen graph, and the dynamic shapes export found for it."""
    shapes = _auto_dynamic_shapes(example_inputs) if dynamic else None
    try:
        with _SizeOblivious(), _quiet_exporter():
            program = torch.export.export(
                reference, example_inputs, dynamic_shapes=shapes, strict=False
            )
    except Exception as e:  # export runs the whole model
        raise OnnxExportError(
            f"export_onnx: torch.export cannot capture the reference model: "
            f"{type(e).__name__}: {_first_line(e)}\n"
            "  fix: check that the reference model runs on example_inputs"
        ) from e
    graph = program.module()
    assert isinstance(graph, fx.GraphModule)
    return graph, _found_dynamic_shapes(program, example_inputs) if dynamic else None


def _found_dynamic_shapes(
    program: torch.export.ExportedProgram, example_inputs: tuple[Any, ...]
) -> Any:
    """``dynamic_shapes`` naming exactly the input dimensions ``program`` kept symbolic.

    Exporting the ATen graph again with every dimension left to export would lose what the
    reference model fixed (a conv's input channels): its weights are constants there.
    """
    values = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
    found = iter(
        values.get(getattr(s.arg, "name", ""))
        for s in program.graph_signature.input_specs
        if s.kind == InputKind.USER_INPUT
    )

    # the inputs in export's flattening order: sequences in order, dicts by insertion, no
    # leaf for None
    def spec(value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, (list, tuple)):
            return type(value)(spec(v) for v in value)
        if isinstance(value, dict):
            return {k: spec(v) for k, v in value.items()}
        shape = getattr(next(found), "shape", ())
        symbolic = {i: Dim.AUTO for i, size in enumerate(shape) if not is_concrete_int(size)}
        return symbolic or None

    return tuple(spec(v) for v in example_inputs)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """torch.onnx logs warnings about packages the export does not use (torchvision's ops),
    and warns that ``torch.export``'s module is in training mode (it cannot be switched)."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnxscript", "onnx_ir")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Exporting a model while it is in training")
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`")
            # the reference LSTM / GRU set torch's flat weight list in forward
            warnings.filterwarnings("ignore", message=r"The tensor attributes .*_flat_weights")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _root_cause(e: BaseException) -> str:
    """The innermost exception of torch.onnx's chain, and the node it was translating."""
    node = ""
    while e.__cause__ is not None:
        match = re.search(r"Error when translating node (%\S+)", str(e))
        node = match.group(1) if match else node
        e = e.__cause__
    where = f" (translating {node})" if node else ""
    return f"{type(e).__name__}: {_first_line(e)}{where}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


# --- reading quantize nodes ----------------------------------------------------------------


@dataclass(frozen=True)
class _Quantizer:
    """A quantize node's arguments, its tensor ones read from the graph's constants."""

    node: fx.Node
    scale: torch.Tensor
    zero_point: torch.Tensor
    axis: int | None
    quant_min: int
    quant_max: int
    dtype: torch.dtype
    name: str  # what the user finds on the reference model

    def codes_of(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` quantized exactly as this node does."""
        args = (values, self.scale, self.zero_point)
        if self.axis is not None:
            codes = _Q.quantize_per_channel(*args, self.axis, *self._range())
        else:
            codes = _Q.quantize_per_tensor.tensor(*args, *self._range())
        return cast(torch.Tensor, codes)

    def _range(self) -> tuple[int, int, torch.dtype]:
        return self.quant_min, self.quant_max, self.dtype


def _constant(graph: fx.GraphModule, arg: Any) -> torch.Tensor | None:
    """The tensor behind ``arg`` if it is a constant of the graph, a Python number as a
    tensor, else None."""
    if isinstance(arg, fx.Node):
        if arg.op != "get_attr":
            return None
        value = _fetch(graph, str(arg.target))
        return value.detach() if isinstance(value, torch.Tensor) else None
    if isinstance(arg, (int, float)):
        return torch.tensor(arg)
    return None


def _owner(graph: fx.GraphModule, target: str) -> tuple[nn.Module, str]:
    """The module holding attribute ``target`` (a dotted path), and the attribute's name."""
    owner_path, _, name = target.rpartition(".")
    return graph.get_submodule(owner_path), name


def _quantizer(graph: fx.GraphModule, node: fx.Node) -> _Quantizer | None:
    """The node's quantizer, if its scale and zero point are constants (static quantization);
    None for a dynamic one."""
    per_channel = node.target is _Q.quantize_per_channel.default
    scale, zero_point = _constant(graph, node.args[1]), _constant(graph, node.args[2])
    if scale is None or zero_point is None:
        return None
    rest = node.args[4:] if per_channel else node.args[3:]
    quant_min, quant_max, dtype = rest
    return _Quantizer(
        node=node,
        scale=scale,
        zero_point=zero_point,
        axis=int(node.args[3]) if per_channel else None,  # type: ignore[arg-type]
        quant_min=int(quant_min),  # type: ignore[arg-type]
        quant_max=int(quant_max),  # type: ignore[arg-type]
        dtype=dtype,  # type: ignore[arg-type]
        name=_name(node),
    )


def _name(node: fx.Node) -> str:
    """A quantizer's name on the reference model: its scale attribute, or for a weight the
    module that owns it."""
    scale = node.args[1]
    if _is_weight(node):
        return f"weight of {_module_path(node)}"
    if isinstance(scale, fx.Node) and scale.op == "get_attr":
        return str(scale.target)
    return node.name


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _ in stack.values() if path]
    return paths[-1] if paths else node.name


def _is_weight(node: fx.Node) -> bool:
    source = node.args[0]
    return isinstance(source, fx.Node) and source.op == "get_attr"


def _quantizers(graph: fx.GraphModule) -> list[_Quantizer]:
    found = []
    for node in graph.graph.nodes:
        if node.target in _QUANTIZE:
            quantizer = _quantizer(graph, node)
            if quantizer is not None:
                found.append(quantizer)
    return found


# --- checks --------------------------------------------------------------------------------


def _check_dtypes(graph: fx.GraphModule, opset: int) -> None:
    for node in graph.graph.nodes:
        if node.target not in _QUANTIZE and node.target not in _DEQUANTIZE:
            continue
        dtype = node.args[-1]
        if dtype not in _ONNX_DTYPE:
            raise OnnxExportError(
                f"export_onnx: {_name(node)} quantizes to {dtype}, which ONNX's "
                "QuantizeLinear does not take; quantize it to uint8, int8, uint16 or int16 "
                "(its QConfig's observer dtype), or keep it float"
            )
        if dtype in (torch.uint16, torch.int16) and opset < _OPSET_16_BIT:
            raise OnnxExportError(
                f"export_onnx: {_name(node)} quantizes to {dtype}, which QuantizeLinear takes "
                f"from opset {_OPSET_16_BIT}; pass opset={_OPSET_16_BIT} or later"
            )


def _check_tensorrt(graph: fx.GraphModule) -> None:
    """TensorRT's explicit quantization: int8, zero point 0, weights in [-127, 127]."""
    wrong = []
    for q in _quantizers(graph):
        if q.dtype != torch.int8:
            wrong.append(f"{q.name}: {q.dtype}, not torch.int8")
        elif bool((q.zero_point != 0).any()):
            wrong.append(f"{q.name}: zero point {q.zero_point.flatten()[:4].tolist()}, not 0")
        elif _is_weight(q.node) and q.quant_min < -127:
            wrong.append(f"{q.name}: weights in [{q.quant_min}, {q.quant_max}], not [-127, 127]")
    dynamic = [
        n.name for n in graph.graph.nodes if n.target is _Q.choose_qparams_per_tensor.default
    ]
    wrong += [f"{name}: dynamic quantization" for name in dynamic]
    if wrong:
        listed = "\n".join(f"  - {line}" for line in wrong[:12])
        more = f"\n  ... and {len(wrong) - 12} more" if len(wrong) > 12 else ""
        raise OnnxExportError(
            f"export_onnx(profile='tensorrt'): {len(wrong)} quantizers are not what TensorRT "
            f"takes (symmetric int8, zero point 0):\n{listed}{more}\n  fix: {_TENSORRT_FIX}"
        )


def _check_weights_are_integers(model: Any) -> None:
    """Every DequantizeLinear of a constant reads integers (the exporter must not have folded
    a weight back into float)."""
    float_inits = {i.name for i in model.graph.initializer if i.data_type == 1}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in float_inits:
            raise OnnxExportError(
                f"export_onnx: DequantizeLinear {node.name!r} reads a float initializer; this "
                "is a bug in quantbridge, please report it with the model"
            )


# --- graph edits ---------------------------------------------------------------------------


def _fold_weight_quantizers(graph: fx.GraphModule) -> tuple[str, ...]:
    """Replace each quantize of a constant with the constant codes, kept beside the weight
    (``conv.weight`` -> ``conv.weight_codes``, which names the initializer in the file)."""
    folded = []
    for q in _quantizers(graph):
        source = q.node.args[0]
        weight = _constant(graph, source)
        if not _is_weight(q.node) or weight is None:
            continue
        assert isinstance(source, fx.Node)
        target = _register_beside(graph, str(source.target), "codes", q.codes_of(weight))
        with graph.graph.inserting_before(q.node):
            constant = graph.graph.get_attr(target)
        q.node.replace_all_uses_with(constant)
        graph.graph.erase_node(q.node)
        if q.zero_point.is_floating_point():
            _integer_zero_points(graph, constant, q)
        folded.append(_module_path(q.node))
    graph.graph.eliminate_dead_code()
    _delete_unused_attributes(graph)
    return tuple(folded)


def _register_beside(graph: fx.GraphModule, target: str, suffix: str, value: torch.Tensor) -> str:
    """Register ``value`` on the module owning ``target`` as ``<name>_<suffix>``."""
    owner, name = _owner(graph, target)
    owner.register_buffer(f"{name}_{suffix}", value)
    return f"{target}_{suffix}"


def _integer_zero_points(graph: fx.GraphModule, codes: fx.Node, q: _Quantizer) -> None:
    """Float zero points (``per_channel_affine_float_qparams``, embeddings): DequantizeLinear
    takes integer ones only, so ``(q - zp) * scale`` is written ``q * scale - zp * scale``,
    a dequantize with zero point 0 and a per-channel float offset (within float32 rounding
    of the reference's arithmetic)."""
    assert q.axis is not None
    shape = [1] * codes.meta["val"].dim() if "val" in codes.meta else [1, 1]
    shape[q.axis] = -1
    weight = str(codes.target).removesuffix("_codes")
    offset = (q.zero_point.to(torch.float32) * q.scale.to(torch.float32)).reshape(shape)
    offset_target = _register_beside(graph, weight, "offset", offset)
    zeros = torch.zeros_like(q.zero_point, dtype=torch.int32)
    zero_target = _register_beside(graph, weight, "zero_point", zeros)
    for dequantize in list(codes.users):
        if dequantize.target is not _Q.dequantize_per_channel.default:
            continue
        readers = list(dequantize.users)
        with graph.graph.inserting_before(dequantize):
            zero = graph.graph.get_attr(zero_target)
        dequantize.update_arg(2, zero)
        with graph.graph.inserting_after(dequantize):
            shift = graph.graph.get_attr(offset_target)
        with graph.graph.inserting_after(shift):
            shifted = graph.graph.call_function(torch.ops.aten.sub.Tensor, (dequantize, shift))
        for reader in readers:
            reader.replace_input_with(dequantize, shifted)


def _rename_clashing_constants(graph: fx.GraphModule) -> None:
    """torch.export names a lifted buffer ``b_<name>`` (parameters ``p_``, constants ``c_``)
    and torch.onnx names the file's initializers by the attribute: a reference model with
    buffers ``fc_scale_0`` and ``b_fc_scale_0`` (modules ``fc`` and ``b.fc``) would give two
    values one name. Such attributes move to a name no lifted one can take."""
    names = [n for n, _ in graph.named_parameters()] + [n for n, _ in graph.named_buffers()]
    lifted = {f"{p}_{n.replace('.', '_')}" for n in names for p in ("p", "b", "c")}
    renamed = {}
    for name in names:
        if name in lifted or name.replace(".", "_") in lifted:
            owner, attr = _owner(graph, name)
            new = f"qdq_{attr}"
            while hasattr(owner, new):
                new = f"_{new}"
            value = getattr(owner, attr)
            delattr(owner, attr)
            owner.register_buffer(new, value)
            renamed[name] = name.removesuffix(attr) + new
    for node in graph.graph.nodes:
        if node.op == "get_attr" and node.target in renamed:
            node.target = renamed[node.target]


def _delete_unused_attributes(graph: fx.GraphModule) -> None:
    used = {str(n.target) for n in graph.graph.nodes if n.op == "get_attr"}
    for name, _ in list(graph.named_parameters()) + list(graph.named_buffers()):
        if name not in used:
            owner, attr = _owner(graph, name)
            delattr(owner, attr)


def _drop_redundant_clamps(graph: fx.GraphModule) -> int:
    """Remove ``relu`` / ``hardtanh`` / ``clamp`` feeding only a quantize that already maps
    its bounds past the quantize's own ends: quantizing is monotonic, so
    ``q(clamp(x, lo, hi)) == clamp(q(x), q(lo), q(hi))``, which is ``q(x)`` when
    ``q(lo) <= quant_min`` and ``q(hi) >= quant_max``."""
    removed = 0
    for q in _quantizers(graph):
        clamp = q.node.args[0]
        if not (
            isinstance(clamp, fx.Node)
            and clamp.target in _CLAMPS
            and len(clamp.users) == 1
            and q.axis is None
            and not _mutates_a_later_read(clamp)
        ):
            continue
        low, high = _clamp_bounds(clamp)
        if low is None and high is None:
            continue
        ends = [v for v in (low, high) if v is not None]
        codes = q.codes_of(torch.tensor(ends, dtype=torch.float32)).tolist()
        low_ok = low is None or codes[0] <= q.quant_min
        high_ok = high is None or codes[-1] >= q.quant_max
        if low_ok and high_ok:
            source = clamp.args[0]
            assert isinstance(source, fx.Node)
            q.node.replace_input_with(clamp, source)
            graph.graph.erase_node(clamp)
            removed += 1
    return removed


def _mutates_a_later_read(node: fx.Node) -> bool:
    """An in-place op also changes its input for that input's readers after it."""
    if not str(node.target).split(".")[-2].endswith("_"):
        return False
    source = node.args[0]
    assert isinstance(source, fx.Node)
    if source.op in ("placeholder", "get_attr"):
        return True
    return any(user > node for user in source.users)  # fx orders nodes as the graph runs


def _functional_in_place_ops(graph: fx.GraphModule) -> None:
    """``relu_`` / ``hardtanh_`` ... whose mutation no one sees become ``relu`` /
    ``hardtanh``: torch.onnx translates those directly, where it decomposes the in-place
    forms through symbolic-shape references (seconds per model)."""
    for node in graph.graph.nodes:
        namespace, name, overload = [*str(node.target).split("."), "", "", ""][:3]
        if not (
            node.op == "call_function"
            and namespace == "aten"
            and name.endswith("_")
            and node.args
            and isinstance(node.args[0], fx.Node)
            and not _mutates_a_later_read(node)
        ):
            continue
        functional = getattr(getattr(torch.ops.aten, name[:-1], None), overload, None)
        if functional is not None:
            node.target = functional


def _reductions_as_matrices(graph: fx.GraphModule) -> None:
    """A sum / mean of a dequantized value of rank 3 or more over dims that are not its last
    ones reduces a matrix instead (:func:`_reduce_as_matrix`): OpenVINO 2026.4 computes
    ``DequantizeLinear -> ReduceSum`` there as zeros for every batch row after the first (a
    mean-pooled sequence), and a permuted view alone does not avoid it."""
    for node in graph.graph.nodes:
        if node.target not in _REDUCTIONS or len(node.args) < 2:
            continue
        source, dims = node.args[0], node.args[1]
        if not (isinstance(source, fx.Node) and source.target in _DEQUANTIZE):
            continue
        rank = source.meta["val"].dim()
        reduced = sorted({d % rank for d in dims}) if dims else list(range(rank))
        if rank >= 3 and reduced != list(range(rank - len(reduced), rank)):
            node.target = _REDUCTIONS[node.target]


def _reduce_as_matrix(
    reduce: Callable[..., torch.Tensor],
    x: torch.Tensor,
    dims: list[int],
    keepdim: bool = False,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``reduce(x, dims, keepdim)`` computed on the matrix (kept dims, reduced dims)."""
    rank = x.dim()
    reduced = sorted({d % rank for d in dims})
    kept = [d for d in range(rank) if d not in reduced]
    width = math.prod(x.shape[d] for d in reduced)
    matrix = x.permute(*kept, *reduced).reshape(-1, width)
    out = reduce(matrix, 1, dtype=dtype).reshape([x.shape[d] for d in kept])
    for d in reduced if keepdim else ():
        out = out.unsqueeze(d)
    return out


def _sum_as_matrix(
    x: torch.Tensor, dims: list[int], keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    return _reduce_as_matrix(torch.sum, x, dims, keepdim, dtype)


def _mean_as_matrix(
    x: torch.Tensor, dims: list[int], keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    return _reduce_as_matrix(torch.mean, x, dims, keepdim, dtype)


_REDUCTIONS: dict[Any, Callable[..., torch.Tensor]] = {
    torch.ops.aten.sum.dim_IntList: _sum_as_matrix,
    torch.ops.aten.mean.dim: _mean_as_matrix,
}


def _linear_biases_added_after(graph: fx.GraphModule) -> None:
    """``linear(x, w, b)`` of a dequantized ``x`` and ``w`` whose result stays float (float
    logits) as ``linear(x, w) + b``.

    ONNX Runtime makes a ``Gemm`` with a float bias and no quantize after it a float
    ``Gemm`` that dequantizes its weight at every call (a quarter of a millisecond for
    MobileNetV2's classifier); without the bias it fuses the inputs into an integer
    ``QGemm`` with a float result. The reference model adds the bias in float, as the
    ``Add`` does. With a quantize after it, ONNX Runtime fuses the whole layer as it is."""
    for node in list(graph.graph.nodes):
        if node.target is not torch.ops.aten.linear.default or len(node.args) < 3:
            continue
        x, weight, bias = node.args[:3]
        dequantized = all(isinstance(a, fx.Node) and a.target in _DEQUANTIZE for a in (x, weight))
        quantized = any(user.target in _QUANTIZE for user in node.users)
        if bias is None or not dequantized or quantized:
            continue
        users = list(node.users)
        node.args = (x, weight)
        with graph.graph.inserting_after(node):
            added = graph.graph.call_function(torch.ops.aten.add.Tensor, (node, bias))
        for user in users:
            user.replace_input_with(node, added)


def _embedding_bags_without_loops(graph: fx.GraphModule) -> None:
    """``embedding_bag`` as gathers, comparisons and one matmul (:func:`_embedding_bag`):
    torch.onnx writes it as an ONNX ``Loop`` over the bags, which OpenVINO 2026.4 does not
    read. Only the result is rewritten: a node whose other outputs are read is left as is."""
    for node in graph.graph.nodes:
        if node.target not in _EMBEDDING_BAGS:
            continue
        if any(u.target is not operator.getitem for u in node.users):
            continue
        others = [u for u in node.users if u.args[1] != 0]
        if any(u.users for u in others):
            continue
        for unread in others:
            graph.graph.erase_node(unread)
        node.target = _embedding_bag


def _embedding_bag(
    weight: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    scale_grad_by_freq: bool = False,
    mode: int = 0,
    sparse: bool = False,
    per_sample_weights: torch.Tensor | None = None,
    include_last_offset: bool = False,
    padding_idx: int | None = -1,
) -> tuple[torch.Tensor, ...]:
    """ATen's ``_embedding_bag`` result (``mode`` 0 sum, 1 mean, 2 max; padding index -1 or
    None for none) from a bag-membership matrix: row ``b`` of ``member`` is 1 at the
    positions of bag ``b``, so a sum is ``member @ rows``. Empty bags give 0, as torch's."""
    if indices.dim() == 2:  # one bag per row, no offsets
        width = indices.shape[1]
        offsets = torch.arange(indices.shape[0], device=indices.device) * width
        indices = indices.reshape(-1)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.reshape(-1)
        include_last_offset = False
    positions = torch.arange(indices.shape[0], device=indices.device)
    if include_last_offset:
        starts, ends = offsets[:-1], offsets[1:]
    else:
        ends = torch.cat([offsets[1:], positions.new_full((1,), indices.shape[0])])
        starts = offsets
    member = (positions[None, :] >= starts[:, None]) & (positions[None, :] < ends[:, None])
    if padding_idx is not None and padding_idx >= 0:
        member = member & (indices != padding_idx)[None, :]
    rows = weight.index_select(0, indices)
    count = member.sum(1, keepdim=True).to(weight.dtype)
    if mode == 2:
        masked = torch.where(member[:, :, None], rows[None, :, :], float("-inf"))
        result = torch.where(count > 0, masked.amax(1), 0.0)
    else:
        weights = member.to(weight.dtype)
        if per_sample_weights is not None:
            weights = weights * per_sample_weights[None, :]
        result = weights @ rows
        if mode == 1:
            result = result / count.clamp(min=1.0)
    return (result,)


def _clamp_bounds(clamp: fx.Node) -> tuple[float | None, float | None]:
    if clamp.target in _RELUS:
        return 0.0, None
    low_at, high_at = _CLAMPS[clamp.target]
    bounds = []
    for position, default in ((low_at, -1.0), (high_at, 1.0)):
        value = (
            clamp.args[position] if position is not None and len(clamp.args) > position else None
        )
        if value is None and clamp.target in _HARDTANHS:
            value = default
        if value is not None and not isinstance(value, (int, float)):
            return None, None  # a tensor bound: not a constant to check
        bounds.append(None if value is None else float(value))
    return bounds[0], bounds[1]


def _clip_narrow_ranges(graph: fx.GraphModule) -> tuple[str, ...]:
    """Activation quantizers with a range narrower than their dtype get a float clamp at the
    range's ends: ONNX's QuantizeLinear only saturates at the dtype's limits."""
    clipped = []
    for q in _quantizers(graph):
        if _is_weight(q.node) or (q.quant_min, q.quant_max) == QUANT_DTYPE_RANGES[q.dtype]:
            continue
        low, high = _range_ends(q)
        source = q.node.args[0]
        assert isinstance(source, fx.Node)
        with graph.graph.inserting_before(q.node):
            clamp = graph.graph.call_function(torch.ops.aten.clamp.default, (source, low, high))
        q.node.replace_input_with(source, clamp)
        clipped.append(q.name)
    return tuple(clipped)


def _range_ends(q: _Quantizer) -> tuple[float, float]:
    """Float values whose codes are exactly ``quant_min`` and ``quant_max``: the dequantized
    ends, nudged inwards in the rare case rounding puts one a code outside."""
    codes = torch.tensor([q.quant_min, q.quant_max], dtype=torch.int32)
    ends = (codes - q.zero_point.to(torch.int32)).to(torch.float32) * q.scale.to(torch.float32)
    for _ in range(4):
        got = q.codes_of(ends).to(torch.int32)
        if bool((got == codes).all()):
            return float(ends[0]), float(ends[1])
        ends = torch.where(got < codes, torch.nextafter(ends, ends + 1), ends)
        ends = torch.where(got > codes, torch.nextafter(ends, ends - 1), ends)
    raise OnnxExportError(
        f"export_onnx: no float value quantizes to the ends of {q.name}'s range "
        f"[{q.quant_min}, {q.quant_max}] (scale {q.scale.tolist()}); quantize it to its dtype's "
        "full range"
    )


# --- ONNX translations of the quantbridge ops ----------------------------------------------


def _translations(opset: int) -> dict[Callable[..., Any], Callable[..., Any]]:
    """torch.onnx translation functions of ``torch.ops.quantbridge``, for ``opset``."""
    op = getattr(importlib.import_module("onnxscript"), f"opset{opset}")

    def scalar(value: Any) -> Any:
        return op.Reshape(value, op.Constant(value_ints=[]))

    def zero_point_as(zero_point: Any, dtype: int) -> Any:
        return op.Cast(zero_point, to=_onnx_type(dtype))

    def scale_of(scale: Any) -> Any:
        return op.Cast(scale, to=1)

    # per tensor: scalar scale and zero point (a one-element vector stops ONNX Runtime's fusions)
    def quantize_per_tensor(x: Any, scale: Any, zp: Any, qmin: int, qmax: int, dtype: int) -> Any:
        return op.QuantizeLinear(x, scalar(scale_of(scale)), scalar(zero_point_as(zp, dtype)))

    def dequantize_per_tensor(q: Any, scale: Any, zp: Any, qmin: int, qmax: int, dtype: int) -> Any:
        return op.DequantizeLinear(q, scalar(scale_of(scale)), scalar(zero_point_as(zp, dtype)))

    def quantize_per_channel(
        x: Any, scale: Any, zp: Any, axis: int, qmin: int, qmax: int, dtype: int
    ) -> Any:
        return op.QuantizeLinear(x, scale_of(scale), zero_point_as(zp, dtype), axis=axis)

    def dequantize_per_channel(
        q: Any, scale: Any, zp: Any, axis: int, qmin: int, qmax: int, dtype: int
    ) -> Any:
        return op.DequantizeLinear(q, scale_of(scale), zero_point_as(zp, dtype), axis=axis)

    def choose_qparams(x: Any, qmin: int, qmax: int, reduce_range: bool = False) -> Any:
        return _choose_qparams(op, x, qmin, qmax, reduce_range)

    return {
        _Q.quantize_per_tensor.default: quantize_per_tensor,
        _Q.quantize_per_tensor.tensor: quantize_per_tensor,
        _Q.dequantize_per_tensor.default: dequantize_per_tensor,
        _Q.dequantize_per_tensor.tensor: dequantize_per_tensor,
        _Q.quantize_per_channel.default: quantize_per_channel,
        _Q.dequantize_per_channel.default: dequantize_per_channel,
        _Q.choose_qparams_per_tensor.default: choose_qparams,
    }


def _onnx_type(dtype: Any) -> int:
    """The exporter hands ScalarType arguments over as ONNX data types; a torch dtype is
    mapped."""
    if isinstance(dtype, torch.dtype):
        return _ONNX_DTYPE[dtype]
    return int(dtype)


def _choose_qparams(op: Any, x: Any, qmin: int, qmax: int, reduce_range: bool) -> Any:
    """torch's dynamic-quantization qparams (``choose_qparams_values``) in ONNX ops, in
    float64 as torch computes them: the range widened to hold 0, a zero range's scale 0.1,
    scales below 6.1e-5 raised to it, the zero point from the end with the smaller error."""
    if reduce_range:
        qmin, qmax = int(qmin / 2), int(qmax / 2)
    f64 = 11
    zero = op.Constant(value_float=0.0)
    low = op.Cast(op.Min(op.ReduceMin(x, keepdims=0), zero), to=f64)
    high = op.Cast(op.Max(op.ReduceMax(x, keepdims=0), zero), to=f64)
    levels = _double(op, float(qmax - qmin))
    scale = op.Div(op.Sub(high, low), levels)
    scale32 = op.Cast(scale, to=1)
    zero_scale = op.Or(
        op.Equal(scale32, op.Constant(value_float=0.0)),
        op.IsInf(op.Reciprocal(scale32)),
    )
    scale = op.Where(zero_scale, _double(op, 0.1), scale)
    small = _double(op, float(torch.tensor(6.1e-5, dtype=torch.float32)))
    tiny = op.Less(scale, small)
    # a tiny range grows to small * levels, from whichever end is not 0
    amplifier = op.Cast(op.Cast(op.Div(small, op.Cast(op.Cast(scale, to=1), to=f64)), to=1), to=f64)
    grown = op.Cast(op.Cast(op.Mul(small, levels), to=1), to=f64)
    low_zero = op.Equal(low, _double(op, 0.0))
    high_zero = op.Equal(high, _double(op, 0.0))
    low = op.Where(
        tiny,
        op.Where(
            low_zero, low, op.Where(high_zero, op.Neg(grown), _f32(op, op.Mul(low, amplifier)))
        ),
        low,
    )
    high = op.Where(
        tiny,
        op.Where(low_zero, grown, op.Where(high_zero, high, _f32(op, op.Mul(high, amplifier)))),
        high,
    )
    scale = op.Where(tiny, small, scale)
    qmin_d, qmax_d = _double(op, float(qmin)), _double(op, float(qmax))
    from_min = op.Sub(qmin_d, op.Div(low, scale))
    from_max = op.Sub(qmax_d, op.Div(high, scale))
    error_min = op.Add(op.Abs(qmin_d), op.Abs(op.Div(low, scale)))
    error_max = op.Add(op.Abs(qmax_d), op.Abs(op.Div(high, scale)))
    initial = op.Where(op.Less(error_min, error_max), from_min, from_max)
    zero_point = op.Cast(op.Clip(op.Round(initial), qmin_d, qmax_d), to=7)
    return scale, zero_point


def _double(op: Any, value: float) -> Any:
    onnx = importlib.import_module("onnx")
    return op.Constant(value=onnx.helper.make_tensor("value", 11, [], [value]))


def _f32(op: Any, value: Any) -> Any:
    """``value`` rounded to float32 and back to float64."""
    return op.Cast(op.Cast(value, to=1), to=11)


def _dynamic_axes(model: Any) -> dict[str, tuple[int, ...]]:
    axes = {}
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        axes[value.name] = tuple(i for i, d in enumerate(dims) if not d.HasField("dim_value"))
    return axes
