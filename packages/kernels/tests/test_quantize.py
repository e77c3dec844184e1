"""quantize / dequantize / requantize against numpy references written here; argument checks."""

from __future__ import annotations

import numba
import numpy as np
import pytest

import quantbridge.kernels as qk
import quantbridge.kernels._quantize as _quantize_module
from quantbridge.kernels import KernelError, TargetUnavailableError


def ref_quantize_per_tensor(x, scale, zp, lo, hi):
    # fma(x, 1/scale, zp) evaluated in extended precision, then one rounding to float32
    inv = np.float32(1.0) / np.float32(scale)
    t = (x.astype(np.longdouble) * np.longdouble(inv) + np.longdouble(zp)).astype(np.float32)
    out = np.empty(x.shape, np.int64)
    nan = np.isnan(t)
    r = np.rint(np.where(nan, 0, t).astype(np.float64))
    out[...] = np.clip(r, lo, hi).astype(np.int64)
    out[nan] = hi
    return out


def ref_quantize_per_channel(x, scales, zps, axis, lo, hi):
    shape = [1] * x.ndim
    shape[axis] = -1
    inv = (np.float32(1.0) / scales.astype(np.float32)).reshape(shape)
    t = ((x * inv).astype(np.float32) + zps.reshape(shape).astype(np.float32)).astype(np.float32)
    r = np.rint(np.where(np.isnan(t), 0, t).astype(np.float64))
    out = np.clip(r, lo, hi).astype(np.int64)
    out[np.isnan(t)] = min(max(0, lo), hi)
    return out


def ref_dequantize_per_tensor(q, scale, zp):
    return (np.float32(scale) * (q.astype(np.int32) - zp).astype(np.float32)).astype(np.float32)


def ref_dequantize_per_channel(q, scales, zps, axis):
    shape = [1] * q.ndim
    shape[axis] = -1
    d = (q.astype(np.float64) - zps.reshape(shape)) * scales.astype(np.float64).reshape(shape)
    return d.astype(np.float32)


