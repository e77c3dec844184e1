"""linear_weight_only / pack_group_weight: every target bit-exact against an int64 / float32
numpy reference of the documented rule, packing round trips, every refusal and its message,
thread counts, and the instructions each target's kernels are made of."""

from __future__ import annotations

import copy
import pickle
import re
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import quantbridge.kernels as qk
from quantbridge.kernels import (
    KernelError,
    PackedGroupWeight,
    TargetUnavailableError,
    _targets,
    available_targets,
    linear_weight_only,
    pack_group_weight,
)
from quantbridge.kernels._targets import ARM_TARGETS
from quantbridge.kernels._wo_kernels import DRIVERS

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the shared strategies, under --import-mode=importlib
    sys.path.insert(0, str(HERE))

from fuzz_strategies import FUZZ, GARBAGE, arrays  # noqa: E402

TARGETS = available_targets()
F32 = np.float32
POOL = numba.config.NUMBA_NUM_THREADS


def reference(x, codes, scales, zero_points, group_size, bias=None):
    """The documented rule: int64 products, every float32 operation rounded on its own."""
    n, k = codes.shape
    ng = k // group_size
    x2 = np.asarray(x, F32).reshape(-1, k)
    xg = x2.reshape(-1, ng, group_size)
    sx = (np.abs(xg).max(axis=2) / F32(127)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(xg / sx[:, :, None])
    q = np.clip(q, -127, 127)
    q[sx == 0] = 0
    qx = q.astype(np.int64)
    w = codes.astype(np.int64).reshape(n, ng, group_size)
    zp = np.zeros((n, ng), np.int64) if zero_points is None else zero_points.astype(np.int64)
    acc = np.zeros((x2.shape[0], n), F32)
    for g in range(ng):
        isum = qx[:, g] @ w[:, g].T - zp[:, g][None, :] * qx[:, g].sum(axis=1)[:, None]
        scale = (scales[:, g][None, :] * sx[:, g][:, None]).astype(F32)
        acc = (acc + (isum.astype(F32) * scale).astype(F32)).astype(F32)
    if bias is not None:
        acc = (acc + bias).astype(F32)
    return acc.reshape(*np.shape(x)[:-1], n)


def make_weight(rng, n, k, bits, group_size, symmetric):
    ng = k // group_size
    if symmetric:
        top = 1 << (bits - 1)
        codes = rng.integers(-top, top, (n, k)).astype(np.int8)
        zero_points = None
    else:
        codes = rng.integers(0, 1 << bits, (n, k)).astype(np.uint8)
        zero_points = rng.integers(0, 1 << bits, (n, ng)).astype(np.uint8)
    scales = rng.uniform(0.001, 0.05, (n, ng)).astype(F32)
    return codes, scales, zero_points


def assert_bytes_equal(got, want):
    assert got.dtype == np.float32
    assert got.shape == want.shape
    assert np.array_equal(got.view(np.int32), want.view(np.int32)), np.abs(got - want).max()


# --- the rule, bit for bit, on every target


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_matches_reference(target, bits, symmetric, group_size):
    rng = np.random.default_rng(bits * 1000 + group_size + symmetric)
    k = 3 * group_size
    for n in (1, 7, 33, 100):
        codes, scales, zps = make_weight(rng, n, k, bits, group_size, symmetric)
        packed = pack_group_weight(codes, scales, zps, bits=bits, group_size=group_size,
                                   target=target)  # fmt: skip
        bias = rng.normal(0, 1, n).astype(F32)
        for m in (1, 2, 5, 17):
            x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(F32)
            for b in (None, bias):
                assert_bytes_equal(linear_weight_only(x, packed, b),
                                   reference(x, codes, scales, zps, group_size, b))  # fmt: skip


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits", [4, 8])
def test_batched_and_strided_inputs(target, bits):
    rng = np.random.default_rng(7)
    codes, scales, _ = make_weight(rng, 40, 128, bits, 32, True)
    packed = pack_group_weight(codes, scales, bits=bits, group_size=32, target=target)
    wide = rng.standard_normal((3, 4, 256)).astype(F32)
    cases = [
        wide[:, :, ::2],  # strided last axis
        wide[:, :, :128].transpose(1, 0, 2),  # permuted leading axes
        np.asfortranarray(wide[0, :, :128]),
        wide[0, 0, :128],  # one row, 1-D
        wide[:, :2, 64:192],  # an offset view
    ]
    frozen = wide[1, :, :128].copy()
    frozen.flags.writeable = False
    cases.append(frozen)  # read-only: numba compiles another driver entry for it
    for x in cases:
        got = linear_weight_only(x, packed)
        assert got.shape == (*x.shape[:-1], 40)
        assert_bytes_equal(got, reference(np.ascontiguousarray(x), codes, scales, None, 32))


@pytest.mark.parametrize("target", TARGETS)
def test_activation_corner_cases(target):
    """All-zero groups, groups whose scale underflows, exact halves (rint to even), -0.0, a
    maximum of 127 * 2**-149 (the scale is the smallest subnormal), large magnitudes, the
    extreme codes."""
    rng = np.random.default_rng(3)
    k = 64
    for bits, symmetric in ((4, True), (8, True), (8, False)):
        codes, scales, zps = make_weight(rng, 19, k, bits, 32, symmetric)
        if symmetric:  # the extremes of the range, -128 included
            codes[0] = -(1 << (bits - 1))
            codes[1] = (1 << (bits - 1)) - 1
        packed = pack_group_weight(codes, scales, zps, bits=bits, group_size=32, target=target)
        tiny = np.float32(np.finfo(F32).smallest_subnormal)
        rows = np.zeros((6, k), F32)
        rows[1, :32] = -0.0
        rows[2, :32] = tiny  # scale tiny / 127 underflows to 0: codes 0
        rows[2, 32:] = rng.standard_normal(32)
        rows[3, 0] = 127.0  # scale 1: x / sx is x, halves round to even
        rows[3, 1:32] = np.arange(31, dtype=F32) - F32(15.5)
        rows[3, 32:] = -np.arange(32, dtype=F32) / F32(2)
        rows[4] = rng.standard_normal(k).astype(F32) * F32(1e-30)
        rows[5, :32] = tiny * F32(127)  # scale exactly the smallest subnormal
        rows[5, 32:] = F32(3e30) * np.sign(rng.standard_normal(32)).astype(F32)
        for b in (None, rng.normal(size=19).astype(F32)):
            assert_bytes_equal(linear_weight_only(rows, packed, b),
                               reference(rows, codes, scales, zps, 32, b))  # fmt: skip


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_every_target_gives_the_same_bytes(bits, symmetric):
    rng = np.random.default_rng(11)
    codes, scales, zps = make_weight(rng, 70, 256, bits, 64, symmetric)
    x = rng.standard_normal((2, 3, 256)).astype(F32)
    packs = [pack_group_weight(codes, scales, zps, bits=bits, group_size=64, target=t)
             for t in TARGETS]  # fmt: skip
    outs = [linear_weight_only(x, packed) for packed in packs]
    for out in outs[1:]:
        assert_bytes_equal(out, outs[0])


@pytest.mark.skipif(POOL < 2, reason="numba runs with one thread on this machine")
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits", [4, 8])
def test_one_and_two_threads_give_the_same_bytes(target, bits):
    rng = np.random.default_rng(5)
    codes, scales, zps = make_weight(rng, 300, 512, bits, 32, False)
    packed = pack_group_weight(codes, scales, zps, bits=bits, group_size=32, target=target)
    try:
        for m in (1, 9, 70):  # decode (parallel over output features), prefill
            x = rng.standard_normal((m, 512)).astype(F32)
            qk.set_num_threads(1)
            one = linear_weight_only(x, packed)
            qk.set_num_threads(2)
            two = linear_weight_only(x, packed)
            assert_bytes_equal(two, one)
            assert_bytes_equal(linear_weight_only(x, packed, num_threads=1), one)
        assert_bytes_equal(one, reference(x, codes, scales, zps, 32))
    finally:
        qk.set_num_threads(None)


# --- packing round trips


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_packing_round_trips(target, bits, symmetric):
    rng = np.random.default_rng(bits + 2 * symmetric)
    codes, scales, zps = make_weight(rng, 37, 128, bits, 32, symmetric)
    packed = pack_group_weight(codes, scales, zps, bits=bits, group_size=32, target=target)
    assert (packed.bits, packed.group_size, packed.symmetric) == (bits, 32, symmetric)
    assert (packed.out_features, packed.in_features, packed.target) == (37, 128, target)
    zp = 0 if zps is None else np.repeat(zps.astype(np.int16), 32, axis=1)
    want = (codes.astype(np.int16) - zp).astype(F32) * np.repeat(scales, 32, axis=1)
    assert_bytes_equal(packed.dequantize(), want)
    arrays = packed.to_arrays()
    assert arrays["codes"].dtype == np.uint8
    assert arrays["codes"].shape == (37, 128 * bits // 8)
    assert set(arrays) == {"codes", "scales", "bits", "group_size"} | (
        set() if symmetric else {"zero_points"}
    )
    assert np.array_equal(arrays["scales"], scales)
    if not symmetric:
        assert np.array_equal(arrays["zero_points"], zps)
    x = rng.standard_normal((3, 128)).astype(F32)
    want_y = linear_weight_only(x, packed)
    for other in TARGETS:  # target-neutral: any target reads what any other wrote
        again = PackedGroupWeight.from_arrays(arrays, target=other)
        assert again.target == other
        assert_bytes_equal(again.dequantize(), want)
        assert_bytes_equal(linear_weight_only(x, again), want_y)
    restored = pickle.loads(pickle.dumps(packed))
    assert restored.target == target
    assert_bytes_equal(linear_weight_only(x, restored), want_y)
    assert copy.copy(packed) is packed  # immutable: copies share it
    assert copy.deepcopy([packed])[0] is packed
    # compact: codes, scales (and zero points) as packed, panels padded
    panel = {"avx512_vnni": 32}.get(target, 16)
    npad = -(-37 // panel) * panel
    assert packed.nbytes == npad * (128 * bits // 8 + 4 * 4 + (0 if symmetric else 4))


def test_to_arrays_layout_is_documented():
    codes = np.array([[1, -2, 3, -8] * 8], np.int8)
    packed = pack_group_weight(codes, np.ones((1, 1), F32), bits=4, group_size=32)
    row = packed.to_arrays()["codes"][0]
    assert list(row[:2]) == [0xE1, 0x83]  # code 2j low nibble, 2j + 1 high; 2's complement
    packed8 = pack_group_weight(codes, np.ones((1, 1), F32), bits=8, group_size=32)
    assert np.array_equal(packed8.to_arrays()["codes"][0, :4], [1, 254, 3, 248])


def test_packed_weight_is_immutable():
    packed = pack_group_weight(np.zeros((2, 32), np.int8), np.ones((2, 1), F32), bits=4,
                               group_size=32)  # fmt: skip
    with pytest.raises(AttributeError, match="immutable"):
        packed.bits = 8  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        del packed._codes
    with pytest.raises(ValueError, match="read-only"):
        packed._codes[0] = 1
    with pytest.raises(KernelError, match="pack_group_weight"):
        PackedGroupWeight()
    assert "bits=4, group_size=32, symmetric" in repr(packed)


def test_environment_selects_packing_target(monkeypatch):
    monkeypatch.setenv(qk.ENV_VAR, "generic")
    packed = pack_group_weight(np.zeros((2, 32), np.int8), np.ones((2, 1), F32), bits=8,
                               group_size=32)  # fmt: skip
    assert packed.target == "generic"


def test_unrunnable_target_is_refused(monkeypatch):
    packed = pack_group_weight(np.zeros((2, 32), np.int8), np.ones((2, 1), F32), bits=8,
                               group_size=32, target=TARGETS[0])  # fmt: skip
    blob = pickle.dumps(packed)
    monkeypatch.setattr(_targets, "cpu_features", lambda: frozenset({"sse2"}))
    with pytest.raises(TargetUnavailableError, match="lacks"):
        pack_group_weight(np.zeros((2, 32), np.int8), np.ones((2, 1), F32), bits=8,
                          group_size=32, target="avx2")  # fmt: skip
    if TARGETS[0] != "generic":
        with pytest.raises(TargetUnavailableError):
            pickle.loads(blob)


# --- refusals, each naming the argument, the expectation and the fix

GOOD = {
    "codes": np.zeros((4, 64), np.int8),
    "scales": np.ones((4, 2), F32),
    "zero_points": None,
    "bits": 4,
    "group_size": 32,
}


def _pack(**changes):
    args = {**GOOD, **changes}
    return pack_group_weight(args.pop("codes"), args.pop("scales"), args.pop("zero_points"),
                             **args)  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"bits": 3}, r"bits: expected one of \[4, 8\], got 3"),
        ({"bits": True}, r"bits: expected one of \[4, 8\], got True"),
        ({"bits": "4"}, r"bits: expected one of \[4, 8\], got '4'"),
        ({"group_size": 16}, r"group_size: expected one of \[32, 64, 128\], got 16"),
        ({"codes": np.zeros((4, 64), np.uint8)},
         r"codes: expected dtype int8 for symmetric \(zero_points is None\) codes, got uint8; "
         r"pass int8 codes, or zero_points"),
        ({"codes": np.zeros((4, 64), np.int8), "zero_points": np.zeros((4, 2), np.uint8)},
         r"codes: expected dtype uint8 for asymmetric .* got int8; pass uint8 codes"),
        ({"codes": np.zeros((4, 64, 1), np.int8)}, r"codes: expected 2-D, got shape \(4, 64, 1\)"),
        ({"codes": np.zeros((0, 64), np.int8)}, r"codes: zero-size array"),
        ({"codes": [[1, 2]]}, r"codes: expected a numpy array, got list"),
        ({"codes": np.zeros((4, 48), np.int8)},
         r"codes: in_features K=48 is not a multiple of group_size=32; pad each row"),
        ({"codes": np.full((4, 64), 8, np.int8)},
         r"codes\[0, 0\]: 8 is outside \[-8, 7\], the range of symmetric 4-bit codes; clip"),
        ({"codes": np.full((4, 64), 16, np.uint8), "zero_points": np.zeros((4, 2), np.uint8)},
         r"codes\[0, 0\]: 16 is outside \[0, 15\], the range of asymmetric 4-bit codes"),
        ({"scales": np.ones((4, 2), np.float64)}, r"scales: expected dtype float32, got float64"),
        ({"scales": np.ones((4, 3), F32)},
         r"scales: expected shape \(N, K // group_size\) = \(4, 2\), got \(4, 3\)"),
        ({"scales": np.array([[1, 1], [1, 0], [1, 1], [1, 1]], F32)},
         r"scales\[1, 1\]: 0.0 is not > 0; every scale must be a finite, normal float32"),
        ({"scales": np.array([[1, -1]] * 4, F32)}, r"scales\[0, 1\]: -1.0 is not > 0"),
        ({"scales": np.array([[1, np.nan]] * 4, F32)}, r"scales\[0, 1\]: nan is NaN"),
        ({"scales": np.array([[np.inf, 1]] * 4, F32)}, r"scales\[0, 0\]: inf is infinite"),
        ({"scales": np.array([[1e-40, 1]] * 4, F32)}, r"scales\[0, 0\]: .* is subnormal"),
        ({"codes": np.zeros((4, 64), np.uint8), "zero_points": np.zeros((4, 2), F32)},
         r"zero_points: expected an integer array, got dtype float32"),
        ({"codes": np.zeros((4, 64), np.uint8), "zero_points": np.zeros((4, 1), np.uint8)},
         r"zero_points: expected shape \(N, K // group_size\) = \(4, 2\), got \(4, 1\)"),
        ({"codes": np.zeros((4, 64), np.uint8), "zero_points": np.full((4, 2), 16)},
         r"zero_points\[0, 0\]: 16 is outside \[0, 15\]"),
        ({"codes": np.zeros((4, 64), np.uint8), "zero_points": np.full((4, 2), 256),
          "bits": 8}, r"zero_points\[0, 0\]: 256 is outside \[0, 255\]"),
        ({"codes": np.zeros((4, 64), np.uint8), "zero_points": np.full((4, 2), -1)},
         r"zero_points\[0, 0\]: -1 is outside"),
        ({"target": "neon"}, r"unknown kernel target 'neon'"),
    ],
)  # fmt: skip
def test_pack_refusals(changes, message):
    with pytest.raises(KernelError, match=message):
        _pack(**changes)


