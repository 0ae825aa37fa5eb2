"""A simulated timeline held as columns: one array per field, objects made when read."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from gpipe.analysis.timeline import Event, Transfer
from gpipe.schedule import KINDS, WEIGHT, Action, Schedule, units

__all__ = ["ActionColumns", "SimulatedColumns", "TransferColumns"]

_CODES = np.zeros(256, np.int64)  # a kind's letter (its byte) -> its index in KINDS
_CODES[[ord(kind) for kind in KINDS]] = range(len(KINDS))


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """NOTE: a long schedule makes hundreds of thousands of events, none in a reference
    cycle; left on, the cyclic garbage collector would rescan them all, again and again."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@dataclass(frozen=True)
class ActionColumns:
    """A schedule's actions, device by device in list order, as arrays: ``kind`` (an index
    into KINDS), ``stage`` and ``microbatch``; device ``d``'s are ``offsets[d]:offsets[d+1]``.

    A fused action takes one row per part, in order; ``parts`` then gives, per listed
    action (every device's, in order), how many rows it takes (None: one each), and
    :meth:`listed` folds rows back into listed actions.
    """

    kind: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    device: np.ndarray
    offsets: list[int]
    parts: np.ndarray | None = None

    def listed(self, values: np.ndarray, how: str) -> np.ndarray:
        """``values`` per row folded into one per listed action: its parts' "first",
        "last" or "max" value."""
        if self.parts is None:
            return values
        last = np.cumsum(self.parts) - 1
        if how == "last":
            return values[last]
        first = last - self.parts + 1
        if how == "first":
            return values[first]
        return np.maximum.reduceat(values, first) if len(values) else values

    @property
    def split_backward(self) -> bool:
        """Whether weight gradients run as separate W actions (zero-bubble)."""
        return bool((self.kind == KINDS.index(WEIGHT)).any())

    @classmethod
    def of(cls, schedule: Schedule) -> ActionColumns:
        rows: Sequence[Sequence[Action]] = schedule.actions
        parts = None
        if schedule.fused:
            parts = np.array([len(a.units) for row in rows for a in row], np.int64)
            rows = [units(row) for row in rows]
        lengths = [len(row) for row in rows]
        count = sum(lengths)
        flat = list(chain.from_iterable(rows))
        # NOTE: list comprehensions, then arrays, beat np.fromiter over attrgetter; the
        # kinds go as one string's bytes, looked up in a table, not converted one by one.
        letters = np.frombuffer("".join([a.kind for a in flat]).encode(), np.uint8)
        kind = _CODES[letters]
        stage = np.fromiter([a.stage for a in flat], np.int64, count)
        microbatch = np.fromiter([a.microbatch for a in flat], np.int64, count)
        offsets = [0, *np.cumsum(lengths).tolist()]
        device = np.repeat(np.arange(len(rows)), lengths)
        return cls(kind, stage, microbatch, device, offsets, parts)

    def listed_offsets(self, schedule: Schedule) -> list[int]:
        """Each device's slice of the listed actions (:meth:`listed`'s output)."""
        return [0, *np.cumsum([len(row) for row in schedule.actions]).tolist()]


@dataclass(frozen=True)
class TransferColumns:
    """The messages of a simulation, one entry per message, in the order they are listed:
    device by device, in the order the receiving actions run, a neighbour's message before
    the skips'."""

    kind: np.ndarray  # index into KINDS
    stage: np.ndarray
    microbatch: np.ndarray
    source: np.ndarray
    target: np.ndarray
    start: np.ndarray
    end: np.ndarray
    nbytes: np.ndarray
    sender: np.ndarray

    def transfers(self) -> list[Transfer]:
        kinds = [KINDS[k] for k in self.kind.tolist()]
        with _collector_paused():
            return self._made(kinds)

    def _made(self, kinds: list[str]) -> list[Transfer]:
        return [
            Transfer(*fields)
            for fields in zip(
                kinds,
                self.stage.tolist(),
                self.microbatch.tolist(),
                self.source.tolist(),
                self.target.tolist(),
                self.start.tolist(),
                self.end.tolist(),
                self.nbytes.tolist(),
                self.sender.tolist(),
            )
        ]


@dataclass(frozen=True)
class SimulatedColumns:
    """Per device, its actions (the schedule's own) and their start, end, memory and what
    each leaves held, as slices ``offsets[d]:offsets[d + 1]`` of one array each.

    Implements :class:`gpipe.analysis.timeline.Columns`; the figures it gives are those the
    events would give, to the last bit (sums run in event order, as ``Timeline`` sums them).
    """

    actions: Sequence[Sequence[Action]]
    offsets: list[int]
    start: np.ndarray
    end: np.ndarray
    memory: np.ndarray
    left: np.ndarray
    messages: TransferColumns

    def _rows(self, values: np.ndarray) -> list[list[float]]:
        listed = values.tolist()
        return [listed[a:b] for a, b in zip(self.offsets, self.offsets[1:])]

    def events(self) -> list[list[Event]]:
        with _collector_paused():
            return self._made()

    def _made(self) -> list[list[Event]]:
        return [
            list(map(Event, *row))
            for row in zip(
                self.actions,
                self._rows(self.start),
                self._rows(self.end),
                self._rows(self.memory),
                self._rows(self.left),
            )
        ]

    def transfers(self) -> list[Transfer]:
        return self.messages.transfers()

    def bounds(self) -> list[tuple[float, float] | None]:
        return [
            (self.start[a].item(), self.end[b - 1].item()) if b > a else None
            for a, b in zip(self.offsets, self.offsets[1:])
        ]

    def busy(self) -> list[float]:
        return [sum(row) for row in self._rows(self.end - self.start)]

    def peak_memory(self) -> list[float]:
        return [max(row, default=0) for row in self._rows(self.memory)]
