"""prepare swaps nn.MultiheadAttention and the nn.Transformer* modules for traceable
equivalents (quantbridge.fx_quant.nn.quantizable) so their Linears are quantized.

Equivalence: the traceable modules (alone, and traced inside a prepared model) give the float
module's outputs within atol 1e-6 in eval mode, over every forward option and constructor
option torch has. Then the swap itself (names, shared parameters, user choices, errors),
static / dynamic / QAT quantization of a small TransformerEncoder model, and explain.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quantbridge.fx_quant import (
    FxQuantError,
    PrepareCustomConfig,
    SwappedModule,
    TransformerSwapError,
    convert_to_reference_fx,
    explain,
    prepare_fx,
    prepare_qat_fx,
)
from quantbridge.fx_quant.nn import quantizable as nnqz
from quantbridge.fx_quant.nn import reference as nnqr
from quantbridge.qconfig import (
    QConfigMapping,
    default_dynamic_qconfig,
    default_qconfig,
    disable_observer,
    get_default_qat_qconfig_mapping,
)

# torch warns (and computes the same) when attn_mask and key_padding_mask types differ.
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched:UserWarning")

ATOL = 1e-6


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """Thousands of tiny forwards: thread start-up dominates on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


E, HEADS, L, S, N = 8, 2, 4, 5, 3


def _close(actual: Tensor | None, expected: Tensor | None, what: str) -> None:
    if expected is None:
        assert actual is None, what
        return
    assert actual is not None, what
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0, msg=lambda m: f"{what}: {m}")


