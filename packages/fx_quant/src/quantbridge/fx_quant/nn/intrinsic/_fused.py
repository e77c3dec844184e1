"""Fused float modules: sequential containers that mark a pattern the flow treats as one unit.

Fusion (``fuse_fx`` or the fuser methods) replaces e.g. ``conv -> relu`` with
``ConvReLU2d(conv, relu)``. They compute exactly what their children compute in order; what
they add is a type the QAT swap and the reference conversion can key on. Constructors check
the children's types so a wrong fusion fails where it is made, not later in convert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils.parametrize import type_before_parametrizations

from quantbridge.fx_quant._errors import FxQuantError

__all__ = [
    "BNReLU2d",
    "BNReLU3d",
    "ConvAdd2d",
    "ConvAddReLU2d",
    "ConvBn1d",
    "ConvBn2d",
    "ConvBn3d",
    "ConvBnReLU1d",
    "ConvBnReLU2d",
    "ConvBnReLU3d",
    "ConvReLU1d",
    "ConvReLU2d",
    "ConvReLU3d",
    "FusedModule",
    "LinearBn1d",
    "LinearLeakyReLU",
    "LinearReLU",
    "LinearTanh",
]


class FusedModule(nn.Sequential):
    """Base of every fused module: the flow recognises fused units by this type."""

    # The child types, in order, that the constructor accepts.
    _CHILD_TYPES: tuple[tuple[type[nn.Module], ...], ...] = ()

    def __init__(self, *modules: nn.Module) -> None:
        expected = self._CHILD_TYPES
        got = tuple(type_before_parametrizations(m) for m in modules)
        if len(got) != len(expected) or not all(
            g in allowed for g, allowed in zip(got, expected, strict=False)
        ):
            want = ", ".join("|".join(t.__name__ for t in allowed) for allowed in expected)
            have = ", ".join(t.__name__ for t in got)
            raise FxQuantError(
                f"{type(self).__name__} fuses ({want}); got ({have}). Build it from modules "
                "of exactly these types (subclasses are not accepted, as in torch.ao)"
            )
        super().__init__(*modules)


# Synchronized batch norm may stand in for its per-rank counterpart (convert_sync_batchnorm
# rewrites a fused model's children in place).
_BN1 = (nn.BatchNorm1d, nn.SyncBatchNorm)
_BN2 = (nn.BatchNorm2d, nn.SyncBatchNorm)
_BN3 = (nn.BatchNorm3d, nn.SyncBatchNorm)
_RELU = (nn.ReLU,)


class ConvReLU1d(FusedModule):
    """``Conv1d -> ReLU``."""

    _CHILD_TYPES = ((nn.Conv1d,), _RELU)

    def __init__(self, conv: nn.Module, relu: nn.Module) -> None:
        super().__init__(conv, relu)


class ConvReLU2d(FusedModule):
    """``Conv2d -> ReLU``."""

    _CHILD_TYPES = ((nn.Conv2d,), _RELU)

    def __init__(self, conv: nn.Module, relu: nn.Module) -> None:
        super().__init__(conv, relu)


class ConvReLU3d(FusedModule):
    """``Conv3d -> ReLU``."""

    _CHILD_TYPES = ((nn.Conv3d,), _RELU)

    def __init__(self, conv: nn.Module, relu: nn.Module) -> None:
        super().__init__(conv, relu)


class ConvBn1d(FusedModule):
    """``Conv1d -> BatchNorm1d``."""

    _CHILD_TYPES = ((nn.Conv1d,), _BN1)

    def __init__(self, conv: nn.Module, bn: nn.Module) -> None:
        super().__init__(conv, bn)


class ConvBn2d(FusedModule):
    """``Conv2d -> BatchNorm2d``."""

    _CHILD_TYPES = ((nn.Conv2d,), _BN2)

    def __init__(self, conv: nn.Module, bn: nn.Module) -> None:
        super().__init__(conv, bn)


class ConvBn3d(FusedModule):
    """``Conv3d -> BatchNorm3d``."""

    _CHILD_TYPES = ((nn.Conv3d,), _BN3)

    def __init__(self, conv: nn.Module, bn: nn.Module) -> None:
        super().__init__(conv, bn)


class ConvBnReLU1d(FusedModule):
    """``Conv1d -> BatchNorm1d -> ReLU``."""

    _CHILD_TYPES = ((nn.Conv1d,), _BN1, _RELU)

    def __init__(self, conv: nn.Module, bn: nn.Module, relu: nn.Module) -> None:
        super().__init__(conv, bn, relu)


class ConvBnReLU2d(FusedModule):
    """``Conv2d -> BatchNorm2d -> ReLU``."""

    _CHILD_TYPES = ((nn.Conv2d,), _BN2, _RELU)

    def __init__(self, conv: nn.Module, bn: nn.Module, relu: nn.Module) -> None:
        super().__init__(conv, bn, relu)


class ConvBnReLU3d(FusedModule):
    """``Conv3d -> BatchNorm3d -> ReLU``."""

    _CHILD_TYPES = ((nn.Conv3d,), _BN3, _RELU)

    def __init__(self, conv: nn.Module, bn: nn.Module, relu: nn.Module) -> None:
        super().__init__(conv, bn, relu)


class LinearReLU(FusedModule):
    """``Linear -> ReLU``."""

    _CHILD_TYPES = ((nn.Linear,), _RELU)

    def __init__(self, linear: nn.Module, relu: nn.Module) -> None:
        super().__init__(linear, relu)


class LinearBn1d(FusedModule):
    """``Linear -> BatchNorm1d``."""

    _CHILD_TYPES = ((nn.Linear,), _BN1)

    def __init__(self, linear: nn.Module, bn: nn.Module) -> None:
        super().__init__(linear, bn)


class LinearLeakyReLU(FusedModule):
    """``Linear -> LeakyReLU``."""

    _CHILD_TYPES = ((nn.Linear,), (nn.LeakyReLU,))

    def __init__(self, linear: nn.Module, leaky_relu: nn.Module) -> None:
        super().__init__(linear, leaky_relu)


class LinearTanh(FusedModule):
    """``Linear -> Tanh``."""

    _CHILD_TYPES = ((nn.Linear,), (nn.Tanh,))

    def __init__(self, linear: nn.Module, tanh: nn.Module) -> None:
        super().__init__(linear, tanh)


class BNReLU2d(FusedModule):
    """``BatchNorm2d -> ReLU``."""

    _CHILD_TYPES = (_BN2, _RELU)

    def __init__(self, batch_norm: nn.Module, relu: nn.Module) -> None:
        super().__init__(batch_norm, relu)


class BNReLU3d(FusedModule):
    """``BatchNorm3d -> ReLU``."""

    _CHILD_TYPES = (_BN3, _RELU)

    def __init__(self, batch_norm: nn.Module, relu: nn.Module) -> None:
        super().__init__(batch_norm, relu)


class ConvAdd2d(FusedModule):
    """``add(conv(x1), x2)``: a Conv2d whose output is added to a second input.

    ``add`` is any callable taking two tensors (``torch.add``, ``operator.add``); it is kept
    as an attribute, not a child, since it need not be a module.
    """

    _CHILD_TYPES = ((nn.Conv2d,),)

    def __init__(self, conv: nn.Module, add: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__(conv)
        self.add = add

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        result: torch.Tensor = self.add(self[0](x1), x2)
        return result


class ConvAddReLU2d(FusedModule):
    """``relu(add(conv(x1), x2))``."""

    _CHILD_TYPES = ((nn.Conv2d,),)

    def __init__(
        self,
        conv: nn.Module,
        add: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        relu: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__(conv)
        self.add = add
        self.relu = relu

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        result: torch.Tensor = self.relu(self.add(self[0](x1), x2))
        return result
