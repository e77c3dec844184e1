"""Dtypes and quantization schemes on plain tensors.

Canonical quantized dtypes are ordinary integer torch dtypes (uint8, int8, uint16, int16,
int32); float configs use float32/float16/bfloat16. torch.ao's quantized dtypes
(``torch.quint8``, ``torch.qint8``, ``torch.qint32``, and the sub-byte ``torch.quint4x2`` /
``torch.quint2x4``) are accepted as aliases so configs written for torch.ao work unchanged.
They are looked up by name, never by attribute, so this module keeps working once PyTorch
removes them.

Quantization schemes are :class:`QScheme` members; torch's ``torch.per_tensor_affine``-style
objects and plain strings are accepted as aliases.
"""

from __future__ import annotations

import enum

import torch

from quantbridge.qconfig._errors import QConfigError

QUANTIZED_DTYPES: tuple[torch.dtype, ...] = (
    torch.uint8,
    torch.int8,
    torch.uint16,
    torch.int16,
    torch.int32,
)
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

# torch.ao alias name -> (canonical dtype, its natural quantized range).
_ALIASES: dict[str, tuple[torch.dtype, tuple[int, int]]] = {
    "quint8": (torch.uint8, (0, 255)),
    "qint8": (torch.int8, (-128, 127)),
    "qint32": (torch.int32, (-(2**31), 2**31 - 1)),
    "quint4x2": (torch.uint8, (0, 15)),
    "quint2x4": (torch.uint8, (0, 3)),
}
_ALIAS_BY_OBJECT: dict[object, str] = {
    getattr(torch, name): name for name in _ALIASES if hasattr(torch, name)
}


def dtype_alias_name(dtype: object) -> str | None:
    """``"quint8"`` for ``torch.quint8`` (and the other torch.ao aliases), else None."""
    try:
        return _ALIAS_BY_OBJECT.get(dtype)
    except TypeError:  # unhashable input
        return None


def canonical_dtype(dtype: object, where: str = "dtype") -> torch.dtype:
    """The plain torch dtype for ``dtype``; torch.ao quantized dtypes map to integer dtypes."""
    alias = dtype_alias_name(dtype)
    if alias is not None:
        return _ALIASES[alias][0]
    if isinstance(dtype, torch.dtype) and dtype in QUANTIZED_DTYPES + FLOAT_DTYPES:
        return dtype
    allowed = ", ".join(str(d) for d in QUANTIZED_DTYPES + FLOAT_DTYPES)
    raise QConfigError(
        f"{where}: unsupported dtype {dtype!r}; use one of {allowed} "
        "(torch.quint8/qint8/qint32/quint4x2/quint2x4 are accepted as aliases)"
    )


def natural_quant_range(dtype: object) -> tuple[int, int]:
    """The full integer range of a quantized dtype or alias (quint4x2 -> (0, 15))."""
    alias = dtype_alias_name(dtype)
    if alias is not None:
        return _ALIASES[alias][1]
    canonical = canonical_dtype(dtype)
    if canonical not in QUANTIZED_DTYPES:
        raise QConfigError(f"{canonical} is not a quantized integer dtype; it has no quant range")
    info = torch.iinfo(canonical)
    return int(info.min), int(info.max)


def is_quantized_dtype(dtype: object) -> bool:
    """True for integer quantized dtypes and their torch.ao aliases."""
    if dtype_alias_name(dtype) is not None:
        return True
    return isinstance(dtype, torch.dtype) and dtype in QUANTIZED_DTYPES


class QScheme(str, enum.Enum):
    """How a tensor is quantized: one (scale, zero_point), one per channel, or one per group
    of consecutive elements of each row (``per_group_*``: not in torch; weight-only LLM
    quantization, a row's input features in groups of 32, 64 or 128)."""

    PER_TENSOR_AFFINE = "per_tensor_affine"
    PER_TENSOR_SYMMETRIC = "per_tensor_symmetric"
    PER_CHANNEL_AFFINE = "per_channel_affine"
    PER_CHANNEL_SYMMETRIC = "per_channel_symmetric"
    PER_CHANNEL_AFFINE_FLOAT_QPARAMS = "per_channel_affine_float_qparams"
    PER_GROUP_AFFINE = "per_group_affine"
    PER_GROUP_SYMMETRIC = "per_group_symmetric"

    @property
    def is_per_channel(self) -> bool:
        return self.value.startswith("per_channel")

    @property
    def is_per_group(self) -> bool:
        return self.value.startswith("per_group")

    @property
    def is_symmetric(self) -> bool:
        return self.value.endswith("symmetric")

    def __str__(self) -> str:
        return self.value


def canonical_qscheme(qscheme: object, where: str = "qscheme") -> QScheme:
    """A QScheme from a QScheme, its name (``"per_tensor_affine"``) or a torch qscheme object."""
    if isinstance(qscheme, QScheme):
        return qscheme
    # torch.per_tensor_affine and friends print as "torch.per_tensor_affine".
    name = str(qscheme).removeprefix("torch.") if qscheme is not None else ""
    try:
        return QScheme(name)
    except ValueError:
        allowed = ", ".join(q.value for q in QScheme)
        raise QConfigError(f"{where}: unknown qscheme {qscheme!r}; use one of {allowed}") from None
