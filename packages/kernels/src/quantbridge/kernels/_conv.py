"""Quantized conv1d/conv2d (+relu): stride, padding, dilation, groups (incl. depthwise).

Layouts: input and output have torch's NCHW shape (NCL for 1-D), uint8. The input may be
C-contiguous or channels-last (NHWC data viewed as NCHW, what ``channels_last=True`` returns,
as torch's quantized conv does): chains of convs then never transpose. Internally each call
reads a zero-point-padded NHWC buffer ``[N, H + 2ph, W + 2pw, G, Cg4]`` with the channels of
each group padded to a multiple of 4 — the channels-last input itself when no padding is
needed, else a copy (a vector-tile transpose from NCHW, ``_transpose.py``) — and runs one
implicit-im2col GEMM per group: row m = output pixel (n, oh, ow) starts at that pixel's
window origin, and the k steps walk (kh, kw, channel) through per-tap offsets — no im2col
matrix is materialized. Weights are packed once per group as a [OCg, KH*KW*Cg4] matrix
(``_pack.py`` layouts). Requantization is the rule in ``_requant.py``. The GEMM's rows are
output pixels, so channels-last output is its natural result; C-contiguous NCHW output is
stored channel-major from registers on ``avx512_vnni`` (one group) and transposed by numpy
otherwise.

Depthwise convs (one input and one output channel per group) run register-blocked
channels-last kernels of their own (``_depthwise.py``), reading the input in place; stem convs
with few input channels keep the channels unpadded and walk whole kernel rows as k steps
(``PackedConvWeight.row_packed``); other small-group convolutions run through the same GEMM
(correct, but each group pads its output channels to a full panel, so they are not fast).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from numba import njit

from quantbridge.kernels import _depthwise as depthwise_module
from quantbridge.kernels._block_kernels import block_lanes
from quantbridge.kernels._checks import check_array, check_zero_point
from quantbridge.kernels._depthwise import DRIVERS as DEPTHWISE_DRIVERS
from quantbridge.kernels._depthwise import MAX_TAPS, DwGeometry
from quantbridge.kernels._dw_simd import LANES, DwOutput, DwWeights
from quantbridge.kernels._dw_vnni import CHANNELS as VNNI_CHANNELS
from quantbridge.kernels._dw_vnni import GROUPS as VNNI_GROUPS
from quantbridge.kernels._dw_vnni import Dw64Weights, permuted_order, split_weights
from quantbridge.kernels._elementwise import _add_params, add_relu
from quantbridge.kernels._elementwise import add as add_plain
from quantbridge.kernels._epilogue_lut import NO_LUT, epilogue_lut
from quantbridge.kernels._errors import KernelError
from quantbridge.kernels._gemm_run import (
    NO_ADD,
    NO_RESIDUAL,
    SERIAL_BELOW,
    gemm_runner,
    row_chunk,
)
from quantbridge.kernels._gemm_simd import drive_vnni_u8t, serial_vnni_u8t
from quantbridge.kernels._layout import InputLayout, InputPlan, channels_last_data
from quantbridge.kernels._linear import PackedLinearWeight, _fast_zp
from quantbridge.kernels._lut import apply_lut, apply_table, table_as_pass
from quantbridge.kernels._numba_compat import compiled_entry_point
from quantbridge.kernels._pack import (
    K_ALIGN,
    kernel_family,
    layout,
    round_up,
    weight_scales,
    weight_zero_points,
)
from quantbridge.kernels._pair_guard import window_rows
from quantbridge.kernels._qparams import QParams, as_qparams
from quantbridge.kernels._quantize import f32_scale
from quantbridge.kernels._targets import (
    check_unpickled_target,
    needs_features,
    resolve_target,
    target_features,
)
from quantbridge.kernels._threads import apply_num_threads, get_num_threads, with_threads
from quantbridge.kernels._transpose import (
    nchw_into_padded_nhwc,
    nhwc_into_padded_nhwc,
    spread_copy,
)


def _pair(name: str, value: int | tuple[int, ...], dims: int, minimum: int) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)):
        vals: tuple[object, ...] = (value,) * dims
    elif isinstance(value, (tuple, list)):
        vals = tuple(value)
    else:
        raise KernelError(f"{name}: expected an int or a tuple of {dims} ints, got {value!r}")
    if len(vals) != dims or not all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= minimum for v in vals
    ):
        raise KernelError(f"{name}: expected {dims} int(s) >= {minimum}, got {value!r}")
    return tuple(int(v) for v in vals)  # type: ignore[call-overload]


class PackedConvWeight:
    """An int8 conv weight packed once per group for one target.

    Args:
        weight: int8 [OC, C/groups, KH, KW] (conv2d) or [OC, C/groups, KW] (conv1d).
        scale: the weight's scale: a per-tensor scalar or a per-output-channel array [OC].
        zero_point: the weight's zero point: a per-tensor scalar or an array [OC].
        bias: optional float32 [OC].
        stride: int or per-dim tuple.
        padding: int or per-dim tuple.
        dilation: int or per-dim tuple.
        groups: channel groups (groups == C and OC multiple of C is depthwise).
        target: kernel target to pack for (None: ``resolve_target``'s choice).
    """

    def __init__(
        self,
        weight: npt.NDArray[np.int8],
        scale: float | npt.ArrayLike,
        zero_point: int | npt.ArrayLike = 0,
        bias: npt.NDArray[np.float32] | None = None,
        *,
        stride: int | tuple[int, ...] = 1,
        padding: int | tuple[int, ...] = 0,
        dilation: int | tuple[int, ...] = 1,
        groups: int = 1,
        target: str | None = None,
    ) -> None:
        w = check_array("weight", weight, np.int8, (3, 4), contiguous=False)
        self.dims = w.ndim - 2
        w4 = w if self.dims == 2 else w[:, :, None, :]
        self.stride = _pair("stride", stride, self.dims, 1)
        self.padding = _pair("padding", padding, self.dims, 0)
        self.dilation = _pair("dilation", dilation, self.dims, 1)
        if self.dims == 1:
            self.stride, self.padding, self.dilation = (
                (1, *self.stride),
                (0, *self.padding),
                (1, *self.dilation),
            )
        oc, cg, kh, kw = (int(s) for s in w4.shape)
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or oc % groups:
            raise KernelError(
                f"groups={groups!r}: must be a positive int dividing out_channels={oc}"
            )
        self.groups, self.oc, self.cg, self.kh, self.kw = groups, oc, cg, kh, kw
        self.in_channels = cg * groups
        self.ocg = oc // groups
        self.cg4 = round_up(cg, 4)
        # Few input channels (a stem conv: 3 -> 32/64, 3x3 or 7x7): each kernel row's kw*cg
        # values are contiguous in the NHWC buffer when the buffer does not pad channels, so the
        # k steps walk whole kernel rows, padded to the k step (7x7x3 on avx2: 7 x 22 = 154
        # values instead of 7 x 7 x 4 = 196, a dense K without an im2col matrix). The steps
        # past kw*cg read up to k_step - 1 bytes past a window row (the buffer has a tail)
        # against zero weights.
        kernel = kernel_family(resolve_target(target), w4)  # one for every group
        kstep = layout(kernel)[1]
        row_p = round_up(kw * cg, kstep)
        self.row_packed = (
            groups == 1 and self.dilation[1] == 1 and cg != self.cg4 and row_p < kw * self.cg4
        )
        if self.row_packed:
            self.cg4 = cg  # channels per pixel in the buffer: unpadded
        scales, per_channel = weight_scales(scale, oc, "weight scale")
        zps = weight_zero_points(zero_point, oc, oc, "weight")
        if bias is not None:
            bias = check_array("bias", bias, np.float32, 1, contiguous=False)
            if bias.shape[0] != oc:
                raise KernelError(f"bias: expected shape ({oc},), got {bias.shape}")
        self.groups_packed: list[PackedLinearWeight] = []
        for g in range(groups):
            if self.row_packed:
                wg = np.zeros((self.ocg, kh, row_p), np.int8)
                wg[..., : kw * cg] = w4.transpose(0, 2, 3, 1).reshape(oc, kh, kw * cg)
            else:
                wg = np.zeros((self.ocg, kh, kw, self.cg4), np.int8)
                wg[..., :cg] = w4[g * self.ocg : (g + 1) * self.ocg].transpose(0, 2, 3, 1)
            sl = slice(g * self.ocg, (g + 1) * self.ocg)
            p = PackedLinearWeight(
                wg.reshape(self.ocg, -1),
                scales[sl] if per_channel else float(scales[0]),
                zps[sl],
                None if bias is None else bias[sl],
                target=target,
                _kernel=kernel,
            )
            p.k_true = kh * kw * cg
            p.channel_offset = g * self.ocg  # messages name the conv's output channel
            self.groups_packed.append(p)
        self.target = self.groups_packed[0].target
        self.kernel = kernel
        self.has_weight_zp = any(p.has_weight_zp for p in self.groups_packed)
        # one input and one output channel per group: the channels-last depthwise loops
        self.depthwise = cg == 1 and self.ocg == 1 and groups > 1 and kh * kw <= MAX_TAPS
        if self.depthwise:
            # [KH*KW, C rounded up to the vector] float32 ``w - w_zp``: vector loads stay inside
            self._dw_cp = round_up(oc, LANES)
            w_minus_zp = w4[:, 0].astype(np.int32) - zps[:oc, None, None].astype(np.int32)
            self._dw_weight = np.zeros((kh * kw, self._dw_cp), np.float32)
            self._dw_weight[:, :oc] = w_minus_zp.reshape(oc, kh * kw).T
            self._dw_wsum = self._dw_weight.sum(axis=0, dtype=np.float32)  # exact: < 2**24
            # the 64-channel vpdpbusd blocks (AVX-512 VNNI): whole blocks of 64 channels, when
            # every w - w_zp fits int8 (32 channels at stride 1: two pixels to a 64-byte
            # vector, the weights repeated per pixel)
            self._dw_c64 = 0
            self._dw_group = 1
            self._dw_w8 = np.zeros((0,), np.int8)
            fits = w_minus_zp.min(initial=0) >= -128 and w_minus_zp.max(initial=0) <= 127
            group = VNNI_GROUPS.get(oc, 1) if self.stride[1] == 1 else 1
            if self.target == "avx512_vnni" and fits and (oc >= VNNI_CHANNELS or group > 1):
                self._dw_c64 = oc - oc % VNNI_CHANNELS if group == 1 else VNNI_CHANNELS
                self._dw_group = group
                block = self._dw_weight[:, : min(oc, self._dw_c64)].astype(np.int32)
                self._dw_w8 = split_weights(np.tile(block, (1, group))).reshape(-1)
                # the real channel at each position of the accumulators' order
                self._dw_order = permuted_order(self._dw_c64) % min(oc, self._dw_c64)
        self._dw_epilogue: dict[tuple[float, float], tuple[npt.NDArray[np.float32], ...]] = {}
        self._koffs: dict[tuple[int, int], npt.NDArray[np.int64]] = {}
        self._rowoffs: dict[tuple[int, ...], npt.NDArray[np.int64]] = {}
        self._plans: dict[tuple[object, ...], _ConvPlan] = {}  # see _conv
        self._add_args: dict[tuple[object, ...], _AddArgs] = {}  # see conv2d_add

    def __getstate__(self) -> dict[str, Any]:
        # call plans are closures (not picklable) and cheap to remake: the copy starts without
        state = self.__dict__.copy()
        state["_plans"] = {}
        state["_add_args"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        check_unpickled_target("PackedConvWeight", state["target"])
        self.__dict__.update(state)

    def koffs(self, wp: int) -> list[npt.NDArray[np.int64]]:
        """Per-group activation offsets of each k step for padded input width ``wp``."""
        out = []
        _, kstep, _ = layout(self.kernel)
        ctot = self.groups * self.cg4
        row_p = round_up(self.kw * self.cg, kstep)
        kg = self.kh * (row_p if self.row_packed else self.kw * self.cg4)
        nk = round_up(kg, K_ALIGN) // kstep
        dh, dw = self.dilation[0], self.dilation[1]
        for g in range(self.groups):
            got = self._koffs.get((wp, g))
            if got is None:
                steps = np.zeros(nk, np.int64)
                idx = 0
                for i in range(self.kh if self.row_packed else 0):  # whole kernel rows
                    for c in range(0, row_p, kstep):
                        steps[idx] = i * dh * wp * ctot + c
                        idx += 1
                for i in range(0 if self.row_packed else self.kh):
                    for j in range(self.kw):
                        tap = (i * dh * wp + j * dw) * ctot + g * self.cg4
                        for c in range(0, self.cg4, kstep):
                            steps[idx] = tap + c
                            idx += 1
                got = steps  # padded steps stay 0: the window origin, against zero weights
                if len(self._koffs) < 256:
                    self._koffs[(wp, g)] = got
            out.append(got)
        return out

    def row_offsets(self, n: int, hp: int, wp: int, oh: int, ow: int) -> npt.NDArray[np.int64]:
        """Offset of each output pixel's window origin in the padded NHWC buffer (cached)."""
        key = (n, hp, wp, oh, ow)
        got = self._rowoffs.get(key)
        if got is None:
            sh, sw = self.stride
            pix = (
                np.arange(n, dtype=np.int64)[:, None, None] * hp
                + np.arange(oh, dtype=np.int64)[None, :, None] * sh
            ) * wp + np.arange(ow, dtype=np.int64)[None, None, :] * sw
            got = (pix * (self.groups * self.cg4)).reshape(-1)
            got.flags.writeable = False
            if len(self._rowoffs) < 64:
                self._rowoffs[key] = got
        return got

    def depthwise_epilogue(
        self, x_scale: float, out_scale: float
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """Per-channel ``(biasq, mult)`` of the GEMM rule, gathered from the groups and
        zero-padded to the vector width (cached)."""
        key = (x_scale, out_scale)
        got = self._dw_epilogue.get(key)
        if got is None:
            parts = [p.epilogue(x_scale, out_scale) for p in self.groups_packed]
            got = (np.zeros(self._dw_cp, np.float32), np.zeros(self._dw_cp, np.float32))
            got[0][: self.oc] = [bq[0] for bq, _ in parts]
            got[1][: self.oc] = [m[0] for _, m in parts]
            if len(self._dw_epilogue) < 64:
                self._dw_epilogue[key] = got
        return got  # type: ignore[return-value]

    def output_size(self, h: int, w: int) -> tuple[int, int]:
        oh = (h + 2 * self.padding[0] - self.dilation[0] * (self.kh - 1) - 1) // self.stride[0] + 1
        ow = (w + 2 * self.padding[1] - self.dilation[1] * (self.kw - 1) - 1) // self.stride[1] + 1
        return oh, ow

    def __repr__(self) -> str:
        return (
            f"PackedConvWeight(OC={self.oc}, C={self.in_channels}, kernel=({self.kh}, "
            f"{self.kw}), stride={self.stride}, padding={self.padding}, "
            f"dilation={self.dilation}, groups={self.groups}, target={self.target!r})"
        )


def _conv(
    x: npt.NDArray[np.uint8],
    packed: PackedConvWeight,
    x_scale: float,
    x_zero_point: int,
    out_scale: float,
    out_zero_point: int,
    relu: bool,
    num_threads: int | None,
    channels_last: bool,
    dims: int,
    name: str,
    fused_add: tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]] | None = None,
    lut: npt.NDArray[np.uint8] | None = None,
) -> npt.NDArray[np.uint8]:
    if not isinstance(packed, PackedConvWeight):
        raise KernelError(f"packed: expected a PackedConvWeight, got {type(packed).__name__}")
    threads = apply_num_threads(num_threads, name)
    x, plan, _ = _find_plan(x, packed, x_scale, x_zero_point, out_scale, out_zero_point, relu,
                            channels_last, dims, name, fused_add, lut, threads)  # fmt: skip
    out: npt.NDArray[np.uint8] = plan.run(x, fused_add)
    return out


