"""The float-op fusion rules (LayerNorm + residual, softmax + scale + mask, GELU in the dynamic
linear's epilogue) and per-token dynamic activations, on a BERT-shaped encoder written the
Hugging Face way, against torch and against the lowering without those rules."""

# no ``from __future__ import annotations``: the models are pickled whole, and torch.fx keeps
# string annotations as text, which pickle refuses
import copy
import io
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule

import quantbridge.lowering as L
from quantbridge.fx_quant import convert_to_reference_fx, prepare_fx
from quantbridge.lowering import _modules as lm
from quantbridge.qconfig import QConfigMapping, default_dynamic_qconfig

# documented float32 tolerances (docs/guide/numerics.md, "Float kernels")
LN_ATOL = 2e-5
SOFTMAX_ATOL = 2e-7
SOFTMAX_RTOL = 2e-6
GELU_TOL = 4e-7  # times max(1, |x|)


class _Layer(nn.Module):
    """One Hugging Face BertLayer (eager attention), small."""

    def __init__(self, hidden: int = 32, heads: int = 4, inter: int = 64, tanh: bool = False):
        super().__init__()
        self.heads, self.d = heads, hidden // heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.attention_output = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate = nn.Linear(hidden, inter)
        self.act = nn.GELU(approximate="tanh" if tanh else "none")
        self.output = nn.Linear(inter, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q = self.query(x).view(b, s, self.heads, self.d).permute(0, 2, 1, 3)
        k = self.key(x).view(b, s, self.heads, self.d).permute(0, 2, 1, 3)
        v = self.value(x).view(b, s, self.heads, self.d).permute(0, 2, 1, 3)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.d)
        probs = F.softmax(scores + mask, dim=-1)
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous().view(b, s, h)
        x = self.attention_norm(self.attention_output(ctx) + x)
        out: torch.Tensor = self.output_norm(self.output(self.act(self.intermediate(x))) + x)
        return out


class _Encoder(nn.Module):
    def __init__(self, tanh: bool = False) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(tanh=tanh) for _ in range(2))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = (1.0 - attention_mask[:, None, None, :]) * torch.finfo(torch.float32).min
        for layer in self.layer:
            x = layer(x, mask)
        return x


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 16, 32, generator=g)
    mask = torch.ones(3, 16)
    mask[1, 11:] = 0
    mask[2, 5:] = 0
    return x, mask


def _reference(model: nn.Module, mapping: QConfigMapping) -> GraphModule:
    backend = L.get_backend("numba")
    example = _inputs(0)
    prepared = prepare_fx(model, mapping, example, backend_config=backend.backend_config)
    for seed in range(3):
        prepared(*_inputs(seed))
    return convert_to_reference_fx(prepared)


def _without_float_rules() -> tuple[L.LoweringRule, ...]:
    names = {r.name for r in L.default_lowering_rules() if r.kind == "fusion"}
    names.discard("conv + add (+relu)")
    return tuple(r for r in L.default_lowering_rules() if r.name not in names)


def _kinds(model: GraphModule) -> list[type]:
    return [type(m) for m in model.modules()]


