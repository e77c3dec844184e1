"""CNN epilogue fusion, squeeze-excite and eval-identity ops, against the unfused lowering.

* A lowered conv / linear / conv + add whose only user is a lookup-table activation runs the
  table in its kernel's epilogue: byte-equal outputs, one module where there were two.
* ``x * sigmoid(fc(pool(x)))``: the per-channel multiply equals ``kernels.mul`` on the
  broadcast tensor, and never builds the broadcast.
* Eval-mode dropout variants, stochastic depth and nn.Identity leave no op behind.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Interpreter

import quantbridge.lowering as L
from quantbridge import kernels as K
from quantbridge.fx_quant import convert_to_reference_fx, prepare_fx
from quantbridge.lowering._modules import (
    QuantizedBinary,
    QuantizedConv,
    QuantizedConvAdd,
    QuantizedLinear,
    QuantizedLookupTable,
)
from quantbridge.qconfig import BackendConfig

NUMBA = [f"numba_{t}" for t in K.available_targets()]
EPILOGUE_RULE = "conv / linear + activation"
CLAMP_RULE = "linear / conv + clamp"
CLAMPS = (nn.ReLU6, nn.Hardtanh, F.relu6, F.hardtanh)
QUANTIZE = torch.ops.quantbridge.quantize_per_tensor.tensor
DEQUANTIZE = torch.ops.quantbridge.dequantize_per_tensor.tensor

# activations as modules or functions; every one is a lookup table after lowering
ACTIVATIONS: dict[str, Callable[[], Callable[[torch.Tensor], torch.Tensor]]] = {
    "relu6": lambda: nn.ReLU6(),
    "hardtanh": lambda: nn.Hardtanh(-1.0, 2.0),
    "clamp": lambda: lambda t: torch.clamp(t, -0.5, 1.0),
    "hardswish": lambda: nn.Hardswish(),
    "hardsigmoid": lambda: nn.Hardsigmoid(),
    "silu": lambda: nn.SiLU(),
    "sigmoid": lambda: nn.Sigmoid(),
    "gelu": lambda: nn.GELU(),
    "tanh": lambda: nn.Tanh(),
    "leaky_relu": lambda: nn.LeakyReLU(0.1),
    "elu": lambda: nn.ELU(),
    "mish": lambda: nn.Mish(),
    # relu(x + 0.5): a table named "add 0.5 + relu" (the fused module's name is sanitized)
    "add_scalar_relu": lambda: lambda t: torch.relu(t + 0.5),
}


class LayerAct(nn.Module):
    """``act(layer(x))`` then a 1x1 conv / linear, so the activation's output is quantized."""

    def __init__(self, layer: str, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.kind = layer
        self.act = act
        if layer == "conv2d":
            self.layer: nn.Module = nn.Conv2d(6, 16, 3, padding=1)
        elif layer == "depthwise":
            self.layer = nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=6)
        elif layer == "grouped":
            self.layer = nn.Conv2d(6, 12, 3, padding=1, groups=2)
        elif layer == "conv1d":
            self.layer = nn.Conv1d(6, 16, 3, padding=1)
        elif layer == "linear":
            self.layer = nn.Linear(6, 24)
        elif layer == "conv_add":
            self.layer = nn.Conv2d(6, 16, 1)
            self.skip = nn.Conv2d(6, 16, 1)
        out_ch = {"depthwise": 6, "grouped": 12, "linear": 24}.get(layer, 16)
        if layer == "conv1d":
            self.head: nn.Module = nn.Conv1d(out_ch, 8, 1)
        elif layer == "linear":
            self.head = nn.Linear(out_ch, 8)
        else:
            self.head = nn.Conv2d(out_ch, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "conv1d":
            x = x.flatten(2)
        elif self.kind == "linear":
            x = x.permute(0, 2, 3, 1)
        y = self.layer(x)
        if self.kind == "conv_add":
            y = y + self.skip(x)
        return self.head(self.act(y))


def _inputs(seed: int) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 6, 7, 7, generator=g) * 2,)


def _reference(
    model: nn.Module, backend: L.Backend, config: BackendConfig | None = None
) -> GraphModule:
    torch.manual_seed(0)
    model = model.eval()
    config = backend.backend_config if config is None else config
    prepared = prepare_fx(model, backend.qconfig_mapping(), _inputs(0), backend_config=config)
    with torch.no_grad():
        for i in range(4):
            prepared(*_inputs(100 + i))
    return convert_to_reference_fx(copy.deepcopy(prepared), backend_config=config)


