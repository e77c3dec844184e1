"""Traceable equivalents of torch's attention and transformer modules.

The role ``torch.ao.nn.quantizable`` has for ``nn.MultiheadAttention`` in torch.ao.

``prepare_fx`` and ``prepare_qat_fx`` swap ``nn.MultiheadAttention``,
``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer``, ``nn.TransformerEncoder``,
``nn.TransformerDecoder`` and ``nn.Transformer`` for these classes before tracing, so the
tracer reaches their ``nn.Linear`` projections and feed-forward layers and the normal flow
quantizes them. :class:`AttentionCore` (softmax attention between the projections) stays a
float leaf. :class:`OutlierSplitLinear` (made by ``keep_outlier_channels_float``) is traced
through too; its float parts (``FLOAT_ONLY``) never get quantized.
"""

from torch import nn

from quantbridge.fx_quant.nn.quantizable._activation import AttentionCore, MultiheadAttention
from quantbridge.fx_quant.nn.quantizable._outliers import (
    FLOAT_ONLY,
    ChannelScale,
    FloatColumns,
    OutlierSplitLinear,
    ZeroedChannels,
)
from quantbridge.fx_quant.nn.quantizable._transformer import (
    FLOAT_TO_TRACEABLE,
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

# Modules the quantization tracer traces through although they live in quantbridge.fx_quant.nn.
TRACED_THROUGH: tuple[type[nn.Module], ...] = (
    MultiheadAttention,
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
    OutlierSplitLinear,
)

__all__ = [
    "FLOAT_ONLY",
    "FLOAT_TO_TRACEABLE",
    "TRACED_THROUGH",
    "AttentionCore",
    "ChannelScale",
    "FloatColumns",
    "OutlierSplitLinear",
    "ZeroedChannels",
    "MultiheadAttention",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
]
