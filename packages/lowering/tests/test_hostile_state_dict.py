"""Lowered models against tampered state dicts, and lowered models pickled whole.

Every tampered entry must either be the genuine value (then the model loads it and gives
exactly the original outputs) or be refused with a LoweringError naming its full key, leaving
the model's outputs unchanged. Nothing is ever cast.
"""

# No ``from __future__ import annotations`` here: the pickling models' forward annotations
# must be real types (torch.fx keeps string annotations as text, which pickle refuses).

import copy
import functools
import io
import math
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

if str(Path(__file__).parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))
import lowering_zoo as zoo

import quantbridge.lowering as L
from quantbridge import kernels as K
from quantbridge.fx_quant import convert_to_reference_fx, prepare_fx

# conv (+ relu), pools and linear; conv + add (QuantizedConvAdd) and mul; lookup tables;
# dynamic linears; embeddings (uint8 rows with float32 row scales and biases)
CASES = ["conv_bn_cnn", "residual_add_mul", "activations", "transformer_dynamic", "embeddings"]
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)


class Lowered:
    """One lowered model, its inputs, genuine state dict and outputs."""

    def __init__(self, name: str) -> None:
        self.case = next(c for c in zoo.ALL_CASES if c.name == name)
        backend = L.get_backend("numba")
        self.model = backend.lower(zoo.reference_model(self.case, backend, seed=0))
        self.state = {k: v.clone() for k, v in self.model.state_dict().items()}
        # the entries of lowered modules (a float module left in the model, e.g. a
        # LayerNorm, loads by torch's own rules)
        self.lowered_keys = sorted(
            k
            for k in self.state
            if isinstance(self.model.get_submodule(k.rpartition(".")[0]), L.LoweredModule)
        )
        self.inputs = self.case.inputs(3)
        self.outputs = self.run()

    def run(self) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            out = self.model(*self.inputs)
        return out if isinstance(out, tuple) else (out,)

    def assert_original_outputs(self) -> None:
        for got, want in zip(self.run(), self.outputs, strict=True):
            assert torch.equal(got, want)

    def load_tampered(self, key: str, value: torch.Tensor, **kwargs: Any) -> None:
        tampered = dict(self.state)
        tampered[key] = value
        self.model.load_state_dict(tampered, **kwargs)


@functools.cache
def lowered(name: str) -> Lowered:
    return Lowered(name)


def _kind(key: str) -> str:
    """What a buffer holds, from its name (the rules the lowered modules apply)."""
    name = key.rsplit(".", 1)[-1]
    if name.endswith("scale"):
        return "scale"
    if name == "weight_zero_point":
        return "weight_zero_point"
    if name.endswith("zero_point"):
        return "zero_point"
    if name.endswith("bias"):
        return "bias"
    return "codes"  # weight / table: every value of the dtype is valid


BAD_VALUES: dict[str, list[float]] = {
    "scale": [math.nan, math.inf, -math.inf, 0.0, -0.5, 1e-40, 1e-45, 5e-324, 4e38],
    "zero_point": [-1, 256, 1000, -(2**40)],
    "weight_zero_point": [-129, 128, 255],
    "bias": [math.nan, math.inf, -math.inf],
}


def _with_value(value: torch.Tensor, index: int, bad: float) -> torch.Tensor:
    """``value`` with element ``index`` set to ``bad`` (infinity where the dtype overflows:
    a float32 row scale cannot hold 4e38)."""
    broken = value.clone()
    try:
        broken.view(-1)[index] = bad
    except RuntimeError:
        broken.view(-1)[index] = math.inf
    return broken


def _expect_refused(lm: Lowered, key: str, value: torch.Tensor, *words: str) -> str:
    with pytest.raises(L.LoweringError) as info:
        lm.load_tampered(key, value)
    message = str(info.value)
    assert f"'{key}'" in message
    for word in words:
        assert word in message, message
    lm.assert_original_outputs()
    return message


# -- the reported cases ------------------------------------------------------------------------


