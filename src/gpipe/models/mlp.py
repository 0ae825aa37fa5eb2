"""An MLP as an nn.Sequential: the simplest model to cut into stages."""

from __future__ import annotations

from torch import nn

__all__ = ["mlp"]


def mlp(layers: int = 16, width: int = 256) -> nn.Sequential:
    """``layers`` blocks of Linear + GELU, all ``width`` wide."""
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks)
