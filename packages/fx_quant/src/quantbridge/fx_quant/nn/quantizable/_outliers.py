"""A Linear split into an int8 part and a few float input channels (LLM.int8()'s decomposition).

Trained transformers carry a few input channels tens to hundreds of times larger than the
rest (LayerNorm outlier dimensions, feed-forward neurons that fire on one token). A per-tensor
activation scale sized for them leaves the other channels a handful of levels.
:class:`OutlierSplitLinear` computes ``linear(x, channels c zeroed) + x[..., c] @ W[:, c].T``:
the first term is an ordinary ``nn.Linear`` that the flow quantizes, and its observer never
sees the outliers; the second runs in float, whatever the QConfigMapping says.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ZeroedChannels(nn.Module):
    """``x`` with the last-axis ``channels`` set to zero (always float)."""

    channels: Tensor

    def __init__(self, channels: Tensor) -> None:
        super().__init__()
        self.register_buffer("channels", channels.detach().to(torch.int64).clone())

    def forward(self, x: Tensor) -> Tensor:
        return x.index_fill(-1, self.channels, 0.0)


class FloatColumns(nn.Module):
    """``x[..., channels] @ weight.T`` in float (always float)."""

    channels: Tensor
    weight: Tensor

    def __init__(self, channels: Tensor, weight: Tensor) -> None:
        super().__init__()
        self.register_buffer("channels", channels.detach().to(torch.int64).clone())
        self.register_buffer("weight", weight.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.index_select(-1, self.channels), self.weight)


class ChannelScale(nn.Module):
    """``x * scale`` per last-axis channel (always float): SmoothQuant's division of a
    Linear's input where no LayerNorm can absorb it."""

    scale: Tensor

    def __init__(self, scale: Tensor) -> None:
        super().__init__()
        self.register_buffer("scale", scale.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


class OutlierSplitLinear(nn.Module):
    """``linear(zeroed(x)) + outliers(x)``, equal in float to the Linear it replaces.

    ``linear`` is that Linear with the columns of ``channels`` zeroed; ``outliers`` holds them.
    """

    def __init__(self, linear: nn.Linear, channels: Tensor) -> None:
        super().__init__()
        channels = channels.detach().to(torch.int64)
        weight = linear.weight.detach()
        self.zeroed = ZeroedChannels(channels)
        self.outliers = FloatColumns(channels, weight[:, channels])
        self.linear = nn.Linear(
            linear.in_features, linear.out_features, linear.bias is not None,
            device=weight.device, dtype=weight.dtype,
        )  # fmt: skip
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            self.linear.weight[:, channels] = 0.0
            if linear.bias is not None:
                self.linear.bias.copy_(linear.bias.detach())

    @property
    def channels(self) -> list[int]:
        """The input channels computed in float."""
        return [int(c) for c in self.outliers.channels]

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.linear(self.zeroed(x)) + self.outliers(x)
        return out

    def extra_repr(self) -> str:
        return f"float channels {self.channels}"


# never quantized: leaves of the quantization tracer, and under torch.export their ops get no
# qconfig
FLOAT_ONLY: tuple[type[nn.Module], ...] = (ZeroedChannels, FloatColumns, ChannelScale)
