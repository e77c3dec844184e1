"""quantbridge.fx_quant: FX graph mode quantization on plain tensors.

Not built yet. It will hold fuse_fx, prepare_fx, prepare_qat_fx, convert_to_reference_fx and
convert_fx with torch.ao 2.13's signatures, the quantize/dequantize ops in the
``torch.ops.quantbridge`` namespace, the fused/QAT/reference nn modules, the built-in
BackendConfigs and the lowering registry. Only its exception class exists today.
"""

from quantbridge.fx_quant import _ops  # noqa: F401  (registers torch.ops.quantbridge.*)
from quantbridge.fx_quant._errors import FxQuantError

__all__ = ["FxQuantError"]
