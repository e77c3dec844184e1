"""Reference quantized modules: forward bit-identical to torch.ao's, plain-int weights, state."""

from __future__ import annotations

import io
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from quantbridge.fx_quant import FxQuantError
from quantbridge.fx_quant.nn import reference as nnqr
from quantbridge.qconfig import QScheme


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", message=".*quantize_per_.*deprecated.*")
    warnings.filterwarnings("ignore", message=".*quantized tensor.*")


def _ao_ref() -> Any:
    pytest.importorskip("torch.ao.quantization")
    import torch.ao.nn.quantized.reference as ao_ref

    return ao_ref


def _qparams(weight: torch.Tensor, scheme: str, dtype_name: str, axis: int = 0) -> dict[str, Any]:
    """torch.ao-style qparams (torch qscheme objects and quantized dtypes) for ``weight``."""
    gen = torch.Generator().manual_seed(weight.numel())
    qdtype = getattr(torch, dtype_name)
    if scheme == "per_tensor_affine":
        scale = float(weight.detach().abs().max()) / 100 + 1e-4
        zp = 3 if dtype_name == "quint8" else -2
        if dtype_name == "quint8":
            zp = 128
        return {"qscheme": torch.per_tensor_affine, "dtype": qdtype, "scale": scale,
                "zero_point": zp}  # fmt: skip
    channels = weight.shape[axis]
    scale = torch.rand(channels, generator=gen) * 0.02 + 1e-3
    if scheme == "per_channel_affine_float_qparams":
        zp = torch.randn(channels, generator=gen) * 3
        return {"qscheme": torch.per_channel_affine_float_qparams, "dtype": qdtype,
                "scale": scale, "zero_point": zp, "axis": axis}  # fmt: skip
    lo, hi = (0, 255) if dtype_name == "quint8" else (-20, 20)
    zp = torch.randint(lo, hi + 1, (channels,), generator=gen)
    return {"qscheme": torch.per_channel_affine, "dtype": qdtype, "scale": scale,
            "zero_point": zp, "axis": axis}  # fmt: skip


SCHEMES = [
    ("per_tensor_affine", "quint8"),
    ("per_tensor_affine", "qint8"),
    ("per_channel_affine", "qint8"),
    ("per_channel_affine", "quint8"),
]


def _check_pair(ours: nn.Module, theirs: nn.Module, *inputs: Any) -> None:
    assert torch.equal(ours.get_weight(), theirs.get_weight())
    assert torch.equal(ours(*inputs), theirs(*inputs))
    q = ours.get_quantized_weight()
    assert not q.values.is_quantized
    assert torch.equal(q.values, theirs.get_quantized_weight().int_repr())
    assert torch.equal(ours.weight_scale, theirs.weight_scale)
    assert torch.equal(ours.weight_zero_point.long(), theirs.weight_zero_point.long())
    assert ours.weight_axis_int == theirs.weight_axis_int


@pytest.mark.parametrize(("scheme", "dtype_name"), SCHEMES)
def test_linear_matches_torch_ao(scheme: str, dtype_name: str) -> None:
    ao_ref = _ao_ref()
    torch.manual_seed(0)
    float_mod = nn.Linear(16, 8)
    qparams = _qparams(float_mod.weight, scheme, dtype_name)
    ours = nnqr.Linear.from_float(float_mod, qparams)
    theirs = ao_ref.Linear.from_float(float_mod, qparams)
    _check_pair(ours, theirs, torch.randn(5, 16))
    assert ours.weight_qscheme == QScheme(scheme)
    assert ours.weight_dtype == {"quint8": torch.uint8, "qint8": torch.int8}[dtype_name]
    assert str(ours._get_name()) == "QuantizedLinear(Reference)"


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize(("scheme", "dtype_name"), SCHEMES)
def test_conv_matches_torch_ao(dim: int, scheme: str, dtype_name: str) -> None:
    ao_ref = _ao_ref()
    torch.manual_seed(dim)
    cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim]
    float_mod = cls(4, 6, 3, stride=2, padding=1, dilation=1, groups=2)
    qparams = _qparams(float_mod.weight, scheme, dtype_name)
    ours = getattr(nnqr, f"Conv{dim}d").from_float(float_mod, qparams)
    theirs = getattr(ao_ref, f"Conv{dim}d").from_float(float_mod, qparams)
    spatial = {1: (11,), 2: (9, 8), 3: (6, 5, 7)}[dim]
    _check_pair(ours, theirs, torch.randn(2, 4, *spatial))


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize(("scheme", "dtype_name"), SCHEMES)
def test_conv_transpose_matches_torch_ao(dim: int, scheme: str, dtype_name: str) -> None:
    ao_ref = _ao_ref()
    torch.manual_seed(10 + dim)
    cls = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[dim]
    float_mod = cls(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2)
    # torch.ao quantizes transposed weights along axis 0 too (the input-channel axis).
    qparams = _qparams(float_mod.weight, scheme, dtype_name, axis=0)
    ours = getattr(nnqr, f"ConvTranspose{dim}d").from_float(float_mod, qparams)
    theirs = getattr(ao_ref, f"ConvTranspose{dim}d").from_float(float_mod, qparams)
    spatial = {1: (7,), 2: (5, 6), 3: (4, 3, 5)}[dim]
    x = torch.randn(2, 4, *spatial)
    _check_pair(ours, theirs, x)
    # torch.ao's reference transposed convs crash when given output_size (they pass the
    # builtin ``input`` instead of x); check against the float module on the same weight.
    size = [2 * s for s in spatial]
    float_copy = cls(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2)
    float_copy.load_state_dict(float_mod.state_dict())
    with torch.no_grad():
        float_copy.weight.copy_(ours.get_weight())
    assert torch.equal(ours(x, size), float_copy(x, size))


