"""What each device holds for backward over a step: each action's count while it runs, and
what it left held (``Event.left``) between actions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from gpipe.schedule import BACKWARD, FORWARD, FUSED, WEIGHT

if TYPE_CHECKING:
    from gpipe.analysis.timeline import Event, Timeline

__all__ = ["HeldMemory", "held_after", "held_memory"]


class HeldMemory(NamedTuple):
    """One device's memory over a step, as step lines: value ``i`` holds from ``times[i]``
    (from the timeline's start) until ``times[i + 1]``; the last time is the step's end."""

    times: list[float]
    held: list[float]
    """All it holds: while an action runs, what the runtime counted for it
    (``Event.memory``, with a backward's gradients and recomputed activations)."""
    kept: list[float]
    """What its micro-batches keep for backward, without a running backward's work: rises as
    a forward starts (and as a zero-bubble B ends, by what it keeps for W), falls as the
    backward or W that frees a micro-batch ends. A fused action counts as its parts: it
    rises as it starts, for its forward, and falls as it ends, for its backward (its count
    while it runs is the most the pair held, which may include the backward's work)."""


def held_memory(timeline: Timeline) -> list[HeldMemory]:
    """Per device, what it holds for backward over the step.

    Between actions, the device holds what the last one left (:func:`held_after`); while
    one runs, what the runtime counted for it. So the lines fall back to zero once the last
    backward (or W) has freed its micro-batch, and the top of ``held`` is
    :attr:`Timeline.peak_memory`.
    """
    origin, end = timeline.start, timeline.start + timeline.makespan
    series = []
    for events in timeline.events:
        times, held, kept = [0.0], [0.0], [0.0]
        for event, left in zip(events, held_after(events)):
            times += [event.start - origin, event.end - origin]
            held += [event.memory, left]
            kept += [event.memory if event.kind in (FORWARD, FUSED) else kept[-1], left]
        series.append(HeldMemory([*times, end - origin], [*held, held[-1]], [*kept, kept[-1]]))
    return series


def held_after(events: Sequence[Event]) -> list[float]:
    """Per event of one device, in order, what the device holds once the event has ended.

    Each event's ``left``, where every event has one. A timeline without them (built by
    hand, or saved before they were recorded) is walked by the rule the runtime counts by:
    a forward leaves its ``memory``; a backward frees what its forward kept; a fused
    action does both, its forward's part first.

    NOTE: with W actions (zero-bubble) and no ``left``, the walk cannot go on: what a B
    keeps for its W shows in no event. Each action is then taken to leave its ``memory``
    held, so the lines show only each action's peak and do not fall between actions.
    """
    recorded = [e.left for e in events if e.left is not None]
    if len(recorded) == len(events):
        return recorded
    if any(e.kind == WEIGHT for e in events):
        return [e.memory for e in events]
    level: float = 0
    kept: dict[tuple[int, int], float] = {}  # per micro-batch of a stage
    out = []
    for e in events:
        for unit in e.action.units:
            key = (unit.stage, unit.microbatch)
            if unit.kind == FORWARD:
                kept[key] = e.memory - level
                level = e.memory
            elif unit.kind == BACKWARD:
                level -= kept.pop(key, 0)
        out.append(level)
    return out