def _sharing_clamps(backend: L.Backend) -> BackendConfig:
    """``backend``'s config without its clamp-after-layer entries: a clamp shares the layer's
    observer, as in torch.ao's configs, and is lowered as a table after it."""
    config = BackendConfig("sharing_clamps")
    for entry in backend.backend_config.configs:
        if not (isinstance(entry.pattern, tuple) and entry.pattern[-1] in CLAMPS):
            config.set_backend_pattern_config(entry)
    assert len(config.configs) < len(backend.backend_config.configs)
    return config


def _without(rule_name: str) -> list[L.LoweringRule]:
    rules = [r for r in L.default_lowering_rules() if r.name != rule_name]
    assert len(rules) == len(L.default_lowering_rules()) - 1
    return rules


def _modules(gm: GraphModule) -> Counter[type]:
    return Counter(
        type(gm.get_submodule(str(n.target))) for n in gm.graph.nodes if n.op == "call_module"
    )


@pytest.mark.parametrize("backend_name", NUMBA)
@pytest.mark.parametrize(
    "layer", ["conv2d", "depthwise", "grouped", "conv1d", "linear", "conv_add"]
)
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_activation_runs_in_the_epilogue_with_the_same_bytes(backend_name, layer, act):
    backend = L.get_backend(backend_name)
    torch.manual_seed(1)
    reference = _reference(LayerAct(layer, ACTIVATIONS[act]()), backend, _sharing_clamps(backend))
    unfused = L.lower_to_kernels(
        copy.deepcopy(reference), backend.target, rules=_without(EPILOGUE_RULE)
    )
    fused = backend.lower(copy.deepcopy(reference))
    before, after = _modules(unfused), _modules(fused)
    # one module where there were two: the table is gone into the conv / linear
    assert before[QuantizedLookupTable] == 1
    assert after[QuantizedLookupTable] == 0
    assert sum(after.values()) == sum(before.values()) - 1
    owner = [
        m
        for m in fused.modules()
        if isinstance(m, (QuantizedConv, QuantizedLinear)) and m.activation
    ]
    assert len(owner) == 1
    assert isinstance(owner[0], QuantizedConvAdd) == (layer == "conv_add")
    for seed in range(3):
        x = _inputs(seed)
        assert torch.equal(fused(*x), unfused(*x))
    report = L.lowering_report(fused)
    assert [w for _, w in report.lowered if "in the epilogue" in w]
    assert {n for n, _ in report.lowered} <= {n.name for n in fused.graph.nodes}


@pytest.mark.parametrize("layer", ["conv2d", "conv_add", "linear"])
def test_fused_module_state_dict_export_and_repr(layer):
    backend = L.get_backend("numba")
    torch.manual_seed(1)
    fused = backend.lower(_reference(LayerAct(layer, nn.Hardswish()), backend))
    torch.manual_seed(2)
    other = backend.lower(_reference(LayerAct(layer, nn.Hardswish()), backend))
    x = _inputs(5)
    assert not torch.equal(other(*x), fused(*x))
    other.load_state_dict(fused.state_dict())
    assert torch.equal(other(*x), fused(*x))
    keys = [k for k in fused.state_dict() if k.endswith("activation_table")]
    assert len(keys) == 1
    bad = fused.state_dict()
    bad[keys[0].replace("table", "zero_point")] = torch.tensor(300)
    with pytest.raises(L.LoweringError, match="activation_zero_point"):
        copy.deepcopy(fused).load_state_dict(bad)
    exported = torch.export.export(fused, x)
    assert torch.equal(exported.module()(*x), fused(*x))
    (owner,) = [m for m in fused.modules() if getattr(m, "activation", None)]
    assert "Hardswish (lookup table in the epilogue)" in repr(owner)


def test_a_conv_with_other_users_keeps_its_activation_separate():
    class TwoUsers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(6, 8, 1)
            self.act = nn.Hardswish()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return self.act(y) + y

    backend = L.get_backend("numba")
    fused = backend.lower(_reference(TwoUsers(), backend))
    assert _modules(fused)[QuantizedLookupTable] == 1
    assert not [m for m in fused.modules() if getattr(m, "activation", None)]


CLAMPED: dict[str, Callable[[], Callable[[torch.Tensor], torch.Tensor]]] = {
    "ReLU6": lambda: nn.ReLU6(inplace=True),
    "Hardtanh": lambda: nn.Hardtanh(-1.0, 2.0),
    "relu6": lambda: F.relu6,
    "hardtanh": lambda: lambda t: F.hardtanh(t, -0.5, 1.0),
}