def _tie_data(rng, n, scale):
    # half the values sit exactly on .5 boundaries of x / scale: where rounding rules differ
    k = rng.integers(-400, 400, n).astype(np.float32)
    x = (rng.standard_normal(n) * 200 * scale).astype(np.float32)
    ties = ((k + np.float32(0.5)) * np.float32(scale)).astype(np.float32)
    x[: n // 2] = ties[: n // 2]
    return x


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("scale", [0.1, 1 / 3, 0.0123456789, 2.0**-7, 0.7802590505849383])
def test_quantize_per_tensor_matches_reference(dtype, scale):
    rng = np.random.default_rng(int(scale * 1e6))
    info = np.iinfo(dtype)
    for zp in (int(info.min), 0, 3, int(info.max)):
        x = _tie_data(rng, 1537, scale)
        got = qk.quantize_per_tensor(x, scale, zp, dtype)
        assert got.dtype == dtype
        want = ref_quantize_per_tensor(x, scale, zp, int(info.min), int(info.max))
        np.testing.assert_array_equal(got.astype(np.int64), want)


def test_quantize_uint8_every_vector_tail():
    # uint8's full range runs in 16-float vectors, the last one masked: every tail length,
    # with NaN, infinities and ties at both ends of the vector
    rng = np.random.default_rng(5)
    for n in [*range(1, 40), 255, 256, 257]:  # (zero-size arrays are refused)
        x = _tie_data(rng, n, 0.05)
        if n > 3:
            x[[0, n // 2, n - 1]] = [np.nan, np.inf, -np.inf]
        got = qk.quantize_per_tensor(x, 0.05, 131)
        np.testing.assert_array_equal(
            got.astype(np.int64), ref_quantize_per_tensor(x, 0.05, 131, 0, 255)
        )


def test_quantize_special_values_and_custom_range():
    x = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 0.0, 0.26, -0.26], np.float32)
    got = qk.quantize_per_tensor(x, 0.1, 10, np.uint8)
    np.testing.assert_array_equal(got, [255, 255, 0, 255, 0, 10, 13, 7])
    got = qk.quantize_per_tensor(x, 0.1, 10, np.uint8, quant_min=5, quant_max=12)
    np.testing.assert_array_equal(got, [12, 12, 5, 12, 5, 10, 12, 7])
    got = qk.quantize_per_tensor(x, 0.1, 0, np.int8, quant_min=-8, quant_max=7)
    np.testing.assert_array_equal(got, [7, 7, -8, 7, -8, 0, 3, -3])


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_quantize_per_channel_matches_reference(dtype):
    rng = np.random.default_rng(7)
    info = np.iinfo(dtype)
    for shape, axis in [((5,), 0), ((3, 7), 1), ((4, 3, 5), 1), ((2, 3, 4, 5), -1), ((6, 2, 3), 0)]:
        c = shape[axis]
        scales = rng.uniform(1e-3, 0.5, c)  # float64 values that float32 cannot hold exactly
        zps = rng.integers(int(info.min), int(info.max) + 1, c)
        x = (rng.standard_normal(shape) * 20).astype(np.float32)
        tie = ((rng.integers(-200, 200, x.size) + 0.5) * scales.min()).astype(np.float32)
        x.flat[1::3] = tie[1::3]
        x.flat[::3] = np.nan
        got = qk.quantize_per_channel(x, scales, zps, axis, dtype)
        want = ref_quantize_per_channel(x, scales, zps, axis % x.ndim, info.min, info.max)
        np.testing.assert_array_equal(got.astype(np.int64), want)


def test_dequantize_matches_reference():
    rng = np.random.default_rng(3)
    q = rng.integers(0, 256, (4, 9, 5)).astype(np.uint8)
    for scale in (0.1, 1 / 3, 0.0123456789):
        got = qk.dequantize_per_tensor(q, scale, 77)
        np.testing.assert_array_equal(got, ref_dequantize_per_tensor(q, scale, 77))
    s8 = rng.integers(-128, 128, (6, 4)).astype(np.int8)
    np.testing.assert_array_equal(
        qk.dequantize_per_tensor(s8, 0.05, -3), ref_dequantize_per_tensor(s8, 0.05, -3)
    )
    scales = rng.uniform(1e-3, 1, 9)
    zps = rng.integers(0, 256, 9)
    got = qk.dequantize_per_channel(q, scales, zps, 1)
    np.testing.assert_array_equal(got, ref_dequantize_per_channel(q, scales, zps, 1))


def test_requantize_is_quantize_of_dequantize():
    rng = np.random.default_rng(11)
    q = rng.integers(0, 256, 3000).astype(np.uint8)
    for s_in, z_in, s_out, z_out in [
        (0.1, 128, 0.2, 3),
        (1 / 3, 0, 0.05, 255),
        (0.02, 17, 0.02, 17),
    ]:
        got = qk.requantize(q, s_in, z_in, s_out, z_out)
        want = ref_quantize_per_tensor(
            ref_dequantize_per_tensor(q, s_in, z_in), s_out, z_out, 0, 255
        )
        np.testing.assert_array_equal(got.astype(np.int64), want)
    np.testing.assert_array_equal(qk.requantize(q, 0.02, 17, 0.02, 17), q)
    limited = qk.requantize(q, 0.1, 128, 0.1, 128, quant_min=10, quant_max=200)
    np.testing.assert_array_equal(limited, np.clip(q, 10, 200))


def test_out_argument_is_used_and_checked():
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(4, 6)
    out = np.empty((4, 6), np.uint8)
    result = qk.quantize_per_tensor(x, 0.05, 60, out=out)
    assert result is out
    np.testing.assert_array_equal(out, qk.quantize_per_tensor(x, 0.05, 60))
    deq = np.empty((4, 6), np.float32)
    assert qk.dequantize_per_tensor(out, 0.05, 60, out=deq) is deq
    with pytest.raises(KernelError, match="out: expected shape"):
        qk.quantize_per_tensor(x, 0.05, 60, out=np.empty((6, 4), np.uint8))
    with pytest.raises(KernelError, match="out: expected dtype"):
        qk.quantize_per_tensor(x, 0.05, 60, out=np.empty((4, 6), np.int8))
    with pytest.raises(KernelError, match="out: expected a C-contiguous"):
        qk.quantize_per_tensor(x, 0.05, 60, out=np.empty((4, 12), np.uint8)[:, ::2])
    readonly = np.empty((4, 6), np.uint8)
    readonly.flags.writeable = False
    with pytest.raises(KernelError, match="read-only"):
        qk.quantize_per_tensor(x, 0.05, 60, out=readonly)
    buffer = np.zeros(8, np.float32)
    with pytest.raises(KernelError, match="overlaps"):
        qk.dequantize_per_tensor(buffer.view(np.uint8)[:8], 0.1, 0, out=buffer)


F32 = np.zeros(3, np.float32)
F32_2D = np.zeros((2, 3), np.float32)
I64_2 = np.zeros(2, np.int64)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: qk.quantize_per_tensor(np.zeros(3, np.float64), 0.1, 0), "x: expected dtype"),
        (lambda: qk.quantize_per_tensor(F32, 0.0, 0), "scale"),
        (lambda: qk.quantize_per_tensor(F32, float("nan"), 0), "scale"),
        (lambda: qk.quantize_per_tensor(F32, 1e-45, 0), "scale"),
        (lambda: qk.quantize_per_tensor(F32, 0.1, 256), "zero_point"),
        (lambda: qk.quantize_per_tensor(F32, 0.1, 1.5), "zero_point"),
        (lambda: qk.quantize_per_tensor(F32, 0.1, 0, np.int16), "dtype"),
        (lambda: qk.quantize_per_tensor(F32, 0.1, 0, quant_min=9, quant_max=3), "quant_min"),
        (lambda: qk.quantize_per_tensor(F32_2D[:, ::2], 0.1, 0), "C-contiguous"),
        (lambda: qk.quantize_per_tensor(np.zeros(0, np.float32), 0.1, 0), "zero-size"),
        (lambda: qk.quantize_per_tensor([1.0, 2.0], 0.1, 0), "numpy array"),
        (lambda: qk.quantize_per_channel(F32_2D, np.ones(2), I64_2, 1), "scales/zero_points"),
        (lambda: qk.quantize_per_channel(F32_2D, np.ones(2), I64_2, 2), "axis"),
        (lambda: qk.quantize_per_channel(F32_2D, -np.ones(2), I64_2, 0), "scales"),
        (lambda: qk.quantize_per_channel(F32_2D, np.ones(2), np.full(2, 300), 0), "zero_points"),
        (lambda: qk.dequantize_per_tensor(np.zeros(3, np.int32), 0.1, 0), "q: expected dtype"),
        (lambda: qk.dequantize_per_tensor(np.zeros(3, np.int8), 0.1, 200), "zero_point"),
        (lambda: qk.requantize(np.zeros(3, np.int8), 0.1, 0, 0.1, 0), "q: expected dtype"),
        (lambda: qk.requantize(np.zeros(3, np.uint8), 0.1, 0, "x", 0), "out_scale"),
    ],
)
def test_bad_input_raises_kernel_error_naming_the_argument(call, message):
    with pytest.raises(KernelError, match=message):
        call()


