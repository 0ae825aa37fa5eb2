"""A U-Net-like model: long skips from each down block to the up block that mirrors it.

``down.0`` ... ``down.3`` halve the resolution step by step, ``middle`` works at the
bottom, ``up.0`` ... ``up.3`` double it back, each concatenating the output of the down
block at its resolution (``up.3`` reads ``down.0``'s). Cut at its blocks into 4 stages,
``down.0``'s output crosses 3 cuts: the skip a pipeline should send directly, not relay::

    model = unet(UNetConfig(), seed=0)
    out = model(images)                       # (B, 3, 16, 16) -> (B, 3, 16, 16)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["UNet", "UNetConfig", "unet"]


@dataclass
class UNetConfig:
    """Channels at each depth; the image side must divide by ``2 ** len(widths)``."""

    in_channels: int = 3
    out_channels: int = 3
    widths: tuple[int, ...] = (8, 16, 32, 64)


class DoubleConv(nn.Module):
    """Two 3x3 convolutions, each followed by GroupNorm and SiLU."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, padding=1)
        self.norm1 = nn.GroupNorm(1, outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1)
        self.norm2 = nn.GroupNorm(1, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.norm1(self.conv1(x)))
        return F.silu(self.norm2(self.conv2(x)))


class Up(nn.Module):
    """Double the resolution, concatenate the skip, then a :class:`DoubleConv`."""

    def __init__(self, inputs: int, skip: int, outputs: int) -> None:
        super().__init__()
        self.conv = DoubleConv(inputs + skip, outputs)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        return self.conv(torch.cat([x, skip], dim=1))


class UNet(nn.Module):
    """``down`` (a ModuleList), ``middle``, ``up`` (a ModuleList), ``head``."""

    def __init__(self, config: UNetConfig) -> None:
        super().__init__()
        widths = config.widths
        self.down = nn.ModuleList(
            DoubleConv(inputs, outputs)
            for inputs, outputs in zip((config.in_channels, *widths[:-1]), widths)
        )
        self.middle = DoubleConv(widths[-1], widths[-1])
        # up.i mirrors down.(n-1-i): it reads that block's output, at that resolution.
        ups = [(widths[-1], widths[-1], widths[-1])]
        ups += [(widths[i + 1], widths[i], widths[i]) for i in reversed(range(len(widths) - 1))]
        self.up = nn.ModuleList(Up(*shape) for shape in ups)
        self.head = nn.Conv2d(widths[0], config.out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """An image ``(B, out_channels, H, W)`` from an image ``(B, in_channels, H, W)``."""
        skips = []
        for down in self.down:
            x = down(x)
            skips.append(x)
            x = F.avg_pool2d(x, 2)
        x = self.middle(x)
        for up in self.up:
            x = up(x, skips.pop())
        return self.head(x)


def unet(config: UNetConfig | None = None, *, seed: int = 0) -> UNet:
    """A :class:`UNet` initialised from ``seed`` (the global random state is left alone)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return UNet(config or UNetConfig())