def _find_plan(
    x: object,
    packed: PackedConvWeight,
    x_scale: float,
    x_zero_point: int,
    out_scale: float,
    out_zero_point: int,
    relu: bool,
    channels_last: bool,
    dims: int,
    name: str,
    fused_add: tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]] | None,
    lut: npt.NDArray[np.uint8] | None,
    threads: int,
) -> tuple[npt.NDArray[np.uint8], _ConvPlan, bool]:
    """The checked input, its plan (kept on ``packed``) and whether the plan is kept."""
    key = _plan_key(x, x_scale, x_zero_point, out_scale, out_zero_point, relu, channels_last,
                    dims, fused_add, lut, threads)  # fmt: skip
    try:
        plan = None if key is None else packed._plans.get(key)
    except TypeError:  # e.g. a 0-d array as a scale: valid, but checked on every call
        key = plan = None
    if plan is not None:
        return x, plan, True  # type: ignore[return-value]  # its key holds a uint8 ndarray
    xa, plan = _ConvPlan.build(
        x, packed, x_scale, x_zero_point, out_scale, out_zero_point, relu, channels_last,
        dims, name, fused_add, lut, threads,
    )  # fmt: skip
    if key is not None and len(packed._plans) < _PLAN_LIMIT:
        packed._plans[key] = plan
    return xa, plan, key is not None


