"""Lowered models: state_dict save/load (weights_only) and torch.export via the custom ops."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

if str(Path(__file__).parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))
import lowering_zoo as zoo

import quantbridge.lowering as L
from quantbridge.lowering import _custom_ops

CASES = ["conv_bn_cnn", "residual_add_mul", "activations", "pools", "matmul", "shapes_cat",
         "depthwise", "conv1d", "transformer_dynamic", "embeddings"]  # fmt: skip


def _case(name: str) -> zoo.Case:
    return next(c for c in zoo.ALL_CASES if c.name == name)


def _as_tuple(out: object) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)  # type: ignore[return-value]


@pytest.mark.parametrize("name", ["conv_bn_cnn", "linear_relu_mlp", "transformer_dynamic",
                                  "embeddings", "activations"])  # fmt: skip
def test_state_dict_round_trip_repacks_weights(name: str) -> None:
    case = _case(name)
    backend = L.get_backend("numba")
    source = backend.lower(zoo.reference_model(case, backend, seed=0))
    # same architecture, other weights and qparams: loading must replace all of them
    target = backend.lower(zoo.reference_model(case, backend, seed=1))
    buf = io.BytesIO()
    torch.save(source.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    for key, value in state.items():
        assert isinstance(value, torch.Tensor), key
        assert value.dtype in (torch.uint8, torch.int8, torch.int64, torch.float32,
                               torch.float64, torch.int32), (key, value.dtype)  # fmt: skip
    inputs = case.inputs(3)
    with torch.no_grad():
        before = _as_tuple(target(*inputs))
        want = _as_tuple(source(*inputs))
    assert any(not torch.equal(a, b) for a, b in zip(before, want, strict=True))
    target.load_state_dict(state)
    with torch.no_grad():
        got = _as_tuple(target(*inputs))
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


def test_state_dict_holds_int8_weights_and_qparams() -> None:
    backend = L.get_backend("numba")
    lowered = backend.lower(zoo.reference_model(_case("conv_bn_cnn"), backend))
    state = lowered.state_dict()
    weights = {k: v for k, v in state.items() if k.endswith(".weight")}
    assert weights
    assert all(v.dtype == torch.int8 for v in weights.values())
    for key in weights:
        prefix = key.removesuffix("weight")
        assert state[prefix + "weight_scale"].dtype == torch.float64
        assert state[prefix + "weight_zero_point"].dtype == torch.int64
        assert state[prefix + "input_scale"].numel() == 1
        assert state[prefix + "scale"].numel() == 1


@pytest.mark.parametrize("name", CASES)
def test_torch_export_uses_custom_ops_and_matches_eager(name: str) -> None:
    case = _case(name)
    backend = L.get_backend("numba")
    lowered = backend.lower(zoo.reference_model(case, backend))
    inputs = case.inputs(0)
    exported = torch.export.export(lowered, inputs)
    ops = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert any(o.startswith("quantbridge_lowering.") for o in ops), ops
    for seed in (0, 5):
        x = case.inputs(seed)
        with torch.no_grad():
            want = _as_tuple(lowered(*x))
            got = _as_tuple(exported.module()(*x))
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b)


def test_eager_forward_does_not_go_through_the_dispatcher(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = L.get_backend("numba")
    case = _case("conv_bn_cnn")
    lowered = backend.lower(zoo.reference_model(case, backend))
    x = case.inputs(0)
    with torch.no_grad():
        want = lowered(*x)

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("custom op called in eager mode")

    monkeypatch.setattr(_custom_ops, "is_tracing", lambda *t: False)
    from quantbridge.lowering import _modules

    monkeypatch.setattr(_modules.ops, "conv_op", boom)
    monkeypatch.setattr(_modules.ops, "linear_op", boom)
    with torch.no_grad():
        assert torch.equal(lowered(*x), want)


def test_torch_compile_traces_through_custom_ops() -> None:
    backend = L.get_backend("numba")
    case = _case("conv_bn_cnn")
    lowered = backend.lower(zoo.reference_model(case, backend))
    compiled = torch.compile(lowered, backend="aot_eager", fullgraph=True)
    x = case.inputs(2)
    with torch.no_grad():
        assert torch.equal(compiled(*x), lowered(*x))
