"""torch.ops.quantbridge quantize/dequantize ops: bit-identical to torch's quantized tensors."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quantbridge.fx_quant  # noqa: F401  (registers the ops)
from quantbridge.fx_quant import FxQuantError

qb = torch.ops.quantbridge

# (torch.ao quantized dtype name, plain dtype, quant_min, quant_max)
DTYPES = [
    ("quint8", torch.uint8, 0, 255),
    ("qint8", torch.int8, -128, 127),
    ("qint32", torch.int32, -(2**31), 2**31 - 1),
]


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*deprecated.*")
    warnings.filterwarnings("ignore", message=".*quantized tensor.*")


def _scales(gen: torch.Generator, n: int) -> list[float]:
    """Random float scales plus powers of two, tiny and large ones."""
    rand = (torch.rand(n, generator=gen, dtype=torch.float64) * 0.2 + 1e-5).tolist()
    return [*rand, 1.0, 0.5, 2.0**-10, 1e-7, 3.7, 1e3, 0.1, 1 / 3]


def _inputs(gen: torch.Generator, scale: float, zp: int) -> torch.Tensor:
    """Gaussian values, exact half-way points (ties), huge values, infinities and NaN."""
    s32 = torch.tensor(scale, dtype=torch.float32)
    n = int(torch.randint(1, 700, (), generator=gen))
    x = torch.randn(n, generator=gen) * s32 * 100
    ties = (torch.randint(-300, 300, (n,), generator=gen).float() + 0.5 - zp) * s32
    wide = torch.randn(n, generator=gen) * s32 * 1e6
    pick = torch.randint(0, 3, (n,), generator=gen)
    x = torch.where(pick == 0, x, torch.where(pick == 1, ties, wide))
    special = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e30, -1e30, 3e38])
    return torch.cat([x, special])


@pytest.mark.parametrize(("name", "dtype", "qmin", "qmax"), DTYPES)
def test_quantize_dequantize_per_tensor_matches_torch(
    name: str, dtype: torch.dtype, qmin: int, qmax: int
) -> None:
    pytest.importorskip("torch.ao.quantization")
    qdtype = getattr(torch, name)
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for scale in _scales(gen, 40):
        for zp in {qmin, qmax, 0, 1, 3, qmin + 77, (qmin + qmax) // 2} - {None}:
            if name == "qint32" and abs(zp) > 2**20:
                zp = 17 if zp > 0 else -19
            x = _inputs(gen, scale, zp)
            ref = torch.quantize_per_tensor(x, scale, zp, qdtype)
            q = qb.quantize_per_tensor(x, scale, zp, qmin, qmax, dtype)
            assert q.dtype == dtype
            assert torch.equal(q, ref.int_repr()), (scale, zp)
            deq = qb.dequantize_per_tensor(q, scale, zp, qmin, qmax, dtype)
            assert torch.equal(deq, ref.dequantize()), (scale, zp)
            # tensor-qparam overload (float32 scale buffer, as reference modules store it)
            st = torch.tensor(scale, dtype=torch.float32)
            zt = torch.tensor(zp)
            ref_t = torch.quantize_per_tensor(x, st, zt, qdtype)
            q_t = qb.quantize_per_tensor.tensor(x, st, zt, qmin, qmax, dtype)
            assert torch.equal(q_t, ref_t.int_repr())
            assert torch.equal(
                qb.dequantize_per_tensor.tensor(q_t, st, zt, qmin, qmax, dtype),
                ref_t.dequantize(),
            )
            # non-contiguous input (a transposed matrix): same values, torch's layout rules
            if x.numel() >= 6:
                xt = x[: (x.numel() // 3) * 3].reshape(3, -1).t()
                ref_nc = torch.quantize_per_tensor(xt, scale, zp, qdtype)
                q_nc = qb.quantize_per_tensor(xt, scale, zp, qmin, qmax, dtype)
                assert torch.equal(q_nc, ref_nc.int_repr())
                assert torch.equal(
                    qb.dequantize_per_tensor(q_nc, scale, zp, qmin, qmax, dtype),
                    ref_nc.dequantize(),
                )
            checked += 1
    assert checked > 200


@pytest.mark.parametrize(("name", "dtype", "qmin", "qmax"), DTYPES)
def test_nan_matches_torch(name: str, dtype: torch.dtype, qmin: int, qmax: int) -> None:
    pytest.importorskip("torch.ao.quantization")
    qdtype = getattr(torch, name)
    x = torch.tensor([float("nan"), 1.0, float("nan")] * 5).reshape(3, 5)
    ref = torch.quantize_per_tensor(x, 0.1, 3, qdtype).int_repr()
    assert torch.equal(qb.quantize_per_tensor(x, 0.1, 3, qmin, qmax, dtype), ref)
    scales = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)
    zps = torch.tensor([3, 0, 1])
    ref_c = torch.quantize_per_channel(x, scales, zps, 0, qdtype).int_repr()
    assert torch.equal(qb.quantize_per_channel(x, scales, zps, 0, qmin, qmax, dtype), ref_c)


@pytest.mark.parametrize(("name", "dtype", "qmin", "qmax"), DTYPES)
def test_quantize_dequantize_per_channel_matches_torch(
    name: str, dtype: torch.dtype, qmin: int, qmax: int
) -> None:
    pytest.importorskip("torch.ao.quantization")
    qdtype = getattr(torch, name)
    gen = torch.Generator().manual_seed(1)
    for trial in range(150):
        ndim = int(torch.randint(1, 5, (), generator=gen))
        shape = torch.randint(1, 7, (ndim,), generator=gen).tolist()
        axis = int(torch.randint(0, ndim, (), generator=gen))
        channels = shape[axis]
        scales = torch.rand(channels, generator=gen, dtype=torch.float64) * 0.1 + 1e-4
        if trial % 2:  # observers hand out float32 scales
            scales = scales.float()
        zlo, zhi = (qmin, qmax) if name != "qint32" else (-1000, 1000)
        zps = torch.randint(zlo, zhi + 1, (channels,), generator=gen)
        bshape = [1] * ndim
        bshape[axis] = -1
        s32 = scales.float().reshape(bshape)
        ties = (torch.randint(-300, 300, shape, generator=gen).float() + 0.5) * s32
        noise = torch.randn(shape, generator=gen) * 300 * s32
        x = torch.where(torch.rand(shape, generator=gen) < 0.5, ties, noise)
        if trial % 3 == 0 and x.dim() >= 2:
            x = x.transpose(0, -1)  # non-contiguous input, axis moves accordingly
            axis = {0: ndim - 1, ndim - 1: 0}.get(axis, axis)
        ref = torch.quantize_per_channel(x, scales, zps, axis, qdtype)
        q = qb.quantize_per_channel(x, scales, zps, axis, qmin, qmax, dtype)
        assert torch.equal(q, ref.int_repr()), trial
        deq = qb.dequantize_per_channel(q, scales, zps, axis, qmin, qmax, dtype)
        assert torch.equal(deq, ref.dequantize()), trial


def test_per_channel_float_qparams_matches_torch() -> None:
    pytest.importorskip("torch.ao.quantization")
    gen = torch.Generator().manual_seed(2)
    for trial in range(100):
        rows, cols = 7, int(torch.randint(1, 40, (), generator=gen))
        w = torch.randn(rows, cols, generator=gen) * 3
        scales = torch.rand(rows, generator=gen) * 0.1 + 1e-3
        if trial % 4 == 1:
            scales = scales.double()
        zps = torch.randn(rows, generator=gen) * 5
        if trial % 2:
            half = torch.randint(-100, 100, (rows, cols), generator=gen).float() + 0.5
            w = (half - zps[:, None]) * scales.float()[:, None]
        ref = torch.quantize_per_channel(w, scales, zps, 0, torch.quint8)
        q = qb.quantize_per_channel(w, scales, zps, 0, 0, 255, torch.uint8)
        assert torch.equal(q, ref.int_repr()), trial
        deq = qb.dequantize_per_channel(q, scales, zps, 0, 0, 255, torch.uint8)
        assert torch.equal(deq, ref.dequantize()), trial


@pytest.mark.parametrize(("name", "qmin", "qmax"), [("quint8", 0, 255), ("qint8", -128, 127)])
@pytest.mark.parametrize("reduce_range", [False, True])
def test_choose_qparams_matches_torch_dynamic(
    name: str, qmin: int, qmax: int, reduce_range: bool
) -> None:
    pytest.importorskip("torch.ao.quantization")
    qdtype = getattr(torch, name)
    dtype = {"quint8": torch.uint8, "qint8": torch.int8}[name]
    gen = torch.Generator().manual_seed(3)
    for trial in range(400):
        x = torch.randn(int(torch.randint(1, 60, (), generator=gen)), generator=gen)
        kind = trial % 6
        magnitude = 10.0 ** float(torch.randint(-10, 6, (), generator=gen))
        if kind == 1:
            x = x.abs() * magnitude
        elif kind == 2:
            x = -x.abs() * magnitude
        elif kind == 3:
            x = torch.zeros_like(x)
        elif kind == 4:
            x = x * magnitude
        ref = torch.quantize_per_tensor_dynamic(x, qdtype, reduce_range)
        scale, zp = qb.choose_qparams_per_tensor(x, qmin, qmax, reduce_range)
        assert scale.item() == ref.q_scale(), trial
        assert zp.item() == ref.q_zero_point(), trial
        q = qb.quantize_per_tensor.tensor(x, scale, zp, qmin, qmax, dtype)
        assert torch.equal(q, ref.int_repr()), trial


def test_int16_follows_round_then_add() -> None:
    x = torch.tensor([2.5, 3.5, -2.5, 1e9, -1e9, float("nan")])
    # round(2.5)=2 (+7 = 9), round(3.5)=4 (+7 = 11): the zero point is added after rounding.
    q = qb.quantize_per_tensor(x, 1.0, 7, -32768, 32767, torch.int16)
    assert q.tolist()[:5] == [9, 11, 5, 32767, -32768]
    assert q.dtype == torch.int16


def test_quant_range_clamps() -> None:
    x = torch.tensor([-10.0, 0.0, 10.0, 100.0])
    q = qb.quantize_per_tensor(x, 1.0, 0, 0, 15, torch.uint8)
    assert q.tolist() == [0, 0, 10, 15]


def test_export_and_compile() -> None:
    class QDQ(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.tensor(0.05))
            self.register_buffer("zp", torch.tensor(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = qb.quantize_per_tensor(x, 0.1, 2, 0, 255, torch.uint8)
            y = qb.dequantize_per_tensor(q, 0.1, 2, 0, 255, torch.uint8)
            q2 = qb.quantize_per_tensor.tensor(y, self.scale, self.zp, -128, 127, torch.int8)
            y2 = qb.dequantize_per_tensor.tensor(q2, self.scale, self.zp, -128, 127, torch.int8)
            s, z = qb.choose_qparams_per_tensor(y2, 0, 255, False)
            q3 = qb.quantize_per_tensor.tensor(y2, s, z, 0, 255, torch.uint8)
            return qb.dequantize_per_tensor.tensor(q3, s, z, 0, 255, torch.uint8) * 2

    x = torch.randn(4, 8)
    model = QDQ()
    expected = model(x)
    exported = torch.export.export(model, (x,))
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert "quantbridge.quantize_per_tensor.default" in targets
    assert "quantbridge.choose_qparams_per_tensor.default" in targets
    assert torch.equal(exported.module()(x), expected)
    for backend in ("eager", "aot_eager"):  # dynamo alone, then with AOT autograd's tracing
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        assert torch.equal(compiled(x), expected)


def test_opcheck() -> None:
    x = torch.randn(3, 4)
    s = torch.tensor([0.1, 0.2, 0.3])
    z = torch.tensor([0, 1, 2])
    q = qb.quantize_per_channel(x, s, z, 0, -128, 127, torch.int8)
    cases = [
        (qb.quantize_per_tensor.default, (x, 0.1, 2, 0, 255, torch.uint8)),
        (qb.quantize_per_channel.default, (x, s, z, 0, -128, 127, torch.int8)),
        (qb.dequantize_per_channel.default, (q, s, z, 0, -128, 127, torch.int8)),
        (qb.choose_qparams_per_tensor.default, (x, 0, 255, True)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x: qb.quantize_per_tensor(x, 0.0, 0, 0, 255, torch.uint8), "scale=0.0"),
        (lambda x: qb.quantize_per_tensor(x, -1.0, 0, 0, 255, torch.uint8), "scale=-1.0"),
        (lambda x: qb.quantize_per_tensor(x, 1e-50, 0, 0, 255, torch.uint8), "scale="),
        (lambda x: qb.quantize_per_tensor(x, 0.1, 0, 0, 300, torch.uint8), "quant_max=300"),
        (lambda x: qb.quantize_per_tensor(x, 0.1, 0, -1, 255, torch.uint8), "quant_min=-1"),
        (lambda x: qb.quantize_per_tensor(x, 0.1, 0, 10, 5, torch.int8), "quant_min=10"),
        (lambda x: qb.quantize_per_tensor(x, 0.1, 300, 0, 255, torch.uint8), "zero_point=300"),
        (lambda x: qb.quantize_per_tensor(x, 0.1, 0, 0, 255, torch.float32), "float32"),
        (lambda x: qb.quantize_per_tensor(x.int(), 0.1, 0, 0, 255, torch.uint8), "floating"),
        (
            lambda x: qb.dequantize_per_tensor(x.to(torch.int8), 0.1, 0, 0, 255, torch.uint8),
            "torch.int8",
        ),
        (
            lambda x: qb.quantize_per_tensor.tensor(
                x, torch.tensor([0.1, 0.2]), torch.tensor(0), 0, 255, torch.uint8
            ),
            "one element",
        ),
        (
            lambda x: qb.quantize_per_channel(
                x,
                torch.tensor([0.1] * 4),
                torch.zeros(4, dtype=torch.long),
                2,
                0,
                255,
                torch.uint8,
            ),
            "axis=2",
        ),
        (
            lambda x: qb.quantize_per_channel(
                x,
                torch.tensor([0.1] * 3),
                torch.zeros(4, dtype=torch.long),
                1,
                0,
                255,
                torch.uint8,
            ),
            "scales has 3",
        ),
        (
            lambda x: qb.quantize_per_channel(
                x,
                torch.tensor([0.1, 0.0, 0.1, 0.1]),
                torch.zeros(4, dtype=torch.long),
                1,
                0,
                255,
                torch.uint8,
            ),
            "scales must be positive",
        ),
        (
            lambda x: qb.quantize_per_channel(
                x,
                torch.tensor([0.1] * 4),
                torch.tensor([0, 0, 999, 0]),
                1,
                0,
                255,
                torch.uint8,
            ),
            "zero_points",
        ),
        (lambda x: qb.choose_qparams_per_tensor(x[:0], 0, 255, False), "empty"),
        (
            lambda x: qb.choose_qparams_per_tensor(
                x.index_fill(1, torch.tensor([2]), torch.nan), 0, 255, False
            ),
            "NaN or infinity",
        ),
        (
            lambda x: qb.choose_qparams_per_tensor(
                x.index_fill(1, torch.tensor([0]), torch.inf), 0, 255, False
            ),
            "NaN or infinity",
        ),
    ],
)
def test_bad_inputs_raise_fx_quant_error(call, message: str) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(3, 4)
    with pytest.raises(FxQuantError, match=message.replace("[", r"\[").replace(".", r"\.")):
        call(x)


def test_fake_kernel_validates_static_arguments() -> None:
    class Bad(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return qb.quantize_per_tensor(x, 0.1, 0, 0, 1000, torch.uint8)

    with pytest.raises(Exception, match="quant_max=1000"):
        torch.export.export(Bad(), (torch.randn(2),))


def _f32(bits: int) -> float:
    import struct

    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


@settings(max_examples=150, deadline=None)
@given(
    bits=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
    scale_bits=st.integers(0x33800000, 0x447A0000),  # float32 scales in ~[6e-8, 1000]
    zp_frac=st.floats(0.0, 1.0),
    unsigned=st.booleans(),
)
def test_per_tensor_matches_torch_on_arbitrary_float_bits(
    bits: list[int], scale_bits: int, zp_frac: float, unsigned: bool
) -> None:
    """Any float32 bit pattern as input (NaN, inf, subnormals included)."""
    pytest.importorskip("torch.ao.quantization")
    name, dtype, qmin, qmax = DTYPES[0] if unsigned else DTYPES[1]
    scale = _f32(scale_bits)
    zp = qmin + round(zp_frac * (qmax - qmin))
    x = torch.tensor([_f32(b) for b in bits], dtype=torch.float32)
    ref = torch.quantize_per_tensor(x, scale, zp, getattr(torch, name))
    q = qb.quantize_per_tensor(x, scale, zp, qmin, qmax, dtype)
    assert torch.equal(q, ref.int_repr())
    assert torch.equal(qb.dequantize_per_tensor(q, scale, zp, qmin, qmax, dtype), ref.dequantize())


# (scale, x) pairs where x / scale + 200 computed in float64 lands exactly on a float32
# rounding midpoint although the exact value does not (found by a vectorized search):
# rounding via float64 gives the wrong integer unless corrected.
_DOUBLE_ROUNDING_CASES = [
    (0.17354963719844818, 0.08677614480257034),
    (0.34709927439689636, 0.17355228960514069),
    (0.043387409299612045, 0.021694036200642586),
    (0.40377315878868103, 0.20188966393470764),
    (0.045015253126621246, 0.02250796929001808),
]


@pytest.mark.parametrize(("scale", "value"), _DOUBLE_ROUNDING_CASES)
def test_fused_rounding_is_single_rounding(scale: float, value: float) -> None:
    pytest.importorskip("torch.ao.quantization")
    x = torch.tensor([value, -value] * 8 + [value])  # vector body and scalar tail
    ref = torch.quantize_per_tensor(x, scale, 200, torch.quint8)
    ours = qb.quantize_per_tensor(x, scale, 200, 0, 255, torch.uint8)
    assert torch.equal(ours, ref.int_repr())
    # the case is a real trap: rounding through float64 alone disagrees with torch
    inv = 1.0 / torch.tensor(scale, dtype=torch.float32)
    naive = torch.round((x.double() * inv.double() + 200).float()).to(torch.uint8)
    assert not torch.equal(naive, ref.int_repr())


def test_int16_matches_torch_decomposed_ops() -> None:
    """int16 has no quantized tensor dtype; torch.ao's decomposed reference ops are the oracle."""
    pytest.importorskip("torch.ao.quantization")
    import torch.ao.quantization.fx._decomposed  # registers torch.ops.quantized_decomposed

    qd = torch.ops.quantized_decomposed
    gen = torch.Generator().manual_seed(4)
    lo, hi = -32768, 32767
    for _ in range(100):
        scale = float(torch.rand((), generator=gen).float()) * 0.01 + 1e-5
        scale = float(torch.tensor(scale, dtype=torch.float32))  # observers hand out float32
        zp = int(torch.randint(-1000, 1000, (), generator=gen))
        x = torch.randn(300, generator=gen) * 1e4 * scale
        x[:100] = (torch.randint(-3000, 3000, (100,), generator=gen).float() + 0.5) * scale
        ref = qd.quantize_per_tensor(x, scale, zp, lo, hi, torch.int16)
        q = qb.quantize_per_tensor(x, scale, zp, lo, hi, torch.int16)
        assert torch.equal(q, ref)
        assert torch.equal(
            qb.dequantize_per_tensor(q, scale, zp, lo, hi, torch.int16),
            qd.dequantize_per_tensor(ref, scale, zp, lo, hi, torch.int16),
        )
        w = torch.randn(4, 30, generator=gen)
        scales = torch.rand(4, generator=gen) * 0.001 + 1e-5
        zps = torch.randint(-100, 100, (4,), generator=gen)
        ref_c = qd.quantize_per_channel(w, scales, zps, 0, lo, hi, torch.int16)
        q_c = qb.quantize_per_channel(w, scales, zps, 0, lo, hi, torch.int16)
        assert torch.equal(q_c, ref_c)
        assert torch.equal(
            qb.dequantize_per_channel(q_c, scales, zps, 0, lo, hi, torch.int16),
            qd.dequantize_per_channel(ref_c, scales, zps, 0, lo, hi, torch.int16),
        )


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor(1.37),
        lambda: torch.empty(0),
        lambda: torch.empty(0, 3),
        lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        lambda: torch.randn(9)[::2],
    ],
    ids=["0-d", "empty", "empty-2d", "channels-last", "strided"],
)
@pytest.mark.parametrize("zp", [0, 7])
def test_layouts_match_torch(make: Any, zp: int) -> None:
    pytest.importorskip("torch.ao.quantization")
    x = make()
    ref = torch.quantize_per_tensor(x.contiguous(), 0.1, zp, torch.quint8)
    q = qb.quantize_per_tensor(x, 0.1, zp, 0, 255, torch.uint8)
    assert q.shape == x.shape
    assert torch.equal(q, ref.int_repr())
    assert torch.equal(qb.dequantize_per_tensor(q, 0.1, zp, 0, 255, torch.uint8), ref.dequantize())
    if x.dim() == 4:
        scales, zps = torch.tensor([0.1, 0.2, 0.05]), torch.tensor([0, 3, 9])
        ref_c = torch.quantize_per_channel(x.contiguous(), scales.double(), zps, 1, torch.quint8)
        q_c = qb.quantize_per_channel(x, scales, zps, 1, 0, 255, torch.uint8)
        assert torch.equal(q_c, ref_c.int_repr())