def _randomize(module: nn.Module, seed: int) -> nn.Module:
    """Nonzero values everywhere (torch zero-initializes the attention biases)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


# ---------------------------------------------------------------- MultiheadAttention


MHA_CONFIGS: list[dict[str, Any]] = [
    {"batch_first": True},
    {"batch_first": False},
    {"batch_first": True, "bias": False},
    {"batch_first": False, "add_bias_kv": True},
    {"batch_first": True, "add_zero_attn": True},
    {"batch_first": False, "add_bias_kv": True, "add_zero_attn": True, "bias": False},
    {"batch_first": True, "kdim": 6, "vdim": 3},
    {"batch_first": False, "kdim": 5, "vdim": 7, "add_bias_kv": True},
    {"batch_first": True, "dropout": 0.5},
]


def _mha_inputs(cfg: dict[str, Any], batched: bool, self_attention: bool, g: torch.Generator):
    kdim, vdim = cfg.get("kdim", E), cfg.get("vdim", E)
    src = L if self_attention else S

    def shaped(length: int, dim: int) -> Tensor:
        if not batched:
            return torch.randn(length, dim, generator=g)
        shape = (N, length, dim) if cfg["batch_first"] else (length, N, dim)
        return torch.randn(shape, generator=g)

    q = shaped(L, E)
    if self_attention:
        return q, q, q, src
    return q, shaped(src, kdim), shaped(src, vdim), src


def _bool_mask(shape: tuple[int, ...], g: torch.Generator) -> Tensor:
    mask = torch.rand(shape, generator=g) < 0.3
    mask[..., 0] = False  # every query keeps a key (a fully masked row is NaN in torch too)
    return mask


def _attn_masks(batched: bool, src: int, g: torch.Generator) -> list[tuple[str, Tensor | None]]:
    three_d = (N * HEADS if batched else HEADS, L, src)
    return [
        ("none", None),
        ("bool 2-D", _bool_mask((L, src), g)),
        ("float 2-D", torch.randn(L, src, generator=g)),
        ("bool 3-D", _bool_mask(three_d, g)),
        ("float 3-D", torch.randn(three_d, generator=g)),
    ]


def _padding_masks(batched: bool, src: int, g: torch.Generator) -> list[tuple[str, Tensor | None]]:
    shape = (N, src) if batched else (src,)
    as_bool = _bool_mask(shape, g)
    as_float = torch.zeros(shape).masked_fill(torch.rand(shape, generator=g) < 0.3, -5.0)
    return [("none", None), ("bool", as_bool), ("float", as_float)]


class _CallMHA(nn.Module):
    """Every forward argument of the attention is a graph input of the prepared model."""

    def __init__(self, mha: nn.Module) -> None:
        super().__init__()
        self.mha = mha
        self.train(mha.training)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None,
        key_padding_mask: Tensor | None,
        need_weights: bool,
        average_attn_weights: bool,
        is_causal: bool,
    ) -> Any:
        return self.mha(
            q,
            k,
            v,
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            attn_mask=attn_mask,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )


WEIGHT_OPTIONS = [(False, True), (True, True), (True, False)]  # need_weights, average


@pytest.mark.parametrize(
    "cfg", MHA_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())
)
def test_multihead_attention_equals_float(cfg: dict[str, Any]) -> None:
    float_mha = _randomize(nn.MultiheadAttention(E, HEADS, **cfg), 0).eval()
    traceable = nnqz.MultiheadAttention.from_float(float_mha).eval()
    g = torch.Generator().manual_seed(1)
    q, k, v, _ = _mha_inputs(cfg, True, False, g)
    mapping = QConfigMapping().set_global(default_qconfig)
    example = (q, k, v, None, None, True, True, False)
    prepared = prepare_fx(_CallMHA(float_mha), mapping, example)
    assert [r.name for r in explain(prepared).swapped] == ["mha"]

    checked = 0
    same_dims = cfg.get("kdim", E) == E and cfg.get("vdim", E) == E
    for batched, self_attention in itertools.product((True, False), (True, False)):
        if self_attention and not same_dims:
            continue
        q, k, v, src = _mha_inputs(cfg, batched, self_attention, g)
        for (mask_name, mask), (kpm_name, kpm), (need, average) in itertools.product(
            _attn_masks(batched, src, g), _padding_masks(batched, src, g), WEIGHT_OPTIONS
        ):
            args = (q, k, v, mask, kpm, need, average, False)
            what = (
                f"batched={batched} self_attention={self_attention} attn_mask={mask_name} "
                f"key_padding_mask={kpm_name} need_weights={need} average={average}"
            )
            results = {
                "traceable": _CallMHA(traceable)(*args),
                "prepared": prepared(*args),
            }
            for grad in (False, True):  # no_grad lets torch take its fast path
                with torch.set_grad_enabled(grad):
                    expected = _CallMHA(float_mha)(*args)
                for name, (out, weights) in results.items():
                    _close(out, expected[0], f"{name} output, {what}, grad={grad}")
                    _close(weights, expected[1], f"{name} weights, {what}, grad={grad}")
            checked += 1
    assert checked == (4 if same_dims else 2) * 5 * 3 * 3


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("batched", [True, False])
def test_multihead_attention_is_causal(batch_first: bool, batched: bool) -> None:
    """The hint replaces attn_mask only without padding mask and weights, as in torch."""
    cfg = {"batch_first": batch_first}
    float_mha = _randomize(nn.MultiheadAttention(E, HEADS, **cfg), 2).eval()
    traceable = nnqz.MultiheadAttention.from_float(float_mha).eval()
    g = torch.Generator().manual_seed(3)
    q, k, v, src = _mha_inputs(cfg, batched, True, g)
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    prepared = prepare_fx(
        _CallMHA(float_mha),
        QConfigMapping().set_global(default_qconfig),
        (q, k, v, causal, None, False, True, True),
    )
    for mask, (kpm_name, kpm), (need, average) in itertools.product(
        (causal, causal.isinf()), _padding_masks(batched, src, g), WEIGHT_OPTIONS
    ):
        args = (q, k, v, mask, kpm, need, average, True)
        expected = _CallMHA(float_mha)(*args)
        for name, model in (("traceable", _CallMHA(traceable)), ("prepared", prepared)):
            out, weights = model(*args)
            what = f"{name} mask={mask.dtype} kpm={kpm_name} need_weights={need}"
            _close(out, expected[0], what)
            _close(weights, expected[1], what)


def test_multihead_attention_is_causal_hint_ignores_the_mask_like_torch() -> None:
    """With the hint and no padding mask torch attends causally whatever attn_mask says."""
    float_mha = _randomize(nn.MultiheadAttention(E, HEADS, batch_first=True), 4).eval()
    traceable = nnqz.MultiheadAttention.from_float(float_mha).eval()
    x = torch.randn(N, L, E)
    not_causal = torch.zeros(L, L)
    expected = float_mha(x, x, x, attn_mask=not_causal, need_weights=False, is_causal=True)[0]
    out = traceable(x, x, x, attn_mask=not_causal, need_weights=False, is_causal=True)[0]
    _close(out, expected, "causal hint")
    plain = float_mha(x, x, x, attn_mask=not_causal, need_weights=False)[0]
    assert (out - plain).abs().max() > 1e-3  # the hint did change the result


def test_multihead_attention_bad_inputs_name_the_problem() -> None:
    mha = nnqz.MultiheadAttention.from_float(nn.MultiheadAttention(E, HEADS)).eval()
    x = torch.randn(L, N, E)
    with pytest.raises(FxQuantError, match="is_causal=True needs attn_mask"):
        mha(x, x, x, is_causal=True)
    with pytest.raises(FxQuantError, match=r"attn_mask has shape \(3, 3\)"):
        mha(x, x, x, attn_mask=torch.zeros(3, 3))
    with pytest.raises(FxQuantError, match=r"key_padding_mask has shape \(2, 4\)"):
        mha(x, x, x, key_padding_mask=torch.zeros(2, L, dtype=torch.bool))
    with pytest.raises(FxQuantError, match=r"key_padding_mask has dtype torch\.int64"):
        mha(x, x, x, key_padding_mask=torch.zeros(N, L, dtype=torch.long))
    with pytest.raises(FxQuantError, match="all be 3-D"):
        mha(x, x[0], x[0])


def test_multihead_attention_from_float_parameters() -> None:
    """Packed weights are copied slice by slice; everything else is the float module's own."""
    packed = _randomize(nn.MultiheadAttention(E, HEADS, add_bias_kv=True), 5)
    new = nnqz.MultiheadAttention.from_float(packed)
    for i, proj in enumerate((new.q_proj, new.k_proj, new.v_proj)):
        assert type(proj) is nn.Linear
        assert torch.equal(proj.weight, packed.in_proj_weight[i * E : (i + 1) * E])
        assert torch.equal(proj.bias, packed.in_proj_bias[i * E : (i + 1) * E])
    assert type(new.out_proj) is nn.Linear  # not NonDynamicallyQuantizableLinear
    assert new.out_proj.weight is packed.out_proj.weight
    assert new.bias_k is packed.bias_k
    assert new.bias_v is packed.bias_v
    separate = nn.MultiheadAttention(E, HEADS, kdim=3, vdim=5)
    new = nnqz.MultiheadAttention.from_float(separate)
    assert new.q_proj.weight is separate.q_proj_weight
    assert new.k_proj.weight is separate.k_proj_weight
    assert new.k_proj.in_features == 3
    assert new.v_proj.weight is separate.v_proj_weight
    assert new.v_proj.in_features == 5
    assert set(new.state_dict()) == {
        "q_proj.weight",
        "q_proj.bias",
        "k_proj.weight",
        "k_proj.bias",
        "v_proj.weight",
        "v_proj.bias",
        "out_proj.weight",
        "out_proj.bias",
    }
    with pytest.raises(FxQuantError, match=r"expects an nn\.MultiheadAttention"):
        nnqz.MultiheadAttention.from_float(nn.Linear(2, 2))  # type: ignore[arg-type]


