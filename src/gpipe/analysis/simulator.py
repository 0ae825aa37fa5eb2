"""The discrete-event simulator: a schedule and a cost model in, a timeline out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gpipe.analysis.columns import ActionColumns, SimulatedColumns, TransferColumns
from gpipe.analysis.costs import Costs, PerStage, Skip, costs_from_timeline, skips_from_timeline
from gpipe.analysis.memory import memory_columns
from gpipe.analysis.timeline import Timeline
from gpipe.analysis.waits import Waits, action_waits, fused_groups, merge_fused_waits, wrap_around
from gpipe.schedule import FORWARD, KINDS, Schedule, ScheduleError, validate

__all__ = ["Costs", "costs_from_timeline", "simulate", "skips_from_timeline"]


def _per_stage(value: PerStage, stages: int, what: str) -> list[float]:
    if isinstance(value, int | float):
        return [value] * stages
    values = list(value)
    if len(values) != stages:
        raise ValueError(f"Costs.{what} lists {len(values)} stages, the schedule has {stages}")
    return values


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
    re-materialized here); ``Event.left`` is what it holds once the action has ended.

    A model that is not a chain also sends values past the stages in between (a U-Net's
    long skip): each of ``skips`` is one more message per micro-batch, from the sending
    stage's forward to the reading stage's, and its gradient from the reader's backward to
    the sender's, costing ``transfer + latency + bytes / bandwidth`` between devices. The
    timeline lists them among its transfers, each as its own message. Transfers are listed
    device by device, in the order the receiving actions run.

    The timeline is held as columns (:mod:`gpipe.analysis.columns`): its events and
    transfers are made when first read, so a search that compares makespans, spans and
    peaks never makes them.

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
    return _simulate(schedule, costs, skips)


def _simulate(schedule: Schedule, costs: Costs, skips: Sequence[Skip]) -> Timeline:
    stages, microbatches = schedule.stages, schedule.microbatches
    forward = _per_stage(costs.forward, stages, "forward")
    backward = _per_stage(costs.backward, stages, "backward")
    weight = _per_stage(costs.weight, stages, "weight")
    held_bytes = _per_stage(costs.activation_bytes, stages, "activation_bytes")
    gradient_bytes = _per_stage(costs.gradient_bytes, stages, "gradient_bytes")
    deferred_bytes = _per_stage(costs.deferred_bytes, stages, "deferred_bytes")
    columns = ActionColumns.of(schedule)
    kind, stage, mb = columns.kind, columns.stage, columns.microbatch
    split = columns.split_backward
    if not split:
        backward = [b + w for b, w in zip(backward, weight)]
    placement = schedule.placement
    # sizes[s]: a message between stage s and s + 1 (s + 1's input forward, its gradient
    # back); edge[s]: what one costs if the two sit on different devices.
    sizes = [gradient_bytes[s + 1] if s + 1 < stages else 0.0 for s in range(stages)]
    edge = [
        costs.transfer + costs.latency + sizes[s] / costs.bandwidth
        if s + 1 < stages and placement[s] != placement[s + 1]
        else 0.0
        for s in range(stages)
    ]
    count, size = len(kind), stages * microbatches
    expected = size if schedule.wrap else 3 * size if split else 2 * size  # a decode: F's
    if count != expected or (
        count and (int(stage.max()) >= stages or int(mb.max()) >= microbatches)
    ):
        raise _invalid(schedule)
    place = np.array(placement, np.int64)
    key = kind * size + stage * microbatches + mb  # F, B, W of (stage, micro-batch)
    if (place[stage] != columns.device).any() or (np.bincount(key, minlength=3 * size) > 1).any():
        raise _invalid(schedule)
    waits = action_waits(kind, stage, mb, stages, microbatches, edge, skips, placement, costs)
    if schedule.wrap:
        wrap_around(waits, kind, stage, mb, stages, microbatches, schedule.wrap, placement, costs)
    duration = np.array([forward, backward, weight], np.float64)[kind, stage]
    groups = fused_groups(columns)
    for first, count_parts in groups:
        duration[first : first + count_parts] *= costs.fused
    times = _run(columns, key, waits, duration, groups)
    if times is None:
        raise _invalid(schedule)
    start, end, finished = times
    memory, left = memory_columns(
        columns,
        schedule,
        held_bytes,
        held_bytes,
        "never",
        gradient=gradient_bytes,
        deferred=deferred_bytes,
    )
    messages = _messages(columns, waits, finished, placement, sizes)
    simulated = SimulatedColumns(
        schedule.actions,
        columns.listed_offsets(schedule),
        columns.listed(start, "first"),
        columns.listed(end, "last"),
        columns.listed(memory, "max"),
        columns.listed(left, "last"),
        messages,
    )
    return Timeline.from_columns(simulated, "cost", schedule.name)


def _messages(
    columns: ActionColumns,
    waits: Waits,
    finished: np.ndarray,
    placement: tuple[int, ...],
    sizes: list[float],
) -> TransferColumns:
    """The messages the actions waited for, one per prerequisite on another device (a
    nonzero transfer time), in action order, a neighbour's before the skips'."""
    rows, senders, nbytes, sent, arrived = [], [], [], [], []
    for column, (key, extra) in enumerate(zip(waits.key, waits.extra)):
        if extra is None:
            continue
        row = np.flatnonzero(extra != 0)
        stage = columns.stage[row]
        if column == 0:
            sender = stage + np.where(columns.kind[row] == KINDS.index(FORWARD), -1, 1)
            carried = np.array(sizes)[np.minimum(stage, sender)]
            token = waits.wrapped[row]  # a decode's token, from the last stage
            sender = np.where(token, len(placement) - 1, sender)
            carried = np.where(token, 0, carried)
        else:
            sender, carried = waits.sender[column][row], waits.nbytes[column][row]
        rows.append(row)
        senders.append(sender)
        nbytes.append(carried)
        sent.append(finished[key[row]])
        arrived.append(sent[-1] + extra[row])

    def merged(parts: list[np.ndarray]) -> np.ndarray:
        return parts[0] if len(parts) == 1 else np.concatenate(parts)[order]

    order = np.argsort(np.concatenate(rows), kind="stable") if len(rows) > 1 else None
    row, sender = merged(rows), merged(senders)
    return TransferColumns(
        kind=columns.kind[row],
        stage=columns.stage[row],
        microbatch=columns.microbatch[row],
        source=np.array(placement, np.int64)[sender],
        target=columns.device[row],
        start=merged(sent),
        end=merged(arrived),
        nbytes=merged(nbytes).astype(np.int64),
        sender=sender,
    )


def _run(
    columns: ActionColumns,
    key: np.ndarray,
    waits: Waits,
    duration: np.ndarray,
    groups: Sequence[tuple[int, int]] = (),
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Start and end of every action, and when each key (F, B or W of a stage and
    micro-batch) finished: each device runs its list in order; an action starts when the
    device's previous action and everything it waits for have finished, plus transfers.

    A fused action's parts (``groups``) run as one: the first starts once everything any
    part waits for has finished, the others follow it, and what each part made is seen
    by the other devices only when the last has ended (the pair is atomic).

    Round by round, every device whose next action can start runs it: a round is a dozen
    array operations over the devices, and the rounds number the longest chain of actions
    (about 2M + 2K for 1F1B), not the actions. None where the devices get stuck.
    """
    count, devices = len(key), len(columns.offsets) - 1
    # Slots, per device: a start (finished at 0.0), its actions in order, a stop it never
    # passes (nan: not finished); after them all, a free slot (-inf: nothing to wait for).
    slot = np.arange(count) + 2 * columns.device + 1
    slots = count + 2 * devices
    free = slots
    starts = np.array(columns.offsets[:-1], np.int64) + 2 * np.arange(devices)
    stops = np.array(columns.offsets[1:], np.int64) + 2 * np.arange(devices) + 1
    by_key = np.full(waits.none + 1, free, np.int64)
    by_key[key] = slot
    # Column 0 (the input, or the next stage's gradient) and the skips carry a transfer
    # time; column 1 (a backward's own forward, a W's backward) none.
    deps: list[np.ndarray] = []
    extra: list[np.ndarray | None] = []
    for key_j, extra_j in zip(waits.key, waits.extra):
        dep = np.full(slots, free, np.int64)
        dep[slot] = by_key[key_j]
        dep[stops] = stops  # a stop waits for itself: never
        deps.append(dep)
        more = None
        if extra_j is not None:
            more = np.zeros(slots)
            more[slot] = extra_j
        extra.append(more)
    lasting = np.zeros(slots)
    lasting[slot] = duration
    end = np.full(slots + 1, np.nan)  # nan: not run yet
    end[starts], end[free] = 0.0, -np.inf
    # What other actions see of an action's end: its own, or its fused action's last part's.
    seen = end if not groups else end.copy()
    closes = merge_fused_waits(groups, slot, deps, extra, free)
    inside = np.zeros(slots + 1, bool)
    for members in closes.values():
        inside[members] = True
    start = np.empty(slots)
    cursor, left = starts + 1, count
    while left:
        arrived = end[cursor - 1]  # the device's previous action (or its start)
        for dep, more in zip(deps, extra):
            if more is None:
                np.maximum(arrived, seen[dep[cursor]], out=arrived)
            else:
                np.maximum(arrived, seen[dep[cursor]] + more[cursor], out=arrived)
        ready = arrived == arrived  # nan while waiting
        runs = np.count_nonzero(ready)
        if not runs:
            return None
        at = cursor
        if runs < devices:
            at, arrived = cursor[ready], arrived[ready]
        start[at] = arrived
        end[at] = arrived + lasting[at]
        if groups:
            ran = np.atleast_1d(at)
            alone = ~inside[ran]  # a fused action's parts are seen only once it ends
            seen[ran[alone]] = end[ran[alone]]
            for last in ran[~alone].tolist():
                if last in closes:
                    seen[closes[last]] = end[last]
        cursor = cursor + ready
        left -= runs
    return start[slot], end[slot], seen[by_key]


def _invalid(schedule: Schedule) -> ScheduleError:
    """The validator's error for a schedule the simulator could not run."""
    try:
        validate(schedule)
    except ScheduleError as error:
        return error
    return ScheduleError(f"simulator could not run schedule {schedule.name!r}")