@pytest.mark.parametrize("dtype_name", ["quint8", "quint4x2"])
def test_embedding_matches_torch_ao(dtype_name: str) -> None:
    ao_ref = _ao_ref()
    torch.manual_seed(4)
    float_mod = nn.Embedding(12, 5)
    qparams = _qparams(float_mod.weight, "per_channel_affine_float_qparams", dtype_name)
    ours = nnqr.Embedding.from_float(float_mod, qparams)
    theirs = ao_ref.Embedding.from_float(float_mod, qparams)
    idx = torch.tensor([[0, 3, 11], [5, 5, 2]])
    assert torch.equal(ours(idx), theirs(idx))
    assert torch.equal(ours.get_weight(), theirs.get_weight())
    if dtype_name == "quint8":
        assert torch.equal(
            ours.get_quantized_weight().values, theirs.get_quantized_weight().int_repr()
        )
    else:
        assert int(ours.get_quantized_weight().values.max()) <= 15


def test_embedding_bag_matches_torch_ao() -> None:
    ao_ref = _ao_ref()
    torch.manual_seed(5)
    float_mod = nn.EmbeddingBag(12, 5, mode="sum", include_last_offset=False)
    qparams = _qparams(float_mod.weight, "per_channel_affine_float_qparams", "quint8")
    ours = nnqr.EmbeddingBag.from_float(float_mod, qparams)
    theirs = ao_ref.EmbeddingBag.from_float(float_mod, qparams)
    idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    offsets = torch.tensor([0, 4])
    weights = torch.rand(8)
    assert torch.equal(ours(idx, offsets), theirs(idx, offsets))
    assert torch.equal(ours(idx, offsets, weights), theirs(idx, offsets, weights))


def test_float16_and_unquantized_weights_match_torch_ao() -> None:
    ao_ref = _ao_ref()
    torch.manual_seed(6)
    float_mod = nn.Linear(7, 3)
    for qparams in (
        {"qscheme": torch.per_tensor_affine, "dtype": torch.float16, "scale": 1.0,
         "zero_point": 0},
        {"qscheme": None, "dtype": torch.float32},
    ):  # fmt: skip
        ours = nnqr.Linear.from_float(float_mod, qparams)
        theirs = ao_ref.Linear.from_float(float_mod, qparams)
        x = torch.randn(2, 7)
        assert torch.equal(ours(x), theirs(x))
        with pytest.raises(FxQuantError, match="no integer form"):
            ours.get_quantized_weight()


def test_accepts_canonical_names() -> None:
    torch.manual_seed(7)
    float_mod = nn.Linear(4, 3)
    scale = torch.tensor([0.01, 0.02, 0.03])
    ours = nnqr.Linear.from_float(
        float_mod,
        {"qscheme": "per_channel_symmetric", "dtype": torch.int8, "scale": scale,
         "zero_point": torch.zeros(3, dtype=torch.int32), "axis": 0},
    )  # fmt: skip
    assert ours.weight_qscheme is QScheme.PER_CHANNEL_AFFINE
    expected = torch.clamp(torch.round(float_mod.weight / scale[:, None]), -128, 127)
    assert torch.equal(ours.get_quantized_weight().values, expected.to(torch.int8))
    assert torch.equal(ours.get_weight(), expected * scale[:, None])


