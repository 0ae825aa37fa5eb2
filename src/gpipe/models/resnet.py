"""A ResNet-like CNN for small images: residual blocks and BatchNorm, torchvision's layout.

A stem, stages ``layer1``, ``layer2``, ... of basic residual blocks (the later ones halve
the resolution and double the width), average pooling and a linear head. Each block's
residual stays inside the block, so any block boundary is a clean cut; its BatchNorm layers
want ``deferred_batch_norm=True`` in a pipe, so their running statistics are those of the
whole mini-batch, not of the last micro-batch::

    model = resnet(ResNetConfig(), seed=0)
    logits = model(images)                    # (B, 3, 16, 16) -> (B, 10)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ResNet", "ResNetConfig", "resnet"]


@dataclass
class ResNetConfig:
    """Widths and block counts per stage; 3x16x16 images in 10 classes by default."""

    in_channels: int = 3
    classes: int = 10
    widths: tuple[int, ...] = (8, 16, 32)
    blocks: tuple[int, ...] = (2, 2, 2)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm, plus a shortcut (1x1 when the shape changes)."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """``stem``, ``layer1`` ... ``layerN`` (Sequentials of blocks), ``pool``, ``fc``."""

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        if len(config.widths) != len(config.blocks):
            raise ValueError(
                f"widths {config.widths} and blocks {config.blocks} differ in length: "
                "give one width and one block count per stage"
            )
        self.stem = nn.Sequential(
            nn.Conv2d(config.in_channels, config.widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(config.widths[0]),
            nn.ReLU(),
        )
        width = config.widths[0]
        self.layer_names = tuple(f"layer{i + 1}" for i in range(len(config.widths)))
        for index, (outputs, count) in enumerate(zip(config.widths, config.blocks)):
            stride = 1 if index == 0 else 2
            blocks = [BasicBlock(width, outputs, stride)]
            blocks += [BasicBlock(outputs, outputs, 1) for _ in range(count - 1)]
            self.add_module(self.layer_names[index], nn.Sequential(*blocks))
            width = outputs
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, config.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits ``(B, classes)`` of images ``(B, in_channels, H, W)``."""
        x = self.stem(x)
        for name in self.layer_names:
            x = getattr(self, name)(x)
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet(config: ResNetConfig | None = None, *, seed: int = 0) -> ResNet:
    """A :class:`ResNet` initialised from ``seed`` (the global random state is left alone)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ResNet(config or ResNetConfig())