# ---------------------------------------------------------------- transformer layers


def _custom_activation(x: Tensor) -> Tensor:
    return F.silu(x) * 0.5


LAYER_CONFIGS: list[dict[str, Any]] = [
    {"batch_first": True, "norm_first": False, "activation": "relu"},
    {"batch_first": False, "norm_first": True, "activation": "gelu"},
    {"batch_first": True, "norm_first": True, "activation": _custom_activation},
    {"batch_first": False, "norm_first": False, "activation": nn.Hardswish()},
    {"batch_first": True, "norm_first": False, "layer_norm_eps": 1e-2, "bias": False},
    {"batch_first": False, "norm_first": True, "dropout": 0.0, "layer_norm_eps": 0.3},
]


def _layer_ids(cfg: dict[str, Any]) -> str:
    return ",".join(f"{k}={getattr(v, '__name__', v)}" for k, v in cfg.items())


def _seq(cfg: dict[str, Any], length: int, batched: bool, g: torch.Generator) -> Tensor:
    if not batched:
        return torch.randn(length, E, generator=g)
    shape = (N, length, E) if cfg["batch_first"] else (length, N, E)
    return torch.randn(shape, generator=g)


class _CallEncoderLayer(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.train(layer.training)

    def forward(self, x: Tensor, mask: Tensor | None, kpm: Tensor | None, causal: bool) -> Tensor:
        out: Tensor = self.layer(x, src_mask=mask, src_key_padding_mask=kpm, is_causal=causal)
        return out


class _CallDecoderLayer(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.train(layer.training)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None,
        memory_mask: Tensor | None,
        tgt_kpm: Tensor | None,
        memory_kpm: Tensor | None,
        tgt_is_causal: bool,
    ) -> Tensor:
        out: Tensor = self.layer(
            x,
            memory,
            tgt_mask=tgt_mask,
            memory_mask=memory_mask,
            tgt_key_padding_mask=tgt_kpm,
            memory_key_padding_mask=memory_kpm,
            tgt_is_causal=tgt_is_causal,
        )
        return out


def _self_masks(batched: bool, g: torch.Generator) -> list[tuple[Tensor | None, Tensor | None]]:
    """(src_mask, key_padding_mask) pairs, masks of one type each (torch warns on a mix)."""
    kpm_shape = (N, L) if batched else (L,)
    return [
        (None, None),
        (_bool_mask((L, L), g), None),
        (torch.randn(L, L, generator=g), None),
        (None, _bool_mask(kpm_shape, g)),
        (_bool_mask((L, L), g), _bool_mask(kpm_shape, g)),
        (torch.randn(L, L, generator=g), torch.randn(kpm_shape, generator=g)),
        (_bool_mask((N * HEADS if batched else HEADS, L, L), g), None),
    ]


@pytest.mark.parametrize("cfg", LAYER_CONFIGS, ids=_layer_ids)
def test_encoder_layer_equals_float(cfg: dict[str, Any]) -> None:
    float_layer = nn.TransformerEncoderLayer(E, HEADS, dim_feedforward=12, **cfg)
    float_layer = _randomize(float_layer, 6).eval()
    g = torch.Generator().manual_seed(7)
    x = _seq(cfg, L, True, g)
    prepared = prepare_fx(
        _CallEncoderLayer(float_layer),
        QConfigMapping().set_global(default_qconfig),
        (x, None, None, False),
    )
    assert [r.name for r in explain(prepared).swapped] == ["layer", "layer.self_attn"]
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    checked = 0
    for batched in (True, False):
        x = _seq(cfg, L, batched, g)
        cases = [(m, k, False) for m, k in _self_masks(batched, g)]
        cases += [(causal, None, True), (causal.isinf(), _self_masks(batched, g)[3][1], True)]
        for mask, kpm, is_causal in cases:
            what = f"batched={batched} mask={mask is not None} kpm={kpm is not None}"
            got = prepared(x, mask, kpm, is_causal)
            expected = float_layer(x, src_mask=mask, src_key_padding_mask=kpm, is_causal=is_causal)
            _close(got, expected, what)
            with torch.no_grad():  # torch's fast path where it applies
                fast = float_layer(x, src_mask=mask, src_key_padding_mask=kpm, is_causal=is_causal)
            if not fast.isnan().any():  # torch 2.13's fast path gives NaN for a float src_mask
                _close(got, fast, f"{what} (no grad)")
            checked += 1
    assert checked == 2 * 9


@pytest.mark.parametrize("cfg", LAYER_CONFIGS, ids=_layer_ids)
def test_decoder_layer_equals_float(cfg: dict[str, Any]) -> None:
    float_layer = nn.TransformerDecoderLayer(E, HEADS, dim_feedforward=12, **cfg)
    float_layer = _randomize(float_layer, 8).eval()
    g = torch.Generator().manual_seed(9)
    x, memory = _seq(cfg, L, True, g), _seq(cfg, S, True, g)
    prepared = prepare_fx(
        _CallDecoderLayer(float_layer),
        QConfigMapping().set_global(default_qconfig),
        (x, memory, None, None, None, None, False),
    )
    swapped = [r.name for r in explain(prepared).swapped]
    assert swapped == ["layer", "layer.self_attn", "layer.multihead_attn"]
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    for batched in (True, False):
        x, memory = _seq(cfg, L, batched, g), _seq(cfg, S, batched, g)
        kpm_shape = (N, S) if batched else (S,)
        memory_masks = [
            (None, None),
            (_bool_mask((L, S), g), _bool_mask(kpm_shape, g)),
            (torch.randn(L, S, generator=g), torch.randn(kpm_shape, generator=g)),
        ]
        for (tgt_mask, tgt_kpm), (mem_mask, mem_kpm), is_causal in itertools.product(
            _self_masks(batched, g)[:3], memory_masks, (False, True)
        ):
            if is_causal:
                tgt_mask = causal
            expected = float_layer(
                x,
                memory,
                tgt_mask=tgt_mask,
                memory_mask=mem_mask,
                tgt_key_padding_mask=tgt_kpm,
                memory_key_padding_mask=mem_kpm,
                tgt_is_causal=is_causal,
            )
            got = prepared(x, memory, tgt_mask, mem_mask, tgt_kpm, mem_kpm, is_causal)
            _close(got, expected, f"batched={batched} causal={is_causal}")


class _Seq2Seq(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(E, HEADS, 12, batch_first=batch_first),
            2,
            norm=nn.LayerNorm(E),
            enable_nested_tensor=False,
        )
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(E, HEADS, 12, batch_first=batch_first, norm_first=True), 2
        )

    def forward(self, src: Tensor, tgt: Tensor, src_kpm: Tensor, tgt_mask: Tensor) -> Tensor:
        memory = self.encoder(src, src_key_padding_mask=src_kpm)
        out: Tensor = self.decoder(
            tgt, memory, tgt_mask=tgt_mask, memory_key_padding_mask=src_kpm, tgt_is_causal=True
        )
        return out