def test_quant_range_from_qparams_is_honoured() -> None:
    float_mod = nn.Linear(4, 2)
    with torch.no_grad():
        float_mod.weight.copy_(torch.tensor([[-1.0, 0.5, 1.0, 2.0], [0.0, -2.0, 0.1, 0.2]]))
    ours = nnqr.Linear.from_float(
        float_mod,
        {"qscheme": torch.per_tensor_affine, "dtype": torch.qint8, "scale": 0.01,
         "zero_point": 0, "quant_min": -127, "quant_max": 127},
    )  # fmt: skip
    values = ours.get_quantized_weight().values
    assert int(values.min()) == -127
    assert int(values.max()) == 127


def test_state_dict_round_trip_weights_only() -> None:
    torch.manual_seed(8)
    float_mod = nn.Conv2d(3, 5, 3)
    qparams = {"qscheme": "per_channel_affine", "dtype": torch.int8,
               "scale": torch.rand(5) * 0.01 + 1e-3,
               "zero_point": torch.randint(-3, 3, (5,)), "axis": 0}  # fmt: skip
    ours = nnqr.Conv2d.from_float(float_mod, qparams)
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    # a fresh module with default (per-tensor uint8) qparams takes the saved ones over
    fresh = nnqr.Conv2d(3, 5, 3)
    assert fresh.weight_qscheme is QScheme.PER_TENSOR_AFFINE
    fresh.load_state_dict(state)
    assert fresh.weight_qscheme is QScheme.PER_CHANNEL_AFFINE
    assert fresh.weight_dtype == torch.int8
    assert torch.equal(fresh.weight_scale, ours.weight_scale)
    assert torch.equal(fresh.weight_zero_point, ours.weight_zero_point)
    x = torch.randn(1, 3, 6, 6)
    assert torch.equal(fresh(x), ours(x))


def test_export_reference_linear() -> None:
    torch.manual_seed(9)
    float_mod = nn.Linear(6, 4)
    ours = nnqr.Linear.from_float(
        float_mod,
        {"qscheme": torch.per_tensor_affine, "dtype": torch.quint8, "scale": 0.01,
         "zero_point": 128},
    )  # fmt: skip
    x = torch.randn(3, 6)
    exported = torch.export.export(ours, (x,))
    assert torch.equal(exported.module()(x), ours(x))


@pytest.mark.parametrize(
    ("qparams", "message"),
    [
        ({"dtype": torch.qint8}, "needs 'qscheme' and 'dtype'"),
        ({"qscheme": "per_tensor_affine", "dtype": torch.float64}, "unsupported dtype"),
        ({"qscheme": "bogus", "dtype": torch.qint8}, "unknown qscheme"),
        ({"qscheme": "per_tensor_affine", "dtype": torch.qint8, "scale": 0.1}, "zero_point"),
        (
            {"qscheme": "per_channel_affine", "dtype": torch.qint8,
             "scale": torch.ones(3), "zero_point": torch.zeros(3, dtype=torch.long)},
            "needs an 'axis'",
        ),
        (
            {"qscheme": "per_channel_affine", "dtype": torch.qint8,
             "scale": torch.ones(3), "zero_point": torch.zeros(3, dtype=torch.long), "axis": 0},
            "4 channels along axis 0",
        ),
        (
            {"qscheme": "per_channel_affine", "dtype": torch.qint8,
             "scale": torch.ones(4), "zero_point": torch.zeros(4, dtype=torch.long), "axis": 5},
            "axis=5",
        ),
        (
            {"qscheme": "per_tensor_affine", "dtype": torch.qint8, "scale": 0.1,
             "zero_point": 0, "quant_min": -300},
            "does not fit",
        ),
    ],
)  # fmt: skip
def test_bad_qparams(qparams: dict[str, Any], message: str) -> None:
    with pytest.raises(FxQuantError, match=message):
        nnqr.Linear.from_float(nn.Linear(3, 4), qparams)


