"""Hand-written ResNet-18/50 and MobileNetV2 with torchvision's layer shapes, for bench/inference.py.

torchvision's build on this machine needs CUDA, so the benchmark cannot import its models. These
follow torchvision's architectures (the same convolutions, strides, BatchNorm, channel counts, the
1000-class head) with random weights; they are benchmark workloads, not checkpoints' homes (the
parameter names differ from torchvision's).

Example::

    from vision_models import resnet18
    model = resnet18().eval()
    logits = model(torch.randn(2, 3, 64, 64))   # (2, 1000)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    """A bias-free convolution with 'same' padding followed by BatchNorm."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)
    )


class BasicBlock(nn.Module):
    """ResNet-18/34's block: two 3x3 convolutions and a shortcut (1x1 strided when the shape changes)."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        self.a, self.b = _conv_bn(cin, width, 3, stride), _conv_bn(width, width, 3)
        self.down = _conv_bn(cin, width, 1, stride) if stride != 1 or cin != width else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(F.relu(self.a(x)))
        return F.relu(h + (x if self.down is None else self.down(x)))


class Bottleneck(nn.Module):
    """ResNet-50's block: 1x1 reduce, 3x3 (strided, as torchvision's v1.5), 1x1 expand by 4, shortcut."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.a, self.b, self.c = _conv_bn(cin, width, 1), _conv_bn(width, width, 3, stride), _conv_bn(width, cout, 1)
        self.down = _conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c(F.relu(self.b(F.relu(self.a(x)))))
        return F.relu(h + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet: 7x7 stem, max-pool, four stages of blocks, global average pool, linear head.

    ``width_mult`` scales every channel count (64, 128, 256, 512 times the block's expansion at 1.0,
    torchvision's) for tiny test models; 1.0 is the published architecture.
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        depths: list[int],
        num_classes: int = 1000,
        width_mult: float = 1.0,
    ) -> None:
        super().__init__()
        base = max(1, round(64 * width_mult))
        self.stem = _conv_bn(3, base, 7, 2)
        stages, cin = [], base
        for i, depth in enumerate(depths):
            width = base * 2**i
            for j in range(depth):
                stages.append(block(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * block.expansion
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.stem(x)), 3, 2, 1)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.stages(x), 1), 1))


def resnet18(num_classes: int = 1000, width_mult: float = 1.0) -> ResNet:
    """ResNet-18 (11.7M parameters). Example: ``resnet18()(torch.randn(1, 3, 64, 64)).shape == (1, 1000)``."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, width_mult)


def resnet50(num_classes: int = 1000, width_mult: float = 1.0) -> ResNet:
    """ResNet-50 (25.6M parameters). Example: ``resnet50()(torch.randn(1, 3, 64, 64)).shape == (1, 1000)``."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, width_mult)


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand (ReLU6), 3x3 depthwise (ReLU6), 1x1 linear project; residual if shapes match."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [_conv_bn(cin, hidden, 1), nn.ReLU6()]
        layers += [_conv_bn(hidden, hidden, 3, stride, groups=hidden), nn.ReLU6(), _conv_bn(hidden, cout, 1)]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


def _round_channels(channels: float, divisor: int = 8) -> int:
    """MobileNetV2's channel rounding: to the nearest multiple of ``divisor`` (at least ``divisor``),
    one up when rounding down would lose more than a tenth."""
    rounded = max(divisor, int(channels + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * channels else rounded


class MobileNetV2(nn.Module):
    """MobileNetV2 (3.5M parameters at width 1.0): torchvision's stage table, dropout 0.2 before the head.

    ``width_mult`` scales the channel counts (rounded to multiples of 8, as the paper's and
    torchvision's models do); the last 1x1 convolution keeps 1280 channels below 1.0, as theirs.
    """

    # (expansion, output channels, blocks, first stride)
    STAGES = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0) -> None:
        super().__init__()
        cin = _round_channels(32 * width_mult)
        last = _round_channels(1280 * max(1.0, width_mult))
        layers: list[nn.Module] = [_conv_bn(3, cin, 3, 2), nn.ReLU6()]
        for expand, cout, n, stride in self.STAGES:
            cout = _round_channels(cout * width_mult)
            for j in range(n):
                layers.append(InvertedResidual(cin, cout, stride if j == 0 else 1, expand))
                cin = cout
        layers += [_conv_bn(cin, last, 1), nn.ReLU6()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(last, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


def mobilenet_v2(num_classes: int = 1000, width_mult: float = 1.0) -> MobileNetV2:
    """MobileNetV2. Example: ``mobilenet_v2()(torch.randn(1, 3, 64, 64)).shape == (1, 1000)``."""
    return MobileNetV2(num_classes, width_mult)


def randomize_batchnorm(model: nn.Module, generator: torch.Generator | None = None) -> nn.Module:
    """Give every BatchNorm random running statistics and affine parameters (freshly built ones
    normalize by mean 0, variance 1, scale 1, shift 0: an identity at inference that a wrong
    reading of them would not show). Returns ``model``.

    Example: ``randomize_batchnorm(resnet18().eval(), torch.Generator().manual_seed(0))``.
    """
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.running_mean.copy_(0.1 * torch.randn(c, generator=generator))
                m.running_var.copy_(0.5 + torch.rand(c, generator=generator))
                m.weight.copy_(0.5 + torch.rand(c, generator=generator))
                m.bias.copy_(0.1 * torch.randn(c, generator=generator))
    return model