@pytest.mark.parametrize("batch_first", [True, False])
def test_encoder_decoder_containers_equal_float(batch_first: bool) -> None:
    model = _randomize(_Seq2Seq(batch_first), 10).eval()
    g = torch.Generator().manual_seed(11)
    cfg = {"batch_first": batch_first}
    src, tgt = _seq(cfg, S, True, g), _seq(cfg, L, True, g)
    kpm = _bool_mask((N, S), g)
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    args = (src, tgt, kpm, causal)
    prepared = prepare_fx(model, QConfigMapping().set_global(default_qconfig), args)
    swapped = {r.name: r.float_type for r in explain(prepared).swapped}
    assert swapped["encoder"] == "nn.TransformerEncoder"
    assert swapped["decoder.layers.1.multihead_attn"] == "nn.MultiheadAttention"
    assert len(swapped) == 2 + 2 * 2 + 2 * 3
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            _close(prepared(*args), model(*args), f"grad={grad}")
    for unbatched in ((src[0], tgt[0]) if batch_first else (src[:, 0], tgt[:, 0]),):
        args = (*unbatched, kpm[0], causal)
        _close(prepared(*args), model(*args), "unbatched")


def test_nn_transformer_equals_float() -> None:
    model = _randomize(nn.Transformer(E, HEADS, 1, 2, 12, batch_first=True), 12).eval()
    g = torch.Generator().manual_seed(13)
    src, tgt = torch.randn(N, S, E, generator=g), torch.randn(N, L, E, generator=g)
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    prepared = prepare_fx(
        model, QConfigMapping().set_global(default_qconfig), (src, tgt, None, causal)
    )
    assert explain(prepared).swapped[0].float_type == "nn.Transformer"
    _close(prepared(src, tgt, None, causal), model(src, tgt, tgt_mask=causal), "nn.Transformer")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_encoder_padding_positions_are_the_standard_path() -> None:
    """torch's nested-tensor fast path (eval, no grad) zeroes padded positions; the
    swapped encoder computes them as torch's standard path does (other positions equal)."""
    layer = nn.TransformerEncoderLayer(E, HEADS, 12, batch_first=True)
    model = _randomize(nn.TransformerEncoder(layer, 2), 14).eval()
    x = torch.randn(N, S, E)
    kpm = torch.zeros(N, S, dtype=torch.bool)
    kpm[0, 3:] = True
    prepared = prepare_fx(model, QConfigMapping().set_global(default_qconfig), (x, None, kpm))
    with torch.no_grad():
        fast, ours = model(x, src_key_padding_mask=kpm), prepared(x, None, kpm)
    assert torch.all(fast[kpm] == 0)
    assert not torch.all(ours[kpm] == 0)
    _close(ours[~kpm], fast[~kpm], "non-padded positions")
    _close(ours, model(x, src_key_padding_mask=kpm), "grad enabled: the standard path")