class PreparedConv:
    """``conv2d`` (``conv1d`` for a 1-D weight) with every argument but the input fixed: for a
    layer called again and again on inputs of one shape and layout.

    ``prepared(x)`` returns exactly ``conv2d(x, packed, *x_qparams, *out_qparams, relu=relu,
    channels_last=channels_last, lut=lut, num_threads=num_threads)``. The first call checks
    its arguments and plans the call as ``conv2d`` does; later calls whose input has the same
    shape, strides and dtype, on the same thread count, run that plan directly, without the
    argument checks and the plan lookup (a few microseconds, and more when the caches are
    cold, as between the layers of a model). Any other input is checked and planned again
    and becomes the fast case. ``lut`` is copied here: changing the caller's array later
    does not change the results.
    """

    __slots__ = ("_fast", "_lut", "_qparams", "_threads", "channels_last", "packed", "relu")

    def __init__(
        self,
        packed: PackedConvWeight,
        x_qparams: QParams | tuple[float, int],
        out_qparams: QParams | tuple[float, int],
        *,
        relu: bool = False,
        channels_last: bool = False,
        lut: npt.NDArray[np.uint8] | None = None,
        num_threads: int | None = None,
    ) -> None:
        if not isinstance(packed, PackedConvWeight):
            raise KernelError(f"packed: expected a PackedConvWeight, got {type(packed).__name__}")
        x_scale, x_zero_point = as_qparams("x_qparams", x_qparams)
        out_scale, out_zero_point = as_qparams("out_qparams", out_qparams)
        table = None if lut is None else np.array(lut, copy=True)
        if num_threads is not None:
            apply_num_threads(num_threads, "PreparedConv")  # refused here, not at the call
        self.packed = packed
        self.relu = relu
        self._qparams = (x_scale, x_zero_point, out_scale, out_zero_point)
        self.channels_last = channels_last
        self._lut = table
        self._threads = num_threads
        self._fast: InputPlan | None = None  # the last plan, for inputs of its layout

    def __call__(self, x: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
        fast = self._fast
        if (
            fast is not None
            and fast.x.fits(x)
            and (self._threads or get_num_threads()) == fast.threads
        ):
            out: npt.NDArray[np.uint8] = fast.run(x, None)
            return out
        return self._plan_and_run(x)

    def _plan_and_run(self, x: object) -> npt.NDArray[np.uint8]:
        dims = self.packed.dims
        name = "conv2d" if dims == 2 else "conv1d"
        threads = apply_num_threads(self._threads, name)
        xa, plan, kept = _find_plan(x, self.packed, *self._qparams, self.relu, self.channels_last,
                                    dims, name, None, self._lut, threads)  # fmt: skip
        self._fast = InputPlan(InputLayout.of(xa), threads, plan.run) if kept else None
        out: npt.NDArray[np.uint8] = plan.run(xa, None)
        return out


# plans kept per packed weight: one per input shape/layout, qparams and thread count in use
_PLAN_LIMIT = 32
_U8 = np.dtype(np.uint8)  # numpy's built-in dtypes are singletons: an identity test


def _plan_key(
    x: object,
    x_scale: object,
    x_zero_point: object,
    out_scale: object,
    out_zero_point: object,
    relu: object,
    channels_last: object,
    dims: int,
    fused_add: tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]] | None,
    lut: object,
    threads: int,
) -> tuple[object, ...] | None:
    """What a call's plan depends on, or None when the call cannot reuse one (then it is
    checked and planned from scratch). A reused plan needs exactly the array layout it was
    made for (a plain uint8 ndarray with the same shape and strides), the same argument values
    (zero points also of the same type) and the same table contents. A fused add's operand and
    parameters are passed to the plan at each call; only whether there is one matters."""
    if type(x) is not np.ndarray or x.dtype is not _U8:
        return None
    if lut is None:
        table = None
    elif type(lut) is np.ndarray:
        table = (lut.dtype.str, lut.shape, lut.tobytes())
    else:
        return None
    # (unhashable values, e.g. 0-d arrays as scales, make the lookup raise: see _conv)
    return (x.shape, x.strides, x_scale, x_zero_point, type(x_zero_point), out_scale,
            out_zero_point, type(out_zero_point), relu, channels_last, dims, threads, table,
            fused_add is None)  # fmt: skip


