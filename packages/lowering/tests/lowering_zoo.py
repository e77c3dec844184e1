"""Small models for the lowering tests: one per structure the lowering pass must handle.

Each entry: a model factory, an example-input factory, and whether every op is expected to
be lowered (then the lowered graph has one quantize per input and one dequantize per output).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule

from quantbridge.fx_quant import convert_to_reference_fx, prepare_fx
from quantbridge.lowering import Backend
from quantbridge.qconfig import (
    QConfigMapping,
    default_dynamic_qconfig,
    float_qparams_weight_only_qconfig,
)


class LinearReLUMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 24)
        self.fc3 = nn.Linear(24, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


class ConvBnCNN(nn.Module):
    """conv2d + BN (folded) + relu, maxpool, conv, adaptive pool, flatten, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(self.gap(x), 1))


class Conv1dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(4, 8, 5, padding=2)
        self.bn = nn.BatchNorm1d(8)
        self.conv2 = nn.Conv1d(8, 8, 3, dilation=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.bn(self.conv1(x))))


class DepthwiseSeparable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.relu = nn.ReLU()
        self.pw = nn.Conv2d(8, 12, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pw(self.relu(self.dw(x)))


class ResidualAddMul(nn.Module):
    """add, add+relu, mul, mul+relu of two quantized tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = nn.Conv2d(8, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 1)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stem(x)
        y = self.relu(self.a(s) + s)
        z = self.b(y) * y
        w = torch.relu(z + y)
        return F.relu(w * s)


class Pools(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3)
        self.maxp = nn.MaxPool2d(3, stride=2, padding=1)
        self.avgp = nn.AvgPool2d(2, padding=1, count_include_pad=False)
        self.adap = nn.AdaptiveAvgPool2d((3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        a = self.adap(self.maxp(y))
        b = F.avg_pool2d(self.avgp(y), 2)
        c = F.max_pool2d(y, 2)
        return torch.cat([a.flatten(1), b.flatten(1), F.adaptive_avg_pool2d(c, 1).flatten(1)], 1)


class ShapesCat(nn.Module):
    """flatten/reshape/view/permute/transpose/getitem/cat with shared qparams."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 12)
        self.fc2 = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.fc1(x), self.fc2(x)
        c = torch.cat([a, b], dim=-1)
        # transposes over a size-1 dim: fx_quant's quantize op needs viewable inputs today
        c = c.reshape(x.shape[0], 1, 24).transpose(1, 2).contiguous()
        c = c.permute(0, 2, 1).view(x.shape[0], -1)
        return torch.flatten(c[:, 2:20].unsqueeze(1), 1)


class Activations(nn.Module):
    """fixed-qparams activations, hardswish and other elementwise ops via lookup tables."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.hs = nn.Hardswish()
        self.sig = nn.Sigmoid()
        self.lrelu = nn.LeakyReLU(0.1)
        self.relu6 = nn.ReLU6()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.fc(x)
        return (
            self.hs(y),
            self.sig(y),
            torch.tanh(y),
            F.hardsigmoid(y),
            self.lrelu(y),
            self.relu6(y),
            F.hardtanh(y, -0.5, 0.5),
            y * 0.5,
            y + 1.0,
            torch.clamp(y, -1.0, 2.0),
        )


class ClampedLayers(nn.Module):
    """conv + BN, depthwise conv, 1x1 conv and linear, each followed by a clamp (ReLU6,
    relu6, hardtanh with bounds) observed after the clamp, as in MobileNetV2's blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu6 = nn.ReLU6(inplace=True)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.pw = nn.Conv2d(8, 12, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(12, 6)
        self.clamp = nn.Hardtanh(-0.5, 0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu6(self.bn(self.conv(x)))
        x = F.relu6(self.dw(x))
        x = F.hardtanh(self.pw(x), -1.0, 2.0)
        return self.clamp(self.fc(torch.flatten(self.pool(x), 1)))


class Matmul(nn.Module):
    """quantized matmul: 2-D x 2-D, batched 3-D and 4-D attention-like scores."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # no transposes: fx_quant's quantize op needs viewable (contiguous) inputs today
        q = self.q(x)  # [B, S, 8]; y: [B, 8, 5]
        s3 = torch.matmul(q, y)
        s4 = torch.matmul(q.reshape(x.shape[0], 2, 3, 8), y.reshape(y.shape[0], 1, 8, 5))
        return s3, s4


class Unsupported(nn.Module):
    """An op the kernels do not run (softmax) between lowered ops: stays reference."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.layer_norm(self.fc1(x), (8,)))


class TransformerDynamic(nn.Module):
    """One encoder layer written out (nn.TransformerEncoderLayer traces as a leaf)."""

    def __init__(self, hidden: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.ff1 = nn.Linear(hidden, 2 * hidden)
        self.ff2 = nn.Linear(2 * hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads
        q = self.q(x).reshape(b, s, self.heads, d).transpose(1, 2)
        k = self.k(x).reshape(b, s, self.heads, d).transpose(1, 2)
        v = self.v(x).reshape(b, s, self.heads, d).transpose(1, 2)
        att = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / d**0.5, dim=-1)
        ctx = torch.matmul(att, v).transpose(1, 2).contiguous().reshape(b, s, h)
        x = self.norm1(x + self.out(ctx))
        return self.norm2(x + self.ff2(F.gelu(self.ff1(x))))


class LSTMDynamic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        # contiguous: fx_quant's quantize op needs viewable inputs today
        return self.head(torch.relu(self.proj(out.contiguous())))


class Embeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 8, mode="sum")
        self.bag_mean = nn.EmbeddingBag(20, 8, mode="mean")
        self.emb = nn.Embedding(20, 8)

    def forward(self, idx: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.bag(idx, offsets), self.bag_mean(idx, offsets), self.emb(idx[:4])


def _embedding_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 20, (10,), generator=g), torch.tensor([0, 3, 3, 7])


def _randn(*shape: int) -> Callable[[int], tuple[torch.Tensor, ...]]:
    def make(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(*shape, generator=g),)

    return make


@dataclass(frozen=True)
class Case:
    name: str
    model: Callable[[], nn.Module]
    inputs: Callable[[int], tuple[torch.Tensor, ...]]
    mode: str = "static"  # static | dynamic | weight_only
    fully_lowered: bool = True


STATIC_CASES = [
    Case("linear_relu_mlp", LinearReLUMLP, _randn(4, 16)),
    Case("conv_bn_cnn", ConvBnCNN, _randn(2, 3, 16, 16)),
    Case("conv1d", Conv1dNet, _randn(2, 4, 20)),
    Case("depthwise", DepthwiseSeparable, _randn(2, 8, 9, 9)),
    Case("residual_add_mul", ResidualAddMul, _randn(2, 3, 8, 8)),
    Case("pools", Pools, _randn(2, 3, 14, 14)),
    Case("shapes_cat", ShapesCat, _randn(3, 12)),
    Case("activations", Activations, _randn(5, 8)),
    Case("clamped_layers", ClampedLayers, _randn(2, 3, 10, 10)),
    Case("matmul", Matmul, lambda seed: _randn(2, 6, 8)(seed) + _randn(2, 8, 5)(seed + 7)),
    Case("unsupported_layer_norm", Unsupported, _randn(4, 8), fully_lowered=False),
]
DYNAMIC_CASES = [
    Case("transformer_dynamic", TransformerDynamic, _randn(2, 5, 16), mode="dynamic"),
    Case("lstm_dynamic", LSTMDynamic, _randn(2, 5, 8), mode="dynamic"),
]
WEIGHT_ONLY_CASES = [
    Case("embeddings", Embeddings, _embedding_inputs, mode="weight_only", fully_lowered=True),
]
ALL_CASES = STATIC_CASES + DYNAMIC_CASES + WEIGHT_ONLY_CASES


def qconfig_mapping_for(case: Case, backend: Backend) -> QConfigMapping:
    if case.mode == "static":
        return backend.qconfig_mapping()
    if case.mode == "dynamic":
        return QConfigMapping().set_object_type(nn.Linear, default_dynamic_qconfig)
    return (
        QConfigMapping()
        .set_object_type(nn.EmbeddingBag, float_qparams_weight_only_qconfig)
        .set_object_type(nn.Embedding, float_qparams_weight_only_qconfig)
    )


def reference_model(
    case: Case, backend: Backend, seed: int = 0, mapping: QConfigMapping | None = None
) -> GraphModule:
    """Prepare with ``backend``'s config and defaults (or ``mapping``), calibrate on a few
    batches, convert."""
    torch.manual_seed(seed)
    model = case.model().eval()
    example = case.inputs(0)
    if mapping is None:
        mapping = qconfig_mapping_for(case, backend)
    prepared = prepare_fx(model, mapping, example, backend_config=backend.backend_config)
    with torch.no_grad():
        for i in range(4):
            prepared(*case.inputs(100 + i))
    return convert_to_reference_fx(copy.deepcopy(prepared), backend_config=backend.backend_config)
