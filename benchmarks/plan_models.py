"""Models for the planning benchmarks, loadable by ``gpipe plan --model plan_models:NAME``."""

from __future__ import annotations

from torch import nn

__all__ = ["mlp"]


def mlp(width: int = 512, depth: int = 6, classes: int = 10) -> nn.Sequential:
    """``depth`` blocks of ``Linear(width, width)`` + ReLU, then a ``Linear(width, classes)``
    head: the model of issue 38's command (``--sample-shape 512``)."""
    blocks: list[nn.Module] = []
    for _ in range(depth):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, classes))