def _rnn_qparams(rnn: nn.Module, per_channel: bool) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name in getattr(rnn, "_flat_weights_names", ["weight_ih", "weight_hh"]):
        if not name.startswith("weight"):
            continue
        w = getattr(rnn, name).detach()
        if per_channel:
            result[name] = {"qscheme": torch.per_channel_affine, "dtype": torch.qint8,
                            "scale": w.abs().amax(1) / 127 + 1e-6,
                            "zero_point": torch.zeros(w.shape[0], dtype=torch.int),
                            "axis": 0}  # fmt: skip
        else:
            result[name] = {"qscheme": torch.per_tensor_affine, "dtype": torch.quint8,
                            "scale": float(w.abs().max()) / 127, "zero_point": 128}  # fmt: skip
    return result


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_rnn_matches_torch_ao(kind: str, per_channel: bool) -> None:
    ao_ref = _ao_ref()
    torch.manual_seed(11)
    float_mod = getattr(nn, kind)(5, 6, num_layers=2, bidirectional=True)
    qparams = _rnn_qparams(float_mod, per_channel)
    ours = getattr(nnqr, kind).from_float(float_mod, qparams)
    theirs = getattr(ao_ref, kind).from_float(float_mod, {"is_decomposed": False, **qparams})
    x = torch.randn(4, 3, 5)
    out_a, hid_a = ours(x)
    out_b, hid_b = theirs(x)
    assert torch.equal(out_a, out_b)
    for a, b in zip(
        hid_a if kind == "LSTM" else (hid_a,), hid_b if kind == "LSTM" else (hid_b,), strict=True
    ):
        assert torch.equal(a, b)
    # packed sequences and an explicit initial state
    packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([4, 3, 2]))
    out_pa, _ = ours(packed)
    out_pb, _ = theirs(packed)
    assert torch.equal(out_pa.data, out_pb.data)
    for name in qparams:
        assert torch.equal(ours.get_weight(name), theirs.get_flat_weights()[
            theirs._flat_weights_names.index(name)
        ])  # fmt: skip
        values = ours.get_quantized_weight(name).values
        assert values.dtype == (torch.int8 if per_channel else torch.uint8)
        assert not values.is_quantized
    # the float parameters themselves are untouched by forward
    assert ours._flat_weights[0] is ours.weight_ih_l0


def test_lstm_with_projection_equals_float_lstm_on_round_tripped_weights() -> None:
    """torch.ao's LSTM.from_float drops proj_size; compare with a float LSTM instead."""
    torch.manual_seed(13)
    float_mod = nn.LSTM(5, 6, num_layers=2, proj_size=3, batch_first=True)
    qparams = _rnn_qparams(float_mod, True)
    ours = nnqr.LSTM.from_float(float_mod, qparams)
    assert ours.proj_size == 3
    expected_mod = nn.LSTM(5, 6, num_layers=2, proj_size=3, batch_first=True)
    with torch.no_grad():
        for name in float_mod._flat_weights_names:
            value = ours.get_weight(name) if name in qparams else getattr(float_mod, name)
            getattr(expected_mod, name).copy_(value)
    x = torch.randn(2, 4, 5)
    h0 = (torch.randn(2, 2, 3), torch.randn(2, 2, 6))
    out, (h, c) = ours(x, h0)
    out_e, (h_e, c_e) = expected_mod(x, h0)
    # Results can differ in the last bit: the float LSTM's weights sit in one flattened
    # buffer, ours are separate tensors, and BLAS may round differently for the two layouts
    # (seen on the cell state everywhere and on the output with AVX-512 BLAS kernels).
    torch.testing.assert_close(out, out_e, rtol=0, atol=1e-6)
    torch.testing.assert_close(h, h_e, rtol=0, atol=1e-6)
    torch.testing.assert_close(c, c_e, rtol=0, atol=1e-6)


def test_rnn_state_dict_round_trip_weights_only() -> None:
    torch.manual_seed(12)
    float_mod = nn.LSTM(4, 5)
    ours = nnqr.LSTM.from_float(float_mod, _rnn_qparams(float_mod, True))
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    buf.seek(0)
    fresh = nnqr.LSTM(4, 5)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert fresh.weight_qparams("weight_hh_l0")[0] is QScheme.PER_CHANNEL_AFFINE
    x = torch.randn(3, 2, 4)
    assert torch.equal(fresh(x)[0], ours(x)[0])


def test_rnn_bad_qparams() -> None:
    float_mod = nn.GRU(3, 4)
    qparams = _rnn_qparams(float_mod, False)
    del qparams["weight_hh_l0"]
    with pytest.raises(FxQuantError, match=r"missing \['weight_hh_l0'\]"):
        nnqr.GRU.from_float(float_mod, qparams)
    qparams = _rnn_qparams(float_mod, True)
    qparams["weight_ih_l0"]["axis"] = 3
    with pytest.raises(FxQuantError, match="axis=3"):
        nnqr.GRU.from_float(float_mod, qparams)