def test_from_arrays_refusals():
    arrays = pack_group_weight(np.zeros((4, 64), np.int8), np.ones((4, 2), F32), bits=4,
                               group_size=32).to_arrays()  # fmt: skip
    cases = [
        ([1, 2], r"arrays: expected a mapping .* got list"),
        ({**arrays, "bias": np.zeros(4)}, r"arrays: unknown keys \['bias'\]"),
        ({k: v for k, v in arrays.items() if k != "scales"}, r"arrays: missing \['scales'\]"),
        ({**arrays, "bits": np.array(5)}, r"arrays\['bits'\]: expected 4 or 8, got 5"),
        ({**arrays, "bits": np.array([4, 8])}, r"arrays\['bits'\]: expected one integer"),
        ({**arrays, "bits": 4.0}, r"arrays\['bits'\]: expected one integer"),
        ({**arrays, "group_size": np.array(48)}, r"group_size: expected one of"),
        ({**arrays, "codes": arrays["codes"].astype(np.int8)},
         r"arrays\['codes'\]: expected dtype uint8"),
        ({**arrays, "codes": arrays["codes"][:, :5]}, r"codes: in_features K=10 is not a"),
        ({**arrays, "scales": arrays["scales"][:, :1]}, r"scales: expected shape"),
        ({**arrays, "zero_points": np.full((4, 2), 99, np.uint8)},
         r"zero_points\[0, 0\]: 99 is outside \[0, 15\]"),
    ]  # fmt: skip
    for bad, message in cases:
        with pytest.raises(KernelError, match=message):
            PackedGroupWeight.from_arrays(bad)  # type: ignore[arg-type]