class _Geometry(NamedTuple):
    """A planned call's shapes: input [n, c, h, w], output [oh, ow]; ``cl``: the input is
    channels-last; ``channels_last``: so is the result."""

    n: int
    c: int
    h: int
    w: int
    oh: int
    ow: int
    cl: bool
    channels_last: bool


class _Epilogue(NamedTuple):
    """A planned call's checked qparams, clamp range, table and thread count."""

    x_scale: float
    out_scale: float
    a_zp: int
    o_zp: int
    qmin: int
    qmax: int
    table: npt.NDArray[np.uint8]
    threads: int


class _ConvPlan:
    """What a conv call derives from its arguments other than the input codes (the checks,
    layouts, offsets, epilogue vectors and kernel choice), made once per ``_plan_key``.
    ``run(x, fused_add)`` takes the checked input array."""

    __slots__ = ("run",)

    def __init__(self, run: Any) -> None:
        self.run = run

    @staticmethod
    def build(
        x: object,
        packed: PackedConvWeight,
        x_scale: float,
        x_zero_point: int,
        out_scale: float,
        out_zero_point: int,
        relu: bool,
        channels_last: bool,
        dims: int,
        name: str,
        fused_add: tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]] | None,
        lut: npt.NDArray[np.uint8] | None,
        threads: int,
    ) -> tuple[npt.NDArray[np.uint8], _ConvPlan]:
        """The checked input array and the plan for this call (every argument checked)."""
        if packed.dims != dims:
            raise KernelError(f"{name}: packed weight is for conv{packed.dims}d, not conv{dims}d")
        xa = check_array("x", x, np.uint8, dims + 2, contiguous=False)
        # channels-last data is read in place; so is C-contiguous data that is channels-last
        # too (1x1 planes, e.g. squeeze-excite convs, or one channel)
        cl = channels_last_data(xa) is not None
        if not cl and not xa.flags.c_contiguous:
            raise KernelError(
                f"x: expected a C-contiguous (N, C, ...) array or channels-last data viewed as "
                f"one, got strides {xa.strides}; pass np.ascontiguousarray(x)"
            )
        x4 = xa if dims == 2 else xa[:, :, None, :]
        n, c, h, w = (int(s) for s in x4.shape)
        if c != packed.in_channels:
            raise KernelError(
                f"{name}: input has {c} channels but the weight expects {packed.in_channels} "
                f"(C/groups={packed.cg} x groups={packed.groups})"
            )
        a_zp = _fast_zp(x_zero_point, "x_zero_point")
        o_zp = _fast_zp(out_zero_point, "out_zero_point")
        # a fused add's table maps the add's codes: it cannot narrow the conv's clamp range
        qmin, qmax, table = epilogue_lut(lut, o_zp if relu else 0, fold=fused_add is None)
        if type(x_scale) is not float:  # float scales are range-checked by the epilogues
            x_scale = f32_scale("x_scale", x_scale)
        if type(out_scale) is not float:
            out_scale = f32_scale("out_scale", out_scale)
        oh, ow = packed.output_size(h, w)
        if oh < 1 or ow < 1:
            raise KernelError(
                f"{name}: input spatial size {(h, w)[2 - dims :]} is too small for kernel "
                f"{(packed.kh, packed.kw)[2 - dims :]} with padding/dilation; output would be "
                "empty"
            )
        geo = _Geometry(n, c, h, w, oh, ow, cl, channels_last)
        epi = _Epilogue(x_scale, out_scale, a_zp, o_zp, qmin, qmax, table, threads)
        if packed.depthwise and fused_add is None:
            run4 = _depthwise_plan(packed, geo, epi)
        else:
            run4 = _gemm_plan(packed, geo, epi, fused_add is not None)
        if dims == 2:
            return xa, _ConvPlan(run4)

        def run1(x: npt.NDArray[np.uint8], fused: Any) -> npt.NDArray[np.uint8]:
            out: npt.NDArray[np.uint8] = run4(x[:, :, None, :], fused)[:, :, 0, :]
            return out

        return xa, _ConvPlan(run1)


def _to_nchw(out: npt.NDArray[np.uint8], channels_last: bool) -> npt.NDArray[np.uint8]:
    """NHWC result as NCHW: a view of the channels-last data, or a C-contiguous copy."""
    nchw = out.transpose(0, 3, 1, 2)
    return nchw if channels_last else np.ascontiguousarray(nchw)


# output planes narrower than this (in either dimension) get the padded copy: 3x3 and strided
# 5x5 kernels below 10 pixels, 5x5 stride-1 kernels (whose border is 2 pixels deep) below 64
_DW_PAD_BELOW = 10
_DW_PAD_BELOW_5X5_S1 = 64