# ---------------------------------------------------------------- the swap in prepare


class _EncoderModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, E)
        layer = nn.TransformerEncoderLayer(E, HEADS, 16, batch_first=True, dropout=0.1)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.encoder(self.embed(x)))
        return out


# Each layer: q/k/v/out projections, linear1, linear2.
_LAYER_LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
_LAYER_LINEARS += ["self_attn.out_proj", "linear1", "linear2"]


def _linear_of(modules: dict[str, nn.Module], name: str) -> nn.Module:
    """The Linear at ``name``, also when linear + relu was fused (the Linear is member 0)."""
    module = modules[name]
    return module[0] if isinstance(module, nn.Sequential) else module


def _is_quantized_linear(modules: dict[str, nn.Module], name: str) -> bool:
    return isinstance(_linear_of(modules, name), nnqr.Linear)


def _calibrated(model: nn.Module, mapping: QConfigMapping, **kw: Any) -> Any:
    torch.manual_seed(15)
    data = [torch.randn(2, 5, 6) for _ in range(4)]
    prepared = prepare_fx(model, mapping, (data[0],), **kw)
    for x in data:
        prepared(x)
    return prepared


def test_static_quantization_quantizes_every_linear() -> None:
    model = _randomize(_EncoderModel(), 16).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prepared = _calibrated(model, QConfigMapping().set_global(default_qconfig), strict=True)
    # The user's model is untouched: same classes, same values.
    assert type(model.encoder) is nn.TransformerEncoder
    assert type(model.encoder.layers[0].self_attn) is nn.MultiheadAttention
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    linears = [f"encoder.layers.{i}.{n}" for i in range(2) for n in _LAYER_LINEARS]
    report = explain(prepared)
    statuses = {r.target: r.status for r in report if r.op == "call_module"}
    assert all(statuses[n] == "quantized" for n in linears), statuses
    assert statuses["encoder.layers.0.self_attn.attention"] == "float"
    reference = convert_to_reference_fx(prepared)
    modules = dict(reference.named_modules())
    for name in linears:
        assert _is_quantized_linear(modules, name), name
    x = torch.randn(2, 5, 6)
    error = (reference(x) - model(x)).abs().max().item()
    assert 0 < error < 0.1, error


