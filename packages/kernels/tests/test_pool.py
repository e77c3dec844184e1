"""max / avg / adaptive-avg pooling: references written here, torch's quantized pools as oracle."""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest

import quantbridge.kernels as qk
import quantbridge.kernels._quantize as _quantize_module
from quantbridge.kernels import KernelError


def _out(size, k, pad, stride, dil, ceil):
    span = size + 2 * pad - dil * (k - 1) - 1
    out = (-(-span // stride) if ceil else span // stride) + 1
    if ceil and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def ref_max_pool(x, k, s, p, d, ceil):
    planes = x.reshape(-1, *x.shape[-2:]).astype(np.int64)
    h, w = planes.shape[1:]
    oh, ow = _out(h, k[0], p[0], s[0], d[0], ceil), _out(w, k[1], p[1], s[1], d[1], ceil)
    padded = np.full(
        (planes.shape[0], h + 2 * p[0] + k[0] * d[0] * 2, w + 2 * p[1] + k[1] * d[1] * 2), -1
    )
    padded[:, p[0] : p[0] + h, p[1] : p[1] + w] = planes
    out = np.empty((planes.shape[0], oh, ow), np.int64)
    for i in range(oh):
        for j in range(ow):
            win = padded[
                :,
                i * s[0] : i * s[0] + k[0] * d[0] : d[0],
                j * s[1] : j * s[1] + k[1] * d[1] : d[1],
            ]
            # a window entirely in the padding gives code 0, as in torch's quantized kernel
            out[:, i, j] = np.maximum(win.reshape(win.shape[0], -1).max(axis=1), 0)
    return out.reshape(*x.shape[:-2], oh, ow).astype(np.uint8)


def ref_avg_pool(x, k, s, p, ceil, include_pad, divisor, scale, zp, out_scale, out_zp):
    planes = x.reshape(-1, *x.shape[-2:]).astype(np.int64)
    h, w = planes.shape[1:]
    oh, ow = _out(h, k[0], p[0], s[0], 1, ceil), _out(w, k[1], p[1], s[1], 1, ceil)
    out = np.empty((planes.shape[0], oh, ow), np.uint8)
    for i in range(oh):
        for j in range(ow):
            y0, x0 = i * s[0] - p[0], j * s[1] - p[1]
            y1, x1 = min(y0 + k[0], h + p[0]), min(x0 + k[1], w + p[1])
            pool = (y1 - y0) * (x1 - x0)
            ya, xa, yb, xb = max(y0, 0), max(x0, 0), min(y1, h), min(x1, w)
            count = (yb - ya) * (xb - xa)
            total = planes[:, ya:yb, xa:xb].reshape(planes.shape[0], -1).sum(axis=1) - count * zp
            div = divisor if divisor else (pool if include_pad else count)
            m = np.float32((scale / out_scale) / div)
            v = (total.astype(np.float32) * m).astype(np.float32) + np.float32(out_zp)
            out[:, i, j] = np.clip(np.rint(v.astype(np.float32)), 0, 255)
    return out.reshape(*x.shape[:-2], oh, ow)


def ref_adaptive(x, oh, ow, qparams=None):
    """torch's quantized adaptive pool; with ``(scale, zp, out_scale, out_zp)``, each window's
    sum requantized by avg_pool2d's rule instead."""
    planes = x.reshape(-1, *x.shape[-2:]).astype(np.int64)
    h, w = planes.shape[1:]
    out = np.empty((planes.shape[0], oh, ow), np.uint8)

    def window(o, n_out, n_in):
        return (
            math.floor(np.float32(o * n_in) / np.float32(n_out)),
            math.ceil(np.float32((o + 1) * n_in) / np.float32(n_out)),
        )

    for i in range(oh):
        ya, yb = window(i, oh, h)
        for j in range(ow):
            xa, xb = window(j, ow, w)
            r = np.float32(np.float32(1) / np.float32(yb - ya)) / np.float32(xb - xa)
            total = planes[:, ya:yb, xa:xb].reshape(planes.shape[0], -1).sum(axis=1)
            if qparams is None:
                v = (total.astype(np.float32) * np.float32(r)).astype(np.float32)
                out[:, i, j] = np.rint(v)
                continue
            scale, zp, out_scale, out_zp = qparams
            count = (yb - ya) * (xb - xa)
            m = np.float32((np.float32(scale) / np.float32(out_scale)) / count)
            v = ((total - count * zp).astype(np.float32) * m).astype(np.float32)
            out[:, i, j] = np.clip(np.rint(v + np.float32(out_zp)), 0, 255)
    return out.reshape(*x.shape[:-2], oh, ow)


def _random_case(rng, min_size=1):
    n, c = int(rng.integers(1, 3)), int(rng.integers(min_size, 4))
    h, w = int(rng.integers(min_size, 12)), int(rng.integers(min_size, 12))
    x = rng.integers(0, 256, (n, c, h, w)).astype(np.uint8)
    if rng.integers(0, 4) == 0:
        x = np.ascontiguousarray(x[0])  # CHW
    k = (int(rng.integers(1, 5)), int(rng.integers(1, 5)))
    s = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
    p = (int(rng.integers(0, k[0] // 2 + 1)), int(rng.integers(0, k[1] // 2 + 1)))
    return x, k, s, p


def _fits(x, k, s, p, d, ceil):
    h, w = x.shape[-2:]
    return _out(h, k[0], p[0], s[0], d[0], ceil) >= 1 and _out(w, k[1], p[1], s[1], d[1], ceil) >= 1


def test_max_pool_matches_reference():
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(150):
        x, k, s, p = _random_case(rng)
        d = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        ceil = bool(rng.integers(0, 2))
        if not _fits(x, k, s, p, d, ceil):
            with pytest.raises(KernelError, match="kernel_size"):
                qk.max_pool2d(x, k, s, p, d, ceil)
            continue
        np.testing.assert_array_equal(
            qk.max_pool2d(x, k, s, p, d, ceil), ref_max_pool(x, k, s, p, d, ceil)
        )
        checked += 1
    assert checked > 60


def test_avg_pool_matches_reference():
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(150):
        x, k, s, p = _random_case(rng)
        ceil, include_pad = bool(rng.integers(0, 2)), bool(rng.integers(0, 2))
        divisor = None if rng.integers(0, 3) else int(rng.integers(1, 10))
        scale, zp = float(rng.uniform(0.01, 1)), int(rng.integers(0, 256))
        out_scale, out_zp = (scale, zp) if rng.integers(0, 2) else (float(rng.uniform(0.01, 1)), 7)
        if not _fits(x, k, s, p, (1, 1), ceil):
            continue
        got = qk.avg_pool2d(
            x, k, s, p, ceil, include_pad, divisor,
            scale=scale, zero_point=zp, out_scale=out_scale, out_zero_point=out_zp,
        )  # fmt: skip
        want = ref_avg_pool(x, k, s, p, ceil, include_pad, divisor, scale, zp, out_scale, out_zp)
        np.testing.assert_array_equal(got, want)
        checked += 1
    assert checked > 60


def test_adaptive_avg_pool_matches_reference():
    rng = np.random.default_rng(2)
    for _ in range(80):
        x, _, _, _ = _random_case(rng)
        oh, ow = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        np.testing.assert_array_equal(qk.adaptive_avg_pool2d(x, (oh, ow)), ref_adaptive(x, oh, ow))
    x = np.arange(16, dtype=np.uint8).reshape(1, 1, 4, 4)
    np.testing.assert_array_equal(qk.adaptive_avg_pool2d(x, 1), [[[[8]]]])  # mean 7.5 -> 8


def test_adaptive_avg_pool_requantizes_to_output_qparams():
    rng = np.random.default_rng(12)
    for _ in range(80):
        x, _, _, _ = _random_case(rng)
        oh, ow = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        qp = (float(rng.uniform(0.01, 1)), int(rng.integers(0, 256)))
        out_qp = (float(rng.uniform(0.005, 1)), int(rng.integers(0, 256)))
        got = qk.adaptive_avg_pool2d(
            x, (oh, ow), scale=qp[0], zero_point=qp[1], out_scale=out_qp[0],
            out_zero_point=out_qp[1],
        )  # fmt: skip
        np.testing.assert_array_equal(got, ref_adaptive(x, oh, ow, (*qp, *out_qp)))
        # the float mean of the dequantized input, quantized: at most one code away
        mean = torch_float_adaptive(x, (oh, ow), qp)
        want = np.clip(np.rint(mean / np.float32(out_qp[0])) + out_qp[1], 0, 255)
        assert np.abs(got.astype(np.int64) - want).max(initial=0) <= 1
    # equal qparams are torch's kernel, bit for bit
    x = rng.integers(0, 256, (2, 3, 7, 5), dtype=np.uint8)
    same = qk.adaptive_avg_pool2d(x, (3, 2), scale=0.1, zero_point=9, out_scale=0.1,
                                  out_zero_point=9)  # fmt: skip
    np.testing.assert_array_equal(same, ref_adaptive(x, 3, 2))


def torch_float_adaptive(x, size, qp):
    torch = pytest.importorskip("torch")
    xf = (torch.from_numpy(x.astype(np.float32)) - qp[1]) * np.float32(qp[0])
    return torch.nn.functional.adaptive_avg_pool2d(xf, size).numpy()


def test_adaptive_avg_pool_qparams_come_together():
    x = np.zeros((1, 2, 4, 4), np.uint8)
    with pytest.raises(KernelError, match="together"):
        qk.adaptive_avg_pool2d(x, 1, scale=0.1, zero_point=0)
    with pytest.raises(KernelError, match="out_scale"):
        qk.adaptive_avg_pool2d(x, 1, scale=0.1, zero_point=0, out_scale=0.0, out_zero_point=0)
    with pytest.raises(KernelError, match="largest window"):
        qk.PreparedAdaptiveAvgPool2d(1, scale=1e-37, zero_point=0, out_scale=1.0,
                                     out_zero_point=0)(x)  # fmt: skip


def test_prepared_adaptive_avg_pool_equals_the_function_through_layout_changes():
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (2, 40, 7, 9), dtype=np.uint8)
    x_cl = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    chw = x[0].copy()
    for size in ((1, 1), (2, 3)):
        prepared = qk.PreparedAdaptiveAvgPool2d(size)
        # repeats take the fast path; a change of layout, shape or thread count plans again
        for i, (xin, threads) in enumerate(
            [(x_cl, 1), (x_cl, 1), (x, 1), (x, 2), (x_cl, 2), (chw, 1), (x[:1].copy(), 1)]
        ):
            qk.set_num_threads(threads)
            try:
                want = qk.adaptive_avg_pool2d(xin, size)
                got = prepared(xin)
            finally:
                qk.set_num_threads(None)
            np.testing.assert_array_equal(got, want, err_msg=f"call {i}")
            np.testing.assert_array_equal(got, ref_adaptive(xin, *size))
            assert got.strides == want.strides
            assert prepared._fast is not None
            assert prepared._fast.threads == threads


def test_prepared_adaptive_avg_pool_refuses_bad_arguments_by_name():
    with pytest.raises(KernelError, match="output_size"):
        qk.PreparedAdaptiveAvgPool2d((0, 2))
    with pytest.raises(KernelError, match="unknown kernel target"):
        qk.PreparedAdaptiveAvgPool2d(1, target="nope")
    prepared = qk.PreparedAdaptiveAvgPool2d(1)
    x = np.zeros((1, 2, 5, 5), np.uint8)
    prepared(x)  # a good call first: the next ones must not slip through its fast path
    with pytest.raises(KernelError, match="x: expected dtype uint8"):
        prepared(x.astype(np.int8))
    with pytest.raises(KernelError, match="C-contiguous"):
        prepared(x[..., ::2])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x: qk.max_pool2d(x, 0), "kernel_size"),
        (lambda x: qk.max_pool2d(x, 3, padding=2), "padding"),
        (lambda x: qk.max_pool2d(x, 2, stride=0), "stride"),
        (lambda x: qk.max_pool2d(x, (2, 2, 2)), "kernel_size"),
        (lambda x: qk.max_pool2d(x, 9), "does not fit"),
        (lambda x: qk.max_pool2d(x, 2, ceil_mode="yes"), "ceil_mode"),
        (lambda x: qk.max_pool2d(x[0, 0], 2), "expected 3 or 4-D"),
        (lambda x: qk.max_pool2d(x.astype(np.int8), 2), "x: expected dtype uint8"),
        (lambda x: qk.max_pool2d(x[..., ::2], 2), "C-contiguous"),
        (lambda x: qk.avg_pool2d(x, 2, zero_point=300), "zero_point"),
        (lambda x: qk.avg_pool2d(x, 2, zero_point=0, divisor_override=0), "divisor_override"),
        (lambda x: qk.avg_pool2d(x, 2, zero_point=0, scale=-1.0), "scale"),
        (lambda x: qk.avg_pool2d(x, 2, zero_point=0, out=np.zeros((1, 2, 3, 3), np.uint8)), "out"),
        (lambda x: qk.adaptive_avg_pool2d(x, (0, 2)), "output_size"),
        (lambda x: qk.adaptive_avg_pool2d(x, 2, out=x), "out"),
        (lambda x: qk.adaptive_avg_pool2d(x, 2, target="nope"), "unknown kernel target"),
    ],
)
def test_bad_input(call, message):
    x = np.zeros((1, 2, 5, 5), np.uint8)
    with pytest.raises(KernelError, match=message):
        call(x)


def test_out_argument_must_not_alias_input():
    x = np.zeros((1, 2, 4, 4), np.uint8)
    with pytest.raises(KernelError, match="overlap"):
        qk.max_pool2d(x, 1, out=x)
    out = np.empty((1, 2, 2, 2), np.uint8)
    assert qk.max_pool2d(x + 3, 2, out=out) is out
    assert (out == 3).all()


@pytest.mark.parametrize("target", qk.available_targets())
@pytest.mark.parametrize("threads", [1, 2])
def test_large_inputs_threads_and_targets(threads, target, monkeypatch):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("numba runs with fewer threads on this machine")
    x = np.random.default_rng(3).integers(0, 256, (2, 16, 48, 48)).astype(np.uint8)
    _force_threaded_path(monkeypatch, threads)
    qk.set_num_threads(threads)
    x_cl = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    try:
        mx = qk.max_pool2d(x, 3, 2, 1, target=target)
        # channels-last: output rows split between the threads, windows at every edge
        mx_cl = qk.max_pool2d(x_cl, 3, 2, 1, target=target)
        mx_cl_dilated = qk.max_pool2d(x_cl, 3, 2, 2, 2, True, target=target)
        av = qk.avg_pool2d(x, 3, 2, 1, scale=0.1, zero_point=10, target=target)
        ad = qk.adaptive_avg_pool2d(x, (5, 7), target=target)
    finally:
        qk.set_num_threads(None)
    # numba's own per-thread count (set above to differ from the call's) is left as it was
    assert numba.get_num_threads() == (numba.config.NUMBA_NUM_THREADS if threads == 1 else 1)
    np.testing.assert_array_equal(mx, ref_max_pool(x, (3, 3), (2, 2), (1, 1), (1, 1), False))
    np.testing.assert_array_equal(mx_cl, mx)
    assert mx_cl.transpose(0, 2, 3, 1).flags.c_contiguous  # the input's layout
    np.testing.assert_array_equal(
        mx_cl_dilated, ref_max_pool(x, (3, 3), (2, 2), (2, 2), (2, 2), True)
    )
    want = ref_avg_pool(x, (3, 3), (2, 2), (1, 1), False, True, None, 0.1, 10, 0.1, 10)
    np.testing.assert_array_equal(av, want)
    np.testing.assert_array_equal(ad, ref_adaptive(x, 5, 7))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_byte_identical_to_torch_quantized_pools():
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.ao.quantization")
    functional = torch.nn.functional
    rng = np.random.default_rng(4)
    compared = 0
    for _ in range(200):
        # C, H, W >= 2: torch routes tensors that also look channels-last (C == 1 or
        # H == W == 1) through its NHWC kernels, a different code path
        x, k, s, p = _random_case(rng, min_size=2)
        if x.ndim == 3:
            continue
        scale, zp = float(rng.uniform(0.01, 1)), int(rng.integers(0, 256))
        tx = torch._make_per_tensor_quantized_tensor(torch.from_numpy(x), scale, zp)
        d = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        ceil, include_pad = bool(rng.integers(0, 2)), bool(rng.integers(0, 2))
        divisor = None if rng.integers(0, 3) else int(rng.integers(1, 10))
        if _fits(x, k, s, p, d, ceil):
            want = functional.max_pool2d(tx, k, s, p, d, ceil_mode=ceil).int_repr().numpy()
            np.testing.assert_array_equal(qk.max_pool2d(x, k, s, p, d, ceil), want)
            compared += 1
        if _fits(x, k, s, p, (1, 1), ceil):
            want = functional.avg_pool2d(tx, k, s, p, ceil, include_pad, divisor)
            got = qk.avg_pool2d(x, k, s, p, ceil, include_pad, divisor, scale=scale, zero_point=zp)
            np.testing.assert_array_equal(got, want.int_repr().numpy())
            compared += 1
        size = (int(rng.integers(1, 9)), int(rng.integers(1, 9)))
        want = functional.adaptive_avg_pool2d(tx, size).int_repr().numpy()
        np.testing.assert_array_equal(qk.adaptive_avg_pool2d(x, size), want)
    assert compared > 150


def _force_threaded_path(monkeypatch, threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("numba runs with fewer threads on this machine")
    # the size threshold is tuned for speed; lower it so these inputs take the threaded path
    monkeypatch.setattr(_quantize_module, "PARALLEL_MIN_WORK", 1)
    monkeypatch.setattr(_quantize_module, "STREAM_MIN_WORK", 1)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS if threads == 1 else 1)
