"""Small models shared by the flow tests: one per structure the flow must handle."""

from __future__ import annotations

import math

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.fc1(x))
        x = torch.nn.functional.relu(self.fc2(x))
        return self.fc3(x)


class ConvBnReLUCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.relu2 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        x = torch.flatten(self.pool(x), 1)
        return self.fc(x)


class ResidualBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.stem(x)
        out = self.relu1(self.bn1(self.conv1(identity)))
        out = self.bn2(self.conv2(out))
        out = out + identity
        return self.relu2(out)


class DepthwiseSeparable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.bn1 = nn.BatchNorm2d(8)
        self.act1 = nn.Hardswish()
        self.pw = nn.Conv2d(8, 16, 1)
        self.bn2 = nn.BatchNorm2d(16)
        self.act2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.bn1(self.dw(x)))
        return self.act2(self.bn2(self.pw(x)))


class AttentionBlock(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.scale = 1.0 / math.sqrt(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        attn = torch.softmax(scores, dim=-1)
        return self.out(torch.matmul(attn, v))


class EmbeddingBagModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(50, 12, mode="sum")
        self.fc = nn.Linear(12, 4)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(indices, offsets))


class QATConvBn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.bn1 = nn.BatchNorm2d(6)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(6, 6, 3)
        self.bn2 = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.bn2(self.conv2(x))
        x = torch.mean(x, dim=(2, 3))
        return self.fc(x)


class FunctionalMix(nn.Module):
    """Functional weighted ops (weight/bias by input_type_to_index), shared-observer ops,
    fixed-qparams ops, shape ops with non-tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 3, 3, 3) * 0.2)
        self.b1 = nn.Parameter(torch.randn(8) * 0.1)
        self.w2 = nn.Parameter(torch.randn(6, 32) * 0.2)
        self.b2 = nn.Parameter(torch.randn(6) * 0.1)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.conv2d(x, self.w1, self.b1, padding=1)
        y = torch.cat([self.pool(y), torch.nn.functional.avg_pool2d(y, 2)], dim=1)
        y = torch.sigmoid(y) + torch.tanh(y)
        y = y.reshape(y.size(0), -1)[:, :32]
        z = torch.nn.functional.linear(y, self.w2, self.b2)
        return torch.nn.functional.hardsigmoid(z).view(z.shape[0], 2, 3)


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.add(self.fc(x), x)


class Nested(nn.Module):
    """Nested scopes for QConfigMapping precedence: module names, regexes, object types of
    enclosing modules, call order."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Inner()
        self.b = Inner()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        x = self.b(x)
        x = torch.add(x, 1.0)
        x = torch.add(x, x)
        return self.fc(x)


def example_inputs(name: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return (torch.randn(4, 16, generator=g),)
    if name in ("cnn", "residual", "qat_conv_bn"):
        return (torch.randn(2, 3, 12, 12, generator=g),)
    if name == "depthwise":
        return (torch.randn(2, 8, 10, 10, generator=g),)
    if name == "attention":
        return (torch.randn(2, 5, 16, generator=g),)
    if name == "functional_mix":
        return (torch.randn(2, 3, 8, 8, generator=g),)
    if name == "nested":
        return (torch.randn(3, 8, generator=g),)
    if name == "embedding_bag":
        return (torch.randint(0, 50, (12,), generator=g), torch.tensor([0, 4, 9]))
    raise KeyError(name)


def build(name: str, seed: int = 0) -> nn.Module:
    """A freshly initialized zoo model (deterministic weights; BN statistics randomized)."""
    torch.manual_seed(seed)
    model: nn.Module = {
        "mlp": MLP,
        "cnn": ConvBnReLUCNN,
        "residual": ResidualBlock,
        "depthwise": DepthwiseSeparable,
        "attention": AttentionBlock,
        "embedding_bag": EmbeddingBagModel,
        "qat_conv_bn": QATConvBn,
        "functional_mix": FunctionalMix,
        "nested": Nested,
    }[name]()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model


PTQ_MODELS = (
    "mlp",
    "cnn",
    "residual",
    "depthwise",
    "attention",
    "embedding_bag",
    "functional_mix",
)
