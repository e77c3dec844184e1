"""Weight packing: int8 weights -> per-target panel layouts, once, with zero-point sums.

Layouts (``Np``: N rounded up to the panel width, ``Kp``: K rounded up to 4; padding is 0):

* ``avx512_vnni`` and ``generic``: int8 ``[Np/32][Kp/4][32][4]`` — panel p, k-step s, column
  jj, byte u holds ``w[32p + jj, 4s + u]``.
* ``avx2``: int16 ``[Np/16][Kp/2][16][2]`` — ``w[16p + jj, 2s + u]`` widened to int16.
* ``avx2_byte`` (the kernels of target ``avx2``, ``_avx2_byte.py``) and ``avx_vnni``: int8
  ``[Np/16][Kp/4][16][4]``; on ``avx2`` the int16 layout serves the rows the byte kernels
  cannot do exactly.

Zero-point corrections use ``colsum[j] = sum_k w[j, k]`` (computed here) and, when any weight
zero point is non-zero, the per-call activation row sums.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from quantbridge.kernels._checks import check_scale, check_scales
from quantbridge.kernels._errors import KernelError

# K is padded to whole k-steps of every target (VNNI consumes 4 values per step, AVX2 2); the
# kernels handle any number of steps, so no more padding (it was 16: a 3x3 conv over 4 padded
# channels, K = 36, then ran 48)
K_ALIGN = 4

# target -> (panel width, k values per step, packed dtype)
_LAYOUT: dict[str, tuple[int, int, type[np.integer]]] = {
    "avx512_vnni": (32, 4, np.int8),
    "generic": (32, 4, np.int8),
    "avx2": (16, 2, np.int16),
    "avx2_byte": (16, 4, np.int8),
    "avx_vnni": (16, 4, np.int8),
    "aarch64_i8mm": (16, 4, np.int8),
    "aarch64_dotprod": (16, 4, np.int8),
}


# two uint8 codes add up to at most this: a pair limit this high needs no guard
PAIR_SAFE = 510


def pair_limit(weight: npt.NDArray[np.int8]) -> int:
    """The largest sum of two activation codes whose products with any two codes of
    ``weight`` add up exactly in ``vpmaddubsw``'s saturating int16 (``PAIR_SAFE`` or more:
    every pair of uint8 codes is exact). At least 256 for any int8 weight."""
    if weight.size == 0:
        return PAIR_SAFE
    hi, lo = max(int(weight.max()), 0), min(int(weight.min()), 0)
    # a0 * w0 + a1 * w1 lies in [lo * (a0 + a1), hi * (a0 + a1)]
    limit = PAIR_SAFE
    if hi:
        limit = min(limit, 32767 // hi)
    if lo:
        limit = min(limit, 32768 // -lo)
    return limit


def kernel_family(target: str, weight: npt.NDArray[np.int8]) -> str:
    """The packed layout and micro-kernels for ``weight`` on ``target``.

    On ``avx2`` every weight runs the ``vpmaddubsw`` kernels (``avx2_byte``). They are exact
    for any activations when every weight code lies in ``[-64, 64]`` (7-bit weights); for
    wider weights a pair of activation codes whose sum passes ``pair_limit`` could saturate,
    and the callers recompute the rows holding one on the int16 ``avx2`` kernels
    (``_pair_guard``). Other targets have one family.
    """
    if target != "avx2" or weight.size == 0:
        return target
    return "avx2_byte"


def layout(target: str) -> tuple[int, int, type[np.integer]]:
    """``(panel width, k per step, packed dtype)`` of ``target`` (or kernel family)."""
    return _LAYOUT[target]


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pack_b(w: npt.NDArray[np.int8], target: str) -> npt.NDArray[np.integer]:
    """Pack ``w`` ([N, K] int8, output channel major) for ``target``; returns a flat array."""
    nr, ks, dt = _LAYOUT[target]
    n, k = w.shape
    np_, kp = round_up(n, nr), round_up(k, K_ALIGN)
    full = np.zeros((np_, kp), dt)
    full[:n, :k] = w
    packed = full.reshape(np_ // nr, nr, kp // ks, ks).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(packed).reshape(-1)


def weight_zero_points(
    zero_point: int | npt.ArrayLike, n: int, n_padded: int, name: str
) -> npt.NDArray[np.int32]:
    """Per-channel int32 weight zero points padded to ``n_padded`` (scalar broadcast)."""
    try:
        zp = np.asarray(zero_point)
        if zp.ndim == 0 and np.issubdtype(zp.dtype, np.integer) and zp.dtype != np.bool_:
            zp = np.full(n, int(zp), np.int64)
    except (TypeError, ValueError, OverflowError):
        zp = np.asarray(None)
    if zp.shape != (n,) or not np.issubdtype(zp.dtype, np.integer) or zp.dtype == np.bool_:
        raise KernelError(
            f"{name}: weight zero point must be an int or an integer array of shape ({n},), "
            f"got {zp.dtype} {zp.shape}"
        )
    if zp.min() < -128 or zp.max() > 127:
        raise KernelError(f"{name}: weight zero points must lie in [-128, 127] for int8 weights")
    out = np.zeros(n_padded, np.int32)
    out[:n] = zp
    return out


def weight_scales(
    scale: float | npt.ArrayLike, n: int, name: str
) -> tuple[npt.NDArray[np.float32], bool]:
    """``(float32 scales of shape [n], per_channel)``; refuses non-finite or non-positive."""
    try:
        raw = np.asarray(scale)
    except (TypeError, ValueError, OverflowError):
        raise KernelError(f"{name}: expected a float or a float array, got {scale!r}") from None
    if raw.dtype.kind not in "fiu":  # not booleans, strings or objects
        raise KernelError(f"{name}: expected a float or a float array, got {raw.dtype} values")
    s = raw.astype(np.float64)
    per_channel = s.ndim == 1
    if s.ndim == 0:
        s = np.full(n, float(s))
    if s.shape != (n,):
        raise KernelError(f"{name}: weight scale must be a float or shape ({n},), got {s.shape}")
    if per_channel:
        check_scales(name, s)
    else:
        check_scale(name, float(s[0]))
    return s.astype(np.float32), per_channel
