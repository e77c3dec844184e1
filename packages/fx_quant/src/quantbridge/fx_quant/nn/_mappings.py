"""Module swaps the flow performs, keyed by exact module type.

* float or fused float -> QAT (``prepare_qat_fx`` swaps modules with ``from_float``);
* QAT -> float (``to_float``, before reference conversion);
* float -> reference quantized (``convert_to_reference_fx``).

BackendConfig entries name these classes as their ``qat_module`` / ``reference_quantized_module``.
"""

from __future__ import annotations

from torch import nn

from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.fx_quant.nn import qat as nnqat
from quantbridge.fx_quant.nn import reference as nnqr
from quantbridge.fx_quant.nn.intrinsic import qat as nniqat

__all__ = [
    "DEFAULT_QAT_MODULE_MAPPINGS",
    "DEFAULT_REFERENCE_MODULE_MAPPINGS",
    "FUSED_TO_QAT_MODULE_MAPPINGS",
    "FLOAT_TO_QAT_MODULE_MAPPINGS",
]

FLOAT_TO_QAT_MODULE_MAPPINGS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: nnqat.Linear,
    nn.Conv1d: nnqat.Conv1d,
    nn.Conv2d: nnqat.Conv2d,
    nn.Conv3d: nnqat.Conv3d,
    nn.Embedding: nnqat.Embedding,
    nn.EmbeddingBag: nnqat.EmbeddingBag,
}

FUSED_TO_QAT_MODULE_MAPPINGS: dict[type[nn.Module], type[nn.Module]] = {
    nni.LinearReLU: nniqat.LinearReLU,
    nni.LinearBn1d: nniqat.LinearBn1d,
    nni.ConvBn1d: nniqat.ConvBn1d,
    nni.ConvBn2d: nniqat.ConvBn2d,
    nni.ConvBn3d: nniqat.ConvBn3d,
    nni.ConvBnReLU1d: nniqat.ConvBnReLU1d,
    nni.ConvBnReLU2d: nniqat.ConvBnReLU2d,
    nni.ConvBnReLU3d: nniqat.ConvBnReLU3d,
    nni.ConvReLU1d: nniqat.ConvReLU1d,
    nni.ConvReLU2d: nniqat.ConvReLU2d,
    nni.ConvReLU3d: nniqat.ConvReLU3d,
}

# What prepare_qat swaps when no BackendConfig says otherwise.
DEFAULT_QAT_MODULE_MAPPINGS: dict[type[nn.Module], type[nn.Module]] = {
    **FLOAT_TO_QAT_MODULE_MAPPINGS,
    **FUSED_TO_QAT_MODULE_MAPPINGS,
}

DEFAULT_REFERENCE_MODULE_MAPPINGS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: nnqr.Linear,
    nn.Conv1d: nnqr.Conv1d,
    nn.Conv2d: nnqr.Conv2d,
    nn.Conv3d: nnqr.Conv3d,
    nn.ConvTranspose1d: nnqr.ConvTranspose1d,
    nn.ConvTranspose2d: nnqr.ConvTranspose2d,
    nn.ConvTranspose3d: nnqr.ConvTranspose3d,
    nn.Embedding: nnqr.Embedding,
    nn.EmbeddingBag: nnqr.EmbeddingBag,
    nn.LSTM: nnqr.LSTM,
    nn.GRU: nnqr.GRU,
    nn.RNNCell: nnqr.RNNCell,
    nn.LSTMCell: nnqr.LSTMCell,
    nn.GRUCell: nnqr.GRUCell,
}