def _depthwise_plan(packed: PackedConvWeight, geo: _Geometry, epi: _Epilogue) -> Any:
    """Depthwise conv into a new NHWC array; reads channels-last input in place (NCHW input
    is transposed once), padding handled by the kernels (no zero-point-padded copy)."""
    n, c, h, w, oh, ow, cl, channels_last = geo
    x_scale, out_scale, a_zp, o_zp, qmin, qmax, table, threads = epi
    sh, sw = packed.stride
    dh, dw = packed.dilation
    ph, pw = packed.padding
    # on small planes the border is a large share of the pixels: a zero-point-padded copy
    # makes every pixel interior, so only the block kernels run (the per-pixel tap-list path
    # is several times slower per pixel). 3x3, 7x7x960: 1.46x faster; from 14x14 on, the copy
    # costs what it saves. 5x5 stride 1: 0.81-0.90x the time up to 56x56, 1.76x at 112x112
    # (measured, kernels DESIGN.md "Depthwise convs")
    below = _DW_PAD_BELOW_5X5_S1 if packed.kw == 5 and sw == 1 else _DW_PAD_BELOW
    # with the 64-channel kernels a border pixel costs about an interior one: at stride 2 the
    # copy (4x the output's bytes) no longer pays (576x14x14: 1.35x slower with it)
    copy_pays = packed._dw_c64 == 0 or sw == 1
    pad = bool(ph or pw) and min(oh, ow) < below and packed.kw in (3, 5) and dw == 1 and copy_pays
    hp, wp = h + 2 * ph, w + 2 * pw
    biasq, mult = packed.depthwise_epilogue(x_scale, out_scale)
    corr = np.float32(a_zp) * packed._dw_wsum  # x_zp * sum(w - w_zp) per channel, exact
    rows = n * oh
    serial, parallel = DEPTHWISE_DRIVERS[packed.target]
    if threads > 1 and rows * ow * c * packed.kh * packed.kw >= depthwise_module.PARALLEL_MIN_MACS:
        driver, per_task = parallel, -(-rows // (4 * threads))
    else:
        driver, per_task = serial, rows
    threaded = driver is parallel
    xh, xw, xph, xpw = (hp, wp, 0, 0) if pad else (h, w, ph, pw)
    geometry = DwGeometry(n, xh, xw, c, oh, ow, packed.kh, packed.kw, sh, sw, dh, dw, xph, xpw)
    weights = DwWeights(packed._dw_weight, packed._dw_cp, corr, biasq, mult)
    # the 64-channel blocks' constants, in their accumulators' channel order (none: empty)
    c64 = packed._dw_c64
    order = packed._dw_order if c64 else np.zeros(0, np.int64)
    acc0 = (-a_zp * packed._dw_wsum[order]).astype(np.int32)  # exact: below 2**24
    weights64 = Dw64Weights(
        c64, packed._dw_group, packed._dw_w8, 4 * c64, acc0, biasq[order], mult[order]
    )
    # with VBMI a pass over the output beats the driver's byte-by-byte row lookup (~20x)
    drive_table = NO_LUT if table_as_pass(table) else table
    output = DwOutput(o_zp, qmin, qmax, drive_table)
    zpf = float(a_zp)  # the input zero point as the float kernels subtract it
    # x writeable (the one argument whose type can change) -> the driver's compiled entry,
    # found through numba's dispatcher by the first call: later calls skip its type dispatch,
    # slow for records (~1 us a call)
    entries: dict[bool, Any] = {}

    def run(x4: npt.NDArray[np.uint8], _fused: Any) -> npt.NDArray[np.uint8]:
        if cl:
            nhwc = x4.transpose(0, 2, 3, 1)
        else:
            nhwc = np.empty((n, h, w, c), np.uint8)
            nchw_into_padded_nhwc(
                x4.reshape(-1), n, c, h, w, 1, c, c, 0, 0, w, h, a_zp, nhwc.reshape(-1)
            )
        if pad:
            padded = np.empty((n, hp, wp, c), np.uint8)
            nhwc_into_padded_nhwc(
                nhwc.reshape(-1), n, h, w, 1, c, c, ph, pw, wp, hp, a_zp, padded.reshape(-1)
            )
            nhwc = padded
        out = np.empty(n * oh * ow * c, np.uint8)  # NHWC
        args = (nhwc.reshape(-1), zpf, geometry, weights, weights64, output, out, per_task)
        writeable = nhwc.flags.writeable
        entry = entries.get(writeable)
        if entry is not None:
            entry(*args)
        else:
            (with_threads(driver, threads) if threaded else driver)(*args)
            entry = compiled_entry_point(driver, args)
            if entry is not None:  # None after a dry run's record (targets/dry_run.py)
                entries[writeable] = with_threads(entry, threads) if threaded else entry
        if drive_table is not table:  # VBMI: the table as one pass over the output
            apply_table(out, table, out, threads)
        return _to_nchw(out.reshape(n, oh, ow, c), channels_last)

    return run


def _gemm_plan(packed: PackedConvWeight, geo: _Geometry, epi: _Epilogue, fused_add: bool) -> Any:
    """Implicit-im2col GEMMs, one per group, over the zero-point-padded NHWC buffer (the
    channels-last input itself when no padding is needed)."""
    n, c, h, w, oh, ow, cl, channels_last = geo
    x_scale, out_scale, a_zp, o_zp, qmin, qmax, table, threads = epi
    g, cg, cg4, oc, ocg = packed.groups, packed.cg, packed.cg4, packed.oc, packed.ocg
    ph, pw = packed.padding
    hp, wp = h + 2 * ph, w + 2 * pw
    in_place = cl and ph == pw == 0 and cg == cg4 and not packed.row_packed
    size = n * hp * wp * g * cg4
    rowoffs = packed.row_offsets(n, hp, wp, oh, ow)
    m = rowoffs.shape[0]
    koffs = packed.koffs(wp)
    direct = g == 1 and packed.target == "avx512_vnni" and not channels_last
    spread = spread_copy(not cl, g, cg, cg4, w)
    # per group: its GEMM runner and row sums (data-dependent only with weight zero points:
    # None, computed per call); the VNNI NCHW path runs its own drivers
    groups = []
    # byte kernels on weights past 7 bits: rows whose window holds a pair of codes past the
    # limit are redone exactly (``_pair_guard``; a channel-padded layout pairs codes in place)
    to_rows = window_rows((n, hp, wp), (oh, ow), (packed.kh, packed.kw), packed.stride,
                          packed.dilation)  # fmt: skip
    for gi, pg in enumerate([] if direct else packed.groups_packed):
        biasq, mult = pg.epilogue(x_scale, out_scale)
        guard = pg.guard(n * hp * wp, g * cg4, not packed.row_packed, to_rows)
        runner = gemm_runner(pg.kernel, rowoffs, koffs[gi], pg.packed, pg.n, pg.colcorr(a_zp),
                             pg.zero_points, biasq, mult, o_zp, qmin, False, threads,
                             fused_add, table, qmax, guard)  # fmt: skip
        groups.append((runner, None if pg.has_weight_zp else pg.rows(m)[1]))
    # the window sums of weight zero points come from the NHWC view, made only for them
    window_sums = any(rowsum is None for _, rowsum in groups)
    if in_place and len(groups) == 1 and not window_sums:
        # the usual pointwise conv between two convs: one GEMM straight on the input bytes
        (runner, rowsum), nhwc_out = groups[0], (n, oh, ow, oc)

        def run_in_place(
            x4: npt.NDArray[np.uint8],
            fused: tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]] | None,
        ) -> npt.NDArray[np.uint8]:
            if fused is None:
                res = runner(x4.ravel(order="K"), rowsum)
            else:
                res = runner(x4.ravel(order="K"), rowsum, fused[0], fused[1])
            return _to_nchw(res.reshape(nhwc_out), channels_last)

        return run_in_place

    def run(
        x4: npt.NDArray[np.uint8],
        fused: tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]] | None,
    ) -> npt.NDArray[np.uint8]:
        if in_place:  # already the layout the kernels read: no copy
            flat = x4.ravel(order="K")  # the NHWC bytes in memory order (a view)
            xp = flat.reshape(n, h, w, g, cg4) if window_sums or direct else None
        else:
            buf = np.empty(size + K_ALIGN, np.uint8)  # every byte is written below
            buf[size:] = 0  # the tail row-packed k steps may read (against zero weights)
            body = buf[:size]
            xp = body.reshape(n, hp, wp, g, cg4)
            flat = buf
            if spread is not None:  # 1-3 input channels (a stem): 16 pixels a vector shuffle
                src = x4.ravel(order="K") if cl else x4.reshape(-1)
                spread(src, n, h, w, a_zp, body, ph, pw, wp, hp)
            elif cl:
                nhwc_into_padded_nhwc(
                    x4.ravel(order="K"), n, h, w, g, cg, cg4, ph, pw, wp, hp, a_zp, body
                )
            else:
                nchw_into_padded_nhwc(
                    x4.reshape(-1), n, c, h, w, g, cg, cg4, ph, pw, wp, hp, a_zp, body
                )
        if direct:
            assert xp is not None  # made for this path above
            return _conv_nchw_direct(packed, flat, rowoffs, koffs[0], xp, n, oh, ow, x_scale,
                                     out_scale, a_zp, o_zp, qmin, qmax, table, threads)  # fmt: skip
        out = np.empty((n, oh, ow, oc), np.uint8) if g > 1 else None
        for gi, (runner, rowsum) in enumerate(groups):
            if rowsum is None:
                assert xp is not None
                rowsum = _window_sums(xp, gi, packed, oh, ow)
            res = runner(
                flat, rowsum,
                None if fused is None else fused[0], None if fused is None else fused[1],
            )  # fmt: skip
            if out is None:
                out = res.reshape(n, oh, ow, oc)  # no scatter
            else:
                out[..., gi * ocg : (gi + 1) * ocg] = res.reshape(n, oh, ow, ocg)
        assert out is not None
        return _to_nchw(out, channels_last)

    return run


