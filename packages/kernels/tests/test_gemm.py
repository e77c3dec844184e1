"""GEMM core: packed layouts, the requantization rule module, threads settings, cached
compilation across processes, and a Hypothesis fuzz of the public wrappers with garbage."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import quantbridge.kernels as qk
from quantbridge.kernels import KernelError, PackedConvWeight, PackedLinearWeight
from quantbridge.kernels._pack import pack_b

TARGETS = qk.available_targets()


def test_vnni_layout_places_each_weight():
    w = np.arange(-50, 50, dtype=np.int8).reshape(5, 20)
    packed = pack_b(w, "avx512_vnni").reshape(1, 5, 32, 4)  # K 20 = 5 steps of 4
    for j in range(5):
        for k in range(20):
            assert packed[0, k // 4, j, k % 4] == w[j, k]
    assert not packed[:, :, 5:, :].any()  # padded columns are zero
    odd = pack_b(w[:, :18], "avx512_vnni").reshape(1, 5, 32, 4)  # K 18 -> 20
    assert not odd[0, 4, :, 2:].any()  # the padded k values of the last step are zero


def test_avx2_layout_widens_to_int16():
    w = np.array([[-128, 127, 5]], np.int8)
    packed = pack_b(w, "avx2")
    assert packed.dtype == np.int16
    packed = packed.reshape(1, 2, 16, 2)  # K 3 -> 4 = 2 steps of 2
    assert packed[0, 0, 0].tolist() == [-128, 127]
    assert packed[0, 1, 0].tolist() == [5, 0]


def test_threads_setting_is_used_and_validated():
    qk.set_num_threads(1)
    try:
        assert qk.get_num_threads() == 1
    finally:
        qk.set_num_threads(None)
    with pytest.raises(KernelError, match="exceeds"):
        qk.set_num_threads(10_000)
    with pytest.raises(KernelError, match="positive int"):
        qk.set_num_threads(0)


def test_prefetch_fetches_the_next_panel_in_disjoint_slices():
    # the drivers' prefetch plan: a tile of at most _PREFETCH_MAX_BLOCKS blocks fetches the
    # next panel (never past it), its blocks' slices disjoint and covering nearly every line;
    # the last panel and larger tiles fetch nothing
    from quantbridge.kernels._gemm_simd import _PREFETCH_MAX_BLOCKS, _prefetch

    step, nk, npanels = 128, 37, 4  # a VNNI panel of 37 k steps, 128 bytes (2 lines) each
    panel = step * nk
    for rows in range(1, 8 * _PREFETCH_MAX_BLOCKS + 9, 3):
        for p in range(npanels):
            lines: list[set[int]] = []
            for i in range(0, rows, 8):
                off, shift = _prefetch(p, npanels, p * panel, panel, rows, 8, i)
                if shift < 0:
                    continue
                # the kernels' addresses: each line of each step, at 1/2^shift of the pace
                addrs = [
                    off + ((s * step + line * 64) >> shift) for s in range(nk) for line in (0, 1)
                ]
                assert min(addrs) >= (p + 1) * panel
                assert max(addrs) < (p + 2) * panel
                lines.append({a // 64 for a in addrs})
            if p == npanels - 1 or rows > 8 * _PREFETCH_MAX_BLOCKS:
                assert not lines
                continue
            assert lines
            union = set().union(*lines)
            assert sum(map(len, lines)) - len(union) <= len(lines)  # only boundary lines shared
            want = set(range((p + 1) * panel // 64, ((p + 2) * panel - 1) // 64 + 1))
            assert len(union & want) >= 0.95 * len(want)


def test_requant_rule_module_matches_documented_float32_sequence():
    from quantbridge.kernels._requant import multipliers, requantize_reference, scaled_bias

    atws, mult = multipliers(0.1, np.array([0.02, 0.03], np.float32), 0.5)
    assert atws.dtype == np.float32
    assert mult[0] == np.float32(np.float32(np.float32(0.1) * np.float32(0.02)) / np.float32(0.5))
    bq = scaled_bias(np.array([1.0, 2.0], np.float32), atws, True, 4)
    assert bq.shape == (4,)
    assert bq[2] == 0
    assert bq[1] == np.float32(2.0) / atws[1]
    acc = np.array([[10, -10, 2**20]], np.int64)
    out = requantize_reference(acc, np.zeros(3, np.float32), np.full(3, 0.5, np.float32), 100)
    assert out.tolist() == [[105, 95, 255]]  # 5.0 -> 5, -5 -> -5; saturates high


def test_ties_round_to_even():
    # acc * 0.5 lands exactly on .5: rint sends 2.5 -> 2 and 3.5 -> 4
    for target in TARGETS:
        packed = PackedLinearWeight(np.ones((2, 1), np.int8), 1.0, 0, None, target=target)
        x = np.array([[5], [7]], np.uint8)
        out = qk.linear(x, packed, 1.0, 0, 2.0, 0)
        assert out[:, 0].tolist() == [2, 4], target


def test_cached_kernels_load_in_a_new_process():
    """Two fresh processes run the same calls; the second loads numba's on-disk cache.

    Timed test: the per-target first-call times are printed, not asserted.
    The first numba call of any process also pays numba's one-time registry setup.
    """
    script = textwrap.dedent(
        """
        import time, numpy as np
        from quantbridge.kernels import PackedLinearWeight, linear
        w = np.arange(64, dtype=np.int8).reshape(8, 8)
        sums, times = [], []
        for target in %r:
            p = PackedLinearWeight(w, 0.1, 0, None, target=target)
            t0 = time.perf_counter()
            out = linear(np.ones((3, 8), np.uint8), p, 0.1, 0, 0.5, 10, num_threads=1)
            times.append(round(time.perf_counter() - t0, 4))
            sums.append(int(out.sum()))
        print(sums, times)
        """
    ) % (TARGETS,)
    outputs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=600,
            env=dict(os.environ),
        )
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout.strip())
    sums = [out.split("] [")[0] for out in outputs]
    assert sums[0] == sums[1]
    print("first-call seconds per target", TARGETS, "in the second process:", outputs[1])


@st.composite
def garbage(draw):
    kind = draw(st.sampled_from(["valid", "array", "scalar", "list", "none"]))
    if kind == "valid":  # right dtype and K, so the checks further in get exercised too
        shape = draw(st.sampled_from([(2, 5), (1, 5), (2, 1, 5), (1, 1, 4, 4), (5, 3), (1, 5, 3)]))
        dtype = draw(st.sampled_from([np.uint8, np.float32, np.int8]))
        return np.ones(shape, dtype)
    if kind == "array":
        dtype = draw(st.sampled_from([np.uint8, np.int8, np.float32, np.float64, np.int32, bool]))
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
        arr = draw(hnp.arrays(dtype, shape))
        if arr.ndim >= 2 and draw(st.booleans()):
            arr = arr.T
        return arr
    if kind == "scalar":
        return draw(st.one_of(st.integers(-300, 300), st.floats(allow_nan=True)))
    if kind == "list":
        return [1, 2, 3]
    return None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=garbage(), s=garbage(), zp=garbage(), target=st.sampled_from(TARGETS))
def test_fuzz_wrappers_raise_kernel_error_or_succeed(x, s, zp, target):
    lin = PackedLinearWeight(np.ones((3, 5), np.int8), 0.1, target=target)
    conv = PackedConvWeight(np.ones((2, 1, 2, 2), np.int8), 0.1, target=target)
    calls = [
        lambda: qk.linear(x, lin, s, zp, 0.1, 0),
        lambda: qk.linear_dynamic(x, lin),
        lambda: qk.conv2d(x, conv, 0.1, zp, s, 0),
        lambda: qk.matmul(x, (0.1, 0), x, (s, zp), (0.1, 0), target=target),
        lambda: PackedLinearWeight(x, s, zp, target=target),
        lambda: PackedLinearWeight(np.ones((3, 5), np.int8), s, zp, x, target=target),
        lambda: PackedConvWeight(np.ones((2, 1, 2, 2), np.int8), s, zp, stride=zp, groups=zp),
    ]
    for call in calls:
        try:
            call()
        except KernelError:
            pass
        except (TypeError, ValueError, OverflowError) as exc:  # pragma: no cover - a bug
            if not isinstance(exc, KernelError):
                raise AssertionError(f"non-KernelError {type(exc).__name__}: {exc}") from exc


# instruction (regex over the assembly) each SIMD target's GEMM drivers multiply with
_GEMM_PRODUCTS = {
    "avx512_vnni": r"vpdpbusd\s+[^\n]*%zmm",
    "avx_vnni": r"vpdpbusd\s+[^\n]*%ymm",
    "avx2": r"vpmaddubsw\s+[^\n]*%ymm",
    "aarch64_i8mm": r"\busdot\s+v\d+\.4s",
    "aarch64_dotprod": r"\bsdot\s+v\d+\.4s",
}


@pytest.mark.parametrize("target", [t for t in TARGETS if t in _GEMM_PRODUCTS])
@pytest.mark.parametrize("mode", ["u8", "f32"])
def test_gemm_drivers_multiply_with_the_targets_instruction(target, mode):
    """Each target's serial driver, compiled here without the disk cache (numba keeps no
    assembly of cached code), holds its product instruction and no other target's."""
    import re

    import numba

    from quantbridge.kernels._gemm_run import serial_driver

    rng = np.random.default_rng(0)
    packed = PackedLinearWeight(rng.integers(-60, 60, (40, 64), dtype=np.int8), 0.01,
                                target=target)  # fmt: skip
    x = rng.integers(0, 128, (9, 64), dtype=np.uint8)
    if mode == "u8":
        qk.linear(x, packed, 0.1, 3, 0.2, 5, num_threads=1)
    else:
        qk.linear_float(x, packed, 0.1, 3, num_threads=1)
    driver = serial_driver(packed.kernel, mode)
    options = {k: v for k, v in driver.targetoptions.items() if k not in ("cache", "nopython")}
    fresh = numba.njit(**options)(driver.py_func)
    sig = driver.signatures[0]
    fresh.compile(sig)
    asm = fresh.inspect_asm(sig)
    assert re.search(_GEMM_PRODUCTS[target], asm)
    for other, pattern in _GEMM_PRODUCTS.items():
        if other != target and not (target == "aarch64_i8mm" and other == "aarch64_dotprod"):
            assert not re.search(pattern, asm), other