def _with_layer_output_quantized(reference: GraphModule) -> GraphModule:
    """``reference`` with the clamp's quantize and dequantize also between the layer and the
    clamp: the form a clamp sharing its layer's qparams has."""
    gm = copy.deepcopy(reference)
    graph = gm.graph
    clamp = next(
        n
        for n in graph.nodes
        if (n.op == "call_module" and isinstance(gm.get_submodule(n.target), CLAMPS[:2]))
        or (n.op == "call_function" and n.target in CLAMPS[2:])
    )
    (quantize,) = clamp.users
    (dequantize,) = [u for u in quantize.users if u.target is DEQUANTIZE]
    with graph.inserting_before(clamp):
        qparams = [graph.get_attr(a.target) for a in quantize.args[1:3]]
        codes = graph.call_function(
            quantize.target, (clamp.args[0], *qparams, *quantize.args[3:]), quantize.kwargs
        )
        value = graph.call_function(
            DEQUANTIZE, (codes, *qparams, *dequantize.args[3:]), dequantize.kwargs
        )
    clamp.update_arg(0, value)
    graph.lint()
    gm.recompile()
    return gm


@pytest.mark.parametrize("backend_name", NUMBA)
@pytest.mark.parametrize("layer", ["conv2d", "depthwise", "grouped", "conv1d", "linear"])
@pytest.mark.parametrize("clamp", sorted(CLAMPED))
def test_a_clamp_after_a_layer_is_observed_once_and_runs_in_its_epilogue(
    backend_name, layer, clamp
):
    backend = L.get_backend(backend_name)
    torch.manual_seed(1)
    reference = _reference(LayerAct(layer, CLAMPED[clamp]()), backend)
    layer_node = next(n for n in reference.graph.nodes if n.target == "layer")
    # no quantize between the layer and the clamp: one observer, after the clamp
    (clamp_node,) = layer_node.users
    assert [u.target for u in clamp_node.users] == [QUANTIZE]
    (quantize,) = clamp_node.users
    scale = float(getattr(reference, quantize.args[1].target))
    low, high = {"ReLU6": (0, 6), "Hardtanh": (-1, 2), "relu6": (0, 6), "hardtanh": (-0.5, 1)}[
        clamp
    ]
    assert scale <= (high - low) / 127 + 1e-6  # codes spent on the clamp's range only
    # quantize(clamp(y)) equals quantize(clamp(dequantize(quantize(y)))): the same model
    # with the layer's output quantized first gives the same floats, and its unfused
    # lowering (layer, then a table) the same bytes as the one fused module
    requantized = _with_layer_output_quantized(reference)
    unfused = L.lower_to_kernels(requantized, backend.target, rules=_without(EPILOGUE_RULE))
    fused = backend.lower(copy.deepcopy(reference))
    assert _modules(unfused)[QuantizedLookupTable] == 1
    assert _modules(fused)[QuantizedLookupTable] == 0
    (owner,) = [m for m in fused.modules() if getattr(m, "activation", None)]
    activation_qparams = (float(owner.activation_scale), int(owner.activation_zero_point))
    assert owner.output_qparams == activation_qparams
    with torch.no_grad():
        for seed in range(3):
            x = _inputs(seed)
            assert torch.equal(requantized(*x), reference(*x))
            assert torch.equal(fused(*x), unfused(*x))
    assert [w for _, w in L.lowering_report(fused).lowered if "in the epilogue" in w]


