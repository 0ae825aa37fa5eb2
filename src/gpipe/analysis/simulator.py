"""The discrete-event simulator: a schedule and a cost model in, a timeline out."""

from __future__ import annotations

import gc
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpipe.analysis.memory import memory_per_action
from gpipe.analysis.timeline import Event, Timeline, Transfer
from gpipe.schedule import BACKWARD, FORWARD, WEIGHT, Action, Schedule, ScheduleError, validate

__all__ = ["Costs", "costs_from_timeline", "simulate"]

PerStage = float | Sequence[float]


@dataclass(frozen=True)
class Costs:
    """What each action costs, per model stage, in any one unit of time (or bytes).

    Args:
        forward: time of one micro-batch's forward on a stage; one number for every
            stage, or a list with one number per model stage.
        backward: time of its backward (the input gradient, in a schedule with W actions).
        weight: time of its weight gradient. A schedule without W actions runs it inside
            B, so there B takes ``backward + weight``.
        transfer: time to move one activation or gradient between two different devices;
            a hand-off between stages on the same device is free.
        latency: time per message between devices, added to ``transfer``.
        bandwidth: bytes per unit of time between devices (inf: free). A message between
            stages ``s`` and ``s+1`` on different devices takes ``transfer + latency +
            gradient_bytes[s+1] / bandwidth``: stage ``s+1``'s input going forward, or its
            gradient, of the same size, coming back.
        activation_bytes: what one micro-batch's forward on a stage keeps for its backward.
        gradient_bytes: the gradient of a stage's input, which its backward sends back and
            the previous stage's backward receives; both hold it while they run.
        deferred_bytes: what a backward keeps for its W (schedules with W actions): the
            gradients at the parameter forks. See :mod:`gpipe.analysis.memory`.
    """

    forward: PerStage = 1.0
    backward: PerStage = 1.0
    weight: PerStage = 0.0
    transfer: float = 0.0
    activation_bytes: PerStage = 1
    gradient_bytes: PerStage = 0
    deferred_bytes: PerStage = 0
    latency: float = 0.0
    bandwidth: float = math.inf

    @classmethod
    def from_timeline(cls, timeline: Timeline, stages: int | None = None) -> Costs:
        """The median F, B and W durations per stage of a measured timeline.

        See :func:`costs_from_timeline`.
        """
        return costs_from_timeline(timeline, stages)


def _per_stage(value: PerStage, stages: int, what: str) -> list[float]:
    if isinstance(value, int | float):
        return [value] * stages
    values = list(value)
    if len(values) != stages:
        raise ValueError(f"Costs.{what} lists {len(values)} stages, the schedule has {stages}")
    return values


def simulate(schedule: Schedule, costs: Costs | Mapping[str, Any] | None = None) -> Timeline:
    """Run ``schedule`` on an idealized machine and record when each action ran.

    Every device runs its list in order. An action starts when its device is free and
    every action it depends on has finished, plus ``costs.transfer`` for a dependency that
    ran on another device. Memory, per device: a forward allocates the stage's
    ``activation_bytes``; they are freed by the backward, or, when the schedule has W
    actions, by the W (the weight gradient needs the stage's saved inputs, so they live
    until then). ``Event.memory`` is the most held during the action: after a forward's
    allocation, before a backward's or W's release, with the gradients a backward receives
    and sends (see :func:`~gpipe.analysis.memory.memory_per_action`; nothing is
    re-materialized here).

    Args:
        schedule: the schedule; it must be valid.
        costs: the cost model, or a dict of its fields (``{"forward": 1, "backward": 2}``);
            by default F = B = 1, W = 0, no transfer time, 1 byte.

    Returns:
        The timeline, in unit ``"cost"``, starting at 0.

    Raises:
        ScheduleError: the schedule is invalid (as :func:`~gpipe.schedule.validate` says).
        ValueError: a per-stage cost list of the wrong length.
        TypeError: a costs dict with a key that is not a field of :class:`Costs`.
    """
    if isinstance(costs, Mapping):
        costs = Costs(**costs)
    costs = costs or Costs()
    # NOTE: a long schedule makes hundreds of thousands of events, none in a reference
    # cycle; left on, the cyclic garbage collector rescans them all, again and again, and
    # takes as long as the simulation itself.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _simulate(schedule, costs)
    finally:
        if collecting:
            gc.enable()


