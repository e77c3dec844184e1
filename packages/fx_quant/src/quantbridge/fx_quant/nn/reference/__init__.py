"""Reference quantized modules (``torch.ao.nn.quantized.reference``'s layout).

Float activations, float weight stored, and a forward that uses
``dequantize(quantize(weight))`` through ``torch.ops.quantbridge``: the model a backend lowers.
"""

from quantbridge.fx_quant.nn.reference._base import QuantizedWeight, ReferenceQuantizedModule
from quantbridge.fx_quant.nn.reference._conv import (
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
)
from quantbridge.fx_quant.nn.reference._grouped import (
    GroupQuantizedEmbedding,
    GroupQuantizedLinear,
    GroupQuantizedWeight,
)
from quantbridge.fx_quant.nn.reference._linear import Linear
from quantbridge.fx_quant.nn.reference._rnn import GRU, LSTM, GRUCell, LSTMCell, RNNCell
from quantbridge.fx_quant.nn.reference._sparse import Embedding, EmbeddingBag

__all__ = [
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "Embedding",
    "EmbeddingBag",
    "GRU",
    "GroupQuantizedEmbedding",
    "GroupQuantizedLinear",
    "GroupQuantizedWeight",
    "GRUCell",
    "LSTM",
    "LSTMCell",
    "RNNCell",
    "Linear",
    "QuantizedWeight",
    "ReferenceQuantizedModule",
]