def test_int32_weight_is_refused_not_wrapped() -> None:
    lm = lowered("conv_bn_cnn")
    weight = lm.state["conv1_1.weight"].to(torch.int32)
    weight.view(-1)[0] = 200  # would become -56 as int8
    _expect_refused(
        lm, "conv1_1.weight", weight, "expected a torch.int8 tensor of shape (8, 3, 3, 3)",
        "found torch.int32 of shape (8, 3, 3, 3)", "never cast",
    )  # fmt: skip


def test_float_weight_is_refused_not_truncated() -> None:
    lm = lowered("conv_bn_cnn")
    weight = torch.full(lm.state["fc_1.weight"].shape, 0.5)
    _expect_refused(lm, "fc_1.weight", weight, "expected a torch.int8", "found torch.float32")


def test_subnormal_output_scale_is_refused() -> None:
    lm = lowered("conv_bn_cnn")
    message = _expect_refused(
        lm, "conv1_1.scale", torch.tensor(1e-45, dtype=torch.float64), "normal in float32"
    )
    assert "found value = 1e-45" in message


def test_the_first_bad_channel_is_named() -> None:
    lm = lowered("conv_bn_cnn")
    scales = lm.state["conv2_1.weight_scale"].clone()
    scales[3] = math.nan
    scales[7] = -1.0
    message = _expect_refused(lm, "conv2_1.weight_scale", scales)
    assert "found value[3] = nan (2 bad values)" in message
    zero_points = lm.state["conv2_1.weight_zero_point"].clone()
    zero_points[5] = 300
    message = _expect_refused(lm, "conv2_1.weight_zero_point", zero_points, "[-128, 127]")
    assert "found value[5] = 300" in message


# -- every entry of every model, each way of breaking it ----------------------------------------


def _broken_versions(value: torch.Tensor, kind: str) -> list[torch.Tensor]:
    versions = [
        value.to(torch.int32 if value.dtype != torch.int32 else torch.int64),
        value.to(torch.float32 if value.dtype != torch.float32 else torch.float64),
        value.reshape(1, *value.shape),  # an extra dim
        torch.cat([value.reshape(-1), value.reshape(-1)[:1]]),  # one more element
    ]
    if value.numel() > 1:
        versions.append(value.reshape(-1)[1:])  # one fewer
    for bad in BAD_VALUES.get(kind, []):
        versions.append(_with_value(value, value.numel() - 1, bad))
    return versions


@pytest.mark.parametrize("name", CASES)
def test_every_entry_is_checked(name: str) -> None:
    lm = lowered(name)
    kinds = set()
    assert len(lm.lowered_keys) >= 8
    for key in lm.lowered_keys:
        value = lm.state[key]
        kinds.add(_kind(key))
        for broken in _broken_versions(value, _kind(key)):
            _expect_refused(lm, key, broken)
    assert "scale" in kinds


def test_conv_add_and_binary_operand_qparams_are_checked() -> None:
    lm = lowered("residual_add_mul")
    keys = [k for k in lm.state if k.endswith(("input2_scale", "add_scale"))]
    assert any(k.endswith("add_scale") for k in keys)  # a fused conv + add is in the model
    for key in keys:
        _expect_refused(lm, key, torch.tensor(0.0, dtype=torch.float64), "found value = 0.0")


def test_non_tensor_entry_is_refused() -> None:
    lm = lowered("conv_bn_cnn")
    _expect_refused(lm, "fc_1.scale", 0.1, "expected a tensor, found float")  # type: ignore[arg-type]


# -- random tampering (Hypothesis) ---------------------------------------------------------------

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.float32, torch.float64]  # fmt: skip


