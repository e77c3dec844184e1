"""Lowering a weight-only quantized model: its reference Linears become kernel modules.

``fx_quant.quantize_weight_only`` swaps a model's Linears and Embeddings for reference
modules holding per-group codes; here each ``GroupQuantizedLinear`` becomes a
``WeightOnlyLinear`` running ``kernels.linear_weight_only`` for one target. Embeddings keep
their reference form: a lookup dequantizes only the rows it reads.
"""

from __future__ import annotations

import copy

from torch import nn

from quantbridge import kernels as K
from quantbridge.fx_quant.nn.reference import GroupQuantizedLinear
from quantbridge.lowering._errors import LoweringError
from quantbridge.lowering._modules import WeightOnlyLinear

__all__ = ["lower_weight_only"]


def lower_weight_only(model: nn.Module, target: str, *, inplace: bool = False) -> nn.Module:
    """``model`` (a copy unless ``inplace``) with each ``GroupQuantizedLinear`` replaced by a
    ``WeightOnlyLinear`` packed for kernel ``target``."""
    result = model if inplace else copy.deepcopy(model)
    if isinstance(result, GroupQuantizedLinear):
        return _lowered(result, target)
    for name, module in list(result.named_modules()):
        if isinstance(module, GroupQuantizedLinear):
            result.set_submodule(name, _lowered(module, target))
    return result


def _lowered(reference: GroupQuantizedLinear, target: str) -> WeightOnlyLinear:
    codes = reference.weight_codes.detach().cpu().numpy()
    scales = reference.weight_scale.detach().cpu().numpy()
    symmetric = reference.qscheme.is_symmetric
    zero_points = None if symmetric else reference.weight_zero_point.detach().cpu().numpy()
    try:
        packed = K.pack_group_weight(
            codes, scales, zero_points, bits=reference.bits,
            group_size=reference.group_size, target=target,
        )  # fmt: skip
    except K.KernelError as e:
        raise LoweringError(f"lower_weight_only: {reference!r}: {e}") from None
    return WeightOnlyLinear(packed, reference.bias)
