"""Fuser methods, root-node getters and extra-inputs getters the built-in configs name.

Every one is a module-level function so a BackendConfig that refers to it can be written to
JSON and loaded back by qualified name (a closure such as ``sequential_wrapper2(...)`` cannot).

Fuser methods take ``(is_qat, *matched)`` in the order of the config's pattern: operator order
for sequential patterns, and the nesting of the complex form for the onednn conv-add patterns,
where ``add`` is the matched function (``torch.add``/``operator.add``) and the extra input is
passed as ``MatchAllNode``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import FunctionType
from typing import Any

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant._fuser_methods import check_same_mode
from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.qconfig import register_config_callables

Add = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# -- two-module fusions into a fused container (is_qat does not matter) ---------------------


def fuse_conv1d_relu(is_qat: bool, conv: nn.Module, relu: nn.Module) -> nn.Module:
    """``Conv1d, ReLU`` -> ``ConvReLU1d``."""
    return nni.ConvReLU1d(conv, relu)


def fuse_conv2d_relu(is_qat: bool, conv: nn.Module, relu: nn.Module) -> nn.Module:
    """``Conv2d, ReLU`` -> ``ConvReLU2d``."""
    return nni.ConvReLU2d(conv, relu)


def fuse_conv3d_relu(is_qat: bool, conv: nn.Module, relu: nn.Module) -> nn.Module:
    """``Conv3d, ReLU`` -> ``ConvReLU3d``."""
    return nni.ConvReLU3d(conv, relu)


def fuse_linear_relu(is_qat: bool, linear: nn.Module, relu: nn.Module) -> nn.Module:
    """``Linear, ReLU`` -> ``LinearReLU``."""
    return nni.LinearReLU(linear, relu)


def fuse_bn2d_relu(is_qat: bool, bn: nn.Module, relu: nn.Module) -> nn.Module:
    """``BatchNorm2d, ReLU`` -> ``BNReLU2d``."""
    return nni.BNReLU2d(bn, relu)


def fuse_bn3d_relu(is_qat: bool, bn: nn.Module, relu: nn.Module) -> nn.Module:
    """``BatchNorm3d, ReLU`` -> ``BNReLU3d``."""
    return nni.BNReLU3d(bn, relu)


def fuse_linear_leaky_relu(is_qat: bool, linear: nn.Module, leaky_relu: nn.Module) -> nn.Module:
    """``Linear, LeakyReLU`` -> ``LinearLeakyReLU``."""
    return nni.LinearLeakyReLU(linear, leaky_relu)


def fuse_linear_tanh(is_qat: bool, linear: nn.Module, tanh: nn.Module) -> nn.Module:
    """``Linear, Tanh`` -> ``LinearTanh``."""
    return nni.LinearTanh(linear, tanh)


# -- fusions that fold batch norm (post-training only) ---------------------------------------


def _no_qat(where: str, is_qat: bool) -> None:
    if is_qat:
        raise FxQuantError(
            f"{where}: this fusion folds batch norm and exists for post-training quantization "
            "only; there is no QAT module for it. Fuse with is_qat=False (prepare_fx), or "
            "remove this pattern from the BackendConfig for QAT"
        )


def _check_eval(where: str, *modules: nn.Module) -> None:
    check_same_mode(where, *modules)
    if modules[0].training:
        raise FxQuantError(
            f"{where}: folding batch norm needs modules in eval mode; call .eval() on the model "
            "before fusing for post-training quantization"
        )


def _fold_conv_bn(where: str, conv: nn.Module, bn: nn.Module) -> nn.Module:
    if type(conv) is not nn.Conv2d:
        raise FxQuantError(f"{where}: expected an nn.Conv2d, got {type(conv).__name__}")
    _check_eval(where, conv, bn)
    folded: nn.Module = fuse_conv_bn_eval(conv, bn)  # type: ignore[arg-type]
    return folded


def fuse_linear_bn_leaky_relu(
    is_qat: bool, linear: nn.Module, bn: nn.Module, leaky_relu: nn.Module
) -> nn.Module:
    """``Linear, BatchNorm1d, LeakyReLU`` -> ``LinearLeakyReLU`` with bn folded into the linear."""
    where = "fuse_linear_bn_leaky_relu"
    check_same_mode(where, linear, bn, leaky_relu)
    _no_qat(where, is_qat)
    if type(linear) is not nn.Linear:
        raise FxQuantError(f"{where}: expected an nn.Linear, got {type(linear).__name__}")
    _check_eval(where, linear, bn)
    folded: nn.Module = fuse_linear_bn_eval(linear, bn)  # type: ignore[arg-type]
    return nni.LinearLeakyReLU(folded, leaky_relu)


# -- onednn: conv + add (+ relu), the conv on the left or right of the add -------------------
# Complex-form patterns: (add, conv, MatchAllNode), (add, MatchAllNode, conv), with (bn, conv)
# in place of conv for the batch-norm variants, and (relu, <add pattern>) on top for the relu
# variants. The root is the conv; the other add operand becomes an extra input of the fused node.


def fuse_conv_add_left(is_qat: bool, add: Add, conv: nn.Module, extra: Any) -> nn.Module:
    """``add(conv(x), y)`` -> ``ConvAdd2d``."""
    return nni.ConvAdd2d(conv, add)


def fuse_conv_add_right(is_qat: bool, add: Add, extra: Any, conv: nn.Module) -> nn.Module:
    """``add(y, conv(x))`` -> ``ConvAdd2d``."""
    return nni.ConvAdd2d(conv, add)


def fuse_conv_bn_add_left(
    is_qat: bool, add: Add, bn_conv: tuple[nn.Module, nn.Module], extra: Any
) -> nn.Module:
    """``add(bn(conv(x)), y)`` -> ``ConvAdd2d`` with bn folded into the conv."""
    bn, conv = bn_conv
    _no_qat("fuse_conv_bn_add_left", is_qat)
    return nni.ConvAdd2d(_fold_conv_bn("fuse_conv_bn_add_left", conv, bn), add)


def fuse_conv_bn_add_right(
    is_qat: bool, add: Add, extra: Any, bn_conv: tuple[nn.Module, nn.Module]
) -> nn.Module:
    """``add(y, bn(conv(x)))`` -> ``ConvAdd2d`` with bn folded into the conv."""
    bn, conv = bn_conv
    _no_qat("fuse_conv_bn_add_right", is_qat)
    return nni.ConvAdd2d(_fold_conv_bn("fuse_conv_bn_add_right", conv, bn), add)


def fuse_conv_add_relu_left(
    is_qat: bool, relu: nn.Module, add_pattern: tuple[Add, nn.Module, Any]
) -> nn.Module:
    """``relu(add(conv(x), y))`` -> ``ConvAddReLU2d``."""
    add, conv, _extra = add_pattern
    return nni.ConvAddReLU2d(conv, add, relu)


def fuse_conv_add_relu_right(
    is_qat: bool, relu: nn.Module, add_pattern: tuple[Add, Any, nn.Module]
) -> nn.Module:
    """``relu(add(y, conv(x)))`` -> ``ConvAddReLU2d``."""
    add, _extra, conv = add_pattern
    return nni.ConvAddReLU2d(conv, add, relu)


def fuse_conv_bn_add_relu_left(
    is_qat: bool, relu: nn.Module, add_pattern: tuple[Add, tuple[nn.Module, nn.Module], Any]
) -> nn.Module:
    """``relu(add(bn(conv(x)), y))`` -> ``ConvAddReLU2d`` with bn folded into the conv."""
    add, (bn, conv), _extra = add_pattern
    _no_qat("fuse_conv_bn_add_relu_left", is_qat)
    return nni.ConvAddReLU2d(_fold_conv_bn("fuse_conv_bn_add_relu_left", conv, bn), add, relu)


def fuse_conv_bn_add_relu_right(
    is_qat: bool, relu: nn.Module, add_pattern: tuple[Add, Any, tuple[nn.Module, nn.Module]]
) -> nn.Module:
    """``relu(add(y, bn(conv(x))))`` -> ``ConvAddReLU2d`` with bn folded into the conv."""
    add, _extra, (bn, conv) = add_pattern
    _no_qat("fuse_conv_bn_add_relu_right", is_qat)
    return nni.ConvAddReLU2d(_fold_conv_bn("fuse_conv_bn_add_relu_right", conv, bn), add, relu)


# Root-node and extra-inputs getters receive the matched node pattern (same nesting as the
# complex pattern) and return the conv node / the list of extra input nodes.


def conv_add_root_node_getter_left(pattern: Any) -> Any:
    _add, conv, _extra = pattern
    return conv


def conv_add_extra_inputs_getter_left(pattern: Any) -> list[Any]:
    _add, _conv, extra = pattern
    return [extra]


def conv_add_root_node_getter_right(pattern: Any) -> Any:
    _add, _extra, conv = pattern
    return conv


def conv_add_extra_inputs_getter_right(pattern: Any) -> list[Any]:
    _add, extra, _conv = pattern
    return [extra]


def conv_bn_add_root_node_getter_left(pattern: Any) -> Any:
    _add, (_bn, conv), _extra = pattern
    return conv


def conv_bn_add_extra_inputs_getter_left(pattern: Any) -> list[Any]:
    _add, _bn_conv, extra = pattern
    return [extra]


def conv_bn_add_root_node_getter_right(pattern: Any) -> Any:
    _add, _extra, (_bn, conv) = pattern
    return conv


def conv_bn_add_extra_inputs_getter_right(pattern: Any) -> list[Any]:
    _add, extra, _bn_conv = pattern
    return [extra]


def conv_add_relu_root_node_getter_left(pattern: Any) -> Any:
    _relu, add_pattern = pattern
    return conv_add_root_node_getter_left(add_pattern)


def conv_add_relu_extra_inputs_getter_left(pattern: Any) -> list[Any]:
    _relu, add_pattern = pattern
    return conv_add_extra_inputs_getter_left(add_pattern)


def conv_add_relu_root_node_getter_right(pattern: Any) -> Any:
    _relu, add_pattern = pattern
    return conv_add_root_node_getter_right(add_pattern)


def conv_add_relu_extra_inputs_getter_right(pattern: Any) -> list[Any]:
    _relu, add_pattern = pattern
    return conv_add_extra_inputs_getter_right(add_pattern)


def conv_bn_add_relu_root_node_getter_left(pattern: Any) -> Any:
    _relu, add_pattern = pattern
    return conv_bn_add_root_node_getter_left(add_pattern)


def conv_bn_add_relu_extra_inputs_getter_left(pattern: Any) -> list[Any]:
    _relu, add_pattern = pattern
    return conv_bn_add_extra_inputs_getter_left(add_pattern)


def conv_bn_add_relu_root_node_getter_right(pattern: Any) -> Any:
    _relu, add_pattern = pattern
    return conv_bn_add_root_node_getter_right(add_pattern)


def conv_bn_add_relu_extra_inputs_getter_right(pattern: Any) -> list[Any]:
    _relu, add_pattern = pattern
    return conv_bn_add_extra_inputs_getter_right(add_pattern)


# Backend config files (BackendConfig.from_json) may name every public function above.
register_config_callables(
    *(
        f
        for name, f in list(globals().items())
        if isinstance(f, FunctionType) and f.__module__ == __name__ and not name.startswith("_")
    )
)
