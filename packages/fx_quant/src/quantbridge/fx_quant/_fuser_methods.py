"""Fuser methods: what a fusion pattern becomes, with torch.ao's ``(is_qat, *modules)`` calls.

For QAT (``is_qat=True``) batch norm stays live inside a fused container (``ConvBn2d`` etc.)
that prepare_qat later swaps for its BN-folding QAT module; for post-training fusion the batch
norm is folded into the preceding layer's weights right away (``torch.nn.utils.fusion``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.qconfig import register_config_callables

__all__ = [
    "DEFAULT_OP_LIST_TO_FUSER_METHOD",
    "fuse_conv_bn",
    "fuse_conv_bn_relu",
    "fuse_convtranspose_bn",
    "fuse_linear_bn",
    "get_fuser_method",
    "sequential_wrapper2",
]

FuserMethod = Callable[..., nn.Module]

_CONV_BN: dict[type[nn.Module], type[nn.Module]] = {
    nn.Conv1d: nni.ConvBn1d,
    nn.Conv2d: nni.ConvBn2d,
    nn.Conv3d: nni.ConvBn3d,
}
_CONV_BN_RELU: dict[type[nn.Module], type[nn.Module]] = {
    nn.Conv1d: nni.ConvBnReLU1d,
    nn.Conv2d: nni.ConvBnReLU2d,
    nn.Conv3d: nni.ConvBnReLU3d,
}
_CONV_RELU: dict[type[nn.Module], type[nn.Module]] = {
    nn.Conv1d: nni.ConvReLU1d,
    nn.Conv2d: nni.ConvReLU2d,
    nn.Conv3d: nni.ConvReLU3d,
}


def _any(module: nn.Module) -> Any:
    """torch's fusion helpers are typed for concrete layer classes; ours are checked above."""
    return module


def check_same_mode(where: str, *modules: nn.Module) -> None:
    """FxQuantError unless ``modules`` are all in train mode or all in eval mode."""
    if len({m.training for m in modules}) > 1:
        modes = ", ".join(
            f"{type(m).__name__}={'train' if m.training else 'eval'}" for m in modules
        )
        raise FxQuantError(
            f"{where}: the modules must all be in train or all in eval mode ({modes}); call "
            ".train() or .eval() on the model before fusing"
        )


def _check_bn(where: str, bn: nn.Module, channels: int) -> None:
    if getattr(bn, "num_features", None) != channels:
        raise FxQuantError(
            f"{where}: {type(bn).__name__} has {getattr(bn, 'num_features', '?')} features but "
            f"the layer before it has {channels} output channels"
        )
    if not getattr(bn, "affine", False):
        raise FxQuantError(f"{where}: only affine batch norm can be fused (affine=True)")
    if not getattr(bn, "track_running_stats", False):
        raise FxQuantError(f"{where}: only batch norm with track_running_stats=True can be fused")


def _lookup(where: str, table: dict[type[nn.Module], type[nn.Module]], mod: nn.Module) -> Any:
    fused = table.get(type(mod))
    if fused is None:
        names = ", ".join(t.__name__ for t in table)
        raise FxQuantError(f"{where}: cannot fuse a {type(mod).__name__}; supported: {names}")
    return fused


def fuse_conv_bn(is_qat: bool, conv: nn.Module, bn: nn.Module) -> nn.Module:
    """conv + bn: ``ConvBnNd(conv, bn)`` for QAT, else a conv with bn folded in."""
    check_same_mode("fuse_conv_bn", conv, bn)
    if is_qat:
        fused = _lookup("fuse_conv_bn", _CONV_BN, conv)
        _check_bn("fuse_conv_bn", bn, conv.out_channels)  # type: ignore[arg-type]
        result: nn.Module = fused(conv, bn)
        return result
    folded: nn.Module = fuse_conv_bn_eval(_any(conv), _any(bn))
    return folded


def fuse_conv_bn_relu(is_qat: bool, conv: nn.Module, bn: nn.Module, relu: nn.Module) -> nn.Module:
    """conv + bn + relu: ``ConvBnReLUNd`` for QAT, else ``ConvReLUNd(folded conv, relu)``."""
    check_same_mode("fuse_conv_bn_relu", conv, bn, relu)
    if is_qat:
        fused = _lookup("fuse_conv_bn_relu", _CONV_BN_RELU, conv)
        _check_bn("fuse_conv_bn_relu", bn, conv.out_channels)  # type: ignore[arg-type]
        result: nn.Module = fused(conv, bn, relu)
        return result
    fused = _lookup("fuse_conv_bn_relu", _CONV_RELU, conv)
    result = fused(fuse_conv_bn_eval(_any(conv), _any(bn)), relu)
    return result


