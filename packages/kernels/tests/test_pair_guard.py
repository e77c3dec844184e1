"""8-bit weights on the AVX2 byte kernels: rows where two activation codes could saturate
``vpmaddubsw``'s int16 pair sum are found and recomputed exactly, whatever the codes."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from quantbridge.kernels import (
    PackedConvWeight,
    PackedLinearWeight,
    add,
    apply_lut,
    available_targets,
    build_lut,
    conv2d,
    conv2d_add,
    linear,
)
from quantbridge.kernels._pair_guard import PairGuard, unsafe_rows, window_rows

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the references, under --import-mode=importlib
    sys.path.insert(0, str(HERE))

from test_conv import _channels_last, reference_conv2d  # noqa: E402
from test_linear import reference_linear  # noqa: E402

needs_avx2 = pytest.mark.skipif("avx2" not in available_targets(), reason="needs an AVX2 CPU")

# share of codes moved to [128, 255]: none, torch.ao-x86-like outliers, many, every one
DENSITIES = [0.0, 0.002, 0.05, 1.0]


def _codes(rng, shape, density):
    """Calibrated 7-bit codes in [0, 127] with ``density`` of them in [128, 255]."""
    x = rng.integers(0, 128, shape).astype(np.uint8)
    hot = rng.random(shape) < density
    x[hot] = rng.integers(128, 256, int(hot.sum()))
    return x


def _wide_weight(rng, shape):
    """int8 weights using the whole range, every other input channel at +-127 / -128."""
    w = rng.integers(-128, 128, shape).astype(np.int8)
    w[:, ::2] = np.where(rng.random(w[:, ::2].shape) < 0.5, 127, -128)
    return w


def _no_twin():
    raise AssertionError("the scan alone needs no int16 packing")


def _without_guard(monkeypatch):
    monkeypatch.setattr(PackedLinearWeight, "guard", lambda self, *args: None)


def test_unsafe_rows_flags_only_pairs_past_the_limit():
    a = np.zeros((6, 8), np.uint8)
    a[0, 2:4] = (200, 58)  # 258: exact for symmetric weights (limit 258)
    a[1, 2:4] = (200, 59)  # 259: could saturate
    a[2, 3:5] = (200, 200)  # two large codes in different pairs: each pair is safe
    a[3, 7] = 255  # a large code with a zero partner
    a[4, 6:8] = (129, 130)
    a[5, :] = 127  # every pair 254
    guard = PairGuard(258, 6, 8, True, None, _no_twin)
    np.testing.assert_array_equal(unsafe_rows(a.reshape(-1), guard, 6), [1, 4])
    # unaligned layouts (a stem conv's row-packed windows) flag every code of 128 or more
    loose = guard._replace(aligned=False)
    np.testing.assert_array_equal(unsafe_rows(a.reshape(-1), loose, 6), [0, 1, 2, 3, 4])
    assert unsafe_rows(np.full(48, 127, np.uint8), guard, 6) is None


def test_unsafe_rows_scans_whole_blocks_and_the_tail():
    # 3 pixels of 100 bytes: one unsafe pair in a whole 64-byte block, one in the tail
    for offset in (10, 70, 130, 290, 298):
        a = np.zeros(300, np.uint8)
        a[offset : offset + 2] = 200
        guard = PairGuard(256, 3, 100, True, None, _no_twin)
        np.testing.assert_array_equal(unsafe_rows(a, guard, 3), [offset // 100])


def test_codes_above_127_everywhere_send_every_row_to_the_int16_kernels():
    a = np.full(64 * 40, 200, np.uint8)
    guard = PairGuard(256, 40, 64, True, None, _no_twin)
    np.testing.assert_array_equal(unsafe_rows(a, guard, 40), np.arange(40))


def test_window_rows_maps_input_pixels_to_every_output_pixel_reading_them():
    # 1 image of 6 x 7 padded pixels, 3x3 windows, stride 2: output 2 x 3
    to_rows = window_rows((1, 6, 7), (2, 3), (3, 3), (2, 2), (1, 1))
    flags = np.zeros(42, np.uint8)
    flags[2 * 7 + 2] = 1  # pixel (2, 2): read by outputs (0, 0), (0, 1), (1, 0), (1, 1)
    got = to_rows(flags).reshape(2, 3)
    want = np.zeros((2, 3), bool)
    for oy in range(2):
        for ox in range(3):
            want[oy, ox] = 2 * oy <= 2 < 2 * oy + 3 and 2 * ox <= 2 < 2 * ox + 3
    np.testing.assert_array_equal(got, want)


@needs_avx2
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("w_zp", [0, 3])
@pytest.mark.parametrize("k", [150, 152])  # 152: rows need no padding (one thread's fast path)
def test_guarded_linear_matches_integer_reference(density, threads, w_zp, k):
    rng = np.random.default_rng(int(density * 1000) + threads + w_zp + k)
    m, n = 37, 48
    a = _codes(rng, (m, k), density)
    w = _wide_weight(rng, (n, k))
    packed = PackedLinearWeight(w, 0.002, w_zp, None, target="avx2")
    assert packed.guarded
    got = linear(a, packed, 0.01, 3, 0.5, 100, num_threads=threads)
    np.testing.assert_array_equal(got, reference_linear(a, 0.01, 3, w, 0.002, w_zp, None, 0.5, 100))


@needs_avx2
@pytest.mark.parametrize(
    ("c", "oc", "k", "stride", "pad", "groups"),
    [
        (16, 32, 1, 1, 0, 1),  # read in place when channels-last
        (8, 24, 3, 1, 1, 1),
        (12, 20, 3, 2, 1, 1),
        (3, 16, 7, 2, 3, 1),  # few channels: row-packed windows, pairs across pixels
        (16, 32, 3, 1, 1, 2),
        (5, 16, 3, 1, 0, 1),  # channels padded to 8
    ],
)
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_guarded_conv_matches_integer_reference(c, oc, k, stride, pad, groups, density,
                                                channels_last):  # fmt: skip
    rng = np.random.default_rng(c * 31 + k + int(density * 1000))
    x = _codes(rng, (2, c, 11, 12), density)
    w = _wide_weight(rng, (oc, c // groups, k, k))
    w_zp = rng.integers(-3, 4, oc) if channels_last else 0
    packed = PackedConvWeight(w, 0.003, w_zp, None, stride=stride, padding=pad, groups=groups,
                              target="avx2")  # fmt: skip
    assert packed.kernel == "avx2_byte"
    xin = _channels_last(x) if channels_last else x
    got = conv2d(xin, packed, 0.02, 5, 0.8, 90, channels_last=channels_last,
                 num_threads=2 if channels_last else 1)  # fmt: skip
    want = reference_conv2d(x, 0.02, 5, w, 0.003, w_zp, None, 0.8, 90, (stride, stride),
                            (pad, pad), (1, 1), groups)  # fmt: skip
    np.testing.assert_array_equal(got, want)


@needs_avx2
def test_an_unsafe_pair_only_in_pixels_a_strided_conv_skips_redoes_nothing():
    # stride 2 over width 2 reads pixel 0 only; the unsafe pair sits in pixel 1 (this once
    # made a GEMM of zero rows, which divided by zero)
    x = np.full((1, 2, 1, 2), 100, np.uint8)
    x[0, :, 0, 1] = 200
    w = np.array([127, -128], np.int8).reshape(1, 2, 1, 1)
    packed = PackedConvWeight(w, 0.01, 0, None, stride=(1, 2), target="avx2")
    assert packed.kernel == "avx2_byte"
    got = conv2d(x, packed, 0.03, 9, 0.01, 100, num_threads=1)
    want = reference_conv2d(x, 0.03, 9, w, 0.01, 0, None, 0.01, 100, (1, 2), (0, 0), (1, 1), 1)
    np.testing.assert_array_equal(got, want)


@needs_avx2
@pytest.mark.parametrize("density", DENSITIES)
def test_guarded_conv_add_with_a_table_matches_conv_then_add(density):
    rng = np.random.default_rng(int(density * 1000))
    x = _codes(rng, (1, 32, 10, 10), density)
    w = _wide_weight(rng, (48, 32, 3, 3))
    packed = PackedConvWeight(w, 0.003, 0, None, padding=1, target="avx2")
    other = rng.integers(0, 256, (1, 48, 10, 10)).astype(np.uint8)
    lut = build_lut("sigmoid", 0.9, 60, 1 / 256, 0)
    conv = conv2d(x, packed, 0.02, 5, 0.8, 90, relu=True)
    want = apply_lut(add(conv, (0.8, 90), other, (0.5, 10), (0.9, 60)), lut)
    got = conv2d_add(x, packed, (0.02, 5), (0.8, 90), other, (0.5, 10), (0.9, 60),
                     relu_conv=True, lut=lut)  # fmt: skip
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        conv,
        reference_conv2d(
            x, 0.02, 5, w, 0.003, 0, None, 0.8, 90, (1, 1), (1, 1), (1, 1), 1, relu=True
        ),
    )


@needs_avx2
def test_without_the_guard_these_codes_saturate(monkeypatch):
    # the cases above would pass vacuously if the byte kernels were exact on them anyway
    rng = np.random.default_rng(1)
    a = _codes(rng, (37, 150), 0.05)
    w = _wide_weight(rng, (48, 150))
    want = reference_linear(a, 0.01, 3, w, 0.002, 0, None, 0.5, 100)
    x = _codes(rng, (1, 8, 9, 9), 0.05)
    wc = _wide_weight(rng, (24, 8, 3, 3))
    want_c = reference_conv2d(x, 0.02, 5, wc, 0.003, 0, None, 0.8, 90, (1, 1), (1, 1), (1, 1), 1)
    _without_guard(monkeypatch)
    got = linear(a, PackedLinearWeight(w, 0.002, 0, None, target="avx2"), 0.01, 3, 0.5, 100)
    assert (got != want).any()
    packed = PackedConvWeight(wc, 0.003, 0, None, padding=1, target="avx2")
    assert (conv2d(x, packed, 0.02, 5, 0.8, 90) != want_c).any()


@needs_avx2
def test_the_int16_packing_is_made_only_when_a_row_needs_it():
    rng = np.random.default_rng(4)
    w = _wide_weight(rng, (24, 8, 3, 3))
    packed = PackedConvWeight(w, 0.003, 0, None, padding=1, target="avx2")
    clean = _codes(rng, (1, 8, 9, 9), 0.0)
    conv2d(clean, packed, 0.02, 5, 0.8, 90)
    assert packed.groups_packed[0]._exact is None  # 7-bit codes: nothing to redo
    conv2d(_codes(rng, (1, 8, 9, 9), 0.05), packed, 0.02, 5, 0.8, 90)
    assert packed.groups_packed[0]._exact is not None
