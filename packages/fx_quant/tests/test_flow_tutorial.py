"""The BackendConfig tutorial (seed 002) reproduced: a custom backend with quantized linear and
fused conv-relu, its two faulty setups, and what explain / strict say about them.

The tutorial's reference models are checked (``convert_to_reference_fx``): a lowering for
"my_backend" may be installed (quantbridge.lowering's test plugin is), which ``convert_fx``
would apply.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from quantbridge.fx_quant import (
    StrictPrepareError,
    convert_to_reference_fx,
    explain,
    prepare_fx,
)
from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.fx_quant.nn import qat as nnqat
from quantbridge.fx_quant.nn import reference as nnqr
from quantbridge.fx_quant.nn.intrinsic import qat as nniqat
from quantbridge.qconfig import (
    BackendConfig,
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    MinMaxObserver,
    ObservationType,
    QConfig,
    QConfigMapping,
    default_weight_observer,
    get_default_qconfig_mapping,
)

ops = torch.ops.quantbridge


def my_backend() -> BackendConfig:
    quint8_with_constraints = DTypeWithConstraints(
        dtype=torch.quint8,
        quant_min_lower_bound=0,
        quant_max_upper_bound=255,
        scale_min_lower_bound=2**-12,
    )
    weighted_int8 = DTypeConfig(
        input_dtype=quint8_with_constraints,
        output_dtype=quint8_with_constraints,
        weight_dtype=torch.qint8,
        bias_dtype=torch.float,
    )

    def fuse_conv2d_relu(is_qat: bool, conv: nn.Module, relu: nn.Module) -> nn.Module:
        return nni.ConvReLU2d(conv, relu)

    linear = (
        BackendPatternConfig(nn.Linear)
        .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
        .add_dtype_config(weighted_int8)
        .set_root_module(nn.Linear)
        .set_qat_module(nnqat.Linear)
        .set_reference_quantized_module(nnqr.Linear)
    )
    conv_relu = (
        BackendPatternConfig((nn.Conv2d, nn.ReLU))
        .set_fused_module(nni.ConvReLU2d)
        .set_fuser_method(fuse_conv2d_relu)
    )
    fused_conv_relu = (
        BackendPatternConfig(nni.ConvReLU2d)
        .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
        .add_dtype_config(weighted_int8)
        .set_root_module(nn.Conv2d)
        .set_qat_module(nniqat.ConvReLU2d)
        .set_reference_quantized_module(nnqr.Conv2d)
    )
    return (
        BackendConfig("my_backend")
        .set_backend_pattern_config(linear)
        .set_backend_pattern_config(conv_relu)
        .set_backend_pattern_config(fused_conv_relu)
    )


def tutorial_mapping() -> QConfigMapping:
    act = MinMaxObserver.with_args(quant_min=0, quant_max=127, eps=2**-12)
    qconfig = QConfig(activation=act, weight=default_weight_observer)
    return (
        QConfigMapping()
        .set_object_type(nn.Linear, qconfig)
        .set_object_type(nn.Conv2d, qconfig)
        .set_object_type(nn.BatchNorm2d, qconfig)
        .set_object_type(nn.ReLU, qconfig)
    )


class MyModel(nn.Module):
    def __init__(self, use_bn: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(10, 3)
        self.conv = nn.Conv2d(3, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.relu = nn.ReLU()
        self.sigmoid = nn.Sigmoid()
        self.use_bn = use_bn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        x = self.conv(x)
        if self.use_bn:
            x = self.bn(x)
        x = self.relu(x)
        return self.sigmoid(x)


EXAMPLE = (torch.rand(1, 3, 10, 10, generator=torch.Generator().manual_seed(0)),)


def _run(use_bn: bool, mapping: QConfigMapping, **kwargs: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = MyModel(use_bn).eval()
    prepared = prepare_fx(model, mapping, EXAMPLE, backend_config=my_backend(), **kwargs)
    prepared(*EXAMPLE)
    report = explain(prepared)
    return prepared, report


def _quantize_inputs(gm: torch.fx.GraphModule) -> list[str]:
    return [n.args[0].name for n in gm.graph.nodes if n.target == ops.quantize_per_tensor.tensor]


def test_linear_and_conv_relu_quantized_sigmoid_float() -> None:
    prepared, report = _run(False, tutorial_mapping())
    assert report.quantized() == ["linear", "conv"]
    assert report["sigmoid"].status == "float"
    assert report["linear"].candidates[0][1] is None
    assert report["linear"].chosen == 0
    converted = convert_to_reference_fx(prepared, backend_config=my_backend())
    assert isinstance(converted.linear, nnqr.Linear)
    assert isinstance(converted.conv, nni.ConvReLU2d)
    assert isinstance(converted.conv[0], nnqr.Conv2d)
    assert isinstance(converted.sigmoid, nn.Sigmoid)
    # quant -> [dequant -> linear -> quant] -> [dequant -> conv_relu -> quant] -> dequant -> sigmoid
    assert _quantize_inputs(converted) == ["x", "linear", "conv"]
    sigmoid = next(n for n in converted.graph.nodes if n.target == "sigmoid")
    assert sigmoid.args[0].target == ops.dequantize_per_tensor.tensor
    # quant_max=127 shaped the qparams: the input scale is max / 127.
    x = EXAMPLE[0]
    expected_scale = float(torch.tensor(x.max().item() / 127, dtype=torch.float32))
    assert converted.linear_input_scale_0.item() == pytest.approx(expected_scale, rel=1e-6)
    assert converted.linear_input_zero_point_0.item() == 0
    assert converted(*EXAMPLE).shape == (1, 3, 8, 1)


def test_conv_bn_relu_only_linear_quantized() -> None:
    prepared, report = _run(True, tutorial_mapping())
    assert report.quantized() == ["linear"]
    for name in ("conv", "bn", "relu"):
        assert report[name].status == "float"
        assert "no pattern of backend 'my_backend'" in report[name].reason
    converted = convert_to_reference_fx(prepared, backend_config=my_backend())
    assert isinstance(converted.linear, nnqr.Linear)
    assert type(converted.conv) is nn.Conv2d
    assert type(converted.bn) is nn.BatchNorm2d
    assert _quantize_inputs(converted) == ["x", "linear"]


def test_default_mapping_quantizes_nothing_and_explain_says_why() -> None:
    with pytest.warns(UserWarning, match=r"ignored the qconfig of 1 node\(s\).*explain"):
        prepared, report = _run(True, get_default_qconfig_mapping())
    assert report.quantized() == []
    linear = report["linear"]
    assert linear.pattern == "nn.Linear"
    assert linear.qconfig_rule == "global"
    assert linear.chosen is None
    ((desc, reason),) = linear.candidates
    assert desc == "in=uint8 out=uint8 w=int8 b=float32"
    assert reason == "activation eps 1.19e-07 below backend scale_min 2**-12"
    text = str(report)
    assert "activation eps 1.19e-07 below backend scale_min 2**-12" in text
    assert "linear" in text
    assert "no DTypeConfig accepts the qconfig" in text
    converted = convert_to_reference_fx(prepared, backend_config=my_backend())
    assert not any(isinstance(m, nnqr.ReferenceQuantizedModule) for m in converted.modules())
    assert _quantize_inputs(converted) == []
    torch.manual_seed(0)
    float_model = MyModel(True).eval()
    torch.testing.assert_close(converted(*EXAMPLE), float_model(*EXAMPLE), rtol=0, atol=0)


def test_strict_raises_with_the_reason() -> None:
    torch.manual_seed(0)
    with pytest.raises(StrictPrepareError) as info:
        prepare_fx(
            MyModel(True).eval(),
            get_default_qconfig_mapping(),
            EXAMPLE,
            backend_config=my_backend(),
            strict=True,
        )
    message = str(info.value)
    assert "linear (linear): no DTypeConfig accepts the qconfig" in message
    assert "activation eps 1.19e-07 below backend scale_min 2**-12" in message
    assert "conv (conv): no pattern of backend 'my_backend' matches this node" in message
    # The tutorial's own mapping passes strict on the conv-relu model.
    _run(False, tutorial_mapping(), strict=True)


def test_tutorial_matches_torch_ao() -> None:
    ao = pytest.importorskip("torch.ao.quantization")
    pytest.importorskip("torch.ao.quantization.backend_config.utils")
    from torch.ao.quantization import backend_config as aobc
    from torch.ao.quantization import quantize_fx as ao_fx

    q8 = aobc.DTypeWithConstraints(
        dtype=torch.quint8,
        quant_min_lower_bound=0,
        quant_max_upper_bound=255,
        scale_min_lower_bound=2**-12,
    )
    dc = aobc.DTypeConfig(
        input_dtype=q8, output_dtype=q8, weight_dtype=torch.qint8, bias_dtype=torch.float
    )
    import torch.ao.nn.intrinsic as ao_nni
    import torch.ao.nn.quantized.reference as ao_ref

    def fuse(is_qat: bool, conv: nn.Module, relu: nn.Module) -> nn.Module:
        return ao_nni.ConvReLU2d(conv, relu)

    backend = (
        aobc.BackendConfig("my_backend")
        .set_backend_pattern_config(
            aobc.BackendPatternConfig(nn.Linear)
            .add_dtype_config(dc)
            .set_root_module(nn.Linear)
            .set_reference_quantized_module(ao_ref.Linear)
        )
        .set_backend_pattern_config(
            aobc.BackendPatternConfig((nn.Conv2d, nn.ReLU))
            .set_fused_module(ao_nni.ConvReLU2d)
            .set_fuser_method(fuse)
        )
        .set_backend_pattern_config(
            aobc.BackendPatternConfig(ao_nni.ConvReLU2d)
            .add_dtype_config(dc)
            .set_root_module(nn.Conv2d)
            .set_reference_quantized_module(ao_ref.Conv2d)
        )
    )
    act = ao.MinMaxObserver.with_args(quant_min=0, quant_max=127, eps=2**-12)
    qconfig = ao.QConfig(activation=act, weight=ao.default_weight_observer)
    mapping = ao.QConfigMapping()
    for t in (nn.Linear, nn.Conv2d, nn.BatchNorm2d, nn.ReLU):
        mapping.set_object_type(t, qconfig)
    for use_bn in (False, True):
        torch.manual_seed(0)
        model = MyModel(use_bn).eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = ao_fx.prepare_fx(
                copy.deepcopy(model), mapping, EXAMPLE, backend_config=backend
            )
        ours = prepare_fx(
            copy.deepcopy(model), tutorial_mapping(), EXAMPLE, backend_config=my_backend()
        )
        theirs(*EXAMPLE)
        ours(*EXAMPLE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref_theirs = ao_fx.convert_to_reference_fx(theirs, backend_config=backend)
        ref_ours = convert_to_reference_fx(ours, backend_config=my_backend())
        buffers_theirs = dict(ref_theirs.named_buffers())
        buffers_ours = dict(ref_ours.named_buffers())
        names = [k for k in buffers_theirs if "_scale_" in k or "_zero_point_" in k]
        assert names
        assert names == [k for k in buffers_ours if k in names]
        for k in names:
            assert buffers_ours[k].item() == buffers_theirs[k].item(), k
        torch.testing.assert_close(ref_ours(*EXAMPLE), ref_theirs(*EXAMPLE), rtol=0, atol=0)