@njit(cache=True, nogil=True)
def _serial_u8t_batch(  # type: ignore[no-untyped-def]  # numba types the arguments
    n, hw, flat, rowoffs, koffs, bp, npanels, res, colcorr, wzp, rowsum, biasq, mult, ozp, qmin,
    qmax, lut,
):  # fmt: skip
    # the batch loop in compiled code: one Python call per conv instead of one per image, whose
    # dispatch and slicing cost more than the kernels themselves on small images
    per = res.shape[1] * hw
    flat_res = res.reshape(-1)
    for b in range(n):
        serial_vnni_u8t(
            flat, rowoffs[b * hw : (b + 1) * hw], hw, koffs, koffs.shape[0], bp, npanels,
            flat_res[b * per : (b + 1) * per], hw, colcorr, wzp, rowsum[b * hw : (b + 1) * hw],
            biasq, mult, ozp, qmin, qmax, hw, NO_RESIDUAL, NO_ADD, lut,
        )  # fmt: skip


needs_features(target_features("avx512_vnni"), _serial_u8t_batch)


def _conv_nchw_direct(
    packed: PackedConvWeight,
    flat: npt.NDArray[np.uint8],
    rowoffs: npt.NDArray[np.int64],
    koffs: npt.NDArray[np.int64],
    xp: npt.NDArray[np.uint8],
    n: int,
    oh: int,
    ow: int,
    x_scale: float,
    out_scale: float,
    a_zp: int,
    o_zp: int,
    qmin: int,
    qmax: int,
    table: npt.NDArray[np.uint8],
    threads: int,
) -> npt.NDArray[np.uint8]:
    """One image at a time, with kernels that store channel-major: NCHW without a transpose."""
    pg = packed.groups_packed[0]
    hw = oh * ow
    biasq, mult = pg.epilogue(x_scale, out_scale)
    colcorr = pg.colcorr(a_zp)
    rowsum = _window_sums(xp, 0, packed, oh, ow) if pg.has_weight_zp else pg.rows(n * hw)[1]
    npanels = pg.n_padded // 32
    if threads == 1 or hw * pg.n_padded * koffs.shape[0] < SERIAL_BELOW[pg.kernel]:
        drv, mchunk = serial_vnni_u8t, hw
    else:
        drv, mchunk = with_threads(drive_vnni_u8t, threads), row_chunk(hw, npanels, threads)
    res = np.empty((n, pg.n_padded, hw), np.uint8)
    if drv is serial_vnni_u8t:
        _serial_u8t_batch(
            n, hw, flat, rowoffs, koffs, pg.packed, npanels, res, colcorr, pg.zero_points,
            rowsum, biasq, mult, o_zp, qmin, qmax, table,
        )  # fmt: skip
    else:
        for b in range(n):
            drv(
                flat,
                rowoffs[b * hw : (b + 1) * hw],
                hw,
                koffs,
                koffs.shape[0],
                pg.packed,
                npanels,
                res[b].reshape(-1),
                hw,
                colcorr,
                pg.zero_points,
                rowsum[b * hw : (b + 1) * hw],
                biasq,
                mult,
                o_zp,
                qmin,
                qmax,
                mchunk,
                NO_RESIDUAL,
                NO_ADD,
                table,
            )
    if pg.n_padded != packed.oc:
        res = np.ascontiguousarray(res[:, : packed.oc])
    return res.reshape(n, packed.oc, oh, ow)


def _window_sums(
    xp: npt.NDArray[np.uint8], g: int, packed: PackedConvWeight, oh: int, ow: int
) -> npt.NDArray[np.int32]:
    """Sum of each output pixel's input window (real channels of group g), for w_zp != 0."""
    s = xp[:, :, :, g, : packed.cg].sum(axis=-1, dtype=np.int64)
    sh, sw = packed.stride
    dh, dw = packed.dilation
    total = np.zeros((xp.shape[0], oh, ow), np.int64)
    for i in range(packed.kh):
        for j in range(packed.kw):
            r0, c0 = i * dh, j * dw
            total += s[:, r0 : r0 + (oh - 1) * sh + 1 : sh, c0 : c0 + (ow - 1) * sw + 1 : sw]
    return total.reshape(-1).astype(np.int32)


