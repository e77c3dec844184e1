"""``QParams``: the scale and zero point of quantized codes, as kernel APIs take them."""

from __future__ import annotations

from typing import Any, NamedTuple

from quantbridge.kernels._errors import KernelError

__all__ = ["QParams", "as_qparams"]


class QParams(NamedTuple):
    """How codes map to values: ``value = scale * (code - zero_point)``.

    A plain ``(scale, zero_point)`` tuple is accepted wherever a ``QParams`` is.
    """

    scale: float
    zero_point: int


def as_qparams(name: str, value: Any) -> QParams:
    """``value`` as QParams; a KernelError naming ``name`` unless it is a (scale, zero point)
    pair (the values themselves are checked by the kernel, under ``name.scale`` etc.)."""
    if isinstance(value, QParams):
        return value
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise KernelError(
            f"{name}: expected QParams(scale, zero_point) or a (scale, zero_point) pair, got "
            f"{value!r}"
        )
    return QParams(value[0], value[1])
