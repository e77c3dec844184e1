"""Small models whose traced graphs exercise the matcher (shared by tests and the bench)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, symbolic_trace


class ConvBnRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.bn2 = nn.BatchNorm2d(4)
        self.conv3 = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return torch.relu(self.conv3(x))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(4, 4, 1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn1(self.conv1(x))
        y = y + self.conv2(x)
        y = self.relu(y)
        z = torch.add(y, x)
        return F.relu(z) + 1.0


class LinearRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x))
        x = self.bn(self.fc2(x))
        x = torch.relu(F.linear(x, self.w))
        return nn.functional.relu(F.linear(x, self.w), inplace=False)


class MethodsAndFunctional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x).relu()
        x = x.view(x.size(0), -1)
        x = x.reshape(-1).sigmoid()
        y = x.mean().tanh()
        x = torch.mul(x, y).relu()
        x = torch.flatten(x) * 2
        return x.contiguous().hardsigmoid() if hasattr(x, "hardsigmoid") else x


class SeveralUsers(nn.Module):
    """Inner nodes with more than one user must not be swallowed by a pattern."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.bn = nn.BatchNorm2d(2)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(2, 2, 1)
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.conv(x)
        b = self.bn(c)
        r = self.relu(b)
        c2 = self.conv2(r)
        out = self.relu2(c2)
        return out + c + b + c2


class ConvAdd(nn.Module):
    """onednn-style conv + add (+ relu), the other add input a MatchAllNode."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 2, 1)
        self.conv2 = nn.Conv2d(2, 2, 1)
        self.bn2 = nn.BatchNorm2d(2)
        self.conv3 = nn.Conv2d(2, 2, 1)
        self.relu = nn.ReLU()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.lin(x)
        a = self.conv1(x) + shared
        b = torch.add(shared, self.bn2(self.conv2(a)))
        c = self.relu(self.conv3(b) + a)
        return c + torch.relu(x)


class Shapes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 1)
        self.bn = nn.BatchNorm1d(2)
        self.ct = nn.ConvTranspose2d(2, 2, 1)
        self.bn2 = nn.BatchNorm2d(2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.emb = nn.Embedding(10, 4)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn(self.conv(x)))
        z = self.pool(self.bn2(self.ct(y.unsqueeze(-1))))
        z = torch.cat([z.flatten(), self.emb(idx).flatten()])
        z = F.hardtanh(z)
        z = torch.transpose(z.unsqueeze(0), 0, 1).squeeze()
        return F.dropout(z) + F.layer_norm(z, z.shape)


def parametrized_model() -> nn.Module:
    """Conv-ReLU whose conv carries a parametrization (its class is swapped by torch)."""
    import torch.nn.utils.parametrize as parametrize

    class Scale(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 1)
            self.relu = nn.ReLU()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(self.relu(self.conv(x)))

    m = M()
    parametrize.register_parametrization(m.conv, "weight", Scale())
    parametrize.register_parametrization(m.lin, "weight", Scale())
    return m


def zoo() -> dict[str, GraphModule]:
    models: dict[str, nn.Module] = {
        "conv_bn_relu": ConvBnRelu(),
        "residual": Residual(),
        "linear_relu": LinearRelu(),
        "methods": MethodsAndFunctional(),
        "several_users": SeveralUsers(),
        "conv_add": ConvAdd(),
        "shapes": Shapes(),
        "parametrized": parametrized_model(),
    }
    return {name: symbolic_trace(m) for name, m in models.items()}


def chain_model(blocks: int) -> GraphModule:
    """A long graph of repeated conv-bn-relu / add / method blocks (~20 nodes each)."""
    graph = torch.fx.Graph()
    root = nn.Module()
    x = graph.placeholder("x")
    for i in range(blocks):
        conv, bn, relu = f"c{i}", f"b{i}", f"r{i}"
        root.add_module(conv, nn.Conv2d(2, 2, 1))
        root.add_module(bn, nn.BatchNorm2d(2))
        root.add_module(relu, nn.ReLU())
        skip = x
        x = graph.call_module(conv, (x,))
        x = graph.call_module(bn, (x,))
        x = graph.call_module(relu, (x,))
        x = graph.call_function(torch.add, (x, skip))
        x = graph.call_function(F.relu, (x,))
        y = graph.call_method("sigmoid", (x,))
        y = graph.call_function(torch.mul, (y, 0.5))
        y = graph.call_method("flatten", (y,))
        y = graph.call_method("reshape", (y, -1))
        y = graph.call_function(torch.mean, (y,))
        x = graph.call_function(torch.add, (x, y))
        x = graph.call_method("relu", (x,))
        x = graph.call_function(torch.tanh, (x,))
        x = graph.call_function(torch.sigmoid, (x,))
        z = graph.call_method("view", (x, -1))
        z = graph.call_method("contiguous", (z,))
        x = graph.call_function(torch.sub, (x, graph.call_function(torch.mean, (z,))))
        x = graph.call_function(F.hardtanh, (x,))
        x = graph.call_function(torch.clamp, (x, -1.0, 1.0))
    graph.output(x)
    return GraphModule(root, graph)