def conv2d(
    x: npt.NDArray[np.uint8],
    packed: PackedConvWeight,
    x_scale: float,
    x_zero_point: int,
    out_scale: float,
    out_zero_point: int,
    *,
    relu: bool = False,
    num_threads: int | None = None,
    channels_last: bool = False,
    lut: npt.NDArray[np.uint8] | None = None,
) -> npt.NDArray[np.uint8]:
    """Quantized 2-D convolution of uint8 ``x`` [N, C, H, W] (relu fused if asked).

    ``x`` is C-contiguous or channels-last. The result is C-contiguous NCHW, or with
    ``channels_last=True`` NHWC data viewed as NCHW (faster: no output transpose, and the
    next conv reads it without a copy when it needs no padding). ``lut``: a uint8[256] table
    (``build_lut``) applied to the output codes in the epilogue, after relu: exactly
    ``apply_lut(conv2d(...), lut)`` without a second pass (a clamp table costs nothing).
    """
    return _conv(
        x, packed, x_scale, x_zero_point, out_scale, out_zero_point, relu, num_threads,
        channels_last, 2, "conv2d", lut=lut,
    )  # fmt: skip


def conv1d(
    x: npt.NDArray[np.uint8],
    packed: PackedConvWeight,
    x_scale: float,
    x_zero_point: int,
    out_scale: float,
    out_zero_point: int,
    *,
    relu: bool = False,
    num_threads: int | None = None,
    channels_last: bool = False,
    lut: npt.NDArray[np.uint8] | None = None,
) -> npt.NDArray[np.uint8]:
    """Quantized 1-D convolution of uint8 ``x`` [N, C, L] (relu fused if asked).

    Layouts as ``conv2d``: C-contiguous or channels-last (NLC data) in; NCL out, or NLC data
    viewed as NCL with ``channels_last=True``. ``lut`` as ``conv2d``'s.
    """
    return _conv(
        x, packed, x_scale, x_zero_point, out_scale, out_zero_point, relu, num_threads,
        channels_last, 1, "conv1d", lut=lut,
    )  # fmt: skip


def conv2d_add(
    x: npt.NDArray[np.uint8],
    packed: PackedConvWeight,
    x_qparams: QParams | tuple[float, int],
    conv_qparams: QParams | tuple[float, int],
    other: npt.NDArray[np.uint8],
    other_qparams: QParams | tuple[float, int],
    out_qparams: QParams | tuple[float, int],
    *,
    relu_conv: bool = False,
    relu: bool = False,
    num_threads: int | None = None,
    lut: npt.NDArray[np.uint8] | None = None,
) -> npt.NDArray[np.uint8]:
    """``add(conv2d(x), other)`` (``add_relu`` with ``relu=True``) in one pass: a residual block.

    Exactly ``add[_relu](conv2d(x, packed, *x_qparams, *conv_qparams, relu=relu_conv),
    *conv_qparams, other, *other_qparams, *out_qparams)``: the conv's output codes are computed
    and rounded as usual, then added to ``other`` with the add kernel's arithmetic, in the
    GEMM's epilogue while the block is still in registers (no conv output written and read
    back). ``other`` has the conv output's shape, C-contiguous or channels-last; the result is
    channels-last. Fused for groups = 1 on ``avx512_vnni`` (any output channels) and on
    ``avx2`` (output channels a multiple of 8); otherwise the two kernels run one after the
    other. ``lut``: a
    uint8[256] table applied to the add's output codes (``apply_lut(conv2d_add(...), lut)``),
    in the same epilogue when fused.
    """
    key = _add_key(x, other, x_qparams, conv_qparams, other_qparams, out_qparams, relu)
    try:
        known = None if key is None else getattr(packed, "_add_args", {}).get(key)
    except TypeError:  # e.g. 0-d arrays as qparams: valid, but checked on every call
        key = known = None
    if known is None:
        known = _checked_add_args(x, packed, x_qparams, conv_qparams, other, other_qparams,
                                  out_qparams, relu, relu_conv, num_threads, lut)  # fmt: skip
        if isinstance(known, np.ndarray):  # not fusable: ran unfused
            return known
        if key is not None and len(packed._add_args) < _PLAN_LIMIT:
            packed._add_args[key] = known
    elif lut is not None:
        epilogue_lut(lut, 0, fold=False)  # a bad table is refused under this name
    x_scale, x_zero_point, conv_scale, conv_zero_point, addp, other_cl = known
    assert isinstance(other, np.ndarray)
    # channels-last codes in memory order (a view), or NCHW codes transposed once
    other_nhwc = other.ravel(order="K") if other_cl else other.transpose(0, 2, 3, 1).ravel()
    return _conv(
        x, packed, x_scale, x_zero_point, conv_scale, conv_zero_point, relu_conv,
        num_threads, True, 2, "conv2d_add", (other_nhwc, addp), lut,
    )  # fmt: skip


class _ConvAddPlan(NamedTuple):
    """``PreparedConvAdd``'s plan: the layouts and thread count it was made for, whether the
    residual is channels-last, the run and the fused add's parameters."""

    x: InputLayout
    other: InputLayout
    threads: int
    other_channels_last: bool
    run: Callable[..., Any]
    add_params: npt.NDArray[np.float32]


class PreparedConvAdd:
    """``conv2d_add`` with every argument but the two inputs fixed: a residual block called
    again and again on inputs of one shape and layout, as ``PreparedConv`` is for ``conv2d``.

    ``prepared(x, other)`` returns exactly ``conv2d_add(x, packed, x_qparams, conv_qparams,
    other, other_qparams, out_qparams, relu_conv=relu_conv, relu=relu, lut=lut,
    num_threads=num_threads)``. The first call checks its arguments and plans the call as
    ``conv2d_add`` does; later calls whose ``x`` and ``other`` have the same shapes, strides
    and dtype, on the same thread count, run that plan directly (``conv2d_add`` spends ~3 us
    a call on its checks and plan lookups). Anything else is checked and planned again. ``lut``
    is copied here, as ``PreparedConv`` does.
    """

    __slots__ = ("_fast", "_lut", "_qparams", "_threads", "packed", "relu", "relu_conv")

    def __init__(
        self,
        packed: PackedConvWeight,
        x_qparams: QParams | tuple[float, int],
        conv_qparams: QParams | tuple[float, int],
        other_qparams: QParams | tuple[float, int],
        out_qparams: QParams | tuple[float, int],
        *,
        relu_conv: bool = False,
        relu: bool = False,
        lut: npt.NDArray[np.uint8] | None = None,
        num_threads: int | None = None,
    ) -> None:
        if not isinstance(packed, PackedConvWeight):
            raise KernelError(f"packed: expected a PackedConvWeight, got {type(packed).__name__}")
        named = (("x_qparams", x_qparams), ("conv_qparams", conv_qparams),
                 ("other_qparams", other_qparams), ("out_qparams", out_qparams))  # fmt: skip
        self._qparams = tuple(as_qparams(name, qp) for name, qp in named)
        if num_threads is not None:
            apply_num_threads(num_threads, "PreparedConvAdd")  # refused here, not at the call
        self.packed = packed
        self.relu_conv = relu_conv
        self.relu = relu
        self._lut = None if lut is None else np.array(lut, copy=True)
        self._threads = num_threads
        self._fast: _ConvAddPlan | None = None  # the last plan, for inputs of its layouts

    def __call__(
        self, x: npt.NDArray[np.uint8], other: npt.NDArray[np.uint8]
    ) -> npt.NDArray[np.uint8]:
        fast = self._fast
        if (
            fast is not None
            and fast.x.fits(x)
            and fast.other.fits(other)
            and (self._threads or get_num_threads()) == fast.threads
        ):
            channels_last = fast.other_channels_last
            flat = other.ravel(order="K") if channels_last else other.transpose(0, 2, 3, 1).ravel()
            out: npt.NDArray[np.uint8] = fast.run(x, (flat, fast.add_params))
            return out
        return self._plan_and_run(x, other)

    def _plan_and_run(self, x: object, other: object) -> npt.NDArray[np.uint8]:
        self._fast = None
        xq, cq, oq, outq = self._qparams
        known = _checked_add_args(x, self.packed, xq, cq, other, oq, outq, self.relu,  # type: ignore[arg-type]
                                  self.relu_conv, self._threads, self._lut)  # fmt: skip
        if isinstance(known, np.ndarray):  # not fusable: ran unfused, nothing to keep
            return known
        x_scale, x_zero_point, conv_scale, conv_zero_point, addp, other_cl = known
        assert isinstance(other, np.ndarray)
        flat = other.ravel(order="K") if other_cl else other.transpose(0, 2, 3, 1).ravel()
        threads = apply_num_threads(self._threads, "conv2d_add")
        xa, plan, kept = _find_plan(x, self.packed, x_scale, x_zero_point, conv_scale,
                                    conv_zero_point, self.relu_conv, True, 2, "conv2d_add",
                                    (flat, addp), self._lut, threads)  # fmt: skip
        if kept and type(other) is np.ndarray:
            self._fast = _ConvAddPlan(
                InputLayout.of(xa), InputLayout.of(other), threads, other_cl, plan.run, addp
            )
        out: npt.NDArray[np.uint8] = plan.run(xa, (flat, addp))
        return out


