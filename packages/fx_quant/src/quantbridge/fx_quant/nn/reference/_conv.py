"""Reference quantized convolutions (plain and transposed, 1d/2d/3d)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantbridge.fx_quant.nn._module_args import conv_args, conv_transpose_args, copy_parameters
from quantbridge.fx_quant.nn.reference._base import ReferenceQuantizedModule

__all__ = [
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
]


def _conv_init(
    self: Any,
    base: type[nn.Module],
    args: tuple[Any, ...],
    device: Any,
    dtype: Any,
    weight_qparams: Mapping[str, Any] | None,
) -> None:
    """``__init__`` of a reference (transposed) conv: the float conv's, then the qparams."""
    base.__init__(self, *args, device=device, dtype=dtype)
    self._init_weight_qparams(weight_qparams, device)


def _from_float(
    cls: Any, args: tuple[Any, ...], float_conv: nn.Module, weight_qparams: Mapping[str, Any]
) -> Any:
    """``cls(*args)`` on ``float_conv``'s device and dtype, with copies of its parameters."""
    weight: torch.Tensor = float_conv.weight  # type: ignore[assignment]
    ref: Any = cls(*args, device=weight.device, dtype=weight.dtype, weight_qparams=weight_qparams)
    copy_parameters(ref, float_conv, ("weight", "bias"))
    ref._check_weight_qparams()
    return ref


class _ConvNd(ReferenceQuantizedModule):
    """Convolution on the round-tripped weight; padding_mode is honoured."""

    _IS_REFERENCE = True
    _FLOAT: type[nn.Module]  # the float conv class this reference module extends

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Any,
        stride: Any = 1,
        padding: Any = 0,
        dilation: Any = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: Any = "zeros",
        device: Any = None,
        dtype: Any = None,
        weight_qparams: Mapping[str, Any] | None = None,
    ) -> None:
        args = (in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                padding_mode)  # fmt: skip
        _conv_init(self, self._FLOAT, args, device, dtype, weight_qparams)

    def _get_name(self) -> str:
        return f"Quantized{self._FLOAT.__name__}(Reference)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # _conv_forward applies non-zero padding modes; with "zeros" it is the plain F.convNd
        # call torch.ao's reference convs make.
        mod: Any = self
        result: torch.Tensor = mod._conv_forward(x, self.get_weight(), mod.bias)
        return result

    @classmethod
    def from_float(cls, float_conv: nn.Module, weight_qparams: Mapping[str, Any]) -> Any:
        """A reference conv with ``float_conv``'s parameters (detached) and these qparams."""
        return _from_float(cls, conv_args(float_conv), float_conv, weight_qparams)


class Conv1d(_ConvNd, nn.Conv1d):
    """Reference quantized Conv1d."""

    _FLOAT = nn.Conv1d


class Conv2d(_ConvNd, nn.Conv2d):
    """Reference quantized Conv2d."""

    _FLOAT = nn.Conv2d


class Conv3d(_ConvNd, nn.Conv3d):
    """Reference quantized Conv3d."""

    _FLOAT = nn.Conv3d


class _ConvTransposeNd(ReferenceQuantizedModule):
    """Transposed convolution on the round-tripped weight (quantized along its own axes)."""

    _IS_REFERENCE = True
    _DIM: int
    _FLOAT: type[nn.Module]

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Any,
        stride: Any = 1,
        padding: Any = 0,
        output_padding: Any = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: Any = 1,
        padding_mode: Any = "zeros",
        device: Any = None,
        dtype: Any = None,
        weight_qparams: Mapping[str, Any] | None = None,
    ) -> None:
        args = (in_channels, out_channels, kernel_size, stride, padding, output_padding, groups,
                bias, dilation, padding_mode)  # fmt: skip
        _conv_init(self, self._FLOAT, args, device, dtype, weight_qparams)

    def _get_name(self) -> str:
        return f"Quantized{self._FLOAT.__name__}(Reference)"

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        mod: Any = self
        output_padding = mod._output_padding(
            x, output_size, mod.stride, mod.padding, mod.kernel_size, self._DIM, mod.dilation
        )
        fn = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[self._DIM]
        result: torch.Tensor = fn(
            x, self.get_weight(), mod.bias, mod.stride, mod.padding, output_padding, mod.groups,
            mod.dilation,
        )  # fmt: skip
        return result

    @classmethod
    def from_float(cls, float_conv: nn.Module, weight_qparams: Mapping[str, Any]) -> Any:
        """A reference transposed conv with ``float_conv``'s parameters and these qparams."""
        return _from_float(cls, conv_transpose_args(float_conv), float_conv, weight_qparams)


class ConvTranspose1d(_ConvTransposeNd, nn.ConvTranspose1d):
    """Reference quantized ConvTranspose1d."""

    _DIM = 1
    _FLOAT = nn.ConvTranspose1d


class ConvTranspose2d(_ConvTransposeNd, nn.ConvTranspose2d):
    """Reference quantized ConvTranspose2d."""

    _DIM = 2
    _FLOAT = nn.ConvTranspose2d


class ConvTranspose3d(_ConvTransposeNd, nn.ConvTranspose3d):
    """Reference quantized ConvTranspose3d."""

    _DIM = 3
    _FLOAT = nn.ConvTranspose3d