def test_dynamic_quantization_quantizes_every_linear() -> None:
    model = _randomize(_EncoderModel(), 17).eval()
    mapping = QConfigMapping().set_global(default_dynamic_qconfig)
    prepared = _calibrated(model, mapping)
    reference = convert_to_reference_fx(prepared)
    modules = dict(reference.named_modules())
    for i, n in itertools.product(range(2), _LAYER_LINEARS):
        module = _linear_of(modules, f"encoder.layers.{i}.{n}")
        assert isinstance(module, nnqr.Linear)
        assert module.weight_dtype == torch.int8
    choose = [n for n in reference.graph.nodes if "choose_qparams" in str(n.target)]
    assert len(choose) >= 2 * 4 + 2  # one per distinct Linear input at least
    x = torch.randn(2, 5, 6)
    error = (reference(x) - model(x)).abs().max().item()
    assert 0 < error < 0.05, error


def test_qat_prepare_trains_with_dropout_and_converts() -> None:
    model = _randomize(_EncoderModel(), 18).train()
    x = torch.randn(2, 5, 6)
    prepared = prepare_qat_fx(model, get_default_qat_qconfig_mapping("x86"), (x,))
    modules = dict(prepared.named_modules())
    q_proj = modules["encoder.layers.0.self_attn.q_proj"]
    assert type(q_proj).__module__.startswith("quantbridge.fx_quant.nn.qat")
    assert modules["encoder.layers.0.self_attn.attention"].training
    torch.manual_seed(0)
    first = prepared(x)
    torch.manual_seed(1)
    assert not torch.equal(first, prepared(x))  # dropout is active in training mode
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.01)
    weight_before = q_proj.weight.detach().clone()
    prepared(x).square().mean().backward()
    optimizer.step()
    assert not torch.equal(q_proj.weight, weight_before)
    prepared.eval()
    prepared.apply(disable_observer)  # observers update in eval mode too
    torch.manual_seed(0)
    first = prepared(x)
    torch.manual_seed(1)
    assert torch.equal(first, prepared(x))  # eval: no dropout
    reference = convert_to_reference_fx(prepared)
    assert _is_quantized_linear(dict(reference.named_modules()), "encoder.layers.1.linear2")


@pytest.mark.parametrize(
    "rule",
    ["module_name", "object_type_layer", "object_type_mha", "regex"],
)
def test_qconfig_none_keeps_the_module_float(rule: str) -> None:
    model = _randomize(_EncoderModel(), 19).eval()
    mapping = QConfigMapping().set_global(default_qconfig)
    if rule == "module_name":
        mapping.set_module_name("encoder.layers.0", None)
    elif rule == "object_type_layer":
        mapping.set_object_type(nn.TransformerEncoderLayer, None)
    elif rule == "object_type_mha":
        mapping.set_object_type(nn.MultiheadAttention, None)
    else:
        mapping.set_module_name_regex(r"encoder\.layers\.0\..*", None)
    prepared = _calibrated(model, mapping)
    swapped = [r.name for r in explain(prepared).swapped]
    modules = dict(prepared.named_modules())
    if rule in ("module_name", "object_type_layer"):
        assert "encoder.layers.0" not in swapped
        assert type(modules["encoder.layers.0"]) is nn.TransformerEncoderLayer
    if rule == "object_type_mha":
        assert [n for n in swapped if "self_attn" in n] == []
        assert type(modules["encoder.layers.0.self_attn"]) is nn.MultiheadAttention
        assert "encoder.layers.0" in swapped
    reference = convert_to_reference_fx(prepared)
    ref_modules = dict(reference.named_modules())
    if rule == "regex":  # the regex matches the attention (kept) but not the layer
        assert "encoder.layers.0" in swapped
        assert "encoder.layers.0.self_attn" not in swapped
        for n in ("linear1", "linear2"):
            assert type(_linear_of(ref_modules, f"encoder.layers.0.{n}")) is nn.Linear, n
    if rule == "object_type_layer":  # no layer swapped: nothing inside is quantized
        assert swapped == ["encoder"]
        assert not any(isinstance(m, nnqr.Linear) for n, m in ref_modules.items() if "layers" in n)
    else:
        assert _is_quantized_linear(ref_modules, "encoder.layers.1.linear1")
    if rule != "object_type_mha":
        assert "encoder.layers.1.self_attn" in swapped or rule == "object_type_layer"
    if rule in ("module_name", "regex"):
        assert _is_quantized_linear(ref_modules, "encoder.layers.1.self_attn.q_proj")
    x = torch.randn(2, 5, 6)
    assert (reference(x) - model(x)).abs().max() < 0.1


