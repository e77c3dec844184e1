"""conv → add(+relu) pairs become one QuantizedConvAdd with the numbers of the two kernels."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch.fx import GraphModule, Interpreter

if str(Path(__file__).parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))
import lowering_zoo as zoo

import quantbridge.lowering as L
from quantbridge import kernels as K
from quantbridge.lowering._modules import QuantizedBinary, QuantizedConv, QuantizedConvAdd

NUMBA = [f"numba_{t}" for t in K.available_targets()]
CASES = {c.name: c for c in zoo.STATIC_CASES}


def _fused_calls(gm: GraphModule, *args: torch.Tensor) -> list[tuple[QuantizedConvAdd, tuple]]:
    seen: list[tuple[QuantizedConvAdd, tuple]] = []

    class Recorder(Interpreter):
        def call_module(self, target, args, kwargs):  # type: ignore[no-untyped-def]
            mod = self.module.get_submodule(str(target))
            out = super().call_module(target, args, kwargs)
            if isinstance(mod, QuantizedConvAdd):
                seen.append((mod, (*args, out)))
            return out

    Recorder(gm).run(*args)
    return seen


@pytest.mark.parametrize("backend_name", NUMBA)
def test_residual_add_fuses_into_the_conv_with_the_same_numbers(backend_name: str):
    case = CASES["residual_add_mul"]
    backend = L.get_backend(backend_name)
    lowered = backend.lower(zoo.reference_model(case, backend))
    calls = _fused_calls(lowered, *case.inputs(1))
    assert calls  # relu(a(s) + s): conv `a` and the add_relu are one module now
    for mod, (x, other, out) in calls:
        conv_qp = (float(mod.scale), int(mod.zero_point))  # the conv's own rounding point
        conv = K.conv2d(
            x.numpy(), mod._packed, *mod.input_qparams, *conv_qp, relu=mod.relu, channels_last=True
        )
        add = K.add_relu if mod.add_relu else K.add
        want = add(conv, conv_qp, other.numpy(), mod.other_qparams, mod.output_qparams)
        assert torch.equal(out, torch.from_numpy(want))
    # no lowered conv is left whose only user is a lowered add
    for node in lowered.graph.nodes:
        if node.op == "call_module" and type(lowered.get_submodule(node.target)) is QuantizedConv:
            users = list(node.users)
            assert not (
                len(users) == 1
                and users[0].op == "call_module"
                and type(lowered.get_submodule(users[0].target)) is QuantizedBinary
                and lowered.get_submodule(users[0].target).kind in ("add", "add_relu")
            )


def test_conv_with_other_users_is_not_fused():
    # s = stem(x) feeds a conv, the add and the final mul: stem itself must stay a conv
    case = CASES["residual_add_mul"]
    backend = L.get_backend("numba")
    lowered = backend.lower(zoo.reference_model(case, backend))
    assert type(lowered.get_submodule("stem_1")) is QuantizedConv


@pytest.mark.parametrize("backend_name", NUMBA)
def test_fused_module_state_dict_and_export(backend_name: str):
    case = CASES["residual_add_mul"]
    backend = L.get_backend(backend_name)
    lowered = backend.lower(zoo.reference_model(case, backend, seed=0))
    other = backend.lower(zoo.reference_model(case, backend, seed=1))
    x = case.inputs(2)
    other.load_state_dict(lowered.state_dict())
    assert torch.equal(other(*x), lowered(*x))
    exported = torch.export.export(lowered, x)
    assert torch.equal(exported.module()(*x), lowered(*x))


def test_the_fusion_is_a_rule_of_the_table_dropping_it_changes_no_number():
    case = CASES["residual_add_mul"]
    backend = L.get_backend("numba")
    reference = zoo.reference_model(case, backend)
    fused = backend.lower(reference)
    unfused_table = [r for r in L.default_lowering_rules() if r.kind != "fusion"]
    fusions = [r.name for r in L.default_lowering_rules() if r.kind == "fusion"]
    assert fusions == ["conv + add (+relu)", "conv / linear + activation"]
    unfused = L.lower_to_kernels(copy.deepcopy(reference), backend.target, rules=unfused_table)
    assert QuantizedConvAdd not in {type(m) for m in unfused.modules()}
    assert QuantizedConvAdd in {type(m) for m in fused.modules()}
    x = case.inputs(3)
    assert torch.equal(fused(*x), unfused(*x))
    # the report lists each fused module once, in place of the conv and the add it replaced
    report = L.lowering_report(fused)
    fused_names = [n for n, what in report.lowered if "conv + add" in what]
    assert fused_names
    assert all(n in report.origins for n in fused_names)
    in_graph = {n.name for n in fused.graph.nodes}
    assert {n for n, _ in report.lowered} <= in_graph  # no entry for an erased conv or add
    assert set(report.origins) <= in_graph