@pytest.mark.parametrize("target", qk.available_targets())
def test_every_available_target_gives_the_same_result(target):
    rng = np.random.default_rng(5)
    x = rng.standard_normal(1000).astype(np.float32)
    base = qk.quantize_per_tensor(x, 0.02, 100)
    np.testing.assert_array_equal(qk.quantize_per_tensor(x, 0.02, 100, target=target), base)
    q = base
    np.testing.assert_array_equal(
        qk.dequantize_per_tensor(q, 0.02, 100, target=target),
        qk.dequantize_per_tensor(q, 0.02, 100),
    )


def test_target_argument_and_environment_are_validated(monkeypatch):
    x = np.zeros(4, np.float32)
    with pytest.raises(KernelError, match="unknown kernel target"):
        qk.quantize_per_tensor(x, 0.1, 0, target="sse9")
    monkeypatch.setenv(qk.ENV_VAR, "bogus")
    with pytest.raises(KernelError, match="environment variable"):
        qk.dequantize_per_tensor(np.zeros(4, np.uint8), 0.1, 0)
    monkeypatch.delenv(qk.ENV_VAR)
    # a CPU without AVX-512 VNNI must refuse that target, even though the code is shared
    import quantbridge.kernels._targets as targets

    monkeypatch.setattr(targets, "cpu_features", lambda: frozenset({"avx2", "fma"}))
    with pytest.raises(TargetUnavailableError, match="avx512_vnni"):
        qk.quantize_per_tensor(x, 0.1, 0, target="avx512_vnni")
    qk.quantize_per_tensor(x, 0.1, 0, target="avx2")