def test_call_refusals():
    packed = _pack()
    x = np.zeros((2, 64), F32)
    cases = [
        ((x, "packed"), {}, r"packed: expected a PackedGroupWeight .* got str"),
        ((x.astype(np.float64), packed), {}, r"x: expected dtype float32, got float64"),
        ((np.zeros((2, 32), F32), packed), {},
         r"x: expected shape \[\.\.\., K\] with K = in_features = 64, got \(2, 32\)"),
        ((np.float32(1.0), packed), {}, r"x: expected a numpy array"),
        ((np.zeros((0, 64), F32), packed), {}, r"x: zero-size array"),
        ((x, packed, np.zeros(5, F32)), {}, r"bias: expected shape \(N,\) = \(4,\), got \(5,\)"),
        ((x, packed, np.zeros(4, np.float64)), {}, r"bias: expected dtype float32"),
        ((x, packed), {"num_threads": 0}, r"linear_weight_only: num_threads must be a positive"),
    ]  # fmt: skip
    for args, kwargs, message in cases:
        with pytest.raises(KernelError, match=message):
            linear_weight_only(*args, **kwargs)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rows_are_refused_by_name(target, bad):
    packed = _pack(target=target)
    x = np.ones((2, 3, 64), F32)
    x[1, 2, 40] = bad
    x[1, 1, 63] = bad
    with pytest.raises(KernelError, match=r"x: row 4 \(index \(1, 1\)\) contains NaN or infin"):
        linear_weight_only(x, packed)
    with pytest.raises(KernelError, match=r"x: row 1 contains NaN or infinity"):
        linear_weight_only(x[1], packed)
    with pytest.raises(KernelError, match=r"x: row 0 contains NaN or infinity"):
        linear_weight_only(x[1, 2], packed)


