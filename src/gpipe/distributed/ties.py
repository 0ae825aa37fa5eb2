"""Tied parameters across ranks: one Parameter used by stages that live on different ranks.

An embedding tied to the LM head is the usual case: the first and the last stage both use
the same weight. Each rank that holds one of those stages keeps its own copy; after every
backward their gradients are summed over the holders, so every copy takes the same step and
the copies stay identical, as the one Parameter of plain training would. A tie is found
when the same Parameter object appears in stages on different ranks, or declared by name
(``tied=[("0.token.weight", "9.weight")]``) for weights that are different objects (a
model built twice, or on meta); declared ties start from the first holder's values.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["Tie", "TiedWeights", "find_ties", "tie_groups"]


@dataclass(frozen=True)
class Tie:
    """One weight, and where it is held: ``(stage, name)`` by each holding stage.

    ``positions`` are the pipeline devices of those stages, in increasing order; the first
    is the weight's home, where it is counted (for the gradient norm) and whose values a
    declared tie starts from.
    """

    holders: tuple[tuple[int, str], ...]
    positions: tuple[int, ...]

    def name_on(self, stages: Sequence[int]) -> str | None:
        """The weight's name in the first of ``stages`` that holds it, if any."""
        for stage, name in self.holders:
            if stage in stages:
                return name
        return None


def find_ties(
    partitions: Sequence[nn.Module],
    placement: Sequence[int],
    declared: Sequence[tuple[str, str]] = (),
) -> list[Tie]:
    """The weights stages on different pipeline devices share (or are declared to share).

    Args:
        partitions: one module per stage, holding the user's layers under their names.
        placement: the pipeline device of each stage.
        declared: pairs of parameter names (as in the user's model) to tie.

    Raises:
        ValueError: a declared name that no stage holds.
    """
    by_object: dict[int, list[tuple[int, str]]] = {}
    by_name: dict[str, tuple[int, torch.nn.Parameter]] = {}
    for stage, partition in enumerate(partitions):
        for name, param in partition.named_parameters(remove_duplicate=False):
            by_object.setdefault(id(param), []).append((stage, name))
            by_name.setdefault(name, (stage, param))
    groups = [holders for holders in by_object.values()]
    for first, second in declared:
        for name in (first, second):
            if name not in by_name:
                known = ", ".join(sorted(by_name)[:8])
                raise ValueError(
                    f"tied names {name!r}, but the model has no parameter of that name "
                    f"(names look like: {known}, ...)"
                )
        a, b = by_object[id(by_name[first][1])], by_object[id(by_name[second][1])]
        merged = a + b
        groups = [g for g in groups if g is not a and g is not b] + [merged]
    ties = []
    for holders in groups:
        positions = tuple(sorted({placement[stage] for stage, _ in holders}))
        if len(positions) > 1:
            ties.append(Tie(tuple(sorted(holders)), positions))
    return sorted(ties, key=lambda tie: tie.holders)


def tie_groups(
    ties: Sequence[Tie], grid: Sequence[Sequence[int]], timeout: datetime.timedelta
) -> list[Any]:
    """This rank's process group for each tie (None where it holds no copy).

    One group per tie and replica, over the ranks holding the tie in that replica; every
    rank makes every group, in the same order, as torch requires.
    """
    mine: list[Any] = []
    me = dist.get_rank()
    for tie in ties:
        ranks = [[row[p] for p in tie.positions] for row in grid]
        group, _ = dist.new_subgroups_by_enumeration(ranks, timeout=timeout)
        mine.append(group if any(me in r for r in ranks) else None)
    return mine


class TiedWeights:
    """The tied weights this rank holds a copy of, and what keeps the copies identical.

    Args:
        ties: every tie of the model (the same list on every rank).
        groups: this rank's process group for each tie (None where it holds no copy).
        stages: the stages this rank holds.
        position: this rank's pipeline device.
        pipeline: the global ranks of this rank's pipeline, device by device.
        view: this rank's layers under their names in the user's model.
    """

    def __init__(
        self,
        ties: Sequence[Tie],
        groups: Sequence[Any],
        stages: Sequence[int],
        position: int,
        pipeline: Sequence[int],
        view: nn.Module,
    ) -> None:
        self._named = [
            (tie, group, name)
            for tie, group in zip(ties, groups)
            if group is not None and (name := tie.name_on(stages)) is not None
        ]
        self._copies: list[tuple[Tie, Any, torch.Tensor]] = []
        self.reread(view)
        self._position = position
        self._pipeline = list(pipeline)

    def reread(self, view: nn.Module) -> None:
        """Take this rank's copies from ``view`` again, by name: after a data-parallel
        engine replaced its Parameters (``fully_shard``'s DTensor shards)."""
        names = dict(view.named_parameters(remove_duplicate=False))
        self._copies = [(tie, group, names[name]) for tie, group, name in self._named]

    def start_alike(self) -> None:
        """Every copy takes its home's values (a declared tie's copies may differ)."""
        for tie, group, param in self._copies:
            with torch.no_grad():
                dist.broadcast(param.data, self._pipeline[tie.positions[0]], group=group)

    def sum_gradients(self, wait: Callable[[Any], None]) -> None:
        """Every copy's gradient becomes the sum over the copies: they take the same step.

        A gradient sharded over the replicas (FSDP's DTensor) is summed shard by shard: the
        holders of a copy in one replica hold the same rows of it.
        """
        for _, group, param in self._copies:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = param.grad
            with torch.no_grad():
                local = grad.to_local() if isinstance(grad, DTensor) else grad
            wait(dist.all_reduce(local, group=group, async_op=True))

    def counted_elsewhere(self) -> set[int]:
        """The ids of this rank's copies whose home is another rank (for the norm)."""
        return {id(param) for tie, _, param in self._copies if tie.positions[0] != self._position}
