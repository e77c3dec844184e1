"""Real CNN architectures written the way torchvision writes them, at small widths.

torchvision cannot be installed next to the pinned torch, so the structures that matter to
the flow are rebuilt here: a ResNet block owns ONE ``nn.ReLU`` that it calls two or three
times (once inside a conv-bn-relu that fusion swallows), the downsample path is a
Sequential, MobileNets and EfficientNet build conv-bn-activation Sequentials, squeeze-excite
multiplies the input by a broadcast scale, and stochastic depth is a module that is the
identity in eval. Widths and depths are scaled down so the tests stay fast; the layer
structure (block types, block counts, strides, module names) is torchvision's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

__all__ = ["MODELS", "build", "example_input"]


def _make_divisible(v: float, divisor: int = 8) -> int:
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:  # never round down by more than 10%
        new_v += divisor
    return new_v


class Conv2dNormActivation(nn.Sequential):
    """conv -> batch norm -> activation, as a Sequential (torchvision.ops.misc)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        stride: int = 1,
        groups: int = 1,
        activation_layer: Callable[..., nn.Module] | None = nn.ReLU,
    ) -> None:
        padding = (kernel_size - 1) // 2
        layers: list[nn.Module] = [
            nn.Conv2d(
                in_channels, out_channels, kernel_size, stride, padding, groups=groups, bias=False
            ),
            nn.BatchNorm2d(out_channels),
        ]
        if activation_layer is not None:
            layers.append(activation_layer(inplace=True))
        super().__init__(*layers)


class SqueezeExcitation(nn.Module):
    """Channel attention: ``scale * input`` with a (N, C, 1, 1) scale (torchvision.ops.misc)."""

    def __init__(
        self,
        input_channels: int,
        squeeze_channels: int,
        activation: Callable[..., nn.Module] = nn.ReLU,
        scale_activation: Callable[..., nn.Module] = nn.Sigmoid,
    ) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(input_channels, squeeze_channels, 1)
        self.fc2 = nn.Conv2d(squeeze_channels, input_channels, 1)
        self.activation = activation()
        self.scale_activation = scale_activation()

    def _scale(self, input: Tensor) -> Tensor:
        scale = self.avgpool(input)
        scale = self.fc1(scale)
        scale = self.activation(scale)
        scale = self.fc2(scale)
        return self.scale_activation(scale)

    def forward(self, input: Tensor) -> Tensor:
        scale = self._scale(input)
        return scale * input