@settings(max_examples=60, deadline=None)
@given(
    bits=st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=4 * 12).filter(
        lambda b: len(b) % 4 == 0
    ),
    scale_bits=st.lists(st.integers(0x33800000, 0x447A0000), min_size=4, max_size=4),
    zps=st.lists(st.integers(-128, 127), min_size=4, max_size=4),
)
def test_per_channel_matches_torch_on_arbitrary_float_bits(
    bits: list[int], scale_bits: list[int], zps: list[int]
) -> None:
    pytest.importorskip("torch.ao.quantization")
    x = torch.tensor([_f32(b) for b in bits], dtype=torch.float32).reshape(-1, 4)
    scales = torch.tensor([_f32(b) for b in scale_bits], dtype=torch.float32)
    zp = torch.tensor(zps)
    ref = torch.quantize_per_channel(x, scales.double(), zp, 1, torch.qint8)
    q = qb.quantize_per_channel(x, scales, zp, 1, -128, 127, torch.int8)
    assert torch.equal(q, ref.int_repr())
    deq = qb.dequantize_per_channel(q, scales, zp, 1, -128, 127, torch.int8)
    assert torch.equal(deq, ref.dequantize())


# -- autograd: the ops run on inputs that require grad, with grad mode on --------------------


def _grad_cases(x: torch.Tensor) -> dict[str, Any]:
    chan = x.shape[1]
    scales = torch.full((chan,), 0.05, requires_grad=True)
    zps = torch.arange(chan)
    scale_t = torch.tensor(0.05, requires_grad=True)
    zp_t = torch.tensor(3)
    return {
        "per_tensor uint8": lambda: qb.dequantize_per_tensor(
            qb.quantize_per_tensor(x, 0.05, 3, 0, 255, torch.uint8), 0.05, 3, 0, 255, torch.uint8
        ),
        "per_tensor int32": lambda: qb.quantize_per_tensor(
            x, 0.05, 0, -(2**31), 2**31 - 1, torch.int32
        ),
        "per_tensor int16": lambda: qb.quantize_per_tensor(x, 0.05, 1, -32768, 32767, torch.int16),
        "per_tensor.tensor int8": lambda: qb.dequantize_per_tensor.tensor(
            qb.quantize_per_tensor.tensor(x, scale_t, zp_t, -128, 127, torch.int8),
            scale_t,
            zp_t,
            -128,
            127,
            torch.int8,
        ),
        "per_channel int8": lambda: qb.dequantize_per_channel(
            qb.quantize_per_channel(x, scales, zps, 1, -128, 127, torch.int8),
            scales,
            zps,
            1,
            -128,
            127,
            torch.int8,
        ),
        "per_channel float zero points": lambda: qb.quantize_per_channel(
            x, scales, zps.float().requires_grad_(True), 1, 0, 255, torch.uint8
        ),
        "choose_qparams": lambda: torch.stack(
            [t.to(torch.float64) for t in qb.choose_qparams_per_tensor(x, 0, 255)]
        ),
    }


