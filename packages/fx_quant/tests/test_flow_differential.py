"""Differential tests against torch.ao 2.13 on the zoo: the same observers in the same places,
identical qparams after the same calibration, reference outputs, QAT forward and gradients."""

from __future__ import annotations

import copy
import functools
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

if str(Path(__file__).parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))
import flow_zoo as zoo

from quantbridge.fx_quant import (
    convert_to_reference_fx,
    explain,
    prepare_fx,
    prepare_qat_fx,
)
from quantbridge.qconfig import (
    float_qparams_weight_only_qconfig,
    get_default_qat_qconfig_mapping,
    get_default_qconfig_mapping,
)

ao = pytest.importorskip("torch.ao.quantization")
pytest.importorskip("torch.ao.quantization.backend_config.utils")  # torch 2.13 getter quirk
from torch.ao.quantization import quantize_fx as ao_fx  # noqa: E402

BACKENDS = ("fbgemm", "qnnpack", "x86")


def _dtype_name(dtype: object) -> str:
    # torch.ao's quint8/qint8 are our uint8/int8.
    return {"quint8": "uint8", "qint8": "int8", "qint32": "int32"}.get(
        str(dtype).removeprefix("torch."), str(dtype).removeprefix("torch.")
    )


def observer_table(model: torch.fx.GraphModule) -> dict[str, Any]:
    """Observer node -> (observed node, users, dtype, qparams); shared instances kept apart."""
    modules = dict(model.named_modules(remove_duplicate=False))
    table: dict[str, Any] = {}
    for node in model.graph.nodes:
        if node.op != "call_module" or not str(node.target).startswith("activation_post_process"):
            continue
        obs = modules[str(node.target)]
        try:
            scale, zp = obs.calculate_qparams()
            qparams: Any = (scale.tolist(), zp.tolist())
        except Exception:  # placeholder observers have no qparams
            qparams = None
        table[node.name] = (
            node.args[0].name,
            tuple(sorted(u.name for u in node.users)),
            _dtype_name(obs.dtype),
            qparams,
        )
    return table


def shared_groups(model: torch.fx.GraphModule) -> list[list[str]]:
    """Observer node names grouped by the observer instance they call."""
    by_id: dict[int, list[str]] = {}
    modules = dict(model.named_modules(remove_duplicate=False))
    for node in model.graph.nodes:
        if node.op == "call_module" and str(node.target).startswith("activation_post_process"):
            by_id.setdefault(id(modules[str(node.target)]), []).append(node.name)
    return sorted(by_id.values())


def _mappings(name: str, backend: str) -> tuple[Any, Any]:
    # executorch and native have no default qconfig mapping of their own.
    mapping_name = "x86" if backend in ("executorch", "native") else backend
    ours = get_default_qconfig_mapping(mapping_name)
    theirs = ao.get_default_qconfig_mapping(mapping_name)
    if name == "embedding_bag":
        ours.set_object_type(nn.EmbeddingBag, float_qparams_weight_only_qconfig)
        theirs.set_object_type(nn.EmbeddingBag, ao.float_qparams_weight_only_qconfig)
    return ours, theirs


@functools.cache
def _prepared_pair(name: str, backend: str) -> tuple[Any, Any]:
    model = zoo.build(name).eval()
    example = zoo.example_inputs(name)
    ours_map, theirs_map = _mappings(name, backend)
    from quantbridge.fx_quant import get_backend_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = ao_fx.prepare_fx(
            copy.deepcopy(model),
            theirs_map,
            example,
            backend_config=_ao_backend_config(backend),
        )
    ours = prepare_fx(
        copy.deepcopy(model), ours_map, example, backend_config=get_backend_config(backend)
    )
    for seed in range(1, 4):
        x = zoo.example_inputs(name, seed)
        theirs(*x)
        ours(*x)
    return ours, theirs


def _prepare_both(name: str, backend: str) -> tuple[Any, Any]:
    """Fresh copies of the calibrated pair (convert mutates its input)."""
    ours, theirs = _prepared_pair(name, backend)
    return copy.deepcopy(ours), copy.deepcopy(theirs)