def stochastic_depth(input: Tensor, p: float, mode: str, training: bool = True) -> Tensor:
    """Drop whole rows (or the whole batch) of a residual branch in training; identity in eval."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"drop probability has to be between 0 and 1, but got {p}")
    if mode not in ("batch", "row"):
        raise ValueError(f"mode has to be either 'batch' or 'row', but got {mode}")
    if not training or p == 0.0:
        return input
    survival_rate = 1.0 - p
    size = [input.shape[0]] + [1] * (input.ndim - 1) if mode == "row" else [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device)
    noise = noise.bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return input * noise


# torchvision wraps it too: a traced model calls it (training is a constant at trace time)
torch.fx.wrap("stochastic_depth")


class StochasticDepth(nn.Module):
    def __init__(self, p: float, mode: str) -> None:
        super().__init__()
        self.p = p
        self.mode = mode

    def forward(self, input: Tensor) -> Tensor:
        return stochastic_depth(input, self.p, self.mode, self.training)


# --- ResNet ---------------------------------------------------------------------------------


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        out = self.relu(out)
        out = self.conv3(out)
        out = self.bn3(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNet(nn.Module):
    def __init__(
        self,
        block: type[BasicBlock | Bottleneck],
        layers: list[int],
        width: int = 8,
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(block, width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(block, width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(
        self, block: type[BasicBlock | Bottleneck], planes: int, blocks: int, stride: int = 1
    ) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers: list[nn.Module] = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes))
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


# --- MobileNetV2 ----------------------------------------------------------------------------


class InvertedResidualV2(nn.Module):
    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        self.stride = stride
        hidden_dim = round(inp * expand_ratio)
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(Conv2dNormActivation(inp, hidden_dim, 1, activation_layer=nn.ReLU6))
        layers.extend(
            [
                Conv2dNormActivation(
                    hidden_dim,
                    hidden_dim,
                    stride=stride,
                    groups=hidden_dim,
                    activation_layer=nn.ReLU6,
                ),
                nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),
                nn.BatchNorm2d(oup),
            ]
        )
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x: Tensor) -> Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    # t (expansion), c (channels), n (repeats), s (first stride): torchvision's full table
    SETTING = (
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )

    def __init__(self, width_mult: float = 0.25, num_classes: int = 10) -> None:
        super().__init__()
        input_channel = _make_divisible(32 * width_mult)
        self.last_channel = _make_divisible(1280 * width_mult)
        features: list[nn.Module] = [
            Conv2dNormActivation(3, input_channel, stride=2, activation_layer=nn.ReLU6)
        ]
        for t, c, n, s in self.SETTING:
            output_channel = _make_divisible(c * width_mult)
            for i in range(n):
                stride = s if i == 0 else 1
                features.append(InvertedResidualV2(input_channel, output_channel, stride, t))
                input_channel = output_channel
        features.append(
            Conv2dNormActivation(input_channel, self.last_channel, 1, activation_layer=nn.ReLU6)
        )
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(
            nn.Dropout(p=0.2), nn.Linear(self.last_channel, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
        x = torch.flatten(x, 1)
        return self.classifier(x)


# --- MobileNetV3 ----------------------------------------------------------------------------


class InvertedResidualV3(nn.Module):
    def __init__(
        self,
        input_channels: int,
        kernel: int,
        expanded_channels: int,
        out_channels: int,
        use_se: bool,
        use_hs: bool,
        stride: int,
    ) -> None:
        super().__init__()
        self.use_res_connect = stride == 1 and input_channels == out_channels
        activation_layer: Callable[..., nn.Module] = nn.Hardswish if use_hs else nn.ReLU
        layers: list[nn.Module] = []
        if expanded_channels != input_channels:
            layers.append(
                Conv2dNormActivation(
                    input_channels, expanded_channels, 1, activation_layer=activation_layer
                )
            )
        layers.append(
            Conv2dNormActivation(
                expanded_channels,
                expanded_channels,
                kernel,
                stride=stride,
                groups=expanded_channels,
                activation_layer=activation_layer,
            )
        )
        if use_se:
            squeeze_channels = _make_divisible(expanded_channels // 4, 8)
            layers.append(
                SqueezeExcitation(
                    expanded_channels, squeeze_channels, scale_activation=nn.Hardsigmoid
                )
            )
        layers.append(
            Conv2dNormActivation(expanded_channels, out_channels, 1, activation_layer=None)
        )
        self.block = nn.Sequential(*layers)

    def forward(self, input: Tensor) -> Tensor:
        result = self.block(input)
        if self.use_res_connect:
            result += input
        return result


class MobileNetV3Small(nn.Module):
    # kernel, expanded, out, SE, hardswish, stride: torchvision's mobilenet_v3_small rows
    SETTING = (
        (3, 16, 16, True, False, 2),
        (3, 72, 24, False, False, 2),
        (3, 88, 24, False, False, 1),
        (5, 96, 40, True, True, 2),
        (5, 240, 40, True, True, 1),
        (5, 240, 40, True, True, 1),
        (5, 120, 48, True, True, 1),
        (5, 144, 48, True, True, 1),
        (5, 288, 96, True, True, 2),
        (5, 576, 96, True, True, 1),
        (5, 576, 96, True, True, 1),
    )

    def __init__(self, width_mult: float = 0.25, num_classes: int = 10) -> None:
        super().__init__()

        def adjust(channels: int) -> int:
            return _make_divisible(channels * width_mult)

        first = adjust(16)
        layers: list[nn.Module] = [
            Conv2dNormActivation(3, first, stride=2, activation_layer=nn.Hardswish)
        ]
        channels = first
        for kernel, expanded, out, use_se, use_hs, stride in self.SETTING:
            layers.append(
                InvertedResidualV3(
                    channels, kernel, adjust(expanded), adjust(out), use_se, use_hs, stride
                )
            )
            channels = adjust(out)
        last_conv = 6 * channels
        layers.append(Conv2dNormActivation(channels, last_conv, 1, activation_layer=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        last_channel = adjust(1024)
        self.classifier = nn.Sequential(
            nn.Linear(last_conv, last_channel),
            nn.Hardswish(inplace=True),
            nn.Dropout(p=0.2, inplace=True),
            nn.Linear(last_channel, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


# --- EfficientNet ---------------------------------------------------------------------------


class MBConv(nn.Module):
    def __init__(
        self,
        input_channels: int,
        out_channels: int,
        expand_ratio: float,
        kernel: int,
        stride: int,
        stochastic_depth_prob: float,
    ) -> None:
        super().__init__()
        self.use_res_connect = stride == 1 and input_channels == out_channels
        expanded_channels = _make_divisible(input_channels * expand_ratio, 8)
        layers: list[nn.Module] = []
        if expanded_channels != input_channels:
            layers.append(
                Conv2dNormActivation(input_channels, expanded_channels, 1, activation_layer=nn.SiLU)
            )
        layers.append(
            Conv2dNormActivation(
                expanded_channels,
                expanded_channels,
                kernel,
                stride=stride,
                groups=expanded_channels,
                activation_layer=nn.SiLU,
            )
        )
        squeeze_channels = max(1, input_channels // 4)
        layers.append(
            SqueezeExcitation(
                expanded_channels, squeeze_channels, activation=partial(nn.SiLU, inplace=True)
            )
        )
        layers.append(
            Conv2dNormActivation(expanded_channels, out_channels, 1, activation_layer=None)
        )
        self.block = nn.Sequential(*layers)
        self.stochastic_depth = StochasticDepth(stochastic_depth_prob, "row")
        self.out_channels = out_channels

    def forward(self, input: Tensor) -> Tensor:
        result = self.block(input)
        if self.use_res_connect:
            result = self.stochastic_depth(result)
            result += input
        return result


class EfficientNetB0(nn.Module):
    # expand ratio, kernel, stride, in, out, layers: torchvision's efficientnet_b0 stages
    SETTING = (
        (1, 3, 1, 32, 16, 1),
        (6, 3, 2, 16, 24, 2),
        (6, 5, 2, 24, 40, 2),
        (6, 3, 2, 40, 80, 3),
        (6, 5, 1, 80, 112, 3),
        (6, 5, 2, 112, 192, 4),
        (6, 3, 1, 192, 320, 1),
    )

    def __init__(
        self, width_mult: float = 0.25, stochastic_depth_prob: float = 0.2, num_classes: int = 10
    ) -> None:
        super().__init__()

        def adjust(channels: int) -> int:
            return _make_divisible(channels * width_mult, 8)

        first = adjust(32)
        layers: list[nn.Module] = [
            Conv2dNormActivation(3, first, stride=2, activation_layer=nn.SiLU)
        ]
        total_blocks = sum(row[-1] for row in self.SETTING)
        block_id = 0
        for expand, kernel, stride, cin, cout, n in self.SETTING:
            stage: list[nn.Module] = []
            for i in range(n):
                sd_prob = stochastic_depth_prob * float(block_id) / total_blocks
                stage.append(
                    MBConv(
                        adjust(cin) if i == 0 else adjust(cout),
                        adjust(cout),
                        expand,
                        kernel,
                        stride if i == 0 else 1,
                        sd_prob,
                    )
                )
                block_id += 1
            layers.append(nn.Sequential(*stage))
        last_in = adjust(320)
        last_channel = 4 * last_in
        layers.append(Conv2dNormActivation(last_in, last_channel, 1, activation_layer=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Dropout(p=0.2, inplace=True), nn.Linear(last_channel, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


# --- the zoo --------------------------------------------------------------------------------

_BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "resnet18": lambda: ResNet(BasicBlock, [2, 2, 2, 2]),
    "resnet50": lambda: ResNet(Bottleneck, [3, 4, 6, 3]),
    "mobilenet_v2": MobileNetV2,
    "mobilenet_v3_small": MobileNetV3Small,
    "efficientnet_b0": EfficientNetB0,
}
MODELS = tuple(_BUILDERS)
# torchvision's own sizes (ImageNet: 224x224 inputs, 1000 classes), for benchmarks
_FULL_SIZE_BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "resnet18": lambda: ResNet(BasicBlock, [2, 2, 2, 2], width=64, num_classes=1000),
    "resnet50": lambda: ResNet(Bottleneck, [3, 4, 6, 3], width=64, num_classes=1000),
    "mobilenet_v2": lambda: MobileNetV2(width_mult=1.0, num_classes=1000),
    "mobilenet_v3_small": lambda: MobileNetV3Small(width_mult=1.0, num_classes=1000),
    "efficientnet_b0": lambda: EfficientNetB0(width_mult=1.0, num_classes=1000),
}


def build(name: str, seed: int = 0, *, full_size: bool = False) -> nn.Module:
    """Model ``name`` in eval mode, with seeded weights and non-trivial batch-norm statistics.

    ``full_size`` builds torchvision's width and 1000 classes (resnet18/50, mobilenet_v2,
    mobilenet_v3_small, efficientnet_b0);
    the default is the small variant the tests run.
    """
    torch.manual_seed(seed)
    model = (_FULL_SIZE_BUILDERS if full_size else _BUILDERS)[name]()
    g = torch.Generator().manual_seed(seed + 1)
    for module in model.modules():
        if isinstance(module, nn.Conv2d):  # torchvision's init: keeps activations alive
            nn.init.kaiming_normal_(module.weight, mode="fan_out")
        elif isinstance(module, nn.BatchNorm2d):
            c = module.num_features
            module.running_mean.copy_(torch.randn(c, generator=g) * 0.1)
            module.running_var.copy_(torch.rand(c, generator=g) * 0.5 + 0.75)
            module.weight.data.copy_(torch.rand(c, generator=g) * 0.5 + 0.75)
            module.bias.data.copy_(torch.randn(c, generator=g) * 0.1)
    return model.eval()


def example_input(seed: int = 0, batch: int = 2) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 32, 32, generator=g)
