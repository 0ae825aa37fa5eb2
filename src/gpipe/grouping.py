"""Grouping: consecutive stages of a :class:`~gpipe.dataflow.Stages` merged into fewer.

How :func:`gpipe.plan` balances among the cuts a model was split at: a plan of K stages
over N pieces runs each of its stages as a group of consecutive pieces, with the values
passed between pieces of one group kept inside it and only those that cross between groups
sent. Each piece keeps its own random streams, so a grouped run draws what the pieces drew
as stages of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from gpipe.dataflow import INPUT, Dataflow, Stages, layered

__all__ = ["group_stages"]


def group_stages(stages: Stages, counts: Sequence[int]) -> Stages:
    """``stages`` merged into fewer: new stage ``g`` runs the next ``counts[g]`` of them.

    The same computation (the same modules, parameters and random streams: each piece
    keeps its own, so dropout draws what it drew unmerged), with the values passed between
    pieces of one new stage kept inside it. Its ``balance`` sums the pieces'; its devices
    are left to the pipe. ``group_stages(stages, [3, 2])`` of five pieces is the split at
    the 4th cut.

    Raises:
        TypeError: ``counts`` is not a list of ints.
        ValueError: an entry below 1, or entries that do not add up to ``len(stages)``.
    """

    if isinstance(counts, (str, bytes)) or not all(
        isinstance(c, int) and not isinstance(c, bool) for c in counts
    ):
        raise TypeError(f"counts must be a list of ints (stages per group), got {counts!r}")
    if not counts or any(c < 1 for c in counts) or sum(counts) != len(stages):
        raise ValueError(
            f"counts={list(counts)} must give each group at least one stage and add up "
            f"to the {len(stages)} stages"
        )
    group_of = [g for g, count in enumerate(counts) for _ in range(count)]
    flow = stages.dataflow
    crossing = [
        (name, source, reader)
        for reader, taken in enumerate(flow.takes)
        for name, source in taken
        if source == INPUT or group_of[source] != group_of[reader]
    ]
    key = _crossing_keys({(name, source) for name, source, _ in crossing})
    takes: list[list[tuple[str, int]]] = [[] for _ in counts]
    gives: list[list[tuple[str, int]]] = [[] for _ in counts]
    for name, source, reader in crossing:
        wire = (key[name, source], INPUT if source == INPUT else group_of[source])
        if wire not in takes[group_of[reader]]:
            takes[group_of[reader]].append(wire)
        if source != INPUT and (name, source) not in gives[group_of[source]]:
            gives[group_of[source]].append((name, source))

    def outside(name: str, source: int, reader: int) -> str | None:
        inside = source != INPUT and group_of[source] == group_of[reader]
        return None if inside else key[name, source]

    modules: list[nn.Module] = []
    balance: list[int] = []
    start = 0
    for g, count in enumerate(counts):
        pieces = range(start, start + count)
        modules.append(
            _Group(
                [stages[p] for p in pieces],
                [[(n, s, outside(n, s, p)) for n, s in flow.takes[p]] for p in pieces],
                start,
                [sum(stages.balance[:p]) for p in pieces],
                None if g == len(counts) - 1 else [(key[v], *v) for v in gives[g]],
            )
        )
        balance.append(sum(stages.balance[start : start + count]))
        start += count
    dataflow = Dataflow(flow.inputs, tuple(tuple(t) for t in takes))
    return Stages(modules, dataflow, balance, None, stages.constants, stages.call_order)


def _crossing_keys(crossing: set[tuple[str, int]]) -> dict[tuple[str, int], str]:
    """The name each value that crosses between groups travels under: its own, unless two
    sources give that name (a skippable Sequential's chain value): then ``name@source``,
    leaving the pipe's inputs their names."""
    sources: dict[str, list[int]] = {}
    for name, source in crossing:
        sources.setdefault(name, []).append(source)
    return {
        (name, source): name if source == INPUT or len(sources[name]) == 1 else f"{name}@{source}"
        for name, source in crossing
    }


class _Group(nn.Module):
    """One stage of :meth:`Stages.grouped`: runs its pieces in order, routing values between
    them, and hands later stages what they read.

    Each piece runs on its own random streams: one with per-layer ``positions`` gets the
    runtime's ``layer_scope``; any other runs inside ``layer_scope(first unit)``, the stream
    it drew from as a stage of its own.
    """

    def __init__(
        self,
        pieces: Sequence[nn.Module],
        takes: list[list[tuple[str, int, str | None]]],
        first: int,
        units: list[int],
        gives: list[tuple[str, str, int]] | None,
    ) -> None:
        super().__init__()
        self.pieces = nn.ModuleList(pieces)
        self._takes = takes  # per piece: (name, source piece, key when it comes from outside)
        self._first = first  # the index of the first piece among all
        self._units = units  # per piece: the position of its first unit in the model
        self._gives = gives  # (key, name, source piece) handed on; None: the last group
        self._scope: Any = None

    @property
    def positions(self) -> list[Any]:
        return [
            key
            for piece, unit in zip(self.pieces, self._units)
            for key in (list(piece.positions) if layered(piece) else [unit])  # type: ignore[arg-type]
        ]

    @property
    def layer_scope(self) -> Any:
        return self._scope

    @layer_scope.setter
    def layer_scope(self, scope: Any) -> None:
        self._scope = scope
        for piece in self.pieces:
            if layered(piece):
                piece.layer_scope = scope

    def forward(self, values: dict[str, Any]) -> Any:
        made: dict[int, Any] = {}
        output: Any = None
        for at, (piece, taken, unit) in enumerate(zip(self.pieces, self._takes, self._units)):
            given = {
                name: values[key] if key is not None else made[source][name]
                for name, source, key in taken
            }
            if self._scope is None or layered(piece):
                output = piece(given)
            else:
                with self._scope(unit):
                    output = piece(given)
            made[self._first + at] = output
        if self._gives is None:
            return output
        return {key: made[source][name] for key, name, source in self._gives}