@pytest.mark.parametrize("tanh", [False, True])
def test_bert_dynamic_float_ops_lowered_and_close(tanh: bool) -> None:
    torch.manual_seed(0)
    model = _Encoder(tanh).eval()
    reference = _reference(model, QConfigMapping().set_global(default_dynamic_qconfig))
    backend = L.get_backend("numba")
    lowered = backend.lower(reference)
    plain = L.lower_to_kernels(copy.deepcopy(reference), backend.target, _without_float_rules())
    report = str(L.lowering_report(lowered))
    assert report.count("kernels.softmax (scale and mask fused)") == 2, report
    assert report.count("kernels.layer_norm (residual add fused)") == 4, report
    gelu = "tanh" if tanh else "none"
    assert report.count(f"GELU ({gelu}) fused") == 2, report
    kinds = _kinds(lowered)
    assert kinds.count(lm.FloatSoftmax) == 2
    assert kinds.count(lm.FloatLayerNorm) == 4
    assert not any(k in (nn.LayerNorm, nn.GELU) for k in kinds)
    assert "torch.softmax" not in lowered.code
    assert "functional.softmax" not in lowered.code
    for seed in (5, 6):
        x, mask = _inputs(seed)
        with torch.no_grad():
            got, unfused, ideal, want = (
                lowered(x, mask),
                plain(x, mask),
                model(x, mask),
                reference(x, mask),
            )
        # float32 differences (~1e-6) may flip a dynamic quantization code downstream: the two
        # lowerings agree to well within the quantization error, which is as the reference's
        err = float((got - ideal).abs().max())
        assert float((got - unfused).abs().max()) < 0.25 * float((want - ideal).abs().max())
        assert 0 < err <= 1.5 * float((want - ideal).abs().max())
    again = copy.deepcopy(lowered)
    buffer = io.BytesIO()
    pickle.dump(lowered, buffer)
    buffer.seek(0)
    loaded = pickle.load(buffer)
    x, mask = _inputs(7)
    with torch.no_grad():
        torch.testing.assert_close(again(x, mask), lowered(x, mask), rtol=0, atol=0)
        torch.testing.assert_close(loaded(x, mask), lowered(x, mask), rtol=0, atol=0)


def test_per_token_activations_option() -> None:
    torch.manual_seed(1)
    model = _Encoder().eval()
    reference = _reference(model, QConfigMapping().set_global(default_dynamic_qconfig))
    backend = L.get_backend("numba")
    per_token = backend.with_options(per_token_activations=True)
    assert per_token.per_token_activations
    assert not backend.per_token_activations
    assert per_token.name == backend.name
    lowered = per_token.lower(reference)
    linears = [m for m in lowered.modules() if isinstance(m, lm.QuantizedDynamicLinear)]
    assert len(linears) == 12
    assert all(m.per_row for m in linears)
    assert "per-token activations" in str(L.lowering_report(lowered))
    per_tensor = backend.lower(reference)
    errors = []
    for low in (lowered, per_tensor):
        total = 0.0
        for seed in (3, 4):
            x, mask = _inputs(seed)
            with torch.no_grad():
                total += float((low(x, mask) - model(x, mask)).abs().mean())
        errors.append(total)
    assert errors[0] < errors[1]  # per-token scales follow each token's range
    with pytest.raises(TypeError, match="per_token_activations"):
        backend.with_options(per_token_activations="yes")  # type: ignore[arg-type]


