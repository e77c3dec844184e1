"""An activation fused into a GEMM/conv epilogue: a 256-entry table on the output codes.

``lut`` maps the kernel's uint8 output code ``q`` to ``lut[q]``, exactly what ``apply_lut``
does to the stored result, but while the block is in registers. A table that is a clamp
(``lut[q] == min(max(q, lo), hi)``: relu, relu6, hardtanh, clamp whose output qparams equal
their input's) needs no lookup at all: it narrows the epilogue's ``[qmin, qmax]`` range.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from quantbridge.kernels._checks import check_array
from quantbridge.kernels._errors import KernelError

NO_LUT = np.zeros(0, np.uint8)  # what the drivers get when no table is fused
_CODES = np.arange(256, dtype=np.int64)
# table bytes -> (lo, hi, is a clamp, a private writeable copy)
_CACHE: dict[bytes, tuple[int, int, bool, npt.NDArray[np.uint8]]] = {}
_CACHE_LIMIT = 256


def _analyse(table: npt.NDArray[np.uint8]) -> tuple[int, int, bool, npt.NDArray[np.uint8]]:
    # keyed by content, so a table changed in place is never mistaken for its old self; the
    # copy is always a writeable C array: the drivers see one array type (numba compiles a
    # separate specialization for read-only arrays such as build_lut's)
    key = table.tobytes()
    got = _CACHE.get(key)
    if got is None:
        lo, hi = int(table[0]), int(table[255])
        clamp = lo <= hi and bool(np.array_equal(table, np.clip(_CODES, lo, hi)))
        got = (lo, hi, clamp, np.array(table, np.uint8))
        if len(_CACHE) < _CACHE_LIMIT:
            _CACHE[key] = got
    return got


def epilogue_lut(
    lut: Any, qmin: int, name: str = "lut", *, fold: bool = True
) -> tuple[int, int, npt.NDArray[np.uint8]]:
    """``(qmin, qmax, table)`` for the drivers: ``lut`` checked (uint8[256]), folded into the
    clamp range when it is a clamp and ``fold`` (then ``table`` is ``NO_LUT``). ``qmin`` is
    the range the kernel clamps to before the table (the output zero point with relu, else 0).
    ``fold=False`` where the table maps codes other than the clamped ones (a fused add's)."""
    if lut is None:
        return qmin, 255, NO_LUT
    table = check_array(name, lut, np.uint8, 1)
    if table.shape[0] != 256:
        raise KernelError(
            f"{name}: expected a uint8 table of 256 entries (see build_lut), got shape "
            f"{table.shape}"
        )
    lo, hi, clamp, private = _analyse(table)
    if not clamp or not fold:
        return qmin, 255, private
    # table[clamp(q, qmin, 255)] == clamp(q, max(qmin, lo), hi); when max(qmin, lo) > hi both
    # give hi, as every epilogue clamps with the upper bound last
    return max(qmin, lo), hi, NO_LUT
