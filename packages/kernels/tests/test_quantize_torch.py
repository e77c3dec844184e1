"""quantize / dequantize / requantize differentially against torch's quantized tensors (oracle)."""

from __future__ import annotations

import numpy as np
import pytest

import quantbridge.kernels as qk

torch = pytest.importorskip("torch")
pytest.importorskip("torch.ao.quantization")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TORCH_DTYPE = {np.uint8: "quint8", np.int8: "qint8"}


def _tq(dtype):
    return getattr(torch, TORCH_DTYPE[dtype])


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_quantize_per_tensor_is_byte_identical_to_torch(dtype):
    rng = np.random.default_rng(0)
    info = np.iinfo(dtype)
    for trial in range(60):
        n = int(rng.integers(1, 3000))
        scale = float(rng.choice([rng.uniform(1e-4, 1), 0.1, 1 / 3, 0.0123456789, 2.0**-7]))
        zp = int(rng.integers(int(info.min), int(info.max) + 1))
        x = (rng.standard_normal(n) * rng.uniform(0.01, 100)).astype(np.float32)
        k = rng.integers(-300, 300, n).astype(np.float32)
        x[: n // 3] = ((k[: n // 3] + np.float32(0.5)) * np.float32(scale))[: n // 3]
        if trial % 7 == 0:
            x[::5] = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30], np.float32)[
                : x[::5].size % 5 or 5
            ][0]
        want = (
            torch.quantize_per_tensor(torch.from_numpy(x), scale, zp, _tq(dtype)).int_repr().numpy()
        )
        np.testing.assert_array_equal(qk.quantize_per_tensor(x, scale, zp, dtype), want)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_quantize_per_channel_is_byte_identical_to_torch(dtype):
    rng = np.random.default_rng(1)
    info = np.iinfo(dtype)
    for _ in range(40):
        ndim = int(rng.integers(1, 5))
        shape = tuple(int(v) for v in rng.integers(1, 7, ndim))
        axis = int(rng.integers(0, ndim))
        c = shape[axis]
        x = (rng.standard_normal(shape) * 3).astype(np.float32)
        scales = rng.uniform(1e-3, 0.5, c)
        ties = (rng.integers(-100, 100, x.size) + 0.5) * np.float32(scales[0])
        x.flat[::2] = ties.astype(np.float32)[::2]
        zps = rng.integers(int(info.min), int(info.max) + 1, c)
        want = (
            torch.quantize_per_channel(
                torch.from_numpy(x),
                torch.from_numpy(scales),
                torch.from_numpy(zps),
                axis,
                _tq(dtype),
            )
            .int_repr()
            .numpy()
        )
        got = qk.quantize_per_channel(x, scales, zps, axis, dtype)
        np.testing.assert_array_equal(got, want)


def test_quantize_nan_and_infinities_like_torch():
    x = np.array([[np.nan, np.inf, -np.inf, 1e30, -1e30, 0.5]] * 2, np.float32)
    for dtype in (np.uint8, np.int8):
        pt = torch.quantize_per_tensor(torch.from_numpy(x), 1.0, 10, _tq(dtype)).int_repr().numpy()
        np.testing.assert_array_equal(qk.quantize_per_tensor(x, 1.0, 10, dtype), pt)
        pc = (
            torch.quantize_per_channel(
                torch.from_numpy(x),
                torch.ones(2, dtype=torch.float64),
                torch.tensor([10, 3]),
                0,
                _tq(dtype),
            )
            .int_repr()
            .numpy()
        )
        got = qk.quantize_per_channel(x, np.ones(2), np.array([10, 3]), 0, dtype)
        np.testing.assert_array_equal(got, pc)


def test_dequantize_is_bit_identical_to_torch():
    rng = np.random.default_rng(2)
    for _ in range(30):
        n = int(rng.integers(1, 2000))
        scale = float(rng.uniform(1e-4, 2))
        zp = int(rng.integers(0, 256))
        q = rng.integers(0, 256, n).astype(np.uint8)
        tq = torch._make_per_tensor_quantized_tensor(torch.from_numpy(q), scale, zp)
        np.testing.assert_array_equal(
            qk.dequantize_per_tensor(q, scale, zp).view(np.int32),
            tq.dequantize().numpy().view(np.int32),
        )
        s8 = rng.integers(-128, 128, n).astype(np.int8)
        tq8 = torch._make_per_tensor_quantized_tensor(torch.from_numpy(s8), scale, zp - 128)
        np.testing.assert_array_equal(
            qk.dequantize_per_tensor(s8, scale, zp - 128), tq8.dequantize().numpy()
        )
        shape = (int(rng.integers(1, 6)), int(rng.integers(1, 6)), int(rng.integers(1, 6)))
        axis = int(rng.integers(0, 3))
        scales = rng.uniform(1e-3, 1, shape[axis])
        zps = rng.integers(0, 256, shape[axis])
        qc = rng.integers(0, 256, shape).astype(np.uint8)
        tqc = torch._make_per_channel_quantized_tensor(
            torch.from_numpy(qc), torch.from_numpy(scales), torch.from_numpy(zps), axis
        )
        np.testing.assert_array_equal(
            qk.dequantize_per_channel(qc, scales, zps, axis), tqc.dequantize().numpy()
        )


def test_requantize_matches_torch_dequantize_then_quantize():
    rng = np.random.default_rng(4)
    q = rng.integers(0, 256, 4096).astype(np.uint8)
    for _ in range(20):
        s_in, s_out = (float(v) for v in rng.uniform(1e-3, 1, 2))
        z_in, z_out = (int(v) for v in rng.integers(0, 256, 2))
        tq = torch._make_per_tensor_quantized_tensor(torch.from_numpy(q), s_in, z_in)
        want = (
            torch.quantize_per_tensor(tq.dequantize(), s_out, z_out, torch.quint8)
            .int_repr()
            .numpy()
        )
        np.testing.assert_array_equal(qk.requantize(q, s_in, z_in, s_out, z_out), want)