# --- what each target is made of


def _assembly(target, bits, parallel):
    """The driver's assembly, compiled here without the disk cache (numba does not keep the
    assembly of cached code)."""
    packed = pack_group_weight(np.ones((300, 256), np.int8), np.ones((300, 8), F32), bits=bits,
                               group_size=32, target=target)  # fmt: skip
    linear_weight_only(np.ones((3, 256), F32), packed, num_threads=2 if parallel else 1)
    family = "generic" if target in ARM_TARGETS else target  # no Arm kernels yet: portable
    driver = DRIVERS[(family, 0 if family == "generic" else bits, parallel)]
    options = {k: v for k, v in driver.targetoptions.items() if k not in ("cache", "nopython")}
    fresh = numba.njit(**options)(driver.py_func)
    sig = driver.signatures[0]
    fresh.compile(sig)
    return fresh.inspect_asm(sig)


# instruction (regex over the assembly) each SIMD target's integer products must use
_PRODUCTS = {
    "avx512_vnni": r"vpdpbusd\s+[^\n]*%zmm",
    "avx_vnni": r"vpdpbusd\s+[^\n]*%ymm",
    "avx2": r"vpmaddubsw\s+[^\n]*%ymm",
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_assembly(target, bits, parallel):
    if parallel and POOL < 2:
        pytest.skip("numba runs with one thread on this machine")
    asm = _assembly(target, bits, parallel)
    # no fused multiply-add anywhere: the rule rounds each product and sum on its own
    assert not re.search(r"\bvfn?m(add|sub)", asm)
    if target in _PRODUCTS:
        assert re.search(_PRODUCTS[target], asm)
    if target == "avx2" and bits == 8:  # the sign trick
        assert re.search(r"vpsignb\s", asm)
        assert re.search(r"vpabsb\s", asm)


# --- fuzz: garbage in, KernelError or the right answer out

FUZZ_CODES = (np.arange(128).reshape(2, 64) % 16 - 8).astype(np.int8)
FUZZ_SCALES = np.array([[0.5, 0.25], [0.125, 2.0]], F32)
PACKED = pack_group_weight(FUZZ_CODES, FUZZ_SCALES, bits=4, group_size=32)


@FUZZ
@given(
    st.one_of(arrays(np.float32), GARBAGE),
    st.one_of(st.just(PACKED), GARBAGE),
    st.one_of(st.none(), arrays(np.float32), GARBAGE),
)
def test_fuzz_call(x, packed, bias):
    try:
        got = linear_weight_only(x, packed, bias)
    except KernelError:
        return
    assert isinstance(packed, PackedGroupWeight)
    assert got.shape == (*x.shape[:-1], 2)
    want = reference(np.ascontiguousarray(x), FUZZ_CODES, FUZZ_SCALES, None, 32, bias)
    assert_bytes_equal(got, want)


@FUZZ
@given(
    st.one_of(arrays(np.int8), arrays(np.uint8), GARBAGE),
    st.one_of(arrays(np.float32), GARBAGE),
    st.one_of(st.none(), arrays(np.uint8), GARBAGE),
    st.one_of(st.sampled_from([4, 8]), GARBAGE),
    st.one_of(st.sampled_from([32, 64, 128]), GARBAGE),
)
def test_fuzz_pack(codes, scales, zero_points, bits, group_size):
    try:
        packed = pack_group_weight(codes, scales, zero_points, bits=bits, group_size=group_size)
    except KernelError:
        return
    zp = 0 if zero_points is None else np.repeat(zero_points.astype(np.int16), group_size, 1)
    want = (codes.astype(np.int16) - zp).astype(F32) * np.repeat(scales, group_size, axis=1)
    assert_bytes_equal(packed.dequantize(), want)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("min_code", [False, True], ids=["codes_above_-128", "code_-128"])
def test_symmetric_8bit_with_and_without_the_code_minus_128(target, min_code):
    """8-bit symmetric codes in [-127, 127] (what the qconfigs make; random codes elsewhere
    in this file nearly always hold -128), and the same with one -128."""
    rng = np.random.default_rng(11)
    n, k = 21, 128
    codes = rng.integers(-127, 128, (n, k)).astype(np.int8)
    codes[3, :32] = 127
    codes[4, 32:64] = -127
    if min_code:
        codes[5, 70] = -128
    scales = rng.uniform(0.001, 0.05, (n, k // 32)).astype(F32)
    packed = pack_group_weight(codes, scales, None, bits=8, group_size=32, target=target)
    x = rng.standard_normal((5, k)).astype(F32)
    x[1, :32] = -np.abs(x[1, :32])  # every code of a group negative: -127 after rounding
    x[2, 32:64] = np.abs(x[2, 32:64])
    for rows in (x, x[:1]):  # prefill blocks and the decode row
        assert_bytes_equal(linear_weight_only(rows, packed),
                           reference(rows, codes, scales, None, 32))  # fmt: skip
