"""Stages: the stage modules of a pipe and where they live, which stay the same across steps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Stages"]


@dataclass
class Stages:
    """What stays the same from step to step: the stage modules and where they live.

    Args:
        modules: one module per model stage; None for a stage this process does not hold
            (a distributed pipe keeps only its own).
        devices: one ``torch.device`` per pipeline device.
        placement: ``placement[s]`` is the device index of stage ``s``.
    """

    modules: Sequence[nn.Module | None]
    devices: list[torch.device]
    placement: tuple[int, ...]
    # Stages whose first layer writes its input in place (ReLU(inplace=True)...): their
    # input is a leaf that needs a gradient, which autograd forbids modifying, so they get a
    # copy. Found once, from the layers' ``inplace`` flags.
    copies_input: list[bool] = field(default_factory=list)
    # Whether a stage's forward draws random numbers, per (stage, training mode); learned
    # from the first forward, which runs seeded and probed to be safe.
    draws_random: dict[tuple[int, bool], bool] = field(default_factory=dict)
    # Bytes a forward keeps for backward, per stage, training mode, input and target shapes
    # and autocast: counted once per key (see StageWorker._forward_kept).
    saved_bytes: dict[tuple[Any, ...], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.copies_input:
            self.copies_input = [
                module is not None and _writes_input(module) for module in self.modules
            ]

    @property
    def count(self) -> int:
        """S, the number of model stages (K·v)."""
        return len(self.placement)

    @property
    def last(self) -> int:
        """The last model stage, which computes the loss."""
        return len(self.placement) - 1

    def module(self, stage: int) -> nn.Module:
        """The module of ``stage``, which this process must hold."""
        module = self.modules[stage]
        if module is None:
            raise RuntimeError(f"stage {stage} is not held by this process")
        return module

    def device_of(self, stage: int) -> torch.device:
        """The ``torch.device`` stage ``stage`` runs on."""
        return self.devices[self.placement[stage]]


def _writes_input(module: nn.Module) -> bool:
    """Whether the first layer ``module`` runs modifies its input in place."""
    while isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[0]
    return bool(getattr(module, "inplace", False))
