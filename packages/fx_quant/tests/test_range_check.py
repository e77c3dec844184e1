"""The warning for observers whose range a sentinel (finfo.min, -inf, 1e30) dominates."""

from __future__ import annotations

import copy
import operator
import warnings

import pytest
import torch
from torch import Tensor, nn

from quantbridge.fx_quant import (
    calibrate,
    convert_to_reference_fx,
    explain,
    find_dominated_ranges,
    prepare_fx,
)
from quantbridge.qconfig import get_default_qconfig_mapping


class _MaskedScores(nn.Module):
    """Scores plus a Hugging Face extended attention mask, as BertSelfAttention adds it."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        scores = torch.matmul(self.q(x), self.k(x).transpose(-1, -2))
        extended = (1.0 - mask[:, None, :]) * torch.finfo(torch.float32).min
        return torch.softmax(scores + extended, dim=-1)


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.conv = nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h = self.fc2(torch.relu(self.fc1(x)))
        return h + 1e3 * self.conv(y).mean()  # large, but data: not a sentinel


def _masked_data() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    return [(torch.randn(2, 5, 8, generator=g), mask) for _ in range(3)]


def _prepared(model: nn.Module, data: list[tuple[Tensor, ...]], mapping: object = None) -> object:
    mapping = get_default_qconfig_mapping("x86") if mapping is None else mapping
    return prepare_fx(model.eval(), mapping, data[0])


def test_mask_warns_at_calibrate_naming_node_range_scale_and_fix() -> None:
    data = _masked_data()
    prepared = _prepared(_MaskedScores(), data)
    with pytest.warns(UserWarning, match="dominates its range") as record:
        calibrate(prepared, data, progress=False)
    messages = [str(w.message) for w in record if "dominates" in str(w.message)]
    text = "\n".join(messages)
    assert "'mul' (operator.mul(" in text  # the mul by finfo.min
    assert "'add' (operator.add(" in text  # and the scores + mask it feeds
    assert "min -3.40282e+38" in text
    assert "its scale is 2.67939e+36" in text  # 3.4e38 / 127 (x86 defaults: reduce_range)
    assert '.set_module_name_object_type_order("", operator.mul, 0, None)' in text
    assert ".set_object_type(operator.add, None)" in text
    findings = find_dominated_ranges(prepared)
    assert {n for f in findings for n in f.nodes} >= {"mul", "add"}
    # explain shows the same lines; convert does not warn a second time
    assert "dominated by a sentinel value" in str(explain(prepared))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reference = convert_to_reference_fx(copy.deepcopy(prepared))
    assert "dominated by a sentinel value" in str(explain(reference))


def test_mask_warns_at_convert_without_calibrate() -> None:
    data = _masked_data()
    prepared = _prepared(_MaskedScores(), data)
    with torch.no_grad():
        for batch in data:
            prepared(*batch)  # user's own loop: the warning comes at convert
    with pytest.warns(UserWarning, match=r"convert_to_reference_fx: observer .* of 'sub'"):
        convert_to_reference_fx(prepared)


def test_following_the_fix_silences_the_warning() -> None:
    data = _masked_data()
    mapping = get_default_qconfig_mapping("x86")
    # exactly the calls the warning suggests: this mul, and every add
    mapping.set_module_name_object_type_order("", operator.mul, 0, None)
    mapping.set_module_name_object_type_order("", operator.sub, 0, None)
    mapping.set_object_type(operator.add, None)
    prepared = _prepared(_MaskedScores(), data, mapping)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calibrate(prepared, data, progress=False)
        convert_to_reference_fx(prepared)
    assert find_dominated_ranges(prepared) == []


def test_normal_models_do_not_warn() -> None:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(3, 8, generator=g), torch.randn(3, 4, 6, generator=g)) for _ in range(3)]
    prepared = _prepared(_Plain(), data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calibrate(prepared, data, progress=False)
        assert find_dominated_ranges(prepared) == []
        assert "sentinel" not in str(explain(prepared))
        convert_to_reference_fx(prepared)


def test_huge_constant_is_flagged() -> None:
    class _Huge(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc(x) - 1e31 * (x < -5).float()

    data = [(torch.full((2, 4), -6.0),), (torch.randn(2, 4),)]
    prepared = _prepared(_Huge(), data)
    with pytest.warns(UserWarning, match=r"'mul' \(operator.mul\(1e\+31, .*max 1e\+31"):
        calibrate(prepared, data, progress=False)