@st.composite
def tamperings(draw: st.DrawFn) -> tuple[str, str, torch.Tensor]:
    name = draw(st.sampled_from(CASES))
    lm = lowered(name)
    key = draw(st.sampled_from(lm.lowered_keys))
    value = lm.state[key]
    how = draw(st.sampled_from(["dtype", "shape", "value"]))
    if how == "dtype":
        return name, key, value.to(draw(st.sampled_from(DTYPES)))
    if how == "shape":
        shape = list(value.shape)
        change = draw(st.sampled_from(["same", "unsqueeze", "flatten", "grow", "shrink"]))
        if change == "unsqueeze":
            return name, key, value.unsqueeze(draw(st.integers(0, value.dim())))
        if change == "flatten":  # the same shape for 1-D entries
            return name, key, value.reshape(-1)
        if change in ("grow", "shrink") and shape:
            dim = draw(st.integers(0, len(shape) - 1))
            if change == "grow":
                extra = value.narrow(dim, 0, 1)
                return name, key, torch.cat([value, extra], dim)
            if shape[dim] > 1:
                return name, key, value.narrow(dim, 0, shape[dim] - 1)
        return name, key, value.clone()
    bad = BAD_VALUES.get(_kind(key))
    if not bad:  # weight codes, lookup tables: every value is valid, so the genuine one
        return name, key, value.clone()
    index = draw(st.integers(0, value.numel() - 1))
    return name, key, _with_value(value, index, draw(st.sampled_from(bad)))


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(tamperings())
def test_random_tampering_loads_identically_or_is_refused_by_key(
    tampering: tuple[str, str, torch.Tensor],
) -> None:
    name, key, value = tampering
    lm = lowered(name)
    genuine = _identical(value, lm.state[key])
    if genuine:  # must load
        lm.load_tampered(key, value)
    else:
        with pytest.raises(L.LoweringError, match=re.escape(f"'{key}'")):
            lm.load_tampered(key, value)
    lm.assert_original_outputs()


# -- genuine state dicts keep loading ------------------------------------------------------------


@pytest.mark.parametrize("name", ["conv_bn_cnn", "transformer_dynamic"])
def test_strict_false_loads_a_partial_state_dict_and_still_checks_it(name: str) -> None:
    case = next(c for c in zoo.ALL_CASES if c.name == name)
    backend = L.get_backend("numba")
    target = backend.lower(zoo.reference_model(case, backend, seed=0))
    base = {k: v.clone() for k, v in target.state_dict().items()}
    other = backend.lower(zoo.reference_model(case, backend, seed=1))
    # one lowered weighted module's entries, from the other calibration
    first = next(k for k in base if k.endswith(".weight_scale")).rsplit(".", 1)[0]
    part = {k: v for k, v in other.state_dict().items() if k.startswith(first + ".")}
    x = case.inputs(1)[0]
    with torch.no_grad():
        before = target(x)
    result = target.load_state_dict(part, strict=False)
    assert not result.unexpected_keys
    assert len(result.missing_keys) == len(base) - len(part)
    for key, value in target.state_dict().items():
        assert torch.equal(value, part[key] if key in part else base[key]), key
    # the loaded module computes with the new weights (repacked), not the old ones
    with torch.no_grad():
        assert not torch.equal(target(x), before)
    bad = dict(part)
    bad[first + ".weight_scale"] = part[first + ".weight_scale"].float()
    with pytest.raises(L.LoweringError, match=rf"'{first}\.weight_scale'"):
        target.load_state_dict(bad, strict=False)


def test_assign_true_loads_genuine_and_refuses_tampered() -> None:
    lm = lowered("conv_bn_cnn")
    fresh = {k: v.clone() for k, v in lm.state.items()}
    lm.model.load_state_dict(fresh, assign=True)
    assert lm.model.get_buffer("conv1_1.weight") is fresh["conv1_1.weight"]
    lm.assert_original_outputs()
    with pytest.raises(L.LoweringError, match=re.escape("'conv1_1.zero_point'")):
        lm.load_tampered("conv1_1.zero_point", torch.tensor(256), assign=True)
    lm.model.load_state_dict({k: v.clone() for k, v in lm.state.items()})
    lm.assert_original_outputs()


# -- pickling the whole model --------------------------------------------------------------------


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn(self.conv1(x)))
        y = self.pool(F.relu(self.conv2(y)) + y)
        return self.fc(F.adaptive_avg_pool2d(y, 1).flatten(1))


class SmallMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