def test_set_module_name_none_on_attention_and_whole_model() -> None:
    model = _randomize(_EncoderModel(), 20).eval()
    mapping = QConfigMapping().set_global(default_qconfig)
    mapping.set_module_name("encoder.layers.0.self_attn", None)
    prepared = _calibrated(model, mapping)
    assert all(isinstance(r, SwappedModule) for r in explain(prepared).swapped)
    swapped = [r.name for r in explain(prepared).swapped]
    assert "encoder.layers.0.self_attn" not in swapped
    assert "encoder.layers.0" in swapped
    modules = dict(prepared.named_modules())
    assert modules["encoder.layers.0.self_attn"] is model.encoder.layers[0].self_attn
    # Everything None: nothing swapped, the prepared model is the float model.
    prepared = _calibrated(model, QConfigMapping())
    assert [r.name for r in explain(prepared).swapped] == [
        "encoder",
        "encoder.layers.0",
        "encoder.layers.0.self_attn",
        "encoder.layers.1",
        "encoder.layers.1.self_attn",
    ]  # global None is not an explicit choice; every Linear then stays float
    reference = convert_to_reference_fx(prepared)
    assert not any(isinstance(m, nnqr.Linear) for m in reference.modules())
    x = torch.randn(2, 5, 6)
    _close(reference(x), model(x), "all-None model")


@pytest.mark.parametrize("how", ["name", "class", "standalone"])
def test_prepare_custom_config_keeps_the_module(how: str) -> None:
    model = _randomize(_EncoderModel(), 21).eval()
    pcc = PrepareCustomConfig()
    if how == "name":
        pcc.set_non_traceable_module_names(["encoder.layers.1"])
    elif how == "class":
        pcc.set_non_traceable_module_classes([nn.MultiheadAttention])
    else:
        pcc.set_standalone_module_name(
            "encoder.layers.1", None, (torch.randn(2, 5, E),), PrepareCustomConfig(), None
        )
    prepared = _calibrated(model, QConfigMapping().set_global(default_qconfig), **{})
    prepared = prepare_fx(
        model, QConfigMapping().set_global(default_qconfig), (torch.randn(2, 5, 6),), pcc
    )
    swapped = [r.name for r in explain(prepared).swapped]
    modules = dict(prepared.named_modules())
    if how == "name":
        assert not any(n.startswith("encoder.layers.1") for n in swapped)
        assert modules["encoder.layers.1"] is model.encoder.layers[1]
    elif how == "class":
        assert not any(n.endswith("self_attn") for n in swapped)
        assert modules["encoder.layers.0.self_attn"] is model.encoder.layers[0].self_attn
    else:
        # A standalone module is prepared on its own, where the swap applies again.
        assert "encoder.layers.1" not in swapped
        standalone = explain(modules["encoder.layers.1"]).swapped
        assert [r.name for r in standalone] == ["", "self_attn"]
    x = torch.randn(2, 5, 6)
    _close(prepared(x), model(x), "prepared (observers only)")


def test_hooks_and_parametrizations_are_refused() -> None:
    model = _EncoderModel().eval()
    x = torch.randn(2, 5, 6)
    handle = model.encoder.layers[1].self_attn.register_forward_hook(lambda *a: None)
    with pytest.raises(TransformerSwapError, match=r"'encoder.layers.1.self_attn'.*forward hooks"):
        prepare_fx(model, QConfigMapping().set_global(default_qconfig), (x,))
    # The fix the message names works.
    pcc = PrepareCustomConfig().set_non_traceable_module_names(["encoder.layers.1.self_attn"])
    prepare_fx(model, QConfigMapping().set_global(default_qconfig), (x,), pcc)
    handle.remove()
    handle = model.encoder.layers[0].self_attn.out_proj.register_forward_pre_hook(lambda *a: None)
    with pytest.raises(TransformerSwapError, match=r"forward hooks \(out_proj\)"):
        prepare_fx(model, QConfigMapping().set_global(default_qconfig), (x,))
    handle.remove()
    # A parametrized Linear of a layer is reused as it is: the swap keeps the parametrization.
    torch.nn.utils.parametrizations.weight_norm(model.encoder.layers[0].linear1)
    prepared = prepare_fx(model, QConfigMapping().set_global(default_qconfig), (x,))
    _close(prepared(x), model(x), "parametrized linear1")
    # A parametrized packed projection would be frozen into copies: refused.
    attention = model.encoder.layers[0].self_attn
    torch.nn.utils.parametrize.register_parametrization(attention, "in_proj_weight", nn.Identity())
    with pytest.raises(
        TransformerSwapError,
        match=r"'encoder.layers.0.self_attn'.*parametrized parameters \(in_proj_weight\)",
    ):
        prepare_fx(model, QConfigMapping().set_global(default_qconfig), (x,))


