"""Memory layouts the wrappers accept: C-contiguous, and any other *dense* axis order.

Elementwise kernels only need every element exactly once, so they run on the flat buffer of
any dense array (a C-contiguous array with its axes permuted: channels-last NHWC data viewed
as NCHW, a transposed matrix) and return their result in the same layout. Conv reads and
writes channels-last data directly; lowered CNNs keep activations channels-last from conv to
conv (no transposes in between), as torch's quantized engine does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from quantbridge.kernels._checks import check_array
from quantbridge.kernels._errors import KernelError

Order = tuple[int, ...]


_U8 = np.dtype(np.uint8)  # numpy's built-in dtypes are singletons: an identity test


def same_layout(
    x: object, shape: tuple[int, ...], strides: tuple[int, ...], dtype: np.dtype[Any] = _U8
) -> bool:
    """``x`` is a plain ndarray of this shape, these strides and this dtype (uint8 codes
    unless told): what a prepared call's plan was made for (anything else is checked and
    planned again)."""
    return type(x) is np.ndarray and x.shape == shape and x.strides == strides and x.dtype is dtype


class InputLayout(NamedTuple):
    """The shape, strides and dtype of an input a prepared call planned for."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype[Any] = _U8

    @classmethod
    def of(cls, x: npt.NDArray[Any]) -> InputLayout:
        return cls(x.shape, x.strides, x.dtype)

    def fits(self, x: object) -> bool:
        """``x`` has this layout (anything else is checked and planned again)."""
        return same_layout(x, self.shape, self.strides, self.dtype)


class InputPlan(NamedTuple):
    """A prepared one-input call's plan: the input layout and thread count it was made for,
    and the run that skips the checks for them."""

    x: InputLayout
    threads: int
    run: Callable[..., Any]


def memory_order(array: npt.NDArray[Any]) -> Order | None:
    """Axes from outermost to innermost in memory if ``array`` is dense, else None."""
    if array.flags.c_contiguous:
        return tuple(range(array.ndim))
    if array.ndim == 4 and array.transpose(0, 2, 3, 1).flags.c_contiguous:
        return (0, 2, 3, 1)  # channels-last, the usual case between lowered convs
    strides = array.strides
    order = tuple(sorted(range(array.ndim), key=lambda axis: -strides[axis]))
    return order if array.transpose(order).flags.c_contiguous else None


def check_dense(
    name: str, array: object, dtype: npt.DTypeLike | tuple[npt.DTypeLike, ...]
) -> tuple[npt.NDArray[Any], Order]:
    """``array`` (validated as ``check_array`` does) and its memory order; dense layouts only."""
    arr = check_array(name, array, dtype, contiguous=False)
    order = memory_order(arr)
    if order is None:
        raise KernelError(
            f"{name}: expected a C-contiguous array or a dense permutation of one such as "
            f"channels-last (got shape {arr.shape}, strides {arr.strides}); "
            "pass np.ascontiguousarray(...)"
        )
    return arr, order


def flat(array: npt.NDArray[Any], order: Order) -> npt.NDArray[Any]:
    """The 1-D view of a dense ``array`` in memory order (no copy)."""
    view: npt.NDArray[Any] = array.transpose(order).reshape(-1)
    return view


def in_order(array: npt.NDArray[Any], order: Order) -> npt.NDArray[Any]:
    """``array`` itself if it is laid out in ``order``, else a copy that is."""
    if array.transpose(order).flags.c_contiguous:
        return array
    copy: npt.NDArray[Any] = np.ascontiguousarray(array.transpose(order))
    back: npt.NDArray[Any] = copy.transpose(np.argsort(order))
    return back


def empty_in_order(shape_of: npt.NDArray[Any], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
    """A new array shaped like ``shape_of`` in the same dense layout."""
    out: npt.NDArray[Any] = np.empty_like(shape_of, dtype=dtype)
    return out


def channels_last_data(x: npt.NDArray[Any]) -> npt.NDArray[Any] | None:
    """The contiguous ``[N, (H,) W, C]`` data of a channels-last ``[N, C, (H,) W]`` array."""
    nhwc = x.transpose((0, *range(2, x.ndim), 1))
    return nhwc if nhwc.flags.c_contiguous else None
