"""256-entry lookup tables: exact float references written here, torch's quantized ops as oracle."""

from __future__ import annotations

import numba
import numpy as np
import pytest

import quantbridge.kernels as qk
import quantbridge.kernels._quantize as _quantize_module
from quantbridge.kernels import KernelError, _lut

CODES = np.arange(256, dtype=np.uint8)


def ref_dequantize(q, scale, zp):
    return (np.float32(scale) * (q.astype(np.int32) - zp).astype(np.float32)).astype(np.float32)


def ref_quantize(x, scale, zp, lo=0, hi=255):
    inv = np.float32(1) / np.float32(scale)
    t = (x.astype(np.longdouble) * np.longdouble(inv) + zp).astype(np.float32)
    out = np.clip(np.rint(np.where(np.isnan(t), hi, t).astype(np.float64)), lo, hi)
    return out.astype(np.uint8)


F32 = np.float32
FLOAT_FUNCTIONS = {
    "sigmoid": lambda x: F32(1) / (F32(1) + np.exp(-x)),
    "tanh": np.tanh,
    "hardsigmoid": lambda x: np.clip(x + F32(3), 0, 6) / F32(6),
    "hardswish": lambda x: x * np.clip(x + F32(3), 0, 6) / F32(6),
    "silu": lambda x: x / (F32(1) + np.exp(-x)),
    "elu": lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, F32(0)))),
    "gelu_tanh": lambda x: (
        F32(0.5) * x * (F32(1) + np.tanh(F32(0.7978845608028654) * (x + F32(0.044715) * x * x * x)))
    ),
    "exp": np.exp,
}


def test_every_named_function_has_a_reference():
    assert set(FLOAT_FUNCTIONS) == set(qk.LUT_FUNCTIONS)


@pytest.mark.parametrize("name", sorted(FLOAT_FUNCTIONS))
@pytest.mark.parametrize(
    ("in_q", "out_q"),
    [((0.05, 128), (1 / 256, 0)), ((0.1, 30), (0.02, 100)), ((0.0234, 200), (0.5, 3))],
)
def test_named_tables_equal_the_float_reference(name, in_q, out_q):
    table = qk.build_lut(name, *in_q, *out_q)
    with np.errstate(all="ignore"):
        real = FLOAT_FUNCTIONS[name](ref_dequantize(CODES, *in_q)).astype(np.float32)
    np.testing.assert_array_equal(table, ref_quantize(real, *out_q))
    assert not table.flags.writeable
    rng = np.random.default_rng(0)
    q = rng.integers(0, 256, (7, 33)).astype(np.uint8)
    np.testing.assert_array_equal(qk.apply_lut(q, table), table[q])


def test_callable_tables_and_custom_range():
    table = qk.build_lut(lambda v: v * v, 0.1, 128, 0.5, 0, quant_min=0, quant_max=100)
    want = ref_quantize((ref_dequantize(CODES, 0.1, 128) ** 2).astype(np.float32), 0.5, 0, 0, 100)
    np.testing.assert_array_equal(table, want)
    assert table.max() == 100
    # float64 results are cast to float32 first, exactly like the reference
    table64 = qk.build_lut(lambda v: np.sin(v.astype(np.float64)), 0.03, 90, 0.01, 128)
    want64 = ref_quantize(
        np.sin(ref_dequantize(CODES, 0.03, 90).astype(np.float64)).astype(np.float32), 0.01, 128
    )
    np.testing.assert_array_equal(table64, want64)