def test_ops_run_with_grad_enabled_on_inputs_that_require_grad() -> None:
    # Regression: the in-place kernel steps failed under autograd ("functions with out=...
    # arguments don't support automatic differentiation").
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3)) * 4
    with torch.no_grad():
        expected = {name: fn() for name, fn in _grad_cases(x).items()}
    xg = x.clone().requires_grad_(True)
    with torch.enable_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ops have no autograd formula, which torch notes
        got = {name: fn() for name, fn in _grad_cases(xg).items()}
    assert got.keys() == expected.keys()
    for name, value in got.items():
        assert value.dtype == expected[name].dtype, name
        assert torch.equal(value.detach(), expected[name]), name


def test_python_kernels_run_with_grad_enabled() -> None:
    # The registered kernels themselves turn tracking off, also when called without the
    # dispatcher (which is how torch.library may run them under some modes).
    from quantbridge.fx_quant import _ops

    x = (torch.randn(3, 6, generator=torch.Generator().manual_seed(4)) * 3).requires_grad_(True)
    with torch.enable_grad():
        q8 = _ops._quantize_per_tensor(x, 0.03, 5, 0, 255, torch.uint8)
        q32 = _ops._quantize_per_tensor(x, 0.03, 0, -(2**31), 2**31 - 1, torch.int32)
        qc = _ops._quantize_per_channel(
            x,
            torch.full((6,), 0.03, requires_grad=True),
            torch.zeros(6, dtype=torch.int64),
            1,
            -128,
            127,
            torch.int8,
        )
    assert not q8.requires_grad
    assert not q32.requires_grad
    assert not qc.requires_grad
    assert torch.equal(q8, torch.clamp(torch.round(x.detach() / 0.03) + 5, 0, 255).to(torch.uint8))
    assert torch.equal(q32, torch.round(x.detach() / 0.03).to(torch.int32))
    assert torch.equal(qc, torch.clamp(torch.round(x.detach() / 0.03), -128, 127).to(torch.int8))
