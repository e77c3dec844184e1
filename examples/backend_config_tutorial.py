"""PyTorch's "(prototype) BackendConfig Tutorial", ported to quantbridge.

A backend with two ops, quantized linear and quantized conv-relu, described by a custom
BackendConfig; a QConfigMapping that satisfies its constraints; prepare_fx / convert_fx; and
the tutorial's two faulty setups (conv-bn-relu, which no pattern covers, and the default
QConfigMapping, whose qconfig breaks the backend's scale constraint).

Ported by changing imports (see docs/porting.md, "Porting from torch.ao").
Two kinds of lines changed beyond the imports:

* the tutorial names torch.ao.nn classes inline (``torch.ao.nn.intrinsic.ConvReLU2d``,
  ``torch.nn.qat.Linear``, ``torch.ao.nn.quantized.reference.Linear`` ...); quantbridge
  would map those to its own classes by name, but this example uses quantbridge's directly
  (``nni``, ``nnqat``, ``nniqat``, ``nnqr`` below) so that it runs without torch.ao;
* ``model.eval()`` before ``prepare_fx``: quantbridge refuses to calibrate a model in
  training mode (torch.ao accepts it).

``convert_fx`` returns the reference model here, with a warning, unless a lowering for
"my_backend" is installed: quantbridge has no kernels for this made-up backend.

Run: ``python examples/backend_config_tutorial.py``. Each experiment prints the converted
model and one ``RESULT`` line (what ``explain`` says is quantized).
"""

from __future__ import annotations

import torch

from quantbridge.fx_quant import convert_fx, explain, prepare_fx
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

# 2. DTypeConfigs with the backend's constraints
quint8_with_constraints = DTypeWithConstraints(
    dtype=torch.quint8,
    quant_min_lower_bound=0,
    quant_max_upper_bound=255,
    scale_min_lower_bound=2**-12,
)

# the dtypes passed to the quantized ops in the reference model spec
weighted_int8_dtype_config = DTypeConfig(
    input_dtype=quint8_with_constraints,
    output_dtype=quint8_with_constraints,
    weight_dtype=torch.qint8,
    bias_dtype=torch.float,
)


# 3. fusion for conv-relu
def fuse_conv2d_relu(is_qat: bool, conv: torch.nn.Module, relu: torch.nn.Module) -> torch.nn.Module:
    """Return a fused ConvReLU2d from individual conv and relu modules."""
    return nni.ConvReLU2d(conv, relu)  # tutorial: torch.ao.nn.intrinsic.ConvReLU2d


# 4. the BackendConfig
linear_config = (
    BackendPatternConfig()
    .set_pattern(torch.nn.Linear)
    .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
    .add_dtype_config(weighted_int8_dtype_config)
    .set_root_module(torch.nn.Linear)
    .set_qat_module(nnqat.Linear)  # tutorial: torch.nn.qat.Linear
    .set_reference_quantized_module(nnqr.Linear)  # torch.ao.nn.quantized.reference.Linear
)

# fusing Conv2d + ReLU into ConvReLU2d: no observation type or dtype config, since no
# quant-dequant ops are inserted in this step
conv_relu_config = (
    BackendPatternConfig()
    .set_pattern((torch.nn.Conv2d, torch.nn.ReLU))
    .set_fused_module(nni.ConvReLU2d)  # tutorial: torch.ao.nn.intrinsic.ConvReLU2d
    .set_fuser_method(fuse_conv2d_relu)
)

# quantizing ConvReLU2d
fused_conv_relu_config = (
    BackendPatternConfig()
    .set_pattern(nni.ConvReLU2d)  # tutorial: torch.ao.nn.intrinsic.ConvReLU2d
    .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
    .add_dtype_config(weighted_int8_dtype_config)
    .set_root_module(torch.nn.Conv2d)
    .set_qat_module(nniqat.ConvReLU2d)  # tutorial: torch.ao.nn.intrinsic.qat.ConvReLU2d
    .set_reference_quantized_module(nnqr.Conv2d)  # torch.ao.nn.quantized.reference.Conv2d
)

backend_config = (
    BackendConfig("my_backend")
    .set_backend_pattern_config(linear_config)
    .set_backend_pattern_config(conv_relu_config)
    .set_backend_pattern_config(fused_conv_relu_config)
)

# 5. a QConfigMapping that satisfies the backend's constraints
# quant_max 127 here, but it could be up to 255 (see quint8_with_constraints)
activation_observer = MinMaxObserver.with_args(quant_min=0, quant_max=127, eps=2**-12)
qconfig = QConfig(activation=activation_observer, weight=default_weight_observer)

# all items of a fused pattern, e.g. Conv2d and ReLU in (Conv2d, ReLU), need the same QConfig
qconfig_mapping = (
    QConfigMapping()
    .set_object_type(torch.nn.Linear, qconfig)
    .set_object_type(torch.nn.Conv2d, qconfig)
    .set_object_type(torch.nn.BatchNorm2d, qconfig)
    .set_object_type(torch.nn.ReLU, qconfig)
)


# 6. quantize the model through prepare and convert
class MyModel(torch.nn.Module):
    def __init__(self, use_bn: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(10, 3)
        self.conv = torch.nn.Conv2d(3, 3, 3)
        self.bn = torch.nn.BatchNorm2d(3)
        self.relu = torch.nn.ReLU()
        self.sigmoid = torch.nn.Sigmoid()
        self.use_bn = use_bn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        x = self.conv(x)
        if self.use_bn:
            x = self.bn(x)
        x = self.relu(x)
        x = self.sigmoid(x)
        return x


def run(title: str, use_bn: bool, mapping: QConfigMapping) -> torch.fx.GraphModule:
    example_inputs = (torch.rand(1, 3, 10, 10, dtype=torch.float),)
    model = MyModel(use_bn=use_bn)
    model.eval()  # not in the tutorial: quantbridge calibrates models in eval mode only
    prepared = prepare_fx(model, mapping, example_inputs, backend_config=backend_config)
    prepared(*example_inputs)  # calibrate
    converted = convert_fx(prepared, backend_config=backend_config)
    print(f"== {title}")
    print(converted)
    report = explain(converted)  # explain works on the converted model too
    floats = [r.node for r in report if r.status != "quantized"]
    print(f"RESULT {title}: quantized={report.quantized()} float={floats}")
    return converted


def main() -> None:
    torch.manual_seed(0)
    run("conv-relu", False, qconfig_mapping)
    # 7. faulty setups: conv-bn-relu is neither fused nor quantized, only linear is
    run("conv-bn-relu", True, qconfig_mapping)
    # the default mapping breaks the scale_min constraint: nothing is quantized (a warning
    # says so, as torch.ao's did)
    run("default-mapping", True, get_default_qconfig_mapping())


if __name__ == "__main__":
    main()