class _FloatOps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(24)
        self.softmax = nn.Softmax(dim=-1)

    def forward(
        self, x: torch.Tensor, r: torch.Tensor, m: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        a = self.norm(x + r)
        b = F.layer_norm(x, (24,), None, None, 1e-6)
        c = torch.softmax(x * 0.3 + m, -1)
        d = self.softmax(x / 2.0)
        e = x.softmax(-1)
        f = torch.softmax(x, 0)  # not the last dimension: stays torch's
        return a, b, c, d, e, f


def test_standalone_float_ops_against_torch() -> None:
    torch.manual_seed(2)
    model = _FloatOps().eval()
    nn.init.normal_(model.norm.weight)
    nn.init.normal_(model.norm.bias)
    x, r = torch.randn(2, 5, 24), torch.randn(2, 5, 24)
    m = torch.where(torch.rand(2, 1, 24) < 0.3, float("-inf"), 0.0)
    m[..., 0] = 0
    prepared = prepare_fx(model, QConfigMapping(), (x, r, m))
    lowered = L.get_backend("numba").lower(convert_to_reference_fx(prepared))
    kinds = _kinds(lowered)
    assert kinds.count(lm.FloatLayerNorm) == 2
    assert kinds.count(lm.FloatSoftmax) == 3
    with torch.no_grad():
        got, want = lowered(x, r, m), model(x, r, m)
    for g, w in zip(got[:2], want[:2], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=LN_ATOL * 4)
    for g, w in zip(got[2:], want[2:], strict=True):
        torch.testing.assert_close(g, w, rtol=SOFTMAX_RTOL, atol=SOFTMAX_ATOL)
    assert torch.equal(got[5], want[5])


class _LinearGelu(nn.Module):
    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.fc = nn.Linear(40, 70)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x), approximate=self.approximate)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_fused_into_dynamic_linear_equals_unfused(approximate: str) -> None:
    torch.manual_seed(3)
    model = _LinearGelu(approximate).eval()
    x = torch.randn(4, 9, 40) * 3
    mapping = QConfigMapping().set_global(default_dynamic_qconfig)
    prepared = prepare_fx(
        model, mapping, (x,), backend_config=L.get_backend("numba").backend_config
    )
    reference = convert_to_reference_fx(prepared)
    backend = L.get_backend("numba")
    fused = backend.lower(reference)
    plain = L.lower_to_kernels(copy.deepcopy(reference), backend.target, _without_float_rules())
    activations = [m.epilogue for m in fused.modules() if isinstance(m, lm.QuantizedDynamicLinear)]
    assert activations == ["gelu" if approximate == "none" else "gelu_tanh"]
    with torch.no_grad():
        got, unfused = fused(x), plain(x)
        pre = plain.get_submodule("fc_dynamic")(x)  # the linear's float output, unfused
    assert torch.all((got - unfused).abs() <= GELU_TOL * pre.abs().clamp(min=1))


class _SdpaLayer(nn.Module):
    """Hugging Face's sdpa attention: q/k/v Linears split into heads, a boolean padding mask,
    ``F.scaled_dot_product_attention`` with an explicit scale, heads merged, output Linear."""

    def __init__(self, hidden: int = 48, heads: int = 4):
        super().__init__()
        self.heads, self.d = heads, hidden // heads
        self.query, self.key, self.value, self.out = (nn.Linear(hidden, hidden) for _ in range(4))

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, self.heads, self.d).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        keep = mask[:, None, None, :].bool()
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=1 / math.sqrt(self.d))
        out: torch.Tensor = self.out(ctx.transpose(1, 2).reshape(b, s, h))
        return out


def _static_pair(
    model: nn.Module, mask: torch.Tensor, g: torch.Generator
) -> tuple[GraphModule, GraphModule]:
    """(reference, lowered) of ``model`` under the static transformer mapping, calibrated on
    four random [B, S, 48] batches drawn from ``g``."""
    backend = L.get_backend("numba")
    shape = (*mask.shape, 48)
    prepared = prepare_fx(
        model, backend.qconfig_mapping(transformer=True), (torch.randn(shape, generator=g), mask),
        backend_config=backend.backend_config,
    )  # fmt: skip
    for _ in range(4):
        prepared(torch.randn(shape, generator=g), mask)
    reference = convert_to_reference_fx(copy.deepcopy(prepared))
    return reference, backend.convert(prepared)


