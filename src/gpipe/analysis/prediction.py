"""The prediction of a step that ran: the simulator fed the step's own measured costs.

Both pipes lay it beside their measured timeline, so what the runtime lost to waiting,
hand-offs and overhead shows as the difference between the two.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

from gpipe.analysis.simulator import Costs, simulate, skips_from_timeline
from gpipe.analysis.timeline import Event, Timeline
from gpipe.schedule import FORWARD, Schedule

__all__ = ["predict"]


def predict(
    measured: Timeline,
    schedule: Schedule,
    *,
    skips: Sequence[tuple[int, int]] = (),
    transfer: float = 0.0,
    link: tuple[float, float] | None = None,
) -> Timeline:
    """The simulator's timeline of ``schedule`` under the costs ``measured`` shows.

    Each stage's F, B and W cost is the median of its measured durations; a fused action
    (a forward and a backward issued together) takes the median share of its parts' sum
    that the measured ones took (:func:`~gpipe.analysis.costs.costs_from_timeline`).
    Each action keeps the bytes the step counted for it and left held: the count follows
    the action order and the sizes, never the timing (see :mod:`gpipe.analysis.memory`),
    so it is the same.

    Args:
        measured: the step's timeline, in seconds.
        schedule: the schedule the step ran.
        skips: (sending stage, reading stage) of each message between stages that are not
            neighbours, each simulated as its own transfer.
        transfer: seconds one hand-off between devices takes.
        link: (latency in seconds, bandwidth in bytes per second) between processes: each
            message then also costs the latency plus its measured median bytes over the
            bandwidth.
    """
    costs = dataclasses.replace(
        Costs.from_timeline(measured, stages=schedule.stages), transfer=transfer
    )
    if link is not None:
        latency, bandwidth = link
        costs = dataclasses.replace(
            costs,
            latency=latency,
            bandwidth=bandwidth,
            gradient_bytes=_received(measured, schedule),
        )
    predicted = simulate(schedule, costs, skips_from_timeline(measured, skips))
    counted = {
        (device, event.action): (event.memory, event.left)
        for device, events in enumerate(measured.events)
        for event in events
    }
    events: list[list[Event]] = []
    for device, simulated in enumerate(predicted.events):
        events.append([])
        for e in simulated:
            memory, left = counted.get((device, e.action), (0, None))
            events[-1].append(dataclasses.replace(e, memory=memory, left=left))
    return Timeline(
        events,
        "s",
        predicted.schedule,
        transfers=predicted.transfers,
        processes=measured.processes,
    )


def _received(measured: Timeline, schedule: Schedule) -> list[float]:
    """The median bytes each stage received from the stage before it during the step."""
    sizes = [0.0] * schedule.stages
    for stage in range(1, schedule.stages):
        came = [
            t.nbytes
            for t in measured.transfers
            if t.kind == FORWARD and t.stage == stage and t.sender in (None, stage - 1)
        ]
        sizes[stage] = statistics.median(came) if came else 0.0
    return sizes
