"""The discrete-event simulator: a schedule and a cost model in, a timeline out."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpipe.analysis.columns import ActionColumns, SimulatedColumns, TransferColumns
from gpipe.analysis.memory import memory_columns
from gpipe.analysis.timeline import Timeline
from gpipe.schedule import BACKWARD, FORWARD, KINDS, WEIGHT, Schedule, ScheduleError, validate

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
        fused: what a fused action (a forward and a backward issued together, DualPipeV)
            takes, as a fraction of its parts run one after another: 1.0 when they do not
            overlap at all (one device's CPU), less where the hardware overlaps them.
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
    fused: float = 1.0

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
    waits = _waits(kind, stage, mb, stages, microbatches, edge, skips, placement, costs)
    if schedule.wrap:
        _wrap_around(waits, kind, stage, mb, stages, microbatches, schedule.wrap, placement, costs)
    duration = np.array([forward, backward, weight], np.float64)[kind, stage]
    groups = _groups(columns)
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


@dataclass(frozen=True)
class _Waits:
    """Per action, what it waits for, one array per column: ``key[j]`` the finish-time key
    of its j-th prerequisite (``none``: nothing) and ``extra[j]`` the transfer time on top
    (None: always 0). Column 0 is the input (F) or the gradient from the next stage (B),
    column 1 a backward's own forward or a W's backward, then one per skip, whose sending
    stage and bytes are ``sender[j]`` and ``nbytes[j]``."""

    key: list[np.ndarray]
    extra: list[np.ndarray | None]
    sender: dict[int, np.ndarray]
    nbytes: dict[int, np.ndarray]
    none: int
    wrapped: np.ndarray  # per action: a decode's F on stage 0 waiting for its lane's token


def _waits(
    kind: np.ndarray,
    stage: np.ndarray,
    mb: np.ndarray,
    stages: int,
    microbatches: int,
    edge: list[float],
    skips: Sequence[Skip],
    placement: tuple[int, ...],
    costs: Costs,
) -> _Waits:
    size = stages * microbatches
    none = 3 * size
    is_f, is_b = kind == KINDS.index(FORWARD), kind == KINDS.index(BACKWARD)
    index = stage * microbatches + mb
    edges = np.array([*edge, 0.0])  # edges[-1]: before stage 0, nothing
    # F(s, i) waits for F(s-1, i); B(s, i) for B(s+1, i) and F(s, i); W(s, i) for B(s, i).
    valid = np.where(is_f, stage > 0, is_b & (stage + 1 < stages))
    key = [
        np.where(valid, np.where(is_f, index - microbatches, size + index + microbatches), none),
        np.where(is_f, none, np.where(is_b, index, size + index)),
    ]
    extra: list[np.ndarray | None] = [
        np.where(valid, edges[np.where(is_f, stage - 1, stage)], 0.0),
        None,
    ]
    # A skip: the reader's F waits for the sender's F, the sender's B for the reader's B;
    # each stage's skips fill columns 2, 3, ... in the order given.
    sender: dict[int, np.ndarray] = {}
    nbytes: dict[int, np.ndarray] = {}
    filled = {FORWARD: [2] * stages, BACKWARD: [2] * stages}
    for sending, reading, count_bytes in skips:
        cost = 0.0
        if placement[sending] != placement[reading]:
            cost = costs.transfer + costs.latency + count_bytes / costs.bandwidth
        for rows, mine, other, offset, which in (
            (is_f, reading, sending, 0, FORWARD),
            (is_b, sending, reading, size, BACKWARD),
        ):
            column = filled[which][mine]
            filled[which][mine] += 1
            if column == len(key):
                key.append(np.full(len(kind), none))
                extra.append(np.zeros(len(kind)))
                sender[column] = np.zeros(len(kind), np.int64)
                nbytes[column] = np.zeros(len(kind))
            at = rows & (stage == mine)
            key[column][at] = offset + other * microbatches + mb[at]
            more = extra[column]
            assert more is not None
            more[at], sender[column][at], nbytes[column][at] = cost, other, count_bytes
    return _Waits(key, extra, sender, nbytes, none, np.zeros(len(kind), bool))


def _wrap_around(
    waits: _Waits,
    kind: np.ndarray,
    stage: np.ndarray,
    mb: np.ndarray,
    stages: int,
    microbatches: int,
    wrap: int,
    placement: tuple[int, ...],
    costs: Costs,
) -> None:
    """A decode's F on stage 0 waits for the last stage's F of its lane's previous token
    (micro-batch ``i - wrap``), plus a message's fixed cost when they are on different
    devices (a token is a few bytes)."""
    rows = (kind == KINDS.index(FORWARD)) & (stage == 0) & (mb >= wrap)
    waits.key[0][rows] = (stages - 1) * microbatches + mb[rows] - wrap
    cost = costs.transfer + costs.latency if placement[-1] != placement[0] else 0.0
    extra = waits.extra[0]
    assert extra is not None
    extra[rows] = cost
    waits.wrapped[rows] = True


def _messages(
    columns: ActionColumns,
    waits: _Waits,
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


def _groups(columns: ActionColumns) -> list[tuple[int, int]]:
    """(first row, rows) of each fused action, in row order."""
    if columns.parts is None:
        return []
    last = np.cumsum(columns.parts)
    fused = np.flatnonzero(columns.parts > 1)
    return [(int(last[i] - columns.parts[i]), int(columns.parts[i])) for i in fused]


def _run(
    columns: ActionColumns,
    key: np.ndarray,
    waits: _Waits,
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
    closes = _merge_group_waits(groups, slot, deps, extra, free)
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


def _merge_group_waits(
    groups: Sequence[tuple[int, int]],
    slot: np.ndarray,
    deps: list[np.ndarray],
    extra: list[np.ndarray | None],
    free: int,
) -> dict[int, np.ndarray]:
    """Move what a fused action's later parts wait for onto its first part (in new
    columns), since the parts start as one; what a part waits for within its own fused
    action is dropped. Returns, per fused action's last slot, all its slots: the slot
    that, once run, makes the whole fused action seen."""
    closes: dict[int, np.ndarray] = {}
    width = len(deps)
    for first, count in groups:
        mine = slot[first : first + count]
        head, column = int(mine[0]), width  # the next new column this fused action fills
        for part in mine[1:].tolist():
            for j in range(width):
                target = int(deps[j][part])
                deps[j][part] = free
                if target == free or target in mine:
                    continue
                if column == len(deps):
                    deps.append(np.full_like(deps[0], free))
                    extra.append(np.zeros(len(deps[0])))
                more, added = extra[j], extra[column]
                assert added is not None
                deps[column][head] = target
                added[head] = 0.0 if more is None else more[part]
                column += 1
        closes[int(mine[-1])] = mine
    return closes


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

    A fused event (a forward and a backward issued together) has no time per part, so it
    is left out of the medians; ``fused`` is the median, over fused events, of its
    duration over what its parts take one after another (its forward's stage's median F
    plus its backward's stage's median B, and W if it carries one), clamped to [0.25, 2].
    Events whose parts' stages have no plain events of those kinds are left out of it.

    Args:
        timeline: any timeline; the stage of each event is its action's stage.
        stages: the number of model stages; by default one more than the largest seen.

    Returns:
        Per-stage costs; a stage or kind with no events gets 0. ``weight`` is the median W
        time if the timeline has W events, else 0 (B then already includes it). ``fused``
        is 1.0 without fused events to measure it from.
    """
    seen = [e for device in timeline.events for e in device]
    most = max((u.stage for e in seen for u in e.action.units), default=-1)
    count = stages if stages is not None else 1 + most
    durations: dict[str, list[list[float]]] = {
        kind: [[] for _ in range(count)] for kind in (FORWARD, BACKWARD, WEIGHT)
    }
    for event in seen:
        if not event.action.parts:
            durations[event.action.kind][event.action.stage].append(event.duration)

    median = {
        kind: [statistics.median(d) if d else 0.0 for d in per_stage]
        for kind, per_stage in durations.items()
    }
    ratios = []
    for event in seen:
        parts = event.action.parts
        if parts and all(durations[u.kind][u.stage] for u in parts):
            alone = sum(median[u.kind][u.stage] for u in parts)
            if alone > 0:
                ratios.append(event.duration / alone)
    fused = min(max(statistics.median(ratios), 0.25), 2.0) if ratios else 1.0
    return Costs(
        forward=median[FORWARD],
        backward=median[BACKWARD],
        weight=median[WEIGHT],
        fused=fused,
    )


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