def test_a_clamp_after_a_layer_with_other_users_shares_nothing():
    class TwoUsers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(6, 8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return F.relu6(y) + y

    backend = L.get_backend("numba")
    reference = _reference(TwoUsers(), backend)
    conv = next(n for n in reference.graph.nodes if n.target == "conv")
    assert [u.target for u in conv.users] == [QUANTIZE]
    lowered = backend.lower(reference)
    assert _modules(lowered)[QuantizedLookupTable] == 1


def test_the_support_table_lists_the_fusion_rule():
    rules = {r.name: r for r in L.default_lowering_rules()}
    assert rules[EPILOGUE_RULE].kind == "fusion"
    text = L.get_backend("numba").support_table()
    assert "activation" in text
    assert "lut=" in text


# --- squeeze-excite --------------------------------------------------------------------------


class SqueezeExcite(nn.Module):
    def __init__(self, gate: nn.Module, scale_first: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(6, 16, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(16, 4, 1)
        self.fc2 = nn.Conv2d(4, 16, 1)
        self.gate = gate
        self.scale_first = scale_first
        self.head = nn.Conv2d(16, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        s = self.gate(self.fc2(F.relu(self.fc1(self.pool(x)))))
        y = s * x if self.scale_first else x * s
        return self.head(y)


def _mul_calls(gm: GraphModule, *args: torch.Tensor) -> list[tuple[QuantizedBinary, tuple]]:
    seen: list[tuple[QuantizedBinary, tuple]] = []

    class Recorder(Interpreter):
        def call_module(self, target, args, kwargs):  # type: ignore[no-untyped-def]
            mod = self.module.get_submodule(str(target))
            out = super().call_module(target, args, kwargs)
            if type(mod) is QuantizedBinary and mod.kind.startswith("mul"):
                seen.append((mod, (*args, out)))
            return out

    Recorder(gm).run(*args)
    return seen


@pytest.mark.parametrize("backend_name", NUMBA)
@pytest.mark.parametrize("gate", ["sigmoid", "hardsigmoid"])
@pytest.mark.parametrize("scale_first", [True, False])
def test_squeeze_excite_multiplies_per_channel_without_the_broadcast(
    backend_name, gate, scale_first, monkeypatch
):
    backend = L.get_backend(backend_name)
    gate_mod = nn.Sigmoid() if gate == "sigmoid" else nn.Hardsigmoid()
    lowered = backend.lower(_reference(SqueezeExcite(gate_mod, scale_first), backend))
    x = _inputs(3)
    calls = _mul_calls(lowered, *x)
    assert len(calls) == 1
    mod, (a, b, out) = calls[0]
    # exactly kernels.mul on the broadcast operands (the old path)
    a_full, b_full = torch.broadcast_tensors(a, b)
    want = K.mul(
        a_full.contiguous().numpy(), mod.input_qparams, b_full.contiguous().numpy(),
        mod.other_qparams, mod.output_qparams,
    )  # fmt: skip
    assert torch.equal(out, torch.from_numpy(np.ascontiguousarray(want)))
    # and it ran as a prepared mul_channels, never broadcasting or calling kernels.mul
    used: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real = K.PreparedMulChannels.__call__

    def spy(self, a, b):  # type: ignore[no-untyped-def]
        used.append((a.shape, b.shape))
        return real(self, a, b)

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("kernels.mul called on a broadcast tensor")

    monkeypatch.setattr(K.PreparedMulChannels, "__call__", spy)
    monkeypatch.setattr(K, "mul", refuse)
    monkeypatch.setattr(torch, "broadcast_tensors", refuse)
    assert torch.equal(lowered(*x), lowered(*x))
    assert len(used) == 2
    assert all((1, 1) in (a[2:], b[2:]) for a, b in used)


# --- identity in eval ------------------------------------------------------------------------


def stochastic_depth(
    input: torch.Tensor, p: float, mode: str, training: bool = True
) -> torch.Tensor:
    """torchvision.ops.stochastic_depth's contract: identity when not training."""
    if not training or p == 0.0:
        return input
    keep = torch.empty([input.shape[0]] + [1] * (input.ndim - 1)).bernoulli_(1.0 - p)
    return input * keep / (1.0 - p)


torch.fx.wrap("stochastic_depth")  # as torchvision does: traced models call it


class StochasticDepth(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stochastic_depth(x, self.p, "row", self.training)


class Identities(nn.Module):
    def __init__(self, with_identities: bool) -> None:
        super().__init__()
        self.on = with_identities
        self.conv1 = nn.Conv2d(6, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv3 = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 4)
        self.drop = nn.Dropout(0.3)
        self.drop2d = nn.Dropout2d(0.2)
        self.alpha = nn.AlphaDropout(0.1)
        self.feature_alpha = nn.FeatureAlphaDropout(0.1)
        self.ident = nn.Identity()
        self.sd = StochasticDepth(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(x)
        if self.on:
            y = self.drop2d(self.ident(y))
            y = F.dropout(y, 0.5, self.training)
        y = self.conv2(y)
        if self.on:
            y = self.sd(self.alpha(self.drop(y)))  # drop: its own observer, same values
            y = F.dropout2d(F.alpha_dropout(y, 0.1, False), 0.3, training=False)
        y = self.conv3(y) + y
        if self.on:
            y = self.feature_alpha(F.feature_alpha_dropout(y, 0.2, False))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


@pytest.mark.parametrize("backend_name", NUMBA)
def test_eval_identities_leave_nothing_behind(backend_name):
    backend = L.get_backend(backend_name)
    torch.manual_seed(4)
    with_ids = Identities(True)
    without = copy.deepcopy(with_ids)
    without.on = False
    ref = _reference(with_ids, backend)
    ref_plain = _reference(without, backend)
    found = {getattr(n.target, "__name__", str(n.target)) for n in ref.graph.nodes}
    assert "stochastic_depth" in found  # the graph really calls it (fx-wrapped)
    lowered = backend.lower(copy.deepcopy(ref))
    plain = backend.lower(copy.deepcopy(ref_plain))
    report = L.lowering_report(lowered)
    assert report.kept == []
    removed = " ".join(w for _, w in report.removed)
    for name in ("Dropout2d", "Identity", "AlphaDropout", "FeatureAlphaDropout", "Dropout ",
                 "dropout", "stochastic_depth", "alpha_dropout", "feature_alpha_dropout",
                 "dropout2d"):  # fmt: skip
        assert name in removed + " ", name
    # the same graph as the model without them: same modules, no requantize, same bytes
    assert _modules(lowered) == _modules(plain)
    calls = [n for n in lowered.graph.nodes if n.op == "call_function"]
    assert all(n.target is torch.flatten for n in calls)
    for seed in range(3):
        x = _inputs(seed)
        assert torch.equal(lowered(*x), plain(*x))


def test_training_mode_dropout_is_not_removed():
    class TrainDrop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(6, 8, 1)
            self.head = nn.Conv2d(8, 4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(F.dropout(self.conv(x), 0.5, True))

    backend = L.get_backend("numba")
    lowered = backend.lower(_reference(TrainDrop(), backend))
    report = L.lowering_report(lowered)
    assert not report.removed
    assert any(F.dropout is n.target for n in lowered.graph.nodes)


def test_differing_qparams_requantize_once():
    class Drop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(6, 8, 1)
            self.drop = nn.Dropout(0.1)
            self.head = nn.Conv2d(8, 4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.drop(self.conv(x)))

    backend = L.get_backend("numba")
    ref = _reference(Drop(), backend)
    # give the dropout's own output observer other qparams than the conv's
    quantizes = [
        n for n in ref.graph.nodes
        if n.op == "call_function" and "quantize_per_tensor" in str(n.target)
        and isinstance(n.args[0], torch.fx.Node) and n.args[0].target == "drop"
    ]  # fmt: skip
    assert len(quantizes) == 1
    scale = getattr(ref, str(quantizes[0].args[1].target))
    scale.mul_(1.5)
    lowered = backend.lower(copy.deepcopy(ref))
    names = [type(m).__name__ for m in lowered.modules()]
    assert "Dropout" not in names
    assert names.count("Requantize") == 1


def test_float_eval_identities_of_a_dynamic_model_are_removed():
    class Block(nn.Module):
        def __init__(self, on: bool) -> None:
            super().__init__()
            self.on = on
            self.fc1 = nn.Linear(16, 32)
            self.drop = nn.Dropout(0.1)
            self.fc2 = nn.Linear(32, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.tanh(self.fc1(x))
            skip = x[:, :8]
            if self.on:
                y = F.dropout(self.drop(y), 0.2, False)
                skip = F.dropout(skip, 0.5, self.training)
            return self.fc2(y) + skip

    backend = L.get_backend("numba")
    x = torch.randn(4, 16)

    def lower(model: nn.Module, train_dropout: bool = False) -> GraphModule:
        prepared = prepare_fx(
            model,
            backend.qconfig_mapping(dynamic=True),
            (x,),
            backend_config=backend.backend_config,
        )
        if train_dropout:
            prepared.get_submodule("drop").train()
        return backend.convert(prepared)

    torch.manual_seed(0)
    with_drops = Block(True).eval()
    without = copy.deepcopy(with_drops)
    without.on = False
    lowered = lower(copy.deepcopy(with_drops))
    removed = " ".join(w for _, w in L.lowering_report(lowered).removed)
    assert "Dropout (identity in eval, float)" in removed
    assert "dropout (identity in eval, float)" in removed
    assert not [m for m in lowered.modules() if isinstance(m, nn.Dropout)]
    assert not [n for n in lowered.graph.nodes if n.target is F.dropout]
    with torch.no_grad():
        assert torch.equal(lowered(x), lower(copy.deepcopy(without))(x))
    # a Dropout module in training mode is not an identity: kept
    trained = lower(copy.deepcopy(with_drops), train_dropout=True)
    assert [m.training for m in trained.modules() if isinstance(m, nn.Dropout)] == [True]