@pytest.mark.parametrize("threads", [1, 2])
def test_parallel_path_matches_serial_reference(threads, monkeypatch):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("numba runs with fewer threads on this machine")
    rng = np.random.default_rng(9)
    x = _tie_data(rng, 7 * 30_011, 0.05).reshape(7, -1)
    _force_threaded_path(monkeypatch, threads)
    qk.set_num_threads(threads)
    try:
        got = qk.quantize_per_tensor(x, 0.05, 128)
        deq = qk.dequantize_per_tensor(got, 0.05, 128)
        scales = np.array([0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
        zps = np.arange(7) * 30
        pc = qk.quantize_per_channel(x, scales, zps, 0)
        dpc = qk.dequantize_per_channel(pc, scales, zps, 0)
        rq = qk.requantize(got, 0.05, 128, 0.1, 5)
    finally:
        qk.set_num_threads(None)
    # numba's own per-thread count (set above to differ from the call's) is left as it was
    assert numba.get_num_threads() == (numba.config.NUMBA_NUM_THREADS if threads == 1 else 1)
    np.testing.assert_array_equal(
        got.astype(np.int64), ref_quantize_per_tensor(x, 0.05, 128, 0, 255)
    )
    np.testing.assert_array_equal(deq, ref_dequantize_per_tensor(got, 0.05, 128))
    np.testing.assert_array_equal(
        pc.astype(np.int64), ref_quantize_per_channel(x, scales, zps, 0, 0, 255)
    )
    np.testing.assert_array_equal(dpc, ref_dequantize_per_channel(pc, scales, zps, 0))
    np.testing.assert_array_equal(
        rq.astype(np.int64),
        ref_quantize_per_tensor(ref_dequantize_per_tensor(got, 0.05, 128), 0.1, 5, 0, 255),
    )


def _force_threaded_path(monkeypatch, threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("numba runs with fewer threads on this machine")
    # the size threshold is tuned for speed; lower it so these inputs take the threaded path
    monkeypatch.setattr(_quantize_module, "PARALLEL_MIN_WORK", 1)
    monkeypatch.setattr(_quantize_module, "STREAM_MIN_WORK", 1)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS if threads == 1 else 1)


def _layouts(shape, dtype, rng, make):
    """The same values C-contiguous, channels-last, transposed, a smaller batch, CHW."""
    x = make(rng, shape).astype(dtype)
    cl = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    return [x, x, cl, cl, np.ascontiguousarray(x[:1]), x[0].copy(), x.T.copy().T]


def _floats(rng, shape):
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    x.reshape(-1)[:4] = [np.nan, np.inf, -np.inf, 0.5]  # NaN, saturations, a tie
    return x


def _codes(rng, shape):
    return rng.integers(0, 256, shape)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 3, 224, 224)])  # the large one splits
