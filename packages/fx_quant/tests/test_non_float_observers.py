"""Observers that would be fed integer tensors (an attention mask, a count, an index) are
refused at prepare when example_inputs show it, and at calibrate otherwise, naming the
observer, the node, the dtype and a QConfigMapping fix that works as written. Integer data
computed only from integer data (the mask reshaped) is never observed in the first place."""

from __future__ import annotations

import copy
import operator
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

if str(Path(__file__).parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))

from quantbridge.fx_quant import (
    ExampleInputsError,
    FxQuantError,
    PrepareCustomConfig,
    calibrate,
    convert_to_reference_fx,
    prepare_fx,
)
from quantbridge.qconfig import QConfigMapping, default_qconfig, get_default_qconfig_mapping

_Q = torch.ops.quantbridge.quantize_per_tensor.tensor


class MaskedMeanPool(nn.Module):
    """Mean over the unmasked positions of a (batch, time, features) tensor."""

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        summed = (h * mask.unsqueeze(-1)).sum(1)
        return summed / mask.sum(1, keepdim=True)


class Encoder(nn.Module):
    def __init__(self, pool_in_submodule: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 8)
        self.head = nn.Linear(8, 4)
        self.pool = MaskedMeanPool() if pool_in_submodule else None

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.pool is not None:
            pooled = self.pool(h, mask)
        else:
            pooled = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        return self.head(pooled)


def _inputs(seed: int, mask_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 6, 16, generator=g)
    lengths = torch.tensor([2, 6, 4])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).to(mask_dtype)
    return x, mask


def _advice(message: str) -> tuple[str, str | None]:
    """(QConfigMapping calls, PrepareCustomConfig expression or None) quoted by the error."""
    found = re.search(
        r"in float: (qconfig_mapping\.[^;]*?)(?:; or .*?prepare_custom_config=(.*))?$", message
    )
    assert found is not None, message
    return found.group(1), found.group(2)


def _follow(calls: str, mapping: QConfigMapping) -> QConfigMapping:
    """Apply the advice exactly as written."""
    result = eval(calls, {"qconfig_mapping": mapping, "operator": operator, "torch": torch})
    assert isinstance(result, QConfigMapping)
    return result


@pytest.mark.parametrize(
    "mapping", [get_default_qconfig_mapping("x86"), QConfigMapping().set_global(default_qconfig)],
    ids=["histogram", "minmax"],
)  # fmt: skip
def test_prepare_names_the_observer_node_dtype_and_fix(mapping: QConfigMapping) -> None:
    with pytest.raises(ExampleInputsError) as info:
        prepare_fx(Encoder(False).eval(), mapping, _inputs(0))
    message = str(info.value)
    assert "observer 'activation_post_process_" in message
    assert "torch.int64" in message
    # the mask's own reshape is integer data from integer data: never observed; the mul
    # that mixes it with float data is what would quantize it
    assert "node 'unsqueeze' (.unsqueeze())" in message
    assert "'mul' (operator.mul)" in message
    calls, untraced = _advice(message)
    assert calls == "qconfig_mapping.set_module_name_object_type_order('', operator.mul, 0, None)"
    assert untraced is None  # the pooling runs in the root module

    # following the advice: prepare, calibrate and convert work; the mask is never quantized
    fixed = _follow(calls, copy.deepcopy(mapping))
    prepared = prepare_fx(Encoder(False).eval(), fixed, _inputs(0))
    calibrate(prepared, [_inputs(1), _inputs(2)], progress=False)
    reference = convert_to_reference_fx(prepared)
    quantized = {n.args[0].name for n in reference.graph.nodes if n.target is _Q}
    assert {"x", "fc", "truediv"} <= quantized  # the float path stays quantized
    assert not quantized & {"mask", "unsqueeze", "sum_2"}
    x, mask = _inputs(3)
    expected = Encoder(False).eval()(x, mask)
    torch.testing.assert_close(reference(x, mask), expected, rtol=0.1, atol=0.05)


