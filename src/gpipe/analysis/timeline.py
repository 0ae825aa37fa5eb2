"""Timelines: what each device did and when, from the runtime or from the simulator."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gpipe.schedule import Action

if TYPE_CHECKING:
    from gpipe.analysis.critical import CriticalPath

__all__ = ["Columns", "Event", "Timeline", "Transfer"]


@dataclass(frozen=True, slots=True)
class Event:
    """One action as it ran (or was simulated) on a device.

    A fused action (``1F3+1B1``, a forward and a backward issued together) is one event:
    from its first part's start to its last part's end, ``memory`` the most the pair held
    and ``left`` what it leaves; its parts have no times of their own.

    ``memory`` is the most bytes the device held while the action ran: the stage inputs
    and the activations autograd saved of every micro-batch in flight, and what a backward
    holds while it runs (the gradients it receives and sends, a recomputation) or keeps for
    W. :mod:`gpipe.analysis.memory` states the rule; a simulated timeline counts in the
    cost model's units.

    ``left`` is what the device holds for backward once the action has ended, by the same
    count: what a forward keeps, less what a backward or W freed, plus what a zero-bubble B
    keeps for its W. Between actions the device holds the last one's ``left`` (see
    :mod:`gpipe.analysis.held`). None where it is not known (a timeline built by hand, or
    saved before it was recorded).
    """

    action: Action
    start: float
    end: float
    memory: float = 0
    left: float | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def kind(self) -> str:
        """ "F", "B", "W" or "F+B" for a fused action (the action's kind)."""
        return self.action.kind

    @property
    def stage(self) -> int:
        """The model stage the action ran on (a fused action's: its forward's)."""
        return self.action.stage

    @property
    def microbatch(self) -> int:
        """The micro-batch the action ran (a fused action's: its forward's)."""
        return self.action.microbatch


@dataclass(frozen=True, slots=True)
class Transfer:
    """One message between two devices: a stage's output going forward (``kind`` "F", for
    the receiving stage's forward) or a gradient coming back (``kind`` "B").

    ``start`` is when the sender handed it over, ``end`` when it had arrived, on the
    timeline's clock; ``stage`` is the receiving stage, ``source`` and ``target`` devices.
    ``sender`` is the sending stage where it is known: a model that is not a chain sends
    values past the stages in between (a skip), so it need not be a neighbour.
    """

    kind: str
    stage: int
    microbatch: int
    source: int
    target: int
    start: float
    end: float
    nbytes: int = 0
    sender: int | None = None


class Columns(Protocol):
    """A timeline held as columns (the simulator's): its events and transfers are made only
    when someone reads them, and the figures a search compares come from the columns."""

    def events(self) -> list[list[Event]]: ...

    def transfers(self) -> list[Transfer]: ...

    def bounds(self) -> list[tuple[float, float] | None]:
        """Per device, its first action's start and its last action's end (None: idle)."""
        ...

    def busy(self) -> list[float]: ...

    def peak_memory(self) -> list[float]: ...


class Timeline:
    """Per device, the events of one training step in start order.

    Args:
        events: ``events[d]`` lists device ``d``'s events.
        unit: ``"s"`` for a measured timeline (seconds from the step's start), ``"cost"``
            for a simulated one (the cost model's units).
        schedule: the name of the schedule that produced it.
        transfers: messages between devices, where they were recorded (a distributed
            step, or a simulation with a transfer cost).
        processes: whether each device was a process of its own (one per rank): drawings
            then show ranks, and the Perfetto trace a process track per rank.
    """

    # NOTE: a plain class, not a dataclass: a long simulated timeline is held as columns,
    # since its Event and Transfer objects can cost more than the simulation; they are
    # made when ``events`` or ``transfers`` is first read (never, in a search).
    __hash__ = None  # type: ignore[assignment]

    def __init__(
        self,
        events: list[list[Event]],
        unit: str = "s",
        schedule: str = "",
        transfers: list[Transfer] | None = None,
        processes: bool = False,
    ) -> None:
        self._events: list[list[Event]] | None = events
        self._transfers: list[Transfer] | None = [] if transfers is None else transfers
        self._columns: Columns | None = None
        self.unit = unit
        self.schedule = schedule
        self.processes = processes

    @classmethod
    def from_columns(cls, columns: Columns, unit: str = "cost", schedule: str = "") -> Timeline:
        """A timeline whose events and transfers ``columns`` makes when they are read."""
        timeline = cls([], unit, schedule)
        timeline._events = timeline._transfers = None
        timeline._columns = columns
        return timeline

    @property
    def events(self) -> list[list[Event]]:
        """``events[d]``: device ``d``'s events, in start order."""
        if self._events is None:
            assert self._columns is not None
            self._events = self._columns.events()
        return self._events

    @events.setter
    def events(self, events: list[list[Event]]) -> None:
        self._events = events

    @property
    def transfers(self) -> list[Transfer]:
        """Messages between devices, where they were recorded."""
        if self._transfers is None:
            assert self._columns is not None
            self._transfers = self._columns.transfers()
        return self._transfers

    @transfers.setter
    def transfers(self, transfers: list[Transfer]) -> None:
        self._transfers = transfers

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Timeline):
            return NotImplemented
        return (self.unit, self.schedule, self.processes, self.events, self.transfers) == (
            other.unit,
            other.schedule,
            other.processes,
            other.events,
            other.transfers,
        )

    def __repr__(self) -> str:
        return (
            f"Timeline(events={self.events!r}, unit={self.unit!r}, schedule={self.schedule!r}, "
            f"transfers={self.transfers!r}, processes={self.processes!r})"
        )

    def _bounds(self) -> list[tuple[float, float] | None]:
        if self._events is None:
            assert self._columns is not None
            return self._columns.bounds()
        return [(device[0].start, device[-1].end) if device else None for device in self._events]

    @property
    def devices(self) -> int:
        return len(self._bounds())

    @property
    def start(self) -> float:
        """When the first action started (each device's events are in start order)."""
        return min((b[0] for b in self._bounds() if b is not None), default=0.0)

    @property
    def makespan(self) -> float:
        """Time from the first action's start to the last action's end."""
        # NOTE: a device runs one action at a time, so its last event ends last: no scan of
        # every event, which matters as this runs once per chart row.
        ends = [b[1] for b in self._bounds() if b is not None]
        return max(ends, default=0.0) - self.start

    @property
    def busy(self) -> list[float]:
        """Per device, the total time spent in actions."""
        if self._events is None:
            assert self._columns is not None
            return self._columns.busy()
        # NOTE: end - start inline, not the duration property: a call per event would
        # dominate a long timeline's chart header.
        return [sum(e.end - e.start for e in device) for device in self._events]

    @property
    def bubble(self) -> float:
        """The idle fraction: ``1 - busy / (K × makespan)``."""
        span = self.makespan
        if span <= 0 or not self.devices:
            return 0.0
        return 1.0 - sum(self.busy) / (self.devices * span)

    @property
    def spans(self) -> list[float]:
        """Per device, the time from its first action's start to its last action's end."""
        return [b[1] - b[0] if b is not None else 0.0 for b in self._bounds()]

    @property
    def steady_bubble(self) -> float:
        """The idle fraction when steps run back to back: ``1 - busy / (K × longest span)``.

        A device idles before its first action and after its last only because the step is
        alone; when the next step's first actions fill that time (the zero-bubble papers
        step the optimizer without a pipeline-wide barrier to get there), a step costs the
        longest span of any one device. This is the bubble Qi et al. (2024) report: zero for
        ZB-H2 and ZB-V with F = B = W. :attr:`bubble` is the bubble of one step alone, which
        ``train_step`` runs.
        """
        span = max(self.spans, default=0.0)
        if span <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.devices * span)

    @property
    def peak_memory(self) -> list[float]:
        """Per device, the most bytes held for backward at any moment."""
        if self._events is None:
            assert self._columns is not None
            return self._columns.peak_memory()
        return [max((e.memory for e in device), default=0) for device in self._events]

    def durations(self, kind: str) -> list[list[float]]:
        """Per device, the durations of its actions of ``kind`` ("F", "B", "W" or "F+B").

        A fused action counts under "F+B" only, never as an F or a B: its parts have no
        times of their own."""
        return [[e.duration for e in device if e.action.kind == kind] for device in self.events]

    def critical_path(self) -> CriticalPath:
        """The chain of actions and waits that set this step's length: how much of it went
        to actions, to the runtime's work between them, and to hand-offs between devices.
        See :mod:`gpipe.analysis.critical`."""
        from gpipe.analysis.critical import critical_path

        return critical_path(self)

    def __str__(self) -> str:
        """The terminal chart, without colour so the text is the same wherever it goes."""
        # NOTE: imported on use, so loading timelines never loads the drawing code.
        from gpipe.analysis.chart import format_chart

        return format_chart(self, color=False)

    def plot(self, path: str | os.PathLike[str], **kwargs: Any) -> Path:
        """Save a PNG Gantt chart; see :func:`gpipe.analysis.plot.plot` for its keywords."""
        from gpipe.analysis.plot import plot

        return plot(self, path, **kwargs)

    def to_chrome_trace(self, path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """The Chrome/Perfetto trace dict, also written as JSON to ``path`` when given."""
        from gpipe.analysis.perfetto import to_chrome_trace

        return to_chrome_trace(self, path)