def test_prepared_conversions_equal_the_functions_through_layout_changes(threads, shape):
    rng = np.random.default_rng(11)
    cases = [
        (qk.PreparedQuantize(0.05, 128), lambda x: qk.quantize_per_tensor(x, 0.05, 128),
         np.float32, _floats),
        (qk.PreparedQuantize(0.02, -3, np.int8, -100, 90),
         lambda x: qk.quantize_per_tensor(x, 0.02, -3, np.int8, -100, 90), np.float32, _floats),
        (qk.PreparedDequantize(0.1, 7), lambda q: qk.dequantize_per_tensor(q, 0.1, 7), np.uint8,
         _codes),
        (qk.PreparedDequantize(0.1, -7), lambda q: qk.dequantize_per_tensor(q, 0.1, -7),
         np.int8, lambda rng, s: rng.integers(-128, 128, s)),
        (qk.PreparedRequantize((0.1, 3), (0.07, 200)),
         lambda q: qk.requantize(q, 0.1, 3, 0.07, 200), np.uint8, _codes),
        (qk.PreparedRequantize((0.1, 3), (0.3, 20), 10, 240),
         lambda q: qk.requantize(q, 0.1, 3, 0.3, 20, 10, 240), np.uint8, _codes),
    ]  # fmt: skip
    qk.set_num_threads(threads)
    try:
        for prepared, function, dtype, make in cases:
            for i, x in enumerate(_layouts(shape, dtype, rng, make)):
                want = function(x)
                got = prepared(x)
                np.testing.assert_array_equal(got, want, err_msg=f"{prepared!r} input {i}")
                assert got.dtype == want.dtype
                assert got.strides == want.strides
                # the call was planned for this layout and thread count: the next takes it
                assert (*prepared._fast.x, prepared._fast.threads) == (
                    x.shape,
                    x.strides,
                    x.dtype,
                    threads,
                )
            # the plan reads its input: new values through the fast path
            again = make(rng, x.shape).astype(dtype)
            np.testing.assert_array_equal(prepared(again), function(again))
    finally:
        qk.set_num_threads(None)
    # one against the reference rule itself, not only against the function
    x = _floats(rng, (4, 33))
    got = qk.PreparedQuantize(0.05, 128)(x)
    np.testing.assert_array_equal(got, ref_quantize_per_tensor(x, 0.05, 128, 0, 255))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: qk.PreparedQuantize(0.0, 128), "scale"),
        (lambda: qk.PreparedQuantize(0.1, 300), "zero_point"),
        (lambda: qk.PreparedQuantize(0.1, 0, np.int16), "dtype"),
        (lambda: qk.PreparedQuantize(0.1, 0, np.uint8, 10, 5), "quant_min"),
        (lambda: qk.PreparedQuantize(0.1, 0, target="nope"), "unknown kernel target"),
        (lambda: qk.PreparedDequantize(float("nan"), 0), "scale"),
        (lambda: qk.PreparedDequantize(0.1, 256), "zero_point"),
        (lambda: qk.PreparedRequantize((0.1, 0), (-1.0, 0)), "out_qparams.scale"),
        (lambda: qk.PreparedRequantize((0.1, 256), (1.0, 0)), "in_qparams.zero_point"),
        (lambda: qk.PreparedRequantize((0.1, 0), (1.0, 3), 10, 200), "out_qparams.zero_point"),
        (lambda: qk.PreparedRequantize(0.1, (1.0, 3)), "in_qparams"),
    ],
)
def test_prepared_conversions_refuse_bad_arguments_by_name(make, message):
    with pytest.raises(KernelError, match=message):
        make()


def test_prepared_conversions_refuse_bad_inputs_after_a_good_call():
    x = np.zeros((2, 3), np.float32)
    codes = np.zeros((2, 3), np.uint8)
    quantize, dequantize = qk.PreparedQuantize(0.1, 3), qk.PreparedDequantize(0.1, 200)
    requantize = qk.PreparedRequantize((0.1, 3), (0.2, 5))
    quantize(x), dequantize(codes), requantize(codes)  # good calls: their fast paths exist
    with pytest.raises(KernelError, match="x: expected dtype float32"):
        quantize(x.astype(np.float64))
    with pytest.raises(KernelError, match="C-contiguous"):
        quantize(np.zeros((2, 6), np.float32)[:, ::2])
    with pytest.raises(KernelError, match="q: expected dtype"):
        dequantize(codes.astype(np.int16))
    # the zero point fits uint8 codes, not int8 ones
    with pytest.raises(KernelError, match="zero_point"):
        dequantize(codes.astype(np.int8))
    with pytest.raises(KernelError, match="q: expected dtype uint8"):
        requantize(codes.astype(np.int8))