PICKLE_MODELS = {"cnn": (SmallCNN, (2, 3, 10, 10)), "mlp": (SmallMLP, (5, 12))}


def _lower_for(model_name: str, backend_name: str) -> tuple[nn.Module, torch.Tensor]:
    factory, shape = PICKLE_MODELS[model_name]
    torch.manual_seed(0)
    backend = L.get_backend(backend_name)
    example = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    prepared = prepare_fx(
        factory().eval(), backend.qconfig_mapping(), (example,),
        backend_config=backend.backend_config,
    )  # fmt: skip
    with torch.no_grad():
        for seed in range(3):
            prepared(torch.randn(*shape, generator=torch.Generator().manual_seed(10 + seed)))
    reference = convert_to_reference_fx(prepared, backend_config=backend.backend_config)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    return backend.lower(reference), x


def _round_trips(model: nn.Module) -> dict[str, nn.Module]:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return {
        "torch.save": torch.load(buf, weights_only=False),
        "pickle": pickle.loads(pickle.dumps(model)),
        "deepcopy": copy.deepcopy(model),
    }


@pytest.mark.parametrize("target", K.available_targets())
@pytest.mark.parametrize("model_name", list(PICKLE_MODELS))
def test_whole_model_pickles_and_gives_identical_outputs(model_name: str, target: str) -> None:
    model, x = _lower_for(model_name, f"numba_{target}")
    lowered_modules = [m for m in model.modules() if isinstance(m, L.LoweredModule)]
    assert any(hasattr(m, "_packed") for m in lowered_modules)
    with torch.no_grad():
        want = model(x)
    for how, copy_ in _round_trips(model).items():
        assert copy_ is not model
        with torch.no_grad():
            assert torch.equal(copy_(x), want), how
        packed = [m for m in copy_.modules() if hasattr(m, "_packed")]
        assert packed, how  # rebuilt on unpickling
        assert all(m.target == target for m in packed), how
        # the copy still refuses tampered state dicts, and loading it leaves the original alone
        state = copy_.state_dict()
        key = next(k for k in state if k.endswith(".weight_scale"))
        tampered = dict(state)
        tampered[key] = state[key].float()
        with pytest.raises(L.LoweringError, match=re.escape(f"'{key}'")):
            copy_.load_state_dict(tampered)
        state[key] = state[key] * 2
        copy_.load_state_dict(state)
        with torch.no_grad():
            assert not torch.equal(copy_(x), want), how
            assert torch.equal(model(x), want), how


def test_pickle_leaves_out_the_packed_layout() -> None:
    model, _ = _lower_for("mlp", "numba")
    for module in model.modules():
        if isinstance(module, L.LoweredModule) and hasattr(module, "_packed"):
            assert "_packed" not in module.__getstate__()
            assert "weight" in module.__getstate__()["_buffers"]


@pytest.mark.parametrize("model_name", list(PICKLE_MODELS))
def test_a_model_saved_where_a_better_target_ran_loads_and_runs_here(
    model_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saved on a CPU with a better kernel target, loaded where numba compiles for plain
    x86-64 (numba's own CPU settings): each lowered module repacks for the best target
    there, says so, and computes the same bytes."""
    from numba.core import config

    if K.best_target() == "generic":
        pytest.skip("this CPU runs only the generic target")
    model, x = _lower_for(model_name, "numba")
    with torch.no_grad():
        want = model(x)
    buf = io.BytesIO()
    torch.save(model, buf)
    monkeypatch.setattr(config, "CPU_NAME", "x86-64")
    monkeypatch.setattr(config, "CPU_FEATURES", "")
    assert K.available_targets() == ["generic"]
    buf.seek(0)
    with pytest.warns(RuntimeWarning, match="repacked for 'generic'"):
        loaded = torch.load(buf, weights_only=False)
    lowered = [m for m in loaded.modules() if isinstance(m, L.LoweredModule)]
    assert lowered
    assert {m.target for m in lowered} == {"generic"}
    with torch.no_grad():
        assert torch.equal(loaded(x), want)
