"""Partitions: cut an nn.Sequential into consecutive stages, each knowing its layers' places."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

__all__ = ["Partition", "check_balance", "split_module"]

# What runs around each layer call: given the layer's position in the user's model, a context
# manager (gpipe.randomness sets the layer's random stream there). None: nothing.
LayerScope = Callable[[int], AbstractContextManager[Any]]


class Partition(nn.Sequential):
    """One stage: an nn.Sequential of the user's own layers that knows where each came from.

    ``positions[i]`` is the index in the user's model of the stage's ``i``-th layer, so
    anything keyed by layer (random streams, above all) is the same whichever stage a layer
    lands on. Layer names are the user's, so ``state_dict`` keys read as in their model. A
    layer object the model uses twice (``act`` in ``Sequential(lin1, act, lin2, act)``) is held
    under both of its names, once per use.
    """

    def __init__(self, layers: Sequence[tuple[str, nn.Module]], positions: Sequence[int]) -> None:
        super().__init__(OrderedDict(layers))
        self.positions = list(positions)
        self.layer_scope: LayerScope | None = None

    def forward(self, input: Any) -> Any:
        scope = self.layer_scope
        if scope is None:
            for layer in self._modules.values():
                input = layer(input)
            return input
        for position, layer in zip(self.positions, self._modules.values()):
            with scope(position):
                input = layer(input)
        return input

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())


def check_balance(module: nn.Sequential, balance: Sequence[int]) -> list[int]:
    """Validate ``balance`` (layers per stage) against ``module`` and return it as a list.

    Raises:
        TypeError: ``balance`` is not a sequence of ints.
        ValueError: it has an entry < 1, or does not sum to ``len(module)`` (so only an
            empty module takes an empty balance).
    """
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
        raise TypeError(f"balance must be a list of ints (layers per stage), got {balance!r}")
    balance = list(balance)
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in balance):
        raise TypeError(f"balance must be a list of ints (layers per stage), got {balance!r}")
    if any(b < 1 for b in balance):
        raise ValueError(
            f"every stage needs at least one layer, got balance={balance}; "
            + _measure_it(len(balance))
        )
    if sum(balance) != len(module):
        reused = len(module) != len(list(module.named_children()))
        raise ValueError(
            f"balance={balance} sums to {sum(balance)} but the module has {len(module)} "
            f"layers{' (a layer object used twice counts twice)' if reused else ''}; "
            + _measure_it(len(balance))
        )
    return balance


def _measure_it(stages: int) -> str:
    """The advice that ends a balance error: let a measurement find the balance."""
    return (
        "a measured balance avoids this, and follows the model as it changes: "
        "`from gpipe.balance import balance_by_time; "
        f"balance = balance_by_time(module, sample, {max(stages, 1)})`, "
        "or GPipe(module, balance='time', sample=sample, devices=...)"
    )


def split_module(module: nn.Sequential, balance: Sequence[int]) -> nn.ModuleList:
    """The stages: one :class:`Partition` per entry of ``balance``, holding the user's layers.

    Layer names are kept, so ``state_dict`` keys of a stage read as in the user's model.
    Every position is kept, a layer object used at two positions included (NOTE:
    ``named_children()`` would drop the second use, leaving a stage short of a layer).
    """
    balance = check_balance(module, balance)
    named = list(module._modules.items())
    stages = nn.ModuleList()
    start = 0
    for size in balance:
        stages.append(Partition(named[start : start + size], range(start, start + size)))
        start += size
    return stages