def test_submodule_advice_and_the_untraced_alternative_both_work() -> None:
    mapping = get_default_qconfig_mapping("x86")
    with pytest.raises(ExampleInputsError) as info:
        prepare_fx(Encoder(True).eval(), mapping, _inputs(0))
    calls, untraced = _advice(str(info.value))
    assert (
        calls == "qconfig_mapping.set_module_name_object_type_order('pool', operator.mul, 0, None)"
    )
    assert untraced == "PrepareCustomConfig().set_non_traceable_module_names(['pool'])"

    fixed = _follow(calls, copy.deepcopy(mapping))
    prepared = prepare_fx(Encoder(True).eval(), fixed, _inputs(0))
    calibrate(prepared, [_inputs(1)], progress=False)
    convert_to_reference_fx(prepared)(*_inputs(2))

    custom = eval(untraced, {"PrepareCustomConfig": PrepareCustomConfig})
    prepared = prepare_fx(
        Encoder(True).eval(), copy.deepcopy(mapping), _inputs(0), prepare_custom_config=custom
    )
    calibrate(prepared, [_inputs(1)], progress=False)
    convert_to_reference_fx(prepared)(*_inputs(2))


def test_calibrate_names_the_observer_when_example_inputs_did_not_show_it() -> None:
    # a float example mask hides the problem at prepare; the calibration data has integers
    prepared = prepare_fx(
        Encoder(False).eval(), get_default_qconfig_mapping("x86"), _inputs(0, torch.float32)
    )
    observers = [m for n, m in prepared.named_modules() if "activation_post_process" in n]
    with pytest.raises(FxQuantError) as info:
        calibrate(prepared, [_inputs(1)], progress=False)
    message = str(info.value)
    assert message.startswith("calibrate: observer 'activation_post_process_")
    assert "torch.int64" in message
    assert "node 'mask' (a model input)" in message
    calls, _ = _advice(message)
    assert "set_object_type('unsqueeze', None)" in calls
    # the check lives only as long as the calibrate call
    assert all(not m._forward_pre_hooks for m in observers)
    calibrate(prepared, [_inputs(1, torch.float32)], progress=False)
    assert all(not m._forward_pre_hooks for m in observers)


def test_torch_ao_inserts_the_same_observers_and_fails_later() -> None:
    """What torch.ao 2.13 does on this model: the same observers on the mask path, then a
    histogram error at calibration, or (min/max observers) a reference model that cannot run."""
    ao = pytest.importorskip("torch.ao.quantization")
    pytest.importorskip("torch.ao.quantization.backend_config.utils")  # torch 2.13 quirk
    import test_flow_differential as diff
    from torch.ao.quantization import quantize_fx as ao_fx

    float_example = _inputs(0, torch.float32)
    ours = prepare_fx(Encoder(False).eval(), get_default_qconfig_mapping("x86"), float_example)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = ao_fx.prepare_fx(
            Encoder(False).eval(), ao.get_default_qconfig_mapping("x86"), float_example
        )
        ours(*float_example)
        theirs(*float_example)
        assert diff.observer_table(ours) == diff.observer_table(theirs)
        observed = {entry[0] for entry in diff.observer_table(theirs).values()}
        assert {"mask", "unsqueeze"} <= observed

        with pytest.raises(NotImplementedError):  # torch.histc has no int64 kernel
            theirs(*_inputs(1))
        minmax = ao_fx.prepare_fx(
            Encoder(False).eval(), ao.QConfigMapping().set_global(ao.default_qconfig), _inputs(0)
        )
        minmax(*_inputs(1))  # calibrates on the integer mask without complaint
        reference: Any = ao_fx.convert_to_reference_fx(minmax)
        with pytest.raises(RuntimeError, match="Float"):
            reference(*_inputs(2))
