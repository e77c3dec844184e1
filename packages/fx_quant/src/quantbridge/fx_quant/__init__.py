"""quantbridge.fx_quant: FX graph mode quantization on plain tensors.

fuse_fx, prepare_fx, prepare_qat_fx, convert_to_reference_fx and convert_fx with torch.ao
2.13's signatures and custom configs; the quantize/dequantize ops in the
``torch.ops.quantbridge`` namespace; the fused, QAT and reference nn modules
(``quantbridge.fx_quant.nn``); the built-in BackendConfigs; the backend registry; and
diagnostics and calibration helpers (explain, compare_layers/compare_weights, bias_correction,
calibrate, sync_observers).
"""

from quantbridge.fx_quant import _ops  # noqa: F401  (registers torch.ops.quantbridge.*)
from quantbridge.fx_quant._api import (
    convert_fx,
    convert_to_reference_fx,
    fuse_fx,
    prepare_fx,
    prepare_qat_fx,
)
from quantbridge.fx_quant._backend_configs import (
    get_executorch_backend_config,
    get_fbgemm_backend_config,
    get_native_backend_config,
    get_native_backend_config_dict,
    get_onednn_backend_config,
    get_qnnpack_backend_config,
    get_tensorrt_backend_config,
    get_tensorrt_backend_config_dict,
    get_x86_backend_config,
)
from quantbridge.fx_quant._bias_correction import bias_correction
from quantbridge.fx_quant._calibrate import ProgressBar, calibrate
from quantbridge.fx_quant._compare import (
    QUANTIZED_OUTPUTS_KEY,
    LayerComparison,
    LayerError,
    WeightComparison,
    WeightError,
    compare_layers,
    compare_weights,
)
from quantbridge.fx_quant._convert import NotPreparedError
from quantbridge.fx_quant._custom_config import (
    ConvertCustomConfig,
    FuseCustomConfig,
    PrepareCustomConfig,
    QuantType,
)
from quantbridge.fx_quant._distributed import sync_observers, sync_observers_hook
from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._explain import ExplainReport, explain
from quantbridge.fx_quant._export_capture import ExportCaptureError, equivalence_table
from quantbridge.fx_quant._fuse import FusionError
from quantbridge.fx_quant._onnx_export import (
    ONNX_OPSETS,
    OnnxExportError,
    OnnxExportReport,
    export_onnx,
)
from quantbridge.fx_quant._outlier_channels import (
    OutlierChannelsConfig,
    keep_outlier_channels_float,
)
from quantbridge.fx_quant._prepare import ExampleInputsError, StrictPrepareError
from quantbridge.fx_quant._qconfig_propagation import FusionQConfigError
from quantbridge.fx_quant._range_check import HUGE_RANGE, RangeFinding, find_dominated_ranges
from quantbridge.fx_quant._registry import (
    BackendEntry,
    BackendLike,
    BackendRegistry,
    LoweringRegistryError,
    backend_config_names,
    backend_registry,
    get_backend_config,
    get_lowering,
    register_backend_config,
    register_lowering,
    registered_lowerings,
    unregister_lowering,
)
from quantbridge.fx_quant._smoothquant import SmoothQuantConfig, SmoothQuantReport, smooth_quant
from quantbridge.fx_quant._state import NodeDecision, SwappedModule
from quantbridge.fx_quant._tracer import QuantizationTracer, TraceError
from quantbridge.fx_quant._transformer_swap import TransformerSwapError
from quantbridge.fx_quant._weight_only import quantize_weight_only

__all__ = [
    "FxQuantError",
    # the flow (torch.ao 2.13 signatures)
    "fuse_fx",
    "prepare_fx",
    "prepare_qat_fx",
    "convert_to_reference_fx",
    "convert_fx",
    "PrepareCustomConfig",
    "ConvertCustomConfig",
    "FuseCustomConfig",
    "QuantType",
    "QuantizationTracer",
    # diagnostics and errors
    "explain",
    "find_dominated_ranges",
    "smooth_quant",
    "quantize_weight_only",
    "SmoothQuantConfig",
    "keep_outlier_channels_float",
    "OutlierChannelsConfig",
    "SmoothQuantReport",
    "HUGE_RANGE",
    "RangeFinding",
    "ExplainReport",
    "NodeDecision",
    "SwappedModule",
    "ExampleInputsError",
    "FusionError",
    "FusionQConfigError",
    "NotPreparedError",
    "StrictPrepareError",
    "TraceError",
    "ExportCaptureError",
    "equivalence_table",
    "TransformerSwapError",
    # accuracy debugging: which quantized op or weight loses the signal
    "compare_layers",
    "compare_weights",
    "LayerComparison",
    "LayerError",
    "WeightComparison",
    "WeightError",
    "QUANTIZED_OUTPUTS_KEY",
    # the backend registry (entry-point group "quantbridge.backends")
    "BackendEntry",
    "BackendLike",
    "BackendRegistry",
    "backend_registry",
    "register_lowering",
    "get_lowering",
    "registered_lowerings",
    "unregister_lowering",
    "LoweringRegistryError",
    # built-in BackendConfigs
    "backend_config_names",
    "get_backend_config",
    "get_executorch_backend_config",
    "get_fbgemm_backend_config",
    "get_native_backend_config",
    "get_native_backend_config_dict",
    "get_onednn_backend_config",
    "get_qnnpack_backend_config",
    "get_tensorrt_backend_config",
    "get_tensorrt_backend_config_dict",
    "get_x86_backend_config",
    "register_backend_config",
    # calibration and QAT across torch.distributed ranks
    "calibrate",
    "ProgressBar",
    "sync_observers",
    "sync_observers_hook",
    # accuracy: bias correction of quantized weights on calibration data
    "bias_correction",
    # deployment: QDQ ONNX files for ONNX Runtime, OpenVINO and TensorRT
    "export_onnx",
    "OnnxExportError",
    "OnnxExportReport",
    "ONNX_OPSETS",
]