def test_requantize_is_an_identity_table():
    q = np.random.default_rng(1).integers(0, 256, 999).astype(np.uint8)
    table = qk.build_lut(lambda v: v, 0.1, 100, 0.3, 7)
    np.testing.assert_array_equal(qk.requantize(q, 0.1, 100, 0.3, 7), qk.apply_lut(q, table))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: qk.build_lut("softplus9", 0.1, 0, 0.1, 0), "unknown function"),
        (lambda: qk.build_lut(42, 0.1, 0, 0.1, 0), "callable"),
        (lambda: qk.build_lut(lambda v: v[:3], 0.1, 0, 0.1, 0), "shape"),
        (lambda: qk.build_lut(lambda v: "no", 0.1, 0, 0.1, 0), "fn"),
        (lambda: qk.build_lut(lambda v: v.astype(np.complex64), 0.1, 0, 0.1, 0), "fn"),
        (lambda: qk.build_lut("tanh", 0.0, 0, 0.1, 0), "in_scale"),
        (lambda: qk.build_lut("tanh", 0.1, 0, 0.1, -1), "out_zero_point"),
        (lambda: qk.apply_lut(CODES, np.zeros(255, np.uint8)), "256 entries"),
        (lambda: qk.apply_lut(CODES, np.zeros(256, np.int8)), "table: expected dtype"),
        (lambda: qk.apply_lut(CODES.astype(np.int8), np.zeros(256, np.uint8)), "q: expected dtype"),
        (lambda: qk.apply_lut(CODES, CODES, out=CODES[:10]), "out: expected shape"),
        (lambda: qk.apply_lut(CODES, CODES.copy(), target="x"), "unknown kernel target"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(KernelError, match=message):
        call()


def test_function_cannot_modify_its_inputs():
    def mutate(v):
        v += 1
        return v

    with pytest.raises(ValueError, match="read-only"):
        qk.build_lut(mutate, 0.1, 0, 0.1, 0)


@pytest.mark.parametrize("target", qk.available_targets())
@pytest.mark.parametrize("threads", [1, 2])
def test_large_input_threads_and_targets(threads, target, monkeypatch):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("numba runs with fewer threads on this machine")
    q = np.random.default_rng(2).integers(0, 256, (5, 100_003)).astype(np.uint8)
    table = qk.build_lut("sigmoid", 0.05, 128, 1 / 256, 0)
    _force_threaded_path(monkeypatch, threads)
    qk.set_num_threads(threads)
    try:
        got = qk.apply_lut(q, table, target=target)
    finally:
        qk.set_num_threads(None)
    # numba's own per-thread count (set above to differ from the call's) is left as it was
    assert numba.get_num_threads() == (numba.config.NUMBA_NUM_THREADS if threads == 1 else 1)
    np.testing.assert_array_equal(got, table[q])


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(("scale", "zp"), [(0.05, 128), (0.1, 30), (0.0234, 200), (0.2, 0)])
def test_tables_reproduce_torch_quantized_ops(scale, zp):
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.ao.quantization")
    tx = torch._make_per_tensor_quantized_tensor(torch.from_numpy(CODES.copy()), scale, zp)
    # sigmoid / tanh / hardsigmoid: torch's output zero point is 0 or the values avoid exact
    # ties, so the tables match byte for byte
    for name, op in [
        ("sigmoid", torch.sigmoid),
        ("tanh", torch.tanh),
        ("hardsigmoid", torch.nn.functional.hardsigmoid),
    ]:
        want = op(tx)
        table = qk.build_lut(name, scale, zp, want.q_scale(), want.q_zero_point())
        np.testing.assert_array_equal(qk.apply_lut(CODES, table), want.int_repr().numpy())
    # torch's hardswish / elu kernels round before adding the zero point; our tables use
    # torch.quantize_per_tensor's rule (the reference model's), so exact .5 ties may differ
    for name, (out_scale, out_zp) in [("hardswish", (0.05, 64)), ("elu", (0.04, 100))]:
        op = getattr(torch.ops.quantized, name)
        want = op(tx, out_scale, out_zp).int_repr().numpy().astype(np.int16)
        table = qk.build_lut(name, scale, zp, out_scale, out_zp)
        got = qk.apply_lut(CODES, table).astype(np.int16)
        assert np.abs(got - want).max() <= 1
        real = FLOAT_FUNCTIONS[name](ref_dequantize(CODES, scale, zp)).astype(np.float64)
        frac = np.abs(real / np.float32(out_scale) % 1.0 - 0.5)
        assert (frac[got != want] < 1e-4).all()  # differences only at near-exact ties


def _force_threaded_path(monkeypatch, threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("numba runs with fewer threads on this machine")
    # the size threshold is tuned for speed; lower it so these inputs take the threaded path
    monkeypatch.setattr(_quantize_module, "PARALLEL_MIN_WORK", 1)
    monkeypatch.setattr(_quantize_module, "STREAM_MIN_WORK", 1)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS if threads == 1 else 1)


@pytest.mark.skipif(not _lut.VBMI, reason="this CPU has no AVX-512 VBMI")
@pytest.mark.parametrize("size", [1, 63, 64, 65, 127, 128, 192, 200, 320 + 9, 4096 + 7])
def test_vbmi_table_pass_equals_numpy(size):
    # 64 codes a vpermi2b pair, two such steps a loop turn (an odd count ends with one), the
    # tail byte by byte; in place too (a fused activation's pass)
    rng = np.random.default_rng(size)
    table = rng.integers(0, 256, 256, dtype=np.uint8)
    q = rng.integers(0, 256, size, dtype=np.uint8)
    q[: min(size, 4)] = [0, 127, 128, 255][: min(size, 4)]  # both halves' edges
    out = np.empty_like(q)
    _lut._gather_vbmi(q, table, out)
    np.testing.assert_array_equal(out, table[q])
    _lut._gather_vbmi(q, table, q)
    np.testing.assert_array_equal(q, out)


@pytest.mark.skipif(not _lut.VBMI, reason="this CPU has no AVX-512 VBMI")
def test_vbmi_table_pass_on_two_threads(monkeypatch):
    # chunks of 64 K codes across the threads, the tail after them; the caller's thread count
    monkeypatch.setattr(_lut, "VBMI_PARALLEL_MIN", 1)
    rng = np.random.default_rng(2)
    table = rng.integers(0, 256, 256, dtype=np.uint8)
    q = rng.integers(0, 256, 3 * 65536 + 100, dtype=np.uint8)
    for threads in (1, 2):
        out = np.empty_like(q)
        _lut.apply_table(q, table, out, threads)
        np.testing.assert_array_equal(out, table[q])
