"""quantbridge.kernels: numba-JIT int8 CPU kernels on numpy arrays, one implementation per target.

Depends on numpy and numba only: GEMM (static and dynamic linear, conv1d/conv2d, quantized
matmul), quantize/dequantize/requantize, elementwise add/mul and clamps, pools, 256-entry
lookup tables, weight-only embedding_bag and weight-only group-quantized linear (int4 /
int8), for the ``avx512_vnni``, ``avx_vnni``, ``avx2``
and ``generic`` targets (chosen at import, overridable). Layouts: see ``_layout.py``.
"""

# First: numba picks each function's cache locator when its @njit(cache=True) runs.
from quantbridge.kernels import _numba_compat
from quantbridge.kernels._numba_compat import KernelCacheWarning

# isort: split
from quantbridge.kernels._activation import clamp, hardtanh, relu, relu6
from quantbridge.kernels._attention import attention
from quantbridge.kernels._conv import (
    PackedConvWeight,
    PreparedConv,
    PreparedConvAdd,
    conv1d,
    conv2d,
    conv2d_add,
)
from quantbridge.kernels._elementwise import add, add_relu, mul, mul_relu
from quantbridge.kernels._embedding import (
    PackedEmbedding,
    embedding_bag,
    from_fused_rows,
    pack_embedding_4bit,
    pack_embedding_8bit,
    to_fused_rows,
)
from quantbridge.kernels._errors import KernelError, TargetUnavailableError
from quantbridge.kernels._float_ops import PreparedLayerNorm, gelu, layer_norm, softmax
from quantbridge.kernels._linear import (
    FloatColumns,
    PackedLinearWeight,
    linear,
    linear_dynamic,
    linear_float,
)
from quantbridge.kernels._lut import LUT_FUNCTIONS, apply_lut, build_lut
from quantbridge.kernels._matmul import matmul
from quantbridge.kernels._mul_channels import PreparedMulChannels, mul_channels
from quantbridge.kernels._pool import (
    PreparedAdaptiveAvgPool2d,
    adaptive_avg_pool2d,
    avg_pool2d,
    max_pool2d,
)
from quantbridge.kernels._qparams import QParams
from quantbridge.kernels._quantize import (
    PreparedDequantize,
    PreparedQuantize,
    PreparedRequantize,
    dequantize_per_channel,
    dequantize_per_tensor,
    quantize_per_channel,
    quantize_per_tensor,
    requantize,
)
from quantbridge.kernels._recurrent import gru_cell, lstm_cell
from quantbridge.kernels._sequence import gru_sequence, lstm_sequence
from quantbridge.kernels._targets import (
    ENV_VAR,
    TARGETS,
    available_targets,
    best_target,
    cpu_features,
    resolve_target,
    target_supported,
)
from quantbridge.kernels._threads import get_num_threads, set_num_threads, set_num_threads_source
from quantbridge.kernels._weight_only import (
    PackedGroupWeight,
    linear_weight_only,
    pack_group_weight,
)

# Every kernel module is imported now: switch their caches to key-named data files.
_numba_compat.harden(_numba_compat.package_dispatchers(_numba_compat.package_modules()))

__all__ = [
    "ENV_VAR",
    "TARGETS",
    "KernelCacheWarning",
    "KernelError",
    "TargetUnavailableError",
    "available_targets",
    "best_target",
    "cpu_features",
    "resolve_target",
    "target_supported",
    # GEMM family (linear, dynamic linear, conv, matmul) and threads
    "PackedConvWeight",
    "PreparedAdaptiveAvgPool2d",
    "PreparedConv",
    "PreparedConvAdd",
    "PreparedDequantize",
    "PreparedLayerNorm",
    "PreparedMulChannels",
    "PreparedQuantize",
    "PreparedRequantize",
    "QParams",
    "FloatColumns",
    "PackedLinearWeight",
    "conv1d",
    "conv2d",
    "conv2d_add",
    "get_num_threads",
    "linear",
    "linear_dynamic",
    "linear_float",
    "lstm_cell",
    "lstm_sequence",
    "matmul",
    "set_num_threads",
    "set_num_threads_source",
    # weight-only group-quantized linear (decoder LLMs)
    "PackedGroupWeight",
    "linear_weight_only",
    "pack_group_weight",
    # float32 ops around the GEMMs (transformers)
    "gelu",
    "layer_norm",
    "attention",
    "softmax",
    # quantize / elementwise / pools / lookup tables / embedding_bag
    "LUT_FUNCTIONS",
    "PackedEmbedding",
    "adaptive_avg_pool2d",
    "add",
    "add_relu",
    "apply_lut",
    "avg_pool2d",
    "build_lut",
    "clamp",
    "dequantize_per_channel",
    "dequantize_per_tensor",
    "embedding_bag",
    "gru_cell",
    "gru_sequence",
    "from_fused_rows",
    "hardtanh",
    "max_pool2d",
    "mul",
    "mul_channels",
    "mul_relu",
    "pack_embedding_4bit",
    "pack_embedding_8bit",
    "quantize_per_channel",
    "quantize_per_tensor",
    "relu",
    "relu6",
    "requantize",
    "to_fused_rows",
]
