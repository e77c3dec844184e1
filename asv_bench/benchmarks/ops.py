"""Per-op benchmarks: every column (fp32 torch, reference decomposition, each numba target).

Shapes are the kernels issue's: the GEMM shapes and the ResNet conv of the kernels bench
(``python packages/kernels/bench/bench_kernels.py``), and a 1x64x56x56 activation for the
elementwise ops, pools, lookup-table activations and quantize/dequantize.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from quantbridge import kernels

from ._common import OP_BACKENDS, best_seconds, interleaved_ratio, kernel_target, single_thread

# The shape tables and the peak probe are the kernels bench's, a script beside the package (not
# in it); importable here as the lowering benches import this suite's modules.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "kernels" / "bench"))
from bench_kernels import (
    CONV_SHAPE,
    DEPTHWISE_SHAPES,
    GEMM_SHAPES,
    STEM_SHAPES,
    measure_peak_gops,
)

X_SCALE, X_ZP, W_SCALE, OUT_SCALE, OUT_ZP = 0.05, 3, 0.01, 2.0, 5
ACT_SHAPE = (1, 64, 56, 56)


def _requant(y: torch.Tensor, scale: float, zp: int) -> torch.Tensor:
    return torch.clamp(torch.round(y / scale) + zp, 0, 255).to(torch.uint8)


def _deq(q: torch.Tensor, scale: float, zp: int) -> torch.Tensor:
    return (q.to(torch.float32) - zp) * scale


def _gemm_shape(shape: str) -> tuple[int, int, int]:
    m, k, n = (int(v) for v in shape.split("x"))
    return m, k, n


class Linear:
    """uint8 x int8 linear with requantized uint8 output, M x K x N."""

    params: ClassVar[list[list[str]]] = [OP_BACKENDS, [f"{m}x{k}x{n}" for m, k, n in GEMM_SHAPES]]
    param_names: ClassVar[list[str]] = ["backend", "shape"]
    timeout = 120

    def setup_cache(self) -> float:
        # one-thread vpdpbusd peak of this machine (0 without AVX-512 VNNI), for % of peak
        return measure_peak_gops(1) or 0.0

    def setup(self, peak: float, backend: str, shape: str) -> None:
        single_thread()
        m, k, n = _gemm_shape(shape)
        rng = np.random.default_rng(0)
        a = rng.integers(0, 256, (m, k), dtype=np.uint8)
        w = rng.integers(-128, 128, (n, k), dtype=np.int8)
        bias = rng.normal(0, 1, n).astype(np.float32)
        self.ops = 2.0 * m * k * n
        self.peak = peak
        xf = torch.from_numpy(a).float()
        wf = torch.from_numpy(w).float()
        bf = torch.from_numpy(bias)
        self.fp32: Callable[[], Any] = lambda: F.linear(xf, wf, bf)
        if backend == "fp32":
            self.fn = self.fp32
        elif backend == "reference":
            xq, wq = torch.from_numpy(a), torch.from_numpy(w)

            def ref() -> torch.Tensor:
                y = F.linear(_deq(xq, X_SCALE, X_ZP), wq.float() * W_SCALE, bf)
                return _requant(y, OUT_SCALE, OUT_ZP)

            self.fn = ref
        else:
            packed = kernels.PackedLinearWeight(w, W_SCALE, 0, bias, target=kernel_target(backend))
            self.fn = lambda: kernels.linear(
                a, packed, X_SCALE, X_ZP, OUT_SCALE, OUT_ZP, num_threads=1
            )
        self.backend = backend
        self.fn()  # JIT / first-call costs outside the timing

    def time_linear(self, peak: float, backend: str, shape: str) -> None:
        self.fn()

    def peakmem_linear(self, peak: float, backend: str, shape: str) -> None:
        self.fn()

    def track_gops(self, peak: float, backend: str, shape: str) -> float:
        return self.ops / best_seconds(self.fn) / 1e9

    track_gops.unit = "GOPS"  # type: ignore[attr-defined]

    def track_percent_of_peak(self, peak: float, backend: str, shape: str) -> float:
        if not backend.startswith("numba_") or not peak:
            return float("nan")  # an int8 peak says nothing about fp32 columns
        return 100.0 * self.ops / best_seconds(self.fn) / 1e9 / peak

    track_percent_of_peak.unit = "%"  # type: ignore[attr-defined]

    def track_speedup_vs_fp32(self, peak: float, backend: str, shape: str) -> float:
        return interleaved_ratio(self.fp32, self.fn)

    track_speedup_vs_fp32.unit = "x"  # type: ignore[attr-defined]


class Conv2d:
    """uint8 x int8 3x3 conv (padding 1), the ResNet block shape; NCHW in, channels-last out."""

    params: ClassVar[list[list[str]]] = [OP_BACKENDS]
    param_names: ClassVar[list[str]] = ["backend"]
    timeout = 120

    def setup(self, backend: str) -> None:
        single_thread()
        bn, c, h, wd, oc, ks = CONV_SHAPE
        rng = np.random.default_rng(0)
        x = rng.integers(0, 256, (bn, c, h, wd), dtype=np.uint8)
        w = rng.integers(-128, 128, (oc, c, ks, ks), dtype=np.int8)
        bias = rng.normal(0, 1, oc).astype(np.float32)
        self.ops = 2.0 * bn * oc * h * wd * c * ks * ks
        xf, wf, bf = (
            torch.from_numpy(x).float(),
            torch.from_numpy(w).float(),
            torch.from_numpy(bias),
        )
        self.fp32: Callable[[], Any] = lambda: F.conv2d(xf, wf, bf, padding=1)
        if backend == "fp32":
            self.fn = self.fp32
        elif backend == "reference":
            xq = torch.from_numpy(x)

            def ref() -> torch.Tensor:
                y = F.conv2d(_deq(xq, X_SCALE, X_ZP), wf * W_SCALE, bf, padding=1)
                return _requant(y, OUT_SCALE, OUT_ZP)

            self.fn = ref
        else:
            packed = kernels.PackedConvWeight(
                w, W_SCALE, 0, bias, padding=1, target=kernel_target(backend)
            )
            # channels-last output: what lowered models use (and torch's quantized conv returns)
            self.fn = lambda: kernels.conv2d(
                x, packed, X_SCALE, X_ZP, OUT_SCALE, OUT_ZP, num_threads=1, channels_last=True
            )
        self.fn()

    def time_conv2d(self, backend: str) -> None:
        self.fn()

    def track_gops(self, backend: str) -> float:
        return self.ops / best_seconds(self.fn) / 1e9

    track_gops.unit = "GOPS"  # type: ignore[attr-defined]

    def track_speedup_vs_fp32(self, backend: str) -> float:
        return interleaved_ratio(self.fp32, self.fn)

    track_speedup_vs_fp32.unit = "x"  # type: ignore[attr-defined]


# name -> (batch, C, H = W, OC, kernel, stride): the kernels bench's depthwise and stem rows
CNN_CONVS = {
    "depthwise3x3_s1": DEPTHWISE_SHAPES[0],
    "depthwise3x3_s2": DEPTHWISE_SHAPES[1],
    "stem7x7_s2": STEM_SHAPES[0],
    "stem3x3_s2": STEM_SHAPES[1],
}


class CnnConv:
    """Depthwise (channels-last in and out, as between layers) and stem convs (NCHW image in)."""

    params: ClassVar[list[list[str]]] = [OP_BACKENDS, list(CNN_CONVS)]
    param_names: ClassVar[list[str]] = ["backend", "conv"]
    timeout = 120

    def setup(self, backend: str, conv: str) -> None:
        single_thread()
        bn, c, hw, oc, ks, stride = CNN_CONVS[conv]
        groups, pad = (c if conv.startswith("depthwise") else 1), ks // 2
        rng = np.random.default_rng(0)
        x = rng.integers(0, 256, (bn, c, hw, hw), dtype=np.uint8)
        if groups > 1:
            x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
        w = rng.integers(-128, 128, (oc, c // groups, ks, ks), dtype=np.int8)
        bias = rng.normal(0, 1, oc).astype(np.float32)
        oh = (hw + 2 * pad - ks) // stride + 1
        self.ops = 2.0 * bn * oc * oh * oh * (c // groups) * ks * ks
        xt = torch.from_numpy(x)  # keeps x's channels-last strides
        xf, wf, bf = xt.float(), torch.from_numpy(w).float(), torch.from_numpy(bias)
        self.fp32: Callable[[], Any] = lambda: F.conv2d(xf, wf, bf, stride, pad, 1, groups)
        if backend == "fp32":
            self.fn = self.fp32
        elif backend == "reference":

            def ref() -> torch.Tensor:
                y = F.conv2d(_deq(xt, X_SCALE, X_ZP), wf * W_SCALE, bf, stride, pad, 1, groups)
                return _requant(y, OUT_SCALE, OUT_ZP)

            self.fn = ref
        else:
            packed = kernels.PackedConvWeight(
                w, W_SCALE, 0, bias, stride=stride, padding=pad, groups=groups,
                target=kernel_target(backend),
            )  # fmt: skip
            self.fn = lambda: kernels.conv2d(
                x, packed, X_SCALE, X_ZP, OUT_SCALE, OUT_ZP, num_threads=1, channels_last=True
            )
        self.fn()

    def time_conv(self, backend: str, conv: str) -> None:
        self.fn()

    def track_gops(self, backend: str, conv: str) -> float:
        return self.ops / best_seconds(self.fn) / 1e9

    track_gops.unit = "GOPS"  # type: ignore[attr-defined]

    def track_speedup_vs_fp32(self, backend: str, conv: str) -> float:
        return interleaved_ratio(self.fp32, self.fn)

    track_speedup_vs_fp32.unit = "x"  # type: ignore[attr-defined]


ELEMENTWISE_OPS = ["add", "max_pool2d", "avg_pool2d", "lut_sigmoid", "quantize", "dequantize"]


class Elementwise:
    """add, pools, lookup-table sigmoid, quantize/dequantize on a 1x64x56x56 activation."""

    params: ClassVar[list[list[str]]] = [OP_BACKENDS, ELEMENTWISE_OPS]
    param_names: ClassVar[list[str]] = ["backend", "op"]
    timeout = 120

    def setup(self, backend: str, op: str) -> None:
        single_thread()
        rng = np.random.default_rng(0)
        a = rng.integers(0, 256, ACT_SHAPE, dtype=np.uint8)
        b = rng.integers(0, 256, ACT_SHAPE, dtype=np.uint8)
        xf = rng.normal(0, 1, ACT_SHAPE).astype(np.float32)
        ta, tb, txf = torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(xf)
        fa, fb = _deq(ta, X_SCALE, X_ZP), _deq(tb, X_SCALE, X_ZP)
        fp32: dict[str, Callable[[], Any]] = {
            "add": lambda: fa + fb,
            "max_pool2d": lambda: F.max_pool2d(fa, 3, 2, 1),
            "avg_pool2d": lambda: F.avg_pool2d(fa, 3, 2, 1),
            "lut_sigmoid": lambda: torch.sigmoid(fa),
        }
        reference: dict[str, Callable[[], Any]] = {
            "add": lambda: _requant(_deq(ta, X_SCALE, X_ZP) + _deq(tb, X_SCALE, X_ZP), 0.1, 0),
            "max_pool2d": lambda: _requant(
                F.max_pool2d(_deq(ta, X_SCALE, X_ZP), 3, 2, 1), X_SCALE, X_ZP
            ),
            "avg_pool2d": lambda: _requant(
                F.avg_pool2d(_deq(ta, X_SCALE, X_ZP), 3, 2, 1), X_SCALE, X_ZP
            ),
            "lut_sigmoid": lambda: _requant(torch.sigmoid(_deq(ta, X_SCALE, X_ZP)), 1 / 256, 0),
            "quantize": lambda: _requant(txf, X_SCALE, X_ZP),
            "dequantize": lambda: _deq(ta, X_SCALE, X_ZP),
        }
        if backend == "fp32":
            if op not in fp32:
                raise NotImplementedError(f"{op} has no fp32 counterpart")
            self.fn = fp32[op]
        elif backend == "reference":
            self.fn = reference[op]
        else:
            t = kernel_target(backend)
            table = kernels.build_lut("sigmoid", X_SCALE, X_ZP, 1 / 256, 0)
            numba_ops: dict[str, Callable[[], Any]] = {
                "add": lambda: kernels.add(
                    a, (X_SCALE, X_ZP), b, (X_SCALE, X_ZP), (0.1, 0), target=t
                ),
                "max_pool2d": lambda: kernels.max_pool2d(a, 3, 2, 1, target=t),
                "avg_pool2d": lambda: kernels.avg_pool2d(
                    a, 3, 2, 1, scale=X_SCALE, zero_point=X_ZP, target=t
                ),
                "lut_sigmoid": lambda: kernels.apply_lut(a, table, target=t),
                "quantize": lambda: kernels.quantize_per_tensor(xf, X_SCALE, X_ZP, target=t),
                "dequantize": lambda: kernels.dequantize_per_tensor(a, X_SCALE, X_ZP, target=t),
            }
            self.fn = numba_ops[op]
        self.fp32 = fp32.get(op, reference[op])
        self.fn()

    def time_op(self, backend: str, op: str) -> None:
        self.fn()

    def track_speedup_vs_fp32(self, backend: str, op: str) -> float:
        # quantize/dequantize have no fp32 op: their baseline is the reference formula
        return interleaved_ratio(self.fp32, self.fn)

    track_speedup_vs_fp32.unit = "x"  # type: ignore[attr-defined]