def _ao_backend_config(backend: str) -> Any:
    import importlib

    module = importlib.import_module(f"torch.ao.quantization.backend_config.{backend}")
    return getattr(module, f"get_{backend}_backend_config")()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", zoo.PTQ_MODELS)
def test_same_observers_and_qparams(name: str, backend: str) -> None:
    ours, theirs = _prepare_both(name, backend)
    mine, ref = observer_table(ours), observer_table(theirs)
    assert mine == ref
    assert shared_groups(ours) == shared_groups(theirs)
    assert len(mine) > 0


@pytest.mark.parametrize("backend", ["onednn", "executorch", "native"])
@pytest.mark.parametrize("name", ["mlp", "residual", "attention", "functional_mix"])
def test_same_observers_other_backends(name: str, backend: str) -> None:
    ours, theirs = _prepare_both(name, backend)
    assert observer_table(ours) == observer_table(theirs)
    assert shared_groups(ours) == shared_groups(theirs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", zoo.PTQ_MODELS)
def test_reference_outputs_match(name: str, backend: str) -> None:
    ours, theirs = _prepare_both(name, backend)
    quantized = explain(ours).quantized()
    ref_ours = convert_to_reference_fx(ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_theirs = ao_fx.convert_to_reference_fx(
            theirs, backend_config=_ao_backend_config(backend)
        )
    # The same weighted modules became reference modules.
    kinds_ours = {n: type(m).__name__ for n, m in ref_ours.named_modules() if n}
    kinds_theirs = {n: type(m).__name__ for n, m in ref_theirs.named_modules() if n}
    assert kinds_ours == kinds_theirs

    # The same nodes are quantized (inputs of quantize ops).
    def quantized_inputs(gm: torch.fx.GraphModule, targets: tuple[Any, ...]) -> list[str]:
        return sorted(n.args[0].name for n in gm.graph.nodes if n.target in targets)

    ops = torch.ops.quantbridge
    assert quantized_inputs(
        ref_ours, (ops.quantize_per_tensor.tensor, ops.quantize_per_channel.default)
    ) == quantized_inputs(ref_theirs, (torch.quantize_per_tensor, torch.quantize_per_channel))
    assert quantized  # something was quantized
    for seed in (7, 8):
        x = zoo.example_inputs(name, seed)
        expected = ref_theirs(*x)
        got = ref_ours(*x)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["qat_conv_bn", "mlp", "residual", "depthwise"])
def test_qat_forward_and_gradients_match(name: str) -> None:
    model = zoo.build(name).train()
    example = zoo.example_inputs(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = ao_fx.prepare_qat_fx(
            copy.deepcopy(model), ao.get_default_qat_qconfig_mapping("fbgemm"), example
        )
    ours = prepare_qat_fx(copy.deepcopy(model), get_default_qat_qconfig_mapping("fbgemm"), example)
    # QAT modules replaced the float ones in the same places.
    kinds_ours = {n: type(m).__name__ for n, m in ours.named_modules() if n and "post" not in n}
    kinds_theirs = {n: type(m).__name__ for n, m in theirs.named_modules() if n and "post" not in n}
    assert {k: v for k, v in kinds_ours.items() if "fake" not in k} == {
        k: v for k, v in kinds_theirs.items() if "fake" not in k
    }
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.05)
    for step in range(3):
        x = zoo.example_inputs(name, step + 1)[0].requires_grad_(True)
        x2 = x.detach().clone().requires_grad_(True)
        out_ours, out_theirs = ours(x), theirs(x2)
        torch.testing.assert_close(out_ours, out_theirs, rtol=1e-5, atol=1e-5)
        out_ours.square().sum().backward()
        out_theirs.square().sum().backward()
        torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-5)
        grads_ours = {n: p.grad for n, p in ours.named_parameters()}
        grads_theirs = {n: p.grad for n, p in theirs.named_parameters()}
        assert grads_ours.keys() == grads_theirs.keys()
        for key, grad in grads_ours.items():
            torch.testing.assert_close(grad, grads_theirs[key], rtol=1e-4, atol=1e-5)
        opt_ours.step()
        opt_theirs.step()
        opt_ours.zero_grad()
        opt_theirs.zero_grad()
    assert observer_table(ours) == observer_table(theirs)
    # Converted QAT models agree too.
    ours.eval()
    theirs.eval()
    ref_ours = convert_to_reference_fx(ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_theirs = ao_fx.convert_to_reference_fx(theirs)
    x = zoo.example_inputs(name, 9)[0]
    torch.testing.assert_close(ref_ours(x), ref_theirs(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "qconfig_name",
    [
        "default_dynamic_qconfig",
        "per_channel_dynamic_qconfig",
        "float16_dynamic_qconfig",
        "float16_static_qconfig",
    ],
)
@pytest.mark.parametrize("name", ["mlp", "attention"])
def test_dynamic_and_float16_match(name: str, qconfig_name: str) -> None:
    import quantbridge.qconfig as qb

    model = zoo.build(name).eval()
    example = zoo.example_inputs(name)
    qconfig = getattr(qb, qconfig_name)
    ao_qconfig = getattr(ao, qconfig_name, None) or getattr(ao.qconfig, qconfig_name)
    ours_map = qb.QConfigMapping().set_object_type(nn.Linear, qconfig)
    ours_map.set_object_type(nn.ReLU, qconfig)
    theirs_map = ao.QConfigMapping().set_object_type(nn.Linear, ao_qconfig)
    theirs_map.set_object_type(nn.ReLU, ao_qconfig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = ao_fx.prepare_fx(copy.deepcopy(model), theirs_map, example)
    ours = prepare_fx(copy.deepcopy(model), ours_map, example)
    theirs(*example)
    ours(*example)
    table = observer_table(ours)
    assert table == observer_table(theirs)
    # placeholder observers mark dynamic inputs (native Linear rejects float16 static, as torch.ao)
    assert bool(table) == (qconfig_name != "float16_static_qconfig")
    ref_ours = convert_to_reference_fx(ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_theirs = ao_fx.convert_to_reference_fx(theirs)
    kinds = {n: type(m).__name__ for n, m in ref_ours.named_modules() if n}
    assert kinds == {n: type(m).__name__ for n, m in ref_theirs.named_modules() if n}
    x = zoo.example_inputs(name, 5)
    torch.testing.assert_close(ref_ours(*x), ref_theirs(*x), rtol=0, atol=0)


def test_qconfig_mapping_precedence_matches() -> None:
    """Global, object types (incl. a function inheriting its enclosing module's entry),
    regexes, module names and call order: the same observers as torch.ao."""
    import quantbridge.qconfig as qb

    model = zoo.build("nested").eval()
    example = zoo.example_inputs("nested")

    def build(lib: Any, mapping: Any) -> Any:
        minmax = lib.QConfig(
            activation=lib.MinMaxObserver.with_args(dtype=torch.quint8),
            weight=lib.default_weight_observer,
        )
        histogram = lib.get_default_qconfig("fbgemm")
        return (
            mapping.set_global(histogram)
            .set_object_type(zoo.Inner, None)  # torch.add inside a and b inherits None
            .set_module_name_regex("b\\.fc", minmax)
            .set_module_name("fc", minmax)
            .set_module_name_object_type_order("", torch.add, 1, None)  # second root add
        )

    ours_map = build(qb, qb.QConfigMapping())
    theirs_map = build(ao, ao.QConfigMapping())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = ao_fx.prepare_fx(copy.deepcopy(model), theirs_map, example)
    ours = prepare_fx(copy.deepcopy(model), ours_map, example)
    for seed in (1, 2):
        x = zoo.example_inputs("nested", seed)
        ours(*x)
        theirs(*x)
    table = observer_table(ours)
    assert table == observer_table(theirs)
    kinds = {
        n: type(m).__name__
        for n, m in ours.named_modules(remove_duplicate=False)
        if n.startswith("activation_post_process")
    }
    assert "MinMaxObserver" in kinds.values()
    assert "HistogramObserver" in kinds.values()
    report = explain(ours)
    assert report["add"].qconfig is None  # torch.add in a: Inner's object-type entry
    assert report["add"].qconfig_rule.startswith("object_type")
    assert report["add_3"].qconfig is None
    assert report["add_3"].qconfig_rule.startswith("module_name_object_type_order")
    assert report["b_fc"].qconfig_rule == "module_name_regex 'b\\\\.fc'"
    assert report["fc"].qconfig_rule == "module_name 'fc'"
