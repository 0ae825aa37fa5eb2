"""The planner's measurements: each micro-batch size profiled once, each balance found once."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpipe.balance import Profile, balance_costs, profile
from gpipe.balance.optimizer_state import OptimizerSpec
from gpipe.structure import map_tensors

__all__ = ["Measurements"]


class Measurements:
    """Per micro-batch size, the profile (with W times for zero-bubble), measured once."""

    def __init__(
        self,
        module: nn.Sequential,
        sample: Any,
        batch_size: int,
        device: str,
        optimizer: OptimizerSpec,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        target: Any,
        *,
        split: bool,
        repeats: int,
    ) -> None:
        self.module, self.sample, self.batch_size = module, sample, batch_size
        self.device, self.optimizer, self.split, self.repeats = device, optimizer, split, repeats
        self.loss_fn, self.target = loss_fn, target
        self._profiles: dict[int, Profile] = {}
        self._balances: dict[tuple[int, int], list[int]] = {}

    def at(self, chunks: int) -> Profile:
        """The profile for the largest micro-batch of ``chunks``."""
        size = math.ceil(self.batch_size / chunks)
        if size not in self._profiles:
            sample = _rows(self.sample, size)
            model = self.module
            if self.loss_fn is not None:
                loss = _LossLayer(self.loss_fn, _rows(self.target, size))
                model = nn.Sequential(*self.module, loss)
            measured = profile(
                model,
                sample,
                device=self.device,
                repeats=self.repeats,
                optimizer=self.optimizer,
                split_backward=self.split,
            )
            if self.loss_fn is not None:
                measured = _fold_loss(measured)
            self._profiles[size] = measured
        return self._profiles[size]

    def balance(self, chunks: int, stages: int) -> list[int]:
        """Layers per stage, ``stages`` of them, balanced on the forward + backward time."""
        size = math.ceil(self.batch_size / chunks)
        if (size, stages) not in self._balances:
            self._balances[size, stages] = balance_costs(self.at(chunks).costs("time"), stages)
        return self._balances[size, stages]


class _LossLayer(nn.Module):
    """The loss on fixed targets, profiled as if it were one more layer."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], target: Any) -> None:
        super().__init__()
        self.loss_fn, self.target = loss_fn, target

    def forward(self, output: Any) -> torch.Tensor:
        return self.loss_fn(output, self.target)


def _rows(value: Any, size: int) -> Any:
    """``value`` with exactly ``size`` rows along dim 0: repeated or cut, contiguous."""

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] == 0:
            raise ValueError(f"sample tensors need a batch dimension, got shape {tuple(t.shape)}")
        times = -(-size // t.shape[0])
        return t.repeat(times, *([1] * (t.dim() - 1)))[:size].clone()

    return map_tensors(resize, value)


# What the loss layer costs joins the last model layer; its other entries are dropped.
_FOLDED = ("forward", "backward", "activation_bytes", "cpu", "weight", "deferred_bytes")


def _fold_loss(measured: Profile) -> Profile:
    """The profile with the loss's time and saved bytes charged to the last layer."""
    changes = {}
    for field in dataclasses.fields(measured):
        values = getattr(measured, field.name)
        if values:
            folded = field.name in _FOLDED
            changes[field.name] = [*values[:-2], values[-2] + values[-1]] if folded else values[:-1]
    return dataclasses.replace(measured, **changes)