class _AddArgs(NamedTuple):
    """A fused ``conv2d_add`` call's checked arguments (cached per ``_add_key``)."""

    x_scale: float
    x_zero_point: int
    conv_scale: float
    conv_zero_point: int
    addp: npt.NDArray[np.float32]
    other_cl: bool


def _add_key(
    x: object,
    other: object,
    x_qparams: object,
    conv_qparams: object,
    other_qparams: object,
    out_qparams: object,
    relu: object,
) -> tuple[object, ...] | None:
    """What a fused add's checked arguments depend on (None: check them on every call): the
    qparams (with the zero points' types, as ``_plan_key``), the relu flag and both arrays'
    shapes and strides; the conv's own arguments are checked by its plan."""
    if type(x) is not np.ndarray or type(other) is not np.ndarray or other.dtype is not _U8:
        return None
    qps = (x_qparams, conv_qparams, other_qparams, out_qparams)
    # (unhashable values make the lookup raise: see conv2d_add)
    return (*qps, *(type(q[1]) if isinstance(q, tuple) and len(q) == 2 else None for q in qps),
            relu, x.shape, other.shape, other.strides)  # fmt: skip


def _checked_add_args(
    x: npt.NDArray[np.uint8],
    packed: PackedConvWeight,
    x_qparams: QParams | tuple[float, int],
    conv_qparams: QParams | tuple[float, int],
    other: npt.NDArray[np.uint8],
    other_qparams: QParams | tuple[float, int],
    out_qparams: QParams | tuple[float, int],
    relu: bool,
    relu_conv: bool,
    num_threads: int | None,
    lut: npt.NDArray[np.uint8] | None,
) -> _AddArgs | npt.NDArray[np.uint8]:
    """Every argument checked: the fused call's arguments, or (a layout the fused epilogue
    does not take) the result of the conv and the add run one after the other."""
    epilogue_lut(lut, 0, fold=False)  # a bad table is refused under this name on every path
    x_scale, x_zero_point = as_qparams("x_qparams", x_qparams)
    conv_scale, conv_zero_point = as_qparams("conv_qparams", conv_qparams)
    other_scale, other_zero_point = as_qparams("other_qparams", other_qparams)
    out_scale, out_zero_point = as_qparams("out_qparams", out_qparams)
    # under this function's names, whichever path runs
    f32_scale("x_qparams.scale", x_scale)
    f32_scale("conv_qparams.scale", conv_scale)
    f32_scale("other_qparams.scale", other_scale)
    f32_scale("out_qparams.scale", out_scale, inverted=True)
    xa = check_array("x", x, np.uint8, 4, contiguous=False)
    ob = check_array("other", other, np.uint8, 4, contiguous=False)
    want = (xa.shape[0], packed.oc, *packed.output_size(xa.shape[2], xa.shape[3]))
    if ob.shape != want:
        raise KernelError(f"other: expected the conv output's shape {want}, got {ob.shape}")
    if not _fusable(packed):
        conv = conv2d(
            x, packed, x_scale, x_zero_point, conv_scale, conv_zero_point,
            relu=relu_conv, num_threads=num_threads, channels_last=True,
        )  # fmt: skip
        add = add_relu if relu else add_plain
        summed = add(
            conv, (conv_scale, conv_zero_point), other, (other_scale, other_zero_point),
            (out_scale, out_zero_point),
        )  # fmt: skip
        return summed if lut is None else apply_lut(summed, lut, out=summed)
    sa, pa, sb, pb, inv, zp = _add_params(
        f32_scale("conv_qparams.scale", conv_scale),
        check_zero_point("conv_qparams.zero_point", conv_zero_point, 0, 255),
        f32_scale("other_qparams.scale", other_scale),
        check_zero_point("other_qparams.zero_point", other_zero_point, 0, 255),
        f32_scale("out_qparams.scale", out_scale, inverted=True),
        check_zero_point("out_qparams.zero_point", out_zero_point, 0, 255),
    )
    floor = np.float32(0.0) if relu else np.float32(-np.inf)
    addp = np.array([sa, pa, sb, pb, inv, floor, zp], np.float32)
    other_cl = channels_last_data(ob) is not None
    return _AddArgs(x_scale, x_zero_point, conv_scale, conv_zero_point, addp, other_cl)


def _fusable(packed: PackedConvWeight) -> bool:
    """The fused epilogue reads the residual laid out like its output rows: one group whose
    rows hold exactly the output channels (any count on VNNI, whose epilogue masks a row's
    end; whole vectors on AVX2)."""
    if not (
        isinstance(packed, PackedConvWeight)
        and packed.dims == 2
        and packed.groups == 1
        and packed.target in ("avx512_vnni", "avx_vnni", "avx2")
    ):
        return False
    kernel = packed.groups_packed[0].kernel
    return kernel == "avx512_vnni" or packed.oc % block_lanes(kernel) == 0