def fuse_linear_bn(is_qat: bool, linear: nn.Module, bn: nn.Module) -> nn.Module:
    """linear + bn1d: ``LinearBn1d`` for QAT, else a Linear with bn folded in."""
    check_same_mode("fuse_linear_bn", linear, bn)
    if is_qat:
        _check_bn("fuse_linear_bn", bn, linear.out_features)  # type: ignore[arg-type]
        return nni.LinearBn1d(linear, bn)
    folded: nn.Module = fuse_linear_bn_eval(_any(linear), _any(bn))
    return folded


def fuse_convtranspose_bn(is_qat: bool, convt: nn.Module, bn: nn.Module) -> nn.Module:
    """conv-transpose + bn: folded for post-training fusion; QAT has no such fused module."""
    check_same_mode("fuse_convtranspose_bn", convt, bn)
    if is_qat:
        raise FxQuantError(
            "fuse_convtranspose_bn: ConvTranspose + BatchNorm cannot be fused for QAT (there "
            "is no QAT ConvTransposeBn module); leave the pair unfused in the BackendConfig"
        )
    folded: nn.Module = fuse_conv_bn_eval(_any(convt), _any(bn), transpose=True)
    return folded


def sequential_wrapper2(sequential: type[nn.Module]) -> FuserMethod:
    """A fuser method that puts two modules into ``sequential`` whatever ``is_qat`` says."""

    def fuser_method(is_qat: bool, m1: nn.Module, m2: nn.Module) -> nn.Module:
        return sequential(m1, m2)

    fuser_method.__name__ = f"fuse_into_{sequential.__name__}"
    return fuser_method


DEFAULT_OP_LIST_TO_FUSER_METHOD: dict[tuple[type[nn.Module], ...], FuserMethod] = {
    (nn.Conv1d, nn.BatchNorm1d): fuse_conv_bn,
    (nn.Conv1d, nn.BatchNorm1d, nn.ReLU): fuse_conv_bn_relu,
    (nn.Conv2d, nn.BatchNorm2d): fuse_conv_bn,
    (nn.Conv2d, nn.BatchNorm2d, nn.ReLU): fuse_conv_bn_relu,
    (nn.Conv3d, nn.BatchNorm3d): fuse_conv_bn,
    (nn.Conv3d, nn.BatchNorm3d, nn.ReLU): fuse_conv_bn_relu,
    (nn.Conv1d, nn.ReLU): sequential_wrapper2(nni.ConvReLU1d),
    (nn.Conv2d, nn.ReLU): sequential_wrapper2(nni.ConvReLU2d),
    (nn.Conv3d, nn.ReLU): sequential_wrapper2(nni.ConvReLU3d),
    (nn.Linear, nn.BatchNorm1d): fuse_linear_bn,
    (nn.Linear, nn.ReLU): sequential_wrapper2(nni.LinearReLU),
    (nn.BatchNorm2d, nn.ReLU): sequential_wrapper2(nni.BNReLU2d),
    (nn.BatchNorm3d, nn.ReLU): sequential_wrapper2(nni.BNReLU3d),
    (nn.ConvTranspose1d, nn.BatchNorm1d): fuse_convtranspose_bn,
    (nn.ConvTranspose2d, nn.BatchNorm2d): fuse_convtranspose_bn,
    (nn.ConvTranspose3d, nn.BatchNorm3d): fuse_convtranspose_bn,
}


def get_fuser_method(
    op_list: tuple[type[nn.Module], ...],
    additional_fuser_method_mapping: dict[tuple[type[nn.Module], ...], FuserMethod] | None = None,
) -> FuserMethod:
    """The fuser method for a tuple of module types (extra mappings take precedence)."""
    mapping = {**DEFAULT_OP_LIST_TO_FUSER_METHOD, **(additional_fuser_method_mapping or {})}
    method = mapping.get(tuple(op_list))
    if method is None:
        names = ", ".join(t.__name__ for t in op_list)
        raise FxQuantError(
            f"get_fuser_method: no fuser method for ({names}); pass one in "
            "additional_fuser_method_mapping or set it on the BackendPatternConfig"
        )
    return method


# Backend config files (BackendConfig.from_json) may name these fuser methods.
register_config_callables(fuse_conv_bn, fuse_conv_bn_relu, fuse_linear_bn, fuse_convtranspose_bn)
