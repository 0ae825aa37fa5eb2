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

__all__ = ["Costs", "costs_from_timeline", "simulate", "skips_from_timeline"]

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


Skip = tuple[int, int, float]  # (sending stage, reading stage, bytes per micro-batch)


def simulate(
    schedule: Schedule,
    costs: Costs | Mapping[str, Any] | None = None,
    skips: Sequence[Skip] = (),
) -> Timeline:
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

    A model that is not a chain also sends values past the stages in between (a U-Net's
    long skip): each of ``skips`` is one more message per micro-batch, from the sending
    stage's forward to the reading stage's, and its gradient from the reader's backward to
    the sender's, costing ``transfer + latency + bytes / bandwidth`` between devices. The
    timeline lists them among its transfers, each as its own message.

    Args:
        schedule: the schedule; it must be valid.
        costs: the cost model, or a dict of its fields (``{"forward": 1, "backward": 2}``);
            by default F = B = 1, W = 0, no transfer time, 1 byte.
        skips: ``(sending stage, reading stage, bytes)`` of each message between stages
            that are not neighbours (``Dataflow.skips()`` with the pipe's input left out).

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
    for sender, reader, _ in skips:
        if not 0 <= sender < reader < schedule.stages:
            raise ValueError(
                f"skip ({sender}, {reader}) is not a message from an earlier stage to a later "
                f"one of the schedule's {schedule.stages} stages"
            )
    # NOTE: a long schedule makes hundreds of thousands of events, none in a reference
    # cycle; left on, the cyclic garbage collector rescans them all, again and again, and
    # takes as long as the simulation itself.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _simulate(schedule, costs, skips)
    finally:
        if collecting:
            gc.enable()


def _simulate(schedule: Schedule, costs: Costs, skips: Sequence[Skip]) -> Timeline:
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
    # Per stage, the skips its forward waits for and those its backward waits for:
    # (the other stage, the extra wait, bytes).
    skips_in: list[list[tuple[int, float, float]]] = [[] for _ in range(stages)]
    skips_back: list[list[tuple[int, float, float]]] = [[] for _ in range(stages)]
    for sender, reader, nbytes in skips:
        cost = 0.0
        if placement[sender] != placement[reader]:
            cost = costs.transfer + costs.latency + nbytes / costs.bandwidth
        skips_in[reader].append((sender, cost, nbytes))
        skips_back[sender].append((reader, cost, nbytes))
    skipping = bool(skips)
    transfers: list[Transfer] = []
    record = any(edge) or any(cost for waits in skips_in for _, cost, _ in waits)

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
            if skipping:  # NOTE: one test per action when there are none: the hot loop
                skipped = _skip_waits(kind, stage, i, microbatches, skips_in, skips_back)
                deps += tuple((key, cost) for key, cost, _ in skipped)
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
                chain = deps[: len(deps) - len(skipped)] if skipping else deps
                _record_transfers(transfers, action, device, chain, ends, placement, sizes)
                if skipping:
                    _record_skips(transfers, action, device, skipped, ends, placement, microbatches)
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
                source,
            )
        )


def _skip_waits(
    kind: str,
    stage: int,
    microbatch: int,
    microbatches: int,
    skips_in: list[list[tuple[int, float, float]]],
    skips_back: list[list[tuple[int, float, float]]],
) -> list[tuple[int, float, float]]:
    """The skips an action waits for: (finish-time key, extra wait, bytes)."""
    size = len(skips_in) * microbatches
    if kind == FORWARD:
        return [(s * microbatches + microbatch, c, b) for s, c, b in skips_in[stage]]
    if kind == BACKWARD:
        return [(size + r * microbatches + microbatch, c, b) for r, c, b in skips_back[stage]]
    return []


def _record_skips(
    transfers: list[Transfer],
    action: Action,
    device: int,
    skipped: list[tuple[int, float, float]],
    ends: list[float],
    placement: tuple[int, ...],
    microbatches: int,
) -> None:
    """The skip messages ``action`` waited for, each its own transfer, if remote."""
    for key, extra, nbytes in skipped:
        if not extra:
            continue
        sender = (key % (len(placement) * microbatches)) // microbatches
        sent = ends[key]
        transfers.append(
            Transfer(
                action.kind,
                action.stage,
                action.microbatch,
                placement[sender],
                device,
                sent,
                sent + extra,
                int(nbytes),
                sender,
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


def skips_from_timeline(timeline: Timeline, pairs: Sequence[tuple[int, int]]) -> list[Skip]:
    """The skips ``pairs`` (sending stage, reading stage) with the median bytes a measured
    timeline's transfers carried between them (0 where none crossed devices), for
    :func:`simulate`."""
    skips: list[Skip] = []
    for sender, reader in pairs:
        sizes = [
            t.nbytes
            for t in timeline.transfers
            if t.kind == FORWARD and t.sender == sender and t.stage == reader
        ]
        skips.append((sender, reader, statistics.median(sizes) if sizes else 0.0))
    return skips
