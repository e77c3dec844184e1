"""Input checks run in Python before any compiled kernel sees an array.

Every public kernel wrapper validates with these helpers, so bad input becomes a KernelError
that names the argument, never a crash or an out-of-bounds access inside numba code.

Scales are checked as the kernels use them: in float32. A scale (or a product/ratio of scales
that a kernel computes, such as ``x_scale * w_scale / out_scale``) that is 0, subnormal,
infinite or NaN in float32 would silently give constant outputs, so it is refused.
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


def plain_array(name: str, array: object) -> npt.NDArray[Any]:
    """``array`` as a base-class ndarray: subclasses (``np.memmap``, ...) become views of the
    same memory; ``np.matrix`` is refused (it stays 2-D under reshape and indexing)."""
    if type(array) is np.ndarray:
        return array
    if isinstance(array, np.matrix):
        raise KernelError(
            f"{name}: np.matrix is not supported (it is always 2-D, so reshaping it cannot "
            "flatten it); pass np.asarray(...)"
        )
    if not isinstance(array, np.ndarray):
        raise KernelError(f"{name}: expected a numpy array, got {type(array).__name__}")
    return array.view(np.ndarray)


def check_array(
    name: str,
    array: object,
    dtype: npt.DTypeLike | tuple[npt.DTypeLike, ...],
    ndim: int | tuple[int, ...] | None = None,
    *,
    contiguous: bool = True,
    allow_empty: bool = False,
) -> npt.NDArray[Any]:
    """``array`` (a plain ndarray view for subclasses) if its dtype/rank/layout fit, else raise."""
    array = plain_array(name, array)
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


# float32's normal range: kernels round every scale to float32 before using it
F32_TINY = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)
_SCALE_RULE = (
    f"kernels compute in float32, so scales and the products/ratios they form must be normal "
    f"float32 numbers in [{F32_TINY:.7g}, {F32_MAX:.7g}]; check the observer or calibration "
    "that produced them"
)


def f32_problem(value: float) -> str | None:
    """Why ``float32(value)`` is unusable as a scale or multiplier, or None if it is fine."""
    if math.isnan(value):
        return "is NaN"
    if value <= 0.0:
        return "is not > 0"
    if math.isinf(value):
        return "is infinite"
    with np.errstate(over="ignore", under="ignore"):
        f32 = float(np.float32(value))
    if f32 == math.inf:
        return "overflows float32 (becomes inf)"
    if f32 == 0.0:
        return "underflows float32 (becomes 0)"
    if f32 < F32_TINY:
        return "is subnormal in float32 (most precision lost)"
    return None


def check_scale(name: str, scale: float, *, inverted: bool = False) -> float:
    """A quantization scale: a real number whose float32 value is normal and > 0.

    ``inverted``: the kernel also uses ``1 / float32(scale)``, which must be normal too.
    """
    if type(scale) is float and F32_TINY <= scale <= _MAX_INVERTIBLE:  # fast path
        return scale
    if isinstance(scale, (bool, str, bytes)):  # float() would accept True and "0.1"
        raise KernelError(f"{name}: scale must be a finite number > 0, got {scale!r}")
    try:
        value = float(scale)
    except (TypeError, ValueError, OverflowError):
        raise KernelError(f"{name}: scale must be a finite number > 0, got {scale!r}") from None
    problem = f32_problem(value)
    if problem is not None:
        raise KernelError(f"{name}: scale {scale!r} {problem}; {_SCALE_RULE}")
    if inverted:
        with np.errstate(all="ignore"):
            inverse = np.float32(1.0) / np.float32(value)
        check_derived(f"1 / {name}", inverse)
    return value


# scales up to here have a normal float32 reciprocal (the fast path of check_scale)
_MAX_INVERTIBLE = float(np.float32(1.0) / np.float32(F32_TINY)) / 2


def check_scales(name: str, scales: npt.ArrayLike, *, inverted: bool = False) -> None:
    """Per-channel scales: each as ``check_scale`` requires; names the first bad channel."""
    s = np.asarray(scales, dtype=np.float64).reshape(-1)
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        s32 = s.astype(np.float32)
        ok = (s32 >= F32_TINY) & (s32 <= F32_MAX)
        if inverted:
            inv = np.float32(1.0) / s32
            ok &= (inv >= F32_TINY) & (inv <= F32_MAX)
    if ok.all():
        return
    j = int(np.flatnonzero(~ok)[0])
    problem = f32_problem(float(s[j]))
    if problem is None:  # only its reciprocal is out of range
        check_derived(f"1 / {name}[{j}]", inv[j])
    raise KernelError(f"{name}[{j}]: scale {float(s[j])!r} {problem}; {_SCALE_RULE}")


def check_derived(what: str, values: npt.ArrayLike, *, channel_offset: int | None = None) -> None:
    """Refuse float32 values a kernel derives from scales (``what`` says how) unless normal.

    ``values`` holds one value, or with ``channel_offset`` one per output channel starting at
    that channel (conv groups check their slice of the channels).
    """
    v = np.asarray(values, dtype=np.float32).reshape(-1)
    ok = (v >= F32_TINY) & (v <= F32_MAX)
    if ok.all():
        return
    j = int(np.flatnonzero(~ok)[0])
    x = float(v[j])
    where = "" if channel_offset is None else f" for output channel {j + channel_offset}"
    if math.isnan(x):
        problem = "is NaN"
    elif x > F32_MAX:
        problem = "overflows float32 (becomes inf)"
    elif x <= 0.0:
        problem = "underflows float32 (becomes 0)"
    else:
        problem = f"is subnormal in float32 ({x:.7g}: most precision lost)"
    raise KernelError(f"{what}{where} {problem}; {_SCALE_RULE}")


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
    name: str = "out",
) -> npt.NDArray[Any]:
    """Validate a caller-provided ``out=`` array: exact shape and dtype, layout, writeable.

    The layout is C-contiguous, or with ``order`` (elementwise kernels on a dense input, see
    ``_layout.py``) the input's axis order in memory. ``out`` may not overlap any of ``inputs``
    unless it *is* that input (same buffer, same layout), which elementwise kernels handle;
    pass no ``inputs`` to forbid any overlap check.
    """
    plain_array(name, out)  # refuses np.matrix and non-arrays; other subclasses write through
    assert isinstance(out, np.ndarray)
    if out.dtype != np.dtype(dtype):
        raise KernelError(f"{name}: expected dtype {np.dtype(dtype)}, got {out.dtype}")
    if out.shape != shape:
        raise KernelError(f"{name}: expected shape {shape}, got {out.shape}")
    if not out.flags.aligned:
        raise KernelError(f"{name}: expected an aligned array")
    if order is None and not out.flags.c_contiguous:
        raise KernelError(f"{name}: expected a C-contiguous, aligned array")
    if order is not None and not out.transpose(order).flags.c_contiguous:
        raise KernelError(
            f"{name}: expected a C-contiguous array, or for a channels-last or other dense input "
            f"the input's layout (np.empty_like(input)); got strides {out.strides}"
        )
    if not out.flags.writeable:
        raise KernelError(f"{name}: array is read-only")
    for array in inputs:
        if np.may_share_memory(out, array) and not (
            out.dtype == array.dtype
            and out.shape == array.shape
            and out.strides == array.strides
            and out.__array_interface__["data"][0] == array.__array_interface__["data"][0]
        ):
            raise KernelError(
                f"{name}: overlaps an input array in a way the kernel cannot handle; "
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
