"""The planner's measurements: every micro-batch size profiled in shared rounds, each balance
found once.

All sizes are timed together, round by round (see :func:`gpipe.balance.profiler.profile_samples`),
so a burst of other work on the host hits one round of every size alike: it cannot make one
micro-batch count look slow and its neighbours fast.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpipe.balance import Profile, balance_costs
from gpipe.balance.optimizer_state import OptimizerSpec
from gpipe.balance.profiler import profile_samples
from gpipe.structure import leaves, map_tensors

__all__ = ["Measurements", "with_rows"]


class Measurements:
    """Per micro-batch size, the profile (with W times for zero-bubble), measured once for
    every size the planned layouts and chunk counts cut."""

    def __init__(
        self,
        module: nn.Sequential,
        sample: Any,
        device: str,
        optimizer: OptimizerSpec,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        target: Any,
        *,
        split: bool,
        repeats: int,
        sizes: list[int],
    ) -> None:
        self.module, self.sample = module, sample
        self.device, self.optimizer, self.split, self.repeats = device, optimizer, split, repeats
        self.loss_fn, self.target = loss_fn, target
        self.sizes = sorted(set(sizes), reverse=True)
        self._profiles: dict[int, Profile] = {}
        self._balances: dict[tuple[int, int], list[int]] = {}

    def at(self, size: int) -> Profile:
        """The profile of a micro-batch of ``size`` rows."""
        if not self._profiles:
            self._measure()
        if size not in self._profiles:
            raise ValueError(f"micro-batches of {size} rows were not among the sizes measured")
        return self._profiles[size]

    def _measure(self) -> None:
        """Profile every micro-batch size, in shared rounds."""
        model = self.module
        if self.loss_fn is not None:
            targets = {size: with_rows(self.target, size) for size in self.sizes}
            model = nn.Sequential(*self.module, _LossLayer(self.loss_fn, targets))
        measured = profile_samples(
            model,
            [with_rows(self.sample, size) for size in self.sizes],
            device=self.device,
            repeats=self.repeats,
            optimizer=self.optimizer,
            split_backward=self.split,
        )
        if self.loss_fn is not None:
            measured = [_fold_loss(m) for m in measured]
        self._profiles = dict(zip(self.sizes, measured))

    def balance(self, size: int, stages: int) -> list[int]:
        """Layers per stage, ``stages`` of them, balanced on the forward + backward time of
        micro-batches of ``size`` rows."""
        if (size, stages) not in self._balances:
            self._balances[size, stages] = balance_costs(self.at(size).costs("time"), stages)
        return self._balances[size, stages]


class _LossLayer(nn.Module):
    """The loss on fixed targets, profiled as if it were one more layer: the targets of as
    many rows as the output has (one set per micro-batch size profiled)."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], targets: dict[int, Any]):
        super().__init__()
        self.loss_fn, self.targets = loss_fn, targets

    def forward(self, output: Any) -> torch.Tensor:
        rows = next(t.shape[0] for t in leaves(output) if isinstance(t, torch.Tensor))
        return self.loss_fn(output, self.targets[rows])


def with_rows(value: Any, size: int) -> Any:
    """``value`` with exactly ``size`` rows along dim 0: repeated or cut, contiguous."""

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] == 0:
            raise ValueError(f"sample tensors need a batch dimension, got shape {tuple(t.shape)}")
        times = -(-size // t.shape[0])
        return t.repeat(times, *([1] * (t.dim() - 1)))[:size].clone()

    return map_tensors(resize, value)


# What the loss layer costs joins the last model layer; its other entries are dropped.
_FOLDED = ("forward", "backward", "activation_bytes", "cpu", "weight", "deferred_bytes")
# The spread of the last layer and the loss: the larger of the two.
_WIDEST = ("spread",)


def _fold_loss(measured: Profile) -> Profile:
    """The profile with the loss's time and saved bytes charged to the last layer."""
    changes = {}
    for field in dataclasses.fields(measured):
        values = getattr(measured, field.name)
        if values:
            if field.name in _FOLDED:
                changes[field.name] = [*values[:-2], values[-2] + values[-1]]
            elif field.name in _WIDEST:
                changes[field.name] = [*values[:-2], max(values[-2], values[-1])]
            else:
                changes[field.name] = values[:-1]
    return dataclasses.replace(measured, **changes)
