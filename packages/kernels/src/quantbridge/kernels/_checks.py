"""Input checks run in Python before any compiled kernel sees an array.

Every public kernel wrapper validates with these helpers, so bad input becomes a KernelError
that names the argument, never a crash or an out-of-bounds access inside numba code.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from quantbridge.kernels._errors import KernelError

INT32_MAX = 2**31 - 1


def check_array(
    name: str,
    array: object,
    dtype: npt.DTypeLike | tuple[npt.DTypeLike, ...],
    ndim: int | tuple[int, ...] | None = None,
    *,
    contiguous: bool = True,
    allow_empty: bool = False,
) -> npt.NDArray[np.generic]:
    """Return ``array`` if it is an ndarray of the right dtype/rank/layout, else raise."""
    if not isinstance(array, np.ndarray):
        raise KernelError(f"{name}: expected a numpy array, got {type(array).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if not any(array.dtype == np.dtype(d) for d in dtypes):
        wanted = " or ".join(str(np.dtype(d)) for d in dtypes)
        raise KernelError(f"{name}: expected dtype {wanted}, got {array.dtype}")
    if ndim is not None:
        ranks = ndim if isinstance(ndim, tuple) else (ndim,)
        if array.ndim not in ranks:
            raise KernelError(
                f"{name}: expected {' or '.join(map(str, ranks))}-D, got shape {array.shape}"
            )
    if contiguous and not array.flags.c_contiguous:
        raise KernelError(
            f"{name}: expected a C-contiguous array (got strides {array.strides}); "
            "pass np.ascontiguousarray(...)"
        )
    if not array.flags.aligned:
        raise KernelError(f"{name}: array is not aligned to its dtype; copy it first")
    if not allow_empty and array.size == 0:
        raise KernelError(f"{name}: zero-size array (shape {array.shape}) is not supported")
    return array


def check_scale(name: str, scale: float) -> float:
    """A quantization scale must be a finite positive number."""
    value = float(scale)
    if not math.isfinite(value) or value <= 0.0:
        raise KernelError(f"{name}: scale must be finite and > 0, got {scale!r}")
    return value


def check_zero_point(name: str, zero_point: int, qmin: int, qmax: int) -> int:
    """A zero point must be an integer inside the quantized range."""
    value = int(zero_point)
    if value != zero_point or not qmin <= value <= qmax:
        raise KernelError(
            f"{name}: zero point must be an integer in [{qmin}, {qmax}], got {zero_point!r}"
        )
    return value


def check_accumulation_fits_int32(name: str, k: int, a_max: int = 255, b_max: int = 128) -> None:
    """Refuse a reduction length whose worst-case dot product overflows int32."""
    if k * a_max * b_max > INT32_MAX:
        limit = INT32_MAX // (a_max * b_max)
        raise KernelError(
            f"{name}: reduction length K={k} can overflow int32 accumulation "
            f"(K * {a_max} * {b_max} > 2**31 - 1); split the reduction (K <= {limit})"
        )
