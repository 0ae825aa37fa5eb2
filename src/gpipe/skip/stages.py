"""Stages of a skippable Sequential: each skip goes straight to the stage that pops it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gpipe.dataflow import Stages
from gpipe.partition import Partition
from gpipe.skip.layout import CHAIN, SkipRoute, inspect_skip_layout
from gpipe.skip.tracker import SkipTracker, use_tracker

__all__ = ["SkipStage", "stages"]


class SkipStage(Partition):
    """One stage of a skippable Sequential, called as a stage of a dataflow.

    It takes ``{"input": value, <skip>: tensor, ...}``: the chain value from the stage
    before and the skips it pops that earlier stages stashed. It runs its layers (each on
    its own random stream, as a :class:`~gpipe.partition.Partition` does) with those skips
    waiting in a tracker of its own, and returns ``{"input": value, <skip>: tensor, ...}``
    with the skips it stashed for later stages; the last stage returns the value alone.
    A skip stashed and popped within the stage stays inside this call.
    """

    def __init__(
        self,
        layers: Sequence[tuple[str, nn.Module]],
        positions: Sequence[int],
        receives: Sequence[SkipRoute] = (),
        gives: Sequence[SkipRoute] = (),
        last: bool = True,
    ) -> None:
        super().__init__(layers, positions)
        self.receives = tuple(receives)
        self.gives = tuple(gives)
        self.last = last

    def forward(self, values: Mapping[str, Any]) -> Any:
        tracker = SkipTracker({route.key: values[route.name] for route in self.receives})
        with use_tracker(tracker):
            output = super().forward(values[CHAIN])
        if self.last:
            return output
        return {CHAIN: output, **{route.name: tracker.take(route.key) for route in self.gives}}


def stages(
    module: nn.Sequential,
    balance: Sequence[int] | str | None,
    devices: Sequence[torch.device | str] | None = None,
) -> Stages:
    """Cut a Sequential with :func:`skippable` layers into stages that route skips directly.

    The result runs anywhere :class:`~gpipe.dataflow.Stages` do (``gpipe.GPipe`` makes it
    for you from such a Sequential). Each skip crossing stages is one message from the
    stage that stashes it to the stage that pops it, never relayed by the stages between.
    The stages hold the user's own layers, so gradients land on ``module``'s parameters.

    Args:
        module: the model, an ``nn.Sequential``.
        balance: layers per stage, as for ``GPipe``.
        devices: where each stage runs, or None to let the pipe choose.

    Returns:
        The stages; ``stages(x)`` runs them in order, as ``module(x)`` does.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, or its stashes and pops do not
            pair up (see :func:`~gpipe.skip.verify_skippables`).
        ValueError: a balance that does not fit the module, or that is not a list.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"gpipe.skip.stages cuts an nn.Sequential, got {type(module).__name__}; for "
            "other models use gpipe.split(model, ...)"
        )
    if balance is None or isinstance(balance, str):
        raise ValueError(
            f"a Sequential with skippable layers needs balance as a list of layers per stage, "
            f"got {balance!r}: e.g. balance=gpipe.balance.balance_by_params(model, 4) "
            "(balance='time' and 'memory' cannot profile skippable layers one by one yet)"
        )
    layout = inspect_skip_layout(module, balance)
    named = list(module._modules.items())
    cut: list[nn.Module] = []
    start = 0
    for stage, size in enumerate(balance):
        cut.append(
            SkipStage(
                named[start : start + size],
                range(start, start + size),
                receives=layout.receives(stage),
                gives=layout.gives(stage),
                last=stage == len(balance) - 1,
            )
        )
        start += size
    devices_ = None if devices is None else [torch.device(d) for d in devices]
    return Stages(cut, layout.dataflow(), balance=list(balance), devices=devices_)
