"""quantbridge.fx_quant.nn: the module zoo of the flow, in torch.ao.nn's layout.

* :mod:`.intrinsic`: fused float modules (``ConvReLU2d``, ``ConvBn2d``, ...);
* :mod:`.intrinsic.qat`: their QAT versions (batch norm folded where fused);
* :mod:`.qat`: QAT Linear/Conv/Embedding;
* :mod:`.quantizable`: traceable attention and transformer modules (swapped in by prepare);
* :mod:`.reference`: reference quantized modules (float op on a quantize-dequantized weight).

The swap tables the flow and the BackendConfigs use are exported here.
"""

from quantbridge.fx_quant.nn import intrinsic, qat, quantizable, reference
from quantbridge.fx_quant.nn._mappings import (
    DEFAULT_QAT_MODULE_MAPPINGS,
    DEFAULT_REFERENCE_MODULE_MAPPINGS,
    FLOAT_TO_QAT_MODULE_MAPPINGS,
    FUSED_TO_QAT_MODULE_MAPPINGS,
)
from quantbridge.fx_quant.nn.intrinsic import qat as intrinsic_qat

__all__ = [
    "DEFAULT_QAT_MODULE_MAPPINGS",
    "DEFAULT_REFERENCE_MODULE_MAPPINGS",
    "FLOAT_TO_QAT_MODULE_MAPPINGS",
    "FUSED_TO_QAT_MODULE_MAPPINGS",
    "intrinsic",
    "intrinsic_qat",
    "qat",
    "quantizable",
    "reference",
]
