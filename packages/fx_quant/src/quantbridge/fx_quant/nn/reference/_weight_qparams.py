"""Weight qparams of reference modules: parsing torch.ao's dict, checks, the weight round trip."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.qconfig import (
    QScheme,
    canonical_dtype,
    canonical_qscheme,
    natural_quant_range,
)

__all__ = [
    "QuantizedWeight",
    "WeightQParams",
    "check_weight_qparams",
    "extra_state_from_torch_ao",
    "fake_quantize_weight",
    "parse_weight_qparams",
    "quantize_weight",
]

_ops = torch.ops.quantbridge

# Symmetric schemes store the same qparams as their affine counterparts (zero point fixed).
_AS_AFFINE = {
    QScheme.PER_TENSOR_SYMMETRIC: QScheme.PER_TENSOR_AFFINE,
    QScheme.PER_CHANNEL_SYMMETRIC: QScheme.PER_CHANNEL_AFFINE,
}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# torch.ao's reference modules default to this when given no qparams.
_DEFAULT_QPARAMS: dict[str, Any] = {
    "qscheme": QScheme.PER_TENSOR_AFFINE,
    "dtype": torch.uint8,
    "scale": 1.0,
    "zero_point": 0,
}


class WeightQParams(NamedTuple):
    """Parsed weight qparams; ``scale``/``zero_point``/``axis`` are ready to be buffers."""

    qscheme: QScheme | None
    dtype: torch.dtype
    quant_min: int
    quant_max: int
    scale: torch.Tensor
    zero_point: torch.Tensor
    axis: torch.Tensor


class QuantizedWeight(NamedTuple):
    """A weight as plain integers plus what is needed to read it back as floats."""

    values: torch.Tensor  # uint8/int8/int32 tensor, same shape as the float weight
    scale: torch.Tensor
    zero_point: torch.Tensor
    axis: int | None  # the channel axis for per-channel schemes
    quant_min: int
    quant_max: int
    dtype: torch.dtype
    qscheme: QScheme


def _as_tensor(value: Any, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        copy = value.detach().clone()
        return copy if device is None else copy.to(device)
    return torch.tensor(value, dtype=dtype, device=device)


def parse_weight_qparams(
    weight_qparams: Mapping[str, Any] | None, where: str, device: torch.device | str | None
) -> WeightQParams:
    """Read a torch.ao-style weight qparams dict (None: torch.ao's per-tensor uint8 default)."""
    qparams = dict(_DEFAULT_QPARAMS if weight_qparams is None else weight_qparams)
    if "dtype" not in qparams or "qscheme" not in qparams:
        raise FxQuantError(
            f"{where}: weight_qparams needs 'qscheme' and 'dtype' keys, got {sorted(qparams)}"
        )
    raw_dtype = qparams["dtype"]
    qscheme = None
    if qparams["qscheme"] is not None:
        try:
            qscheme = canonical_qscheme(qparams["qscheme"], f"{where}: weight_qparams['qscheme']")
        except ValueError as e:
            raise FxQuantError(str(e)) from None
        qscheme = _AS_AFFINE.get(qscheme, qscheme)
    try:
        dtype = canonical_dtype(raw_dtype, f"{where}: weight_qparams['dtype']")
    except ValueError as e:
        raise FxQuantError(str(e)) from None
    placeholder_axis = torch.tensor(0, dtype=torch.int32, device=device)
    if qscheme is None or dtype in FLOAT_DTYPES:
        # Placeholders keep the buffer layout uniform (torch.ao does the same).
        return WeightQParams(
            qscheme,
            dtype,
            0,
            0,
            torch.tensor(1.0, dtype=torch.float32, device=device),
            torch.tensor(0, dtype=torch.int32, device=device),
            placeholder_axis,
        )
    low, high = natural_quant_range(raw_dtype)
    qmin, qmax = qparams.get("quant_min"), qparams.get("quant_max")
    quant_min = low if qmin is None else int(qmin)
    quant_max = high if qmax is None else int(qmax)
    if not low <= quant_min <= quant_max <= high:
        raise FxQuantError(
            f"{where}: weight_qparams quant range [{qmin}, {qmax}] does not fit dtype "
            f"{raw_dtype} ([{low}, {high}])"
        )
    for key in ("scale", "zero_point"):
        if key not in qparams:
            raise FxQuantError(f"{where}: weight_qparams is missing {key!r}")
    float_zp = qscheme is QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS
    scale = _as_tensor(qparams["scale"], torch.float32, device)
    zero_point = _as_tensor(
        qparams["zero_point"], torch.float32 if float_zp else torch.int32, device
    )
    axis = placeholder_axis
    if qscheme.is_per_channel:
        if qparams.get("axis") is None:
            raise FxQuantError(f"{where}: weight_qparams for {qscheme.value} needs an 'axis'")
        axis = _as_tensor(qparams["axis"], torch.int32, device)
    return WeightQParams(qscheme, dtype, quant_min, quant_max, scale, zero_point, axis)


def check_weight_qparams(
    weight: torch.Tensor,
    qscheme: QScheme | None,
    dtype: torch.dtype,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    axis: int,
    where: str,
) -> None:
    """FxQuantError unless the qparams' shapes fit ``weight``."""
    if qscheme is None or dtype in FLOAT_DTYPES:
        return
    if not qscheme.is_per_channel:
        if scale.numel() != 1 or zero_point.numel() != 1:
            raise FxQuantError(
                f"{where}: per-tensor weight_qparams need one scale and one zero_point, "
                f"got {scale.numel()} and {zero_point.numel()}"
            )
        return
    ndim = weight.dim()
    if not -ndim <= axis < ndim:
        raise FxQuantError(
            f"{where}: weight_qparams axis={axis} is out of range for a {ndim}-d weight"
        )
    channels = weight.shape[axis]
    if scale.numel() != channels or zero_point.numel() != channels:
        raise FxQuantError(
            f"{where}: weight has {channels} channels along axis {axis} but weight_qparams "
            f"has {scale.numel()} scales and {zero_point.numel()} zero points"
        )


def fake_quantize_weight(
    weight: torch.Tensor,
    qscheme: QScheme | None,
    dtype: torch.dtype,
    quant_min: int,
    quant_max: int,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    axis: int,
) -> torch.Tensor:
    """``dequantize(quantize(weight))`` through torch.ops.quantbridge (float weights pass)."""
    if qscheme is None or dtype == torch.float32:
        return weight
    if dtype in FLOAT_DTYPES:
        return weight.to(dtype).to(weight.dtype)
    if qscheme.is_per_channel:
        q = _ops.quantize_per_channel(weight, scale, zero_point, axis, quant_min, quant_max, dtype)
        result: torch.Tensor = _ops.dequantize_per_channel(
            q, scale, zero_point, axis, quant_min, quant_max, dtype
        )
        return result
    q = _ops.quantize_per_tensor.tensor(weight, scale, zero_point, quant_min, quant_max, dtype)
    result = _ops.dequantize_per_tensor.tensor(q, scale, zero_point, quant_min, quant_max, dtype)
    return result


def quantize_weight(
    weight: torch.Tensor,
    qscheme: QScheme | None,
    dtype: torch.dtype,
    quant_min: int,
    quant_max: int,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    axis: int,
    where: str,
) -> QuantizedWeight:
    """``weight`` as plain integers with its qparams; FxQuantError for float schemes."""
    if qscheme is None or dtype in FLOAT_DTYPES:
        raise FxQuantError(
            f"{where}: weight dtype {dtype} (qscheme {qscheme}) has no integer form; "
            "use get_weight()"
        )
    with torch.no_grad():
        if qscheme.is_per_channel:
            values = _ops.quantize_per_channel(
                weight, scale, zero_point, axis, quant_min, quant_max, dtype
            )
            channel_axis: int | None = axis
        else:
            values = _ops.quantize_per_tensor.tensor(
                weight, scale, zero_point, quant_min, quant_max, dtype
            )
            channel_axis = None
    return QuantizedWeight(
        values, scale, zero_point, channel_axis, quant_min, quant_max, dtype, qscheme
    )


def extra_state_from_torch_ao(qscheme: object, dtype: object) -> dict[str, Any]:
    """Our extra state for torch.ao's saved ``weight_qscheme``/``weight_dtype`` objects."""
    parsed = parse_weight_qparams(
        {"qscheme": qscheme, "dtype": dtype, "scale": 1.0, "zero_point": 0, "axis": 0},
        "torch.ao state_dict",
        None,
    )
    return {
        "weight_qscheme": None if parsed.qscheme is None else parsed.qscheme.value,
        "weight_dtype": str(parsed.dtype).removeprefix("torch."),
        "weight_quant_min": parsed.quant_min,
        "weight_quant_max": parsed.quant_max,
    }