def _simulate(schedule: Schedule, costs: Costs) -> Timeline:
    stages, microbatches = schedule.stages, schedule.microbatches
    forward = _per_stage(costs.forward, stages, "forward")
    backward = _per_stage(costs.backward, stages, "backward")
    weight = _per_stage(costs.weight, stages, "weight")
    held_bytes = _per_stage(costs.activation_bytes, stages, "activation_bytes")
    gradient_bytes = _per_stage(costs.gradient_bytes, stages, "gradient_bytes")
    deferred_bytes = _per_stage(costs.deferred_bytes, stages, "deferred_bytes")
    split = schedule.split_backward
    if not split:
        backward = [b + w for b, w in zip(backward, weight)]
    placement = schedule.placement
    # sizes[s]: a message between stage s and s + 1 (s + 1's input forward, its gradient
    # back); edge[s]: what one costs if the two sit on different devices; from_previous /
    # from_next: the extra wait for one to arrive.
    sizes = [gradient_bytes[s + 1] if s + 1 < stages else 0.0 for s in range(stages)]
    edge = [
        costs.transfer + costs.latency + sizes[s] / costs.bandwidth
        if s + 1 < stages and placement[s] != placement[s + 1]
        else 0.0
        for s in range(stages)
    ]
    from_previous = [edge[s - 1] if s else 0.0 for s in range(stages)]
    from_next = edge
    transfers: list[Transfer] = []
    record = any(edge)

    # NOTE: this loop is the simulator's whole cost (K=128, M=1024 is 262k actions), so it
    # keeps finish times in one flat list of floats, keyed by int, with -1.0 for "not yet":
    # key = kind offset + stage * M + micro-batch.
    size = stages * microbatches
    offset = {FORWARD: 0, BACKWARD: size, WEIGHT: 2 * size}
    ends = [-1.0] * (3 * size)
    devices = schedule.devices
    try:
        memory = memory_per_action(
            schedule,
            held_bytes,
            held_bytes,
            "never",
            gradient=gradient_bytes,
            deferred=deferred_bytes,
        )
    except IndexError:  # an action on a stage the schedule does not have
        raise _invalid(schedule) from None
    events: list[list[Event]] = [[] for _ in range(devices)]
    position = [0] * devices
    free_at = [0.0] * devices
    # A device blocks on one missing result at a time; waiting maps that result's key to
    # the device, so finishing it wakes exactly the device that needs it.
    waiting: dict[int, int] = {}
    ready = list(range(devices))
    while ready:
        device = ready.pop()
        actions = schedule.actions[device]
        out = events[device]
        held = memory[device]
        at, clock = position[device], free_at[device]
        while at < len(actions):
            action = actions[at]
            kind, stage, i = action.kind, action.stage, action.microbatch
            if stage >= stages or i >= microbatches or placement[stage] != device:
                raise _invalid(schedule)
            index = stage * microbatches + i
            # What the action waits for: (finish-time key, extra wait for a transfer).
            deps: tuple[tuple[int, float], ...]
            if kind == FORWARD:
                deps = ((index - microbatches, from_previous[stage]),) if stage else ()
                duration = forward[stage]
            elif kind == BACKWARD:
                deps = ((index, 0.0),)
                if stage + 1 < stages:
                    deps += ((size + index + microbatches, from_next[stage]),)
                duration = backward[stage]
            else:
                deps = ((size + index, 0.0),)
                duration = weight[stage]
            start, blocked = clock, False
            for dep, extra in deps:
                end = ends[dep]
                if end < 0:  # not run yet: wait for it, wake when it finishes
                    waiting[dep] = device
                    blocked = True
                    break
                if end + extra > start:
                    start = end + extra
            if blocked:
                break
            if record:
                _record_transfers(transfers, action, device, deps, ends, placement, sizes)
            key = offset[kind] + index
            if ends[key] >= 0:
                raise _invalid(schedule)
            clock = start + duration
            ends[key] = clock
            out.append(Event(action, start, clock, held[at]))
            at += 1
            woken = waiting.pop(key, None)
            if woken is not None:
                ready.append(woken)
        position[device], free_at[device] = at, clock
    expected = 3 * size if split else 2 * size
    if sum(position) != len(schedule) or sum(len(e) for e in events) != expected:
        raise _invalid(schedule)
    return Timeline(events, unit="cost", schedule=schedule.name, transfers=transfers)


def _record_transfers(
    transfers: list[Transfer],
    action: Action,
    device: int,
    deps: tuple[tuple[int, float], ...],
    ends: list[float],
    placement: tuple[int, ...],
    sizes: list[float],
) -> None:
    """The messages ``action`` waited for: its input's or its gradient's, if remote."""
    stage = action.stage
    for dep, extra in deps:
        if not extra:
            continue
        source = stage - 1 if action.kind == FORWARD else stage + 1
        sent = ends[dep]
        transfers.append(
            Transfer(
                action.kind,
                stage,
                action.microbatch,
                placement[source],
                device,
                sent,
                sent + extra,
                int(sizes[min(stage, source)]),
            )
        )


def _invalid(schedule: Schedule) -> ScheduleError:
    """The validator's error for a schedule the simulator could not run."""
    try:
        validate(schedule)
    except ScheduleError as error:
        return error
    return ScheduleError(f"simulator could not run schedule {schedule.name!r}")


def costs_from_timeline(timeline: Timeline, stages: int | None = None) -> Costs:
    """The median F, B and W duration of each model stage in a (measured) timeline.

    Feeding the result to :func:`simulate` predicts the timeline from its own parts, so
    prediction and measurement can be compared. Transfer time is left at 0.

    Args:
        timeline: any timeline; the stage of each event is its action's stage.
        stages: the number of model stages; by default one more than the largest seen.

    Returns:
        Per-stage costs; a stage or kind with no events gets 0. ``weight`` is the median W
        time if the timeline has W events, else 0 (B then already includes it).
    """
    seen = [e for device in timeline.events for e in device]
    count = stages if stages is not None else 1 + max((e.action.stage for e in seen), default=-1)
    durations: dict[str, list[list[float]]] = {
        kind: [[] for _ in range(count)] for kind in (FORWARD, BACKWARD, WEIGHT)
    }
    for event in seen:
        durations[event.action.kind][event.action.stage].append(event.duration)

    def medians(kind: str) -> list[float]:
        return [statistics.median(d) if d else 0.0 for d in durations[kind]]

    return Costs(forward=medians(FORWARD), backward=medians(BACKWARD), weight=medians(WEIGHT))