def test_static_sdpa_runs_on_codes_and_matches_the_reference() -> None:
    torch.manual_seed(0)
    model = _SdpaLayer().eval()
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(3, 12)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    reference, lowered = _static_pair(model, mask, g)
    report = L.lowering_report(lowered)
    fused = [what for _, what in report.lowered if what.startswith("kernels.attention")]
    assert fused == ["kernels.attention (dequantize of q, k, v fused, uint8 output)"], str(report)
    assert not report.kept
    modules = dict(lowered.named_modules())
    (node,) = [
        n for n in lowered.graph.nodes
        if n.op == "call_module" and isinstance(modules[n.target], lm.QuantizedAttention)
    ]  # fmt: skip
    # q, k and v are the projections' codes (views), never dequantized float
    assert [(a.op, a.target) for a in node.args[:3]] == [("call_method", "transpose")] * 3
    # the output Linear's step: one attention code apart moves it by at most a few steps
    out_step = float(lowered.out_1.scale)
    for _ in range(3):
        x = torch.randn(3, 12, 48, generator=g)
        with torch.no_grad():
            got, want = lowered(x, mask), reference(x, mask)
        assert float((got - want).abs().max()) <= 2 * out_step + 1e-6
        assert float((got - want).abs().mean()) <= 0.05 * out_step
    # state dict and pickle keep the attention's qparams
    clone = pickle.loads(pickle.dumps(lowered))
    clone.load_state_dict(lowered.state_dict())
    with torch.no_grad():
        assert torch.equal(clone(x, mask), lowered(x, mask))
    bad = dict(lowered.state_dict())
    key = next(k for k in bad if k.endswith("input3_scale"))
    bad[key] = torch.tensor(-1.0, dtype=torch.float64)
    with pytest.raises(L.LoweringError, match="input3_scale"):
        clone.load_state_dict(bad)
    # torch.export sees the custom op, with the same numbers
    exported = torch.export.export(lowered, (x, mask))
    assert "attention" in str(exported.graph)
    with torch.no_grad():
        assert torch.equal(exported.module()(x, mask), lowered(x, mask))


def test_static_layer_norms_read_and_write_codes_with_the_same_bytes() -> None:
    torch.manual_seed(0)
    model = _Encoder().eval()
    reference = _reference(model, L.get_backend("numba").qconfig_mapping(transformer=True))
    fused = L.lower_to_kernels(copy.deepcopy(reference), "generic")
    ln_rules = {"layer_norm reads codes", "layer_norm + quantize"}
    rules = tuple(r for r in L.default_lowering_rules() if r.name not in ln_rules)
    plain = L.lower_to_kernels(copy.deepcopy(reference), "generic", rules=rules)
    norms = [m for m in fused.modules() if isinstance(m, lm.FloatLayerNorm)]
    # each layer: LayerNorm(attention output + x), LayerNorm(FFN output + that): both read the
    # output Linear's float result (its consumers are float, so it is not requantized) and
    # hand codes to the next Linear (the last one only its floats)
    assert len(norms) == 4
    assert sum(m._x_qp is not None for m in norms) == 0
    assert sum(m._codes_qp is not None for m in norms) == 3
    assert _kinds(fused).count(lm.QuantizedLinearFloat) == 4
    kinds = _kinds(fused)
    assert lm.Quantize in _kinds(plain)
    assert kinds.count(lm.Quantize) == _kinds(plain).count(lm.Quantize) - 3
    report = str(L.lowering_report(fused))
    assert "also returns codes" in report
    for seed in (5, 6):
        x, mask = _inputs(seed)
        with torch.no_grad():
            assert torch.equal(fused(x, mask), plain(x, mask))
    exported = torch.export.export(fused, _inputs(7))
    assert "layer_norm_codes" in str(exported.graph)
    with torch.no_grad():
        assert torch.equal(exported.module()(*_inputs(7)), fused(*_inputs(7)))


