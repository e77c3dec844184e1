"""Model builders shared by the asv benchmarks (the lowering issue's performance targets).

The lowering issue's MLP, ResNet-style CNN and transformer encoder layer (also imported by
``packages/lowering/bench/bench_models.py``, so both benches time the same models) and the
digits CNN of ``examples/demo.py``. They live here because asv imports benchmark modules from
``benchmark_dir`` only. Weights are random: these models measure speed, not accuracy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class MLP(nn.Module):
    """Linear 768->3072, ReLU, Linear 3072->768."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(768, 3072)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(3072, 768)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.relu(self.fc1(x)))
        return out


class BasicBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        out: torch.Tensor = self.relu2(x + y)
        return out


class ResNetish(nn.Module):
    """3x3 stem to 64 channels, two residual blocks, global average pool, classifier."""

    def __init__(self, channels: int = 64, blocks: int = 2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.blocks = nn.Sequential(*[BasicBlock(channels) for _ in range(blocks)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.relu(self.bn(self.stem(x))))
        out: torch.Tensor = self.fc(self.flatten(self.pool(x)))
        return out


class EncoderLayer(nn.Module):
    """A post-norm transformer encoder layer written with traceable ops (no fused fast path)."""

    def __init__(self, hidden: int = 384, heads: int = 12, ffn: int = 1536) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.ff1 = nn.Linear(hidden, ffn)
        self.act = nn.GELU()
        self.ff2 = nn.Linear(ffn, hidden)
        self.norm2 = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads
        q = self.q(x).reshape(b, s, self.heads, d).transpose(1, 2)
        k = self.k(x).reshape(b, s, self.heads, d).transpose(1, 2)
        v = self.v(x).reshape(b, s, self.heads, d).transpose(1, 2)
        attn = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * (d**-0.5), dim=-1)
        ctx = torch.matmul(attn, v).transpose(1, 2).reshape(b, s, h)
        x = self.norm1(x + self.out(ctx))
        out: torch.Tensor = self.norm2(x + self.ff2(self.act(self.ff1(x))))
        return out


class DigitsCNN(nn.Module):
    """The demo's model for 8x8 digits: two conv+ReLU, a max pool, two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.conv1(x))
        x = self.pool(self.relu2(self.conv2(x)))
        out: torch.Tensor = self.fc2(self.relu3(self.fc1(self.flatten(x))))
        return out


# name -> (builder, input shape, quantization mode); modes:
#   static: the backend's own qconfig mapping; dynamic: dynamic int8 Linear only;
#   static_linear: the backend's global static qconfig on Linear modules only.
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], str]] = {
    "mlp": (MLP, (32, 768), "static"),
    "resnet_cnn": (ResNetish, (1, 3, 56, 56), "static"),
    "transformer_dynamic": (EncoderLayer, (1, 128, 384), "dynamic"),
    "transformer_static": (EncoderLayer, (1, 128, 384), "static_linear"),
    "digits_cnn": (DigitsCNN, (64, 1, 8, 8), "static"),
}