def test_explain_lists_the_swapped_modules() -> None:
    model = _randomize(_EncoderModel(), 22).eval()
    mapping = QConfigMapping().set_global(default_qconfig)
    mapping.set_module_name("encoder.layers.1.linear2", None)
    text = str(explain(_calibrated(model, mapping)))
    assert "modules swapped for traceable equivalents" in text
    assert "  encoder: nn.TransformerEncoder -> quantizable.TransformerEncoder\n" in text
    assert (
        "  encoder.layers.0.self_attn: nn.MultiheadAttention -> quantizable.MultiheadAttention; "
        "Linears: q_proj quantized, k_proj quantized, v_proj quantized, out_proj quantized"
    ) in text
    assert (
        "encoder.layers.1: nn.TransformerEncoderLayer -> quantizable.TransformerEncoderLayer; "
        "Linears: linear1 quantized, linear2 float"
    ) in text


def test_torch_ao_leaves_the_attention_float() -> None:
    """Differential: torch.ao's tracer keeps nn.TransformerEncoder a leaf, so of this model
    it quantizes only the Linears outside the encoder; here every Linear inside is too."""
    ao_fx = pytest.importorskip("torch.ao.quantization.quantize_fx")
    ao = pytest.importorskip("torch.ao.quantization")
    model = _randomize(_EncoderModel(), 23).eval()
    x = torch.randn(2, 5, 6)
    ao_mapping = ao.QConfigMapping().set_global(ao.default_qconfig)
    ao_prepared = ao_fx.prepare_fx(model, ao_mapping, (x,))
    ao_prepared(x)
    ao_ref = ao_fx.convert_to_reference_fx(ao_prepared)
    ao_linears = {
        n.removesuffix(".0")  # a fused LinearReLU holds the Linear
        for n, m in ao_ref.named_modules()
        if type(m).__module__.endswith("quantized.reference.modules.linear")
    }
    ours = convert_to_reference_fx(_calibrated(model, QConfigMapping().set_global(default_qconfig)))
    our_linears = {
        n.removesuffix(".0") for n, m in ours.named_modules() if isinstance(m, nnqr.Linear)
    }
    assert ao_linears == {"embed", "head"}
    inside = {f"encoder.layers.{i}.{n}" for i in range(2) for n in _LAYER_LINEARS}
    assert our_linears == ao_linears | inside


def test_object_type_entry_of_the_torch_class_applies_to_the_equivalent() -> None:
    """The adds inside the layers get the nn.TransformerEncoderLayer entry (as the enclosing
    module's type); module calls keep their own rules (global None here)."""
    model = _randomize(_EncoderModel(), 24).eval()
    mapping = QConfigMapping().set_object_type(nn.TransformerEncoderLayer, default_qconfig)
    report = explain(_calibrated(model, mapping))
    assert report.quantized() == ["add", "add_1", "add_2", "add_3"]
    assert report["add"].qconfig_rule.startswith("object_type ")
    assert report["add"].qconfig_rule.endswith(".TransformerEncoderLayer")


class _SharedLayer(nn.Module):
    """One encoder layer (relu: linear1 fuses with it) under two names, applied twice."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.TransformerEncoderLayer(E, HEADS, 16, batch_first=True)
        self.second = self.first

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.second(self.first(x))
        return out


@pytest.mark.parametrize("qat", [False, True])
def test_a_shared_layer_is_swapped_and_fused_once(qat: bool) -> None:
    model = _randomize(_SharedLayer(), 25).train(qat)
    x = torch.randn(N, L, E)
    if qat:
        prepared = prepare_qat_fx(model, get_default_qat_qconfig_mapping("x86"), (x,))
    else:
        prepared = prepare_fx(model, QConfigMapping().set_global(default_qconfig), (x,))
        _close(prepared(x), model(x), "prepared (observers only)")
    assert [r.name for r in explain(prepared).swapped] == ["first", "first.self_attn"]
    calls = [n.target for n in prepared.graph.nodes if n.op == "call_module"]
    assert calls.count("first.self_attn.q_proj") == 2  # both calls use the one module
    assert calls.count("first.linear1") == 2
    assert isinstance(prepared.get_submodule("first.linear1"), nn.Sequential)  # fused, once
    quantized = explain(prepared).quantized()
    assert {"first_linear1", "first_linear1_1"} <= set(quantized)
    for _ in range(3):  # calibrate (QAT: the fake quantizes observe in training mode)
        prepared(x)
    prepared.eval()
    reference = convert_to_reference_fx(prepared)
    assert (reference(x) - model.eval()(x)).abs().max() < 0.2
