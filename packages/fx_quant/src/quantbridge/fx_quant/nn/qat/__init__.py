"""QAT modules (``torch.ao.nn.qat``'s layout): float layers whose weight is fake-quantized.

Each is built with ``from_float(mod)`` from a float module carrying ``mod.qconfig`` (the weight
fake-quant comes from ``qconfig.weight()``) and turns back with ``to_float()``.
"""

from quantbridge.fx_quant.nn.qat._conv import Conv1d, Conv2d, Conv3d
from quantbridge.fx_quant.nn.qat._embedding import Embedding, EmbeddingBag
from quantbridge.fx_quant.nn.qat._linear import Linear

__all__ = ["Conv1d", "Conv2d", "Conv3d", "Embedding", "EmbeddingBag", "Linear"]
