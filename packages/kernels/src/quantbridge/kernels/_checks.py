"""Input checks run in Python before any compiled kernel sees an array.

Every public kernel wrapper validates with these helpers, so bad input becomes a KernelError
that names the argument, never a crash or an out-of-bounds access inside numba code.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from quantbridge.kernels._errors import KernelError

INT32_MAX = 2**31 - 1
# (min, max) of the integer dtypes quantized values use; a dict lookup beats np.iinfo per call.
INT_RANGES: dict[np.dtype[np.generic], tuple[int, int]] = {
    np.dtype(t): (int(np.iinfo(t).min), int(np.iinfo(t).max)) for t in (np.uint8, np.int8, np.int32)
}


def check_array(
    name: str,
    array: object,
    dtype: npt.DTypeLike | tuple[npt.DTypeLike, ...],
    ndim: int | tuple[int, ...] | None = None,
    *,
    contiguous: bool = True,
    allow_empty: bool = False,
) -> npt.NDArray[Any]:
    """Return ``array`` if it is an ndarray of the right dtype/rank/layout, else raise."""
    if not isinstance(array, np.ndarray):
        raise KernelError(f"{name}: expected a numpy array, got {type(array).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if array.dtype not in dtypes:
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
    if type(scale) is float and 0.0 < scale < math.inf:  # fast path for the common case
        return scale
    try:
        value = float(scale)
    except (TypeError, ValueError, OverflowError):
        raise KernelError(f"{name}: scale must be a finite number > 0, got {scale!r}") from None
    if isinstance(scale, bool) or not math.isfinite(value) or value <= 0.0:
        raise KernelError(f"{name}: scale must be finite and > 0, got {scale!r}")
    return value


def check_zero_point(name: str, zero_point: int, qmin: int, qmax: int) -> int:
    """A zero point must be an integer inside the quantized range."""
    if type(zero_point) is int and qmin <= zero_point <= qmax:  # fast path
        return zero_point
    value = check_int(name, zero_point)
    if not qmin <= value <= qmax:
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


def check_out(
    out: object,
    shape: tuple[int, ...],
    dtype: npt.DTypeLike,
    *inputs: npt.NDArray[np.generic],
    order: tuple[int, ...] | None = None,
) -> npt.NDArray[Any]:
    """Validate a caller-provided ``out=`` array: exact shape and dtype, layout, writeable.

    The layout is C-contiguous, or with ``order`` (elementwise kernels on a dense input, see
    ``_layout.py``) the input's axis order in memory. ``out`` may not overlap any of ``inputs``
    unless it *is* that input (same buffer, same layout), which elementwise kernels handle;
    pass no ``inputs`` to forbid any overlap check.
    """
    if not isinstance(out, np.ndarray):
        raise KernelError(f"out: expected a numpy array, got {type(out).__name__}")
    if out.dtype != np.dtype(dtype):
        raise KernelError(f"out: expected dtype {np.dtype(dtype)}, got {out.dtype}")
    if out.shape != shape:
        raise KernelError(f"out: expected shape {shape}, got {out.shape}")
    if not out.flags.aligned:
        raise KernelError("out: expected an aligned array")
    if order is None and not out.flags.c_contiguous:
        raise KernelError("out: expected a C-contiguous, aligned array")
    if order is not None and not out.transpose(order).flags.c_contiguous:
        raise KernelError(
            f"out: expected a C-contiguous array, or for a channels-last or other dense input "
            f"the input's layout (np.empty_like(input)); got strides {out.strides}"
        )
    if not out.flags.writeable:
        raise KernelError("out: array is read-only")
    for array in inputs:
        if np.may_share_memory(out, array) and not (
            out.dtype == array.dtype
            and out.shape == array.shape
            and out.strides == array.strides
            and out.__array_interface__["data"][0] == array.__array_interface__["data"][0]
        ):
            raise KernelError(
                "out: overlaps an input array in a way the kernel cannot handle; "
                "pass a separate output array (or the input itself for in-place elementwise ops)"
            )
    return out


def check_quant_range(
    dtype: npt.DTypeLike, quant_min: int | None, quant_max: int | None
) -> tuple[int, int]:
    """Resolve ``quant_min``/``quant_max`` (default: the dtype's full range) and check them."""
    dmin, dmax = INT_RANGES[np.dtype(dtype)]
    lo = dmin if quant_min is None else check_int("quant_min", quant_min)
    hi = dmax if quant_max is None else check_int("quant_max", quant_max)
    if not dmin <= lo <= hi <= dmax:
        raise KernelError(
            f"quant_min/quant_max: expected integers with {dmin} <= quant_min <= quant_max "
            f"<= {dmax} for {np.dtype(dtype)}, got ({quant_min!r}, {quant_max!r})"
        )
    return lo, hi


def check_int(name: str, value: object) -> int:
    """An integer argument: a Python/numpy integer (not bool), or a float with integral value."""
    if type(value) is int:  # fast path for the common case
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (float, np.floating)) and math.isfinite(value) and value == int(value):
        return int(value)
    raise KernelError(f"{name}: expected an integer, got {value!r}")