class _CausalLayer(_SdpaLayer):
    """A decoder's self-attention: ``is_causal=True`` and no mask (Hugging Face's GPT-2 with
    sdpa attention and no padding)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.out(ctx.transpose(1, 2).reshape(b, s, h))
        return out


def test_static_causal_sdpa_runs_on_codes() -> None:
    torch.manual_seed(0)
    model = _CausalLayer().eval()
    g = torch.Generator().manual_seed(2)
    mask = torch.ones(2, 10)
    reference, lowered = _static_pair(model, mask, g)
    cores = [m for m in lowered.modules() if isinstance(m, lm.QuantizedAttention)]
    assert len(cores) == 1
    assert cores[0].causal
    out_step = float(lowered.out_1.scale)
    for _ in range(3):
        x = torch.randn(2, 10, 48, generator=g)
        with torch.no_grad():
            got, want = lowered(x, mask), reference(x, mask)
        assert float((got - want).abs().max()) <= 2 * out_step + 1e-6
    # a change in a later position leaves every earlier output as it was
    with torch.no_grad():
        y = x.clone()
        y[:, 7:] += 1.0
        assert torch.equal(lowered(y, mask)[:, :7], lowered(x, mask)[:, :7])


def test_attention_module_takes_what_the_reference_takes() -> None:
    # 3-D q, k, v (no head dimension), grouped-query heads and a float16 mask: what torch's
    # SDPA accepts, the lowered module computes as the reference does (dequantize, torch's
    # attention, quantize) or on the kernel with the mask widened
    qp = ((0.03, 128), (0.025, 120), (0.02, 131))
    mod = lm.QuantizedAttention(qp, (0.01, 127), None, True, "generic")
    g = torch.Generator().manual_seed(3)

    def codes(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

    def reference(q, k, v, mask, gqa=False):  # type: ignore[no-untyped-def]
        deq = [
            (x.float() - zp) * torch.tensor(s, dtype=torch.float32)
            for x, (s, zp) in zip((q, k, v), qp, strict=True)
        ]
        out = F.scaled_dot_product_attention(*deq, attn_mask=mask, enable_gqa=gqa)
        return torch.clamp(torch.round(out / 0.01) + 127, 0, 255).to(torch.uint8)

    q, k, v = codes(2, 9, 16), codes(2, 11, 16), codes(2, 11, 16)
    keep = torch.rand(2, 9, 11, generator=g) < 0.8
    keep[..., 0] = True
    diff = (mod(q, k, v, keep).int() - reference(q, k, v, keep).int()).abs()
    assert int(diff.max()) <= 1
    q4, k4, v4 = codes(1, 4, 6, 8), codes(1, 2, 6, 8), codes(1, 2, 6, 8)
    diff = (mod(q4, k4, v4, None).int() - reference(q4, k4, v4, None, gqa=True).int()).abs()
    assert int(diff.max()) <= 1
    q4, k4, v4 = codes(1, 2, 6, 8), codes(1, 2, 6, 8), codes(1, 2, 6, 8)
    half = torch.where(torch.rand(1, 1, 6, 6, generator=g) < 0.7, 0.0, -1e4).to(torch.float16)
    assert torch.equal(mod(q4, k4, v4, half), mod(q4, k4, v4, half.float()))


@pytest.mark.parametrize(
    ("codes_in", "codes_out", "other"),
    [
        (True, True, "same"),  # a BERT layer's fused LayerNorm: codes in, floats and codes out
        (True, False, "same"),
        (False, True, None),
        (False, False, "same"),  # float only
        (True, True, "broadcast"),  # a broadcasting residual: the plain path
        (False, True, "half"),  # a float16 residual
    ],
)
def test_layer_norm_array_form_gives_the_forwards_results(codes_in, codes_out, other):
    # the lowered model passes arrays to FloatLayerNorm (ArrayForward): every path of its
    # forward must come out the same, as arrays
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(24, generator=g), torch.randn(24, generator=g)
    mod = lm.FloatLayerNorm(
        w, b, 1e-5, other is not None, "generic",
        in_qparams=(0.05, 120) if codes_in else None,
        out_qparams=(0.03, 110) if codes_out else None,
    )  # fmt: skip
    x = (
        torch.randint(0, 256, (2, 5, 24), dtype=torch.uint8, generator=g)
        if codes_in
        else torch.randn(2, 5, 24, generator=g)
    )
    args = [x]
    if other == "same":
        args.append(torch.randn(2, 5, 24, generator=g))
    elif other == "broadcast":
        args.append(torch.randn(24, generator=g))
    elif other == "half":
        args.append(torch.randn(2, 5, 24, generator=g).half())
    with torch.no_grad():
        want = mod(*args)
        got = mod.forward_arrays(*(a.numpy() for a in args))
    wants = want if isinstance(want, tuple) else (want,)
    gots = got if isinstance(got, tuple) else (got,)
    assert len(gots) == len(wants)
    for g_, w_ in zip(gots, wants, strict=True):
        assert g_.dtype == w_.numpy().dtype
        assert torch.equal(torch.from_numpy(g_), w_)
