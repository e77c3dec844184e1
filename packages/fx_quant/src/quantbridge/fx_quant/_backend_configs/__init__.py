"""The built-in BackendConfigs: torch.ao 2.13's seven, with quantbridge's modules."""

from collections.abc import Callable

from quantbridge.fx_quant._backend_configs._executorch import get_executorch_backend_config
from quantbridge.fx_quant._backend_configs._fbgemm import get_fbgemm_backend_config
from quantbridge.fx_quant._backend_configs._native import (
    get_native_backend_config,
    get_native_backend_config_dict,
    get_test_only_legacy_native_backend_config,
    get_test_only_legacy_native_backend_config_dict,
)
from quantbridge.fx_quant._backend_configs._onednn import get_onednn_backend_config
from quantbridge.fx_quant._backend_configs._qnnpack import get_qnnpack_backend_config
from quantbridge.fx_quant._backend_configs._tensorrt import (
    get_tensorrt_backend_config,
    get_tensorrt_backend_config_dict,
)
from quantbridge.fx_quant._backend_configs._x86 import get_x86_backend_config
from quantbridge.qconfig import BackendConfig

# the names get_backend_config knows without any plugin
BUILTIN_BACKEND_CONFIGS: dict[str, Callable[[], BackendConfig]] = {
    "native": get_native_backend_config,
    "fbgemm": get_fbgemm_backend_config,
    "x86": get_x86_backend_config,
    "qnnpack": get_qnnpack_backend_config,
    "onednn": get_onednn_backend_config,
    "executorch": get_executorch_backend_config,
    "tensorrt": get_tensorrt_backend_config,
}

__all__ = [
    "BUILTIN_BACKEND_CONFIGS",
    "get_executorch_backend_config",
    "get_fbgemm_backend_config",
    "get_native_backend_config",
    "get_native_backend_config_dict",
    "get_onednn_backend_config",
    "get_qnnpack_backend_config",
    "get_tensorrt_backend_config",
    "get_tensorrt_backend_config_dict",
    "get_test_only_legacy_native_backend_config",
    "get_test_only_legacy_native_backend_config_dict",
    "get_x86_backend_config",
]
