"""Skip layout: which stage stashes each skip and which pops it, for a Sequential and a balance.

A skip whose stash and pop land on one stage never leaves it. Any other goes straight from
the stashing stage to the popping stage, whatever lies between: the layout is a
:class:`~gpipe.dataflow.Dataflow` in which stage ``s`` reads the chain value from ``s - 1``
and each skip it pops from the stage that stashed it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from gpipe.dataflow import INPUT, Dataflow
from gpipe.partition import check_balance
from gpipe.skip.namespace import Namespace
from gpipe.skip.skippable import Skippable
from gpipe.skip.tracker import SkipKey
from gpipe.skip.verify import verify_skippables

__all__ = ["CHAIN", "SkipLayout", "SkipRoute", "inspect_skip_layout"]

CHAIN = "input"  # the dataflow name of the value each layer hands the next


@dataclass(frozen=True)
class SkipRoute:
    """One skip: its key, its name in the dataflow, and where it is stashed and popped.

    ``stash``/``pop`` are layer positions in the Sequential; ``source``/``reader`` the
    stages holding those layers.
    """

    key: SkipKey
    name: str
    stash: int
    pop: int
    source: int
    reader: int

    @property
    def crosses(self) -> bool:
        """Whether the skip leaves its stage (its pop is on a later stage)."""
        return self.reader > self.source


@dataclass(frozen=True)
class SkipLayout:
    """Every skip of a Sequential cut by a balance, in the order their pops run."""

    routes: tuple[SkipRoute, ...]
    stages: int

    def receives(self, stage: int) -> list[SkipRoute]:
        """The skips ``stage`` pops that an earlier stage stashed, by source stage."""
        found = [r for r in self.routes if r.reader == stage and r.crosses]
        return sorted(found, key=lambda r: (r.source, r.pop))

    def gives(self, stage: int) -> list[SkipRoute]:
        """The skips ``stage`` stashes that a later stage pops."""
        return [r for r in self.routes if r.source == stage and r.crosses]

    def dataflow(self) -> Dataflow:
        """The stages' dataflow: the chain from stage to stage, each skip source to reader."""
        takes = tuple(
            (
                (CHAIN, stage - 1 if stage else INPUT),
                *((r.name, r.source) for r in self.receives(stage)),
            )
            for stage in range(self.stages)
        )
        return Dataflow((CHAIN,), takes)


def inspect_skip_layout(module: nn.Sequential, balance: Sequence[int]) -> SkipLayout:
    """Where each skip of ``module`` goes when it is cut into stages by ``balance``.

    Args:
        module: the model, an ``nn.Sequential`` whose layers may be :func:`skippable`.
        balance: layers per stage.

    Raises:
        TypeError: a stash without its pop, or the like (see :func:`verify_skippables`).
        ValueError: a balance that does not fit the module.
    """
    verify_skippables(module)
    balance = check_balance(module, balance)
    stage_of = [s for s, size in enumerate(balance) for _ in range(size)]
    stashed_at: dict[SkipKey, int] = {}
    popped_at: dict[SkipKey, int] = {}
    for position, layer in enumerate(module._modules.values()):
        if isinstance(layer, Skippable):
            stashed_at.update((key, position) for key in layer.stashable())
            popped_at.update((key, position) for key in layer.poppable())
    names = _dataflow_names(sorted(popped_at, key=popped_at.__getitem__))
    routes = tuple(
        SkipRoute(key, names[key], stashed_at[key], at, stage_of[stashed_at[key]], stage_of[at])
        for key, at in sorted(popped_at.items(), key=lambda item: item[1])
    )
    return SkipLayout(routes, len(balance))


def _dataflow_names(keys: Sequence[SkipKey]) -> dict[SkipKey, str]:
    """A name per skip for the dataflow: ``skip:<name>``, ``skip:<name>@<k>`` if isolated.

    NOTE: ``k`` counts namespaces in the order the model first uses them, never their
    random ids, so every process of a distributed run that builds the model the same way
    names the skips the same way.
    """
    numbers: dict[Namespace, int] = {}
    counter = itertools.count(1)
    names: dict[SkipKey, str] = {}
    for ns, name in keys:
        if ns is None:
            names[(ns, name)] = f"skip:{name}"
        else:
            if ns not in numbers:
                numbers[ns] = next(counter)
            names[(ns, name)] = f"skip:{name}@{numbers[ns]}"
    return names