@pytest.mark.parametrize("kind", ["RNNCell", "LSTMCell", "GRUCell"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_rnn_cells_match_torch_ao(kind: str, per_channel: bool) -> None:
    ao_ref = _ao_ref()
    torch.manual_seed(14)
    extra = {"nonlinearity": "relu"} if kind == "RNNCell" and per_channel else {}
    float_mod = getattr(nn, kind)(5, 6, **extra)
    qparams = _rnn_qparams(float_mod, per_channel)
    assert set(qparams) == {"weight_ih", "weight_hh"}
    ours = getattr(nnqr, kind).from_float(float_mod, qparams)
    theirs = getattr(ao_ref, kind).from_float(float_mod, {"is_decomposed": False, **qparams})
    for x in (torch.randn(3, 5), torch.randn(5)):  # batched and unbatched
        out_a, out_b = ours(x), theirs(x)
        pairs = zip(out_a, out_b, strict=True) if kind == "LSTMCell" else [(out_a, out_b)]
        for a, b in pairs:
            assert torch.equal(a, b)
    hx = torch.randn(3, 6)
    state = (hx, torch.randn(3, 6)) if kind == "LSTMCell" else hx
    x = torch.randn(3, 5)
    out_a, out_b = ours(x, state), theirs(x, state)
    pairs = zip(out_a, out_b, strict=True) if kind == "LSTMCell" else [(out_a, out_b)]
    for a, b in pairs:
        assert torch.equal(a, b)
    assert torch.equal(ours.get_weight_ih(), theirs.get_weight_ih())
    assert torch.equal(
        ours.get_quantized_weight_hh().values, theirs.get_quantized_weight_hh().int_repr()
    )


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_conv_honours_padding_mode(mode: str) -> None:
    """torch.ao's reference convs pad with zeros whatever padding_mode says; ours do not."""
    torch.manual_seed(15)
    float_mod = nn.Conv2d(3, 4, 3, padding=1, padding_mode=mode)
    ours = nnqr.Conv2d.from_float(
        float_mod,
        {"qscheme": torch.per_tensor_affine, "dtype": torch.qint8, "scale": 0.01,
         "zero_point": 0},
    )  # fmt: skip
    expected = nn.Conv2d(3, 4, 3, padding=1, padding_mode=mode)
    expected.load_state_dict(float_mod.state_dict())
    with torch.no_grad():
        expected.weight.copy_(ours.get_weight())
    x = torch.randn(1, 3, 6, 6)
    assert torch.equal(ours(x), expected(x))
    zero_padded = torch.nn.functional.conv2d(x, ours.get_weight(), ours.bias, padding=1)
    assert not torch.equal(ours(x), zero_padded)


def test_torch_ao_reference_state_dict_loads() -> None:
    """torch.ao reference checkpoints (torch objects inside: weights_only=False) load into ours."""
    ao_ref = _ao_ref()
    torch.manual_seed(17)
    cases: list[tuple[str, nn.Module, dict[str, Any], Any]] = []
    lin = nn.Linear(6, 4)
    cases.append(("Linear", lin, _qparams(lin.weight, "per_channel_affine", "qint8"),
                  torch.randn(2, 6)))  # fmt: skip
    conv = nn.Conv2d(3, 4, 3)
    cases.append(("Conv2d", conv, _qparams(conv.weight, "per_tensor_affine", "quint8"),
                  torch.randn(1, 3, 5, 5)))  # fmt: skip
    emb = nn.Embedding(9, 4)
    cases.append(("Embedding", emb,
                  _qparams(emb.weight, "per_channel_affine_float_qparams", "quint8"),
                  torch.tensor([1, 8, 3])))  # fmt: skip
    for name, float_mod, qparams, x in cases:
        theirs = getattr(ao_ref, name).from_float(float_mod, qparams)
        buf = io.BytesIO()
        torch.save(theirs.state_dict(), buf)
        buf.seek(0)
        state = torch.load(buf, weights_only=False)
        fresh = getattr(nnqr, name).from_float(float_mod, None)  # default per-tensor qparams
        fresh.load_state_dict(state)
        assert fresh.weight_qscheme == QScheme(str(qparams["qscheme"]).removeprefix("torch."))
        assert torch.equal(fresh(x), theirs(x)), name
