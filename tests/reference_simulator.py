"""Today's simulator and "auto" search, kept as they were, as the reference for the fast ones.

A frozen copy (gpipe 0.1.0, before issue 31): ``simulate`` with its memory walk, and
``search`` with the greedy builder it runs (since issue 40 its candidates with two stages
per device include v-half and v-min, as the library's do). tests/test_simulate_reference.py
checks that the library's give the same events, transfers and choice; benchmarks/simulate.py
times both.
Nothing here is to be edited except to follow a change of meaning on purpose.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from gpipe.analysis.simulator import Costs
from gpipe.analysis.timeline import Event, Timeline, Transfer
from gpipe.recompute import checkpointed
from gpipe.schedule import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    Schedule,
    ScheduleError,
    gpipe,
    one_f_one_b,
    round_robin,
    v_half,
    v_min,
    v_shape,
    validate,
    zb_h1,
    zb_h2,
    zb_v,
)

__all__ = ["greedy", "memory_per_action", "search", "simulate"]

PerStage = float | Sequence[float]
Sizes = Sequence[float]
Skip = tuple[int, int, float]


# --- gpipe/analysis/memory.py ---


def memory_per_action(
    schedule: Schedule,
    full: Sizes,
    kept: Sizes,
    checkpoint: str,
    *,
    gradient: Sizes | None = None,
    deferred: Sizes | None = None,
) -> list[list[float]]:
    """Per device, per action in list order, the most bytes held while the action runs.

    Args:
        schedule: the schedule.
        full: per model stage, what one micro-batch keeps without re-materialization.
        kept: per model stage, what a checkpointed micro-batch keeps (its stage input).
        checkpoint: the re-materialization mode.
        gradient: per model stage, the bytes of the gradient of its input, which its B sends
            back and the previous stage's B receives; None for none (gradients not modelled).
        deferred: per model stage, what B keeps for W besides recomputed activations (split
            schedules); None for nothing.

    Returns:
        ``memory[d][j]`` for action ``schedule.actions[d][j]``.
    """
    stages = schedule.stages
    grads = list(gradient) if gradient is not None else [0] * stages
    later = list(deferred) if deferred is not None else [0] * stages
    split = schedule.split_backward
    m = schedule.microbatches
    memory: list[list[float]] = []
    for actions in schedule.actions:
        held: float = 0
        row: list[float] = []
        for action in actions:
            s, i = action.stage, action.microbatch
            again = checkpoint != "never" and checkpointed(checkpoint, i, m)
            if action.kind == FORWARD:
                held += kept[s] if again else full[s]
                row.append(held)
            elif action.kind == BACKWARD:
                recomputed = full[s] - kept[s] if again else 0
                received = grads[s + 1] if s + 1 < stages else 0
                sent = grads[s]
                keeps = later[s] if split else 0
                # NOTE: a stage that sends no input gradient defers its whole backward to W,
                # keeping the gradient it received: already counted in ``received``.
                fresh = keeps if sent else max(0, keeps - received)
                row.append(held + recomputed + received + sent + fresh)
                if split:  # W frees the micro-batch: its input, activations and gradients
                    held += recomputed + keeps
                else:
                    held -= kept[s] if again else full[s]
            else:
                row.append(held)
                if action.kind == WEIGHT:
                    held -= full[s] + later[s]
        memory.append(row)
    return memory


# --- gpipe/analysis/simulator.py ---


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


# --- gpipe/schedule/greedy.py ---


def _greedy_per_stage(value: PerStage, stages: int, what: str) -> list[float]:
    if isinstance(value, int | float):
        return [float(value)] * stages
    values = [float(v) for v in value]
    if len(values) != stages:
        raise ValueError(f"{what} lists {len(values)} stages, the placement has {stages}")
    return values


def greedy(
    name: str,
    placement: Sequence[int],
    microbatches: int,
    *,
    limit: PerStage,
    order: str = "BFW",
    lead: int | None = None,
    forward: PerStage = 1.0,
    backward: PerStage = 1.0,
    weight: PerStage = 1.0,
    transfer: float = 0.0,
    activation: PerStage = 1.0,
) -> Schedule | None:
    """Build a schedule with split backward (F, B, W) by greedy list scheduling.

    Each stage runs its F's and its B's in micro-batch order; a device's W's run in the
    order of their B's. Of the actions a device could start, it starts the one that can
    start earliest; among those that start at the same time, the kind that comes first in
    ``order``, then the later stage. A forward may start only while the device holds at
    most ``limit`` minus the stage's ``activation`` (a micro-batch is held from its F to its W).

    Args:
        name: the schedule's name.
        placement: ``placement[s]`` is the device of stage ``s``; a device holds one stage,
            or two (a V: the lower one is its chunk 0).
        microbatches: M.
        limit: per device (or one number for all), the most activation it may hold.
        order: the three kinds by rank, e.g. "BFW": a backward before a forward before a W.
        lead: with two stages per device, how far the F's of one stage run ahead of the B's
            of the other: F of micro-batch i waits for the other stage's B of ``i - lead``,
            and B of micro-batch j for the other stage's F of ``j + lead - 1``. This pins
            the order of the messages each pair of devices exchanges (see the module).
        forward: F time per stage (or one number for all).
        backward: B time per stage (the input gradient only).
        weight: W time per stage.
        transfer: extra wait for a result made on another device.
        activation: what one micro-batch's F holds on each stage, until its W.

    Returns:
        The schedule, or None when the devices get stuck (``limit`` too small to hold what
        a backward needs).

    Raises:
        ValueError: a device holding more than two stages, two stages without ``lead``, a
            bad ``order``, or a per-stage list of the wrong length.
    """
    stages = len(placement)
    devices = max(placement, default=-1) + 1
    if sorted(order) != sorted(FORWARD + BACKWARD + WEIGHT):
        raise ValueError(f"order must rank F, B and W once each, e.g. 'BFW'; got {order!r}")
    held_by = [[s for s in range(stages) if placement[s] == d] for d in range(devices)]
    if any(len(mine) > 2 for mine in held_by):
        raise ValueError("the greedy builder takes one or two stages per device")
    partner = [-1] * stages
    for mine in held_by:
        if len(mine) == 2:
            if lead is None or lead < 1:
                raise ValueError(f"two stages per device need a lead >= 1, got {lead!r}")
            partner[mine[0]], partner[mine[1]] = mine[1], mine[0]
    f = _greedy_per_stage(forward, stages, "forward")
    b = _greedy_per_stage(backward, stages, "backward")
    w = _greedy_per_stage(weight, stages, "weight")
    act = _greedy_per_stage(activation, stages, "activation")
    caps = _greedy_per_stage(limit, devices, "limit")
    rank = {kind: order.index(kind) for kind in (FORWARD, BACKWARD, WEIGHT)}
    m = microbatches
    lead = lead or 0

    # Finish times, -1.0 until scheduled, at [stage * M + micro-batch].
    f_end = [-1.0] * (stages * m)
    b_end = [-1.0] * (stages * m)
    next_f, next_b = [0] * stages, [0] * stages
    free, held = [0.0] * devices, [0.0] * devices
    weights: list[deque[int]] = [deque() for _ in range(devices)]
    lists: list[list[Action]] = [[] for _ in range(devices)]
    # Later stages first: they are nearer the loss, so their backward frees memory sooner.
    mine_deep = [sorted(mine, reverse=True) for mine in held_by]

    def wait(stage: int, end: float, device: int) -> float:
        return end + (transfer if placement[stage] != device else 0.0)

    def best(device: int) -> tuple[float, int, int, str, int] | None:
        """(start, rank, -stage, kind, stage) of the action this device would start next."""
        found: tuple[float, int, int, str, int] | None = None
        clock = free[device]
        for s in mine_deep[device]:
            i = next_f[s]
            room = i < m and held[device] + act[s] <= caps[device] + 1e-9
            if room and (partner[s] < 0 or i < lead or b_end[partner[s] * m + i - lead] >= 0):
                start = clock
                if s > 0:
                    end = f_end[(s - 1) * m + i]
                    start = -1.0 if end < 0 else max(start, wait(s - 1, end, device))
                if start >= 0:
                    key = (start, rank[FORWARD], -s, FORWARD, s)
                    found = key if found is None or key < found else found
            j = next_b[s]
            if j < m and f_end[s * m + j] >= 0:
                paired = partner[s] < 0 or f_end[partner[s] * m + min(j + lead - 1, m - 1)] >= 0
                start = max(clock, f_end[s * m + j]) if paired else -1.0
                if start >= 0 and s + 1 < stages:
                    end = b_end[(s + 1) * m + j]
                    start = -1.0 if end < 0 else max(start, wait(s + 1, end, device))
                if start >= 0:
                    key = (start, rank[BACKWARD], -s, BACKWARD, s)
                    found = key if found is None or key < found else found
        if weights[device]:
            s = weights[device][0] // m
            key = (clock, rank[WEIGHT], -s, WEIGHT, s)
            found = key if found is None or key < found else found
        return found

    # NOTE: a device's choice changes only when it runs something or a neighbour finishes
    # what it waits for, so only those are re-ranked after each step; the choices wait in a
    # heap, where a device's older entries are skipped (its version moved on).
    version = [0] * devices
    ranked: list[tuple[tuple[float, int, int, str, int], int, int]] = []
    for d in range(devices):
        found = best(d)
        if found is not None:
            heapq.heappush(ranked, (found, d, 0))
    remaining = 3 * stages * m
    while remaining:
        while ranked and ranked[0][2] != version[ranked[0][1]]:
            heapq.heappop(ranked)
        if not ranked:
            return None
        (start, _, _, kind, s), device, _ = heapq.heappop(ranked)
        if kind == FORWARD:
            i = next_f[s]
            next_f[s] += 1
            end = start + f[s]
            f_end[s * m + i] = end
            held[device] += act[s]
            touched = [device] + ([placement[s + 1]] if s + 1 < stages else [])
        elif kind == BACKWARD:
            i = next_b[s]
            next_b[s] += 1
            end = start + b[s]
            b_end[s * m + i] = end
            weights[device].append(s * m + i)
            touched = [device] + ([placement[s - 1]] if s > 0 else [])
        else:
            i = weights[device].popleft() % m
            end = start + w[s]
            held[device] -= act[s]
            touched = [device]
        lists[device].append(Action(kind, s, i))
        free[device] = end
        remaining -= 1
        for d in set(touched):
            version[d] += 1
            found = best(d)
            if found is not None:
                heapq.heappush(ranked, (found, d, version[d]))
    return Schedule(name, lists, microbatches, stages, tuple(placement))


# --- gpipe/analysis/search.py ---

_ORDERS = ("BFW", "FBW")


def _per(value: float | Sequence[float], count: int, what: str) -> list[float]:
    if isinstance(value, int | float):
        return [float(value)] * count
    values = [float(v) for v in value]
    if len(values) != count:
        raise ValueError(f"{what} lists {len(values)} entries, expected {count}")
    return values


def search(
    stages: int,
    microbatches: int,
    *,
    virtual_stages: int = 1,
    costs: Costs | Mapping[str, Any] | None = None,
    memory_limit: float | Sequence[float] | None = None,
) -> Schedule:
    """The schedule with the shortest simulated step that fits ``memory_limit`` ("auto").

    With one stage per device the candidates are gpipe, 1f1b, zb-h1, zb-h2 and the greedy
    builder's schedules; with two, the stages are laid out in a V (as zb-v) and the
    candidates are zb-v, GPipe's fill-drain and the greedy builder's V schedules.

    Memory is counted as the simulator does: a micro-batch's forward on a stage holds the
    stage's ``costs.activation_bytes`` (1 by default: one unit per micro-batch per stage)
    until its W (its B, in a schedule without W actions).

    Below 1F1B's memory, where no named schedule fits, it still finds one. For 3 stages,
    4 micro-batches, F = B = W = 1 and at most 2 micro-batches per device (1F1B holds 3 on
    device 0), laid out in time::

        0: 0F0 0F1             0B0 0W0 0B1 0F2 0W1 0F3         0B2 0W2 0B3 0W3
        1:     1F0 1F1     1B0 1W0 1B1 1W1     1F2     1F3 1B2 1W2 1B3 1W3
        2:         2F0 2B0 2F1 2B1 2W0 2W1         2F2 2B2 2F3 2B3 2W2 2W3

    Args:
        stages: K, the number of devices.
        microbatches: M.
        virtual_stages: stages per device, 1 or 2 (then in a V).
        costs: per-stage F, B, W times (and transfer time, activation sizes), as for
            :func:`simulate`; F = B = W = 1 by default. ``weight`` is what a zero-bubble
            schedule runs as W; the others run it inside B.
        memory_limit: the most each device may hold (one number, or one per device), in
            the units of ``costs.activation_bytes``; by default what 1F1B holds (zb-v with
            two stages per device): K with the default costs (2K with two stages).

    Returns:
        The schedule, named "auto".

    Raises:
        ValueError: a count below 1, ``virtual_stages`` other than 1 or 2, a cost or limit
            list of the wrong length, or a limit no candidate fits in (the message says the
            least any candidate needs).
    """
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages and microbatches must be >= 1, got {stages}, {microbatches}")
    if virtual_stages not in (1, 2):
        raise ValueError(
            f"schedule 'auto' searches one or two stages per device (two in a V, as zb-v), "
            f"got virtual_stages={virtual_stages}; use schedule='interleaved' for more"
        )
    if isinstance(costs, Mapping):
        costs = Costs(**costs)
    costs = costs if costs is not None else Costs(forward=1.0, backward=1.0, weight=1.0)
    count = stages * virtual_stages
    activation = _per(costs.activation_bytes, count, "Costs.activation_bytes")
    named = _named(stages, microbatches, virtual_stages)
    if memory_limit is None:
        # 1F1B's memory: zb-v holds as much with two stages per device.
        reference = named[0] if virtual_stages == 2 else one_f_one_b(stages, microbatches)
        limits = [max(simulate(reference, costs).peak_memory)] * stages
    else:
        limits = _per(memory_limit, stages, "memory_limit")
    if any(not limit > 0 for limit in limits):
        raise ValueError(f"memory_limit must be > 0 on every device, got {memory_limit!r}")

    best: tuple[tuple[float, float, float], Schedule] | None = None
    smallest: tuple[float, str] | None = None
    for schedule in [*named, *_built(stages, microbatches, virtual_stages, costs, limits)]:
        timeline = simulate(schedule, costs)
        peaks = timeline.peak_memory
        need = max(peak - limit for peak, limit in zip(peaks, limits))
        if need > 1e-9:
            if smallest is None or max(peaks) < smallest[0]:
                smallest = (max(peaks), schedule.name)
            continue
        key = (timeline.makespan, max(timeline.spans), max(peaks))
        if best is None or key < best[0]:
            best = (key, schedule)
    if best is None:
        assert smallest is not None
        least = min(activation) if virtual_stages == 1 else 2 * min(activation)
        raise ValueError(
            f"no schedule fits memory_limit={memory_limit!r}: the least any candidate holds "
            f"is {smallest[0]:g} ({smallest[1]}); a device needs at least {least:g} to run "
            "a backward at all. Raise memory_limit, or checkpoint to shrink activations"
        )
    return dataclasses.replace(best[1], name="auto")


def _named(stages: int, microbatches: int, virtual_stages: int) -> list[Schedule]:
    """The named schedules with the placement the search uses."""
    if virtual_stages == 2:
        return [
            zb_v(stages, microbatches),
            gpipe(stages, microbatches, virtual_stages=2, placement=v_shape(stages)),
            v_half(stages, microbatches),
            v_min(stages, microbatches),
        ]
    return [
        one_f_one_b(stages, microbatches),
        gpipe(stages, microbatches),
        zb_h1(stages, microbatches),
        zb_h2(stages, microbatches),
    ]


def _built(
    stages: int, microbatches: int, virtual_stages: int, costs: Costs, limits: list[float]
) -> list[Schedule]:
    """The greedy builder's schedules over the sweep of its rules."""
    count = stages * virtual_stages
    forward = _per(costs.forward, count, "Costs.forward")
    backward = _per(costs.backward, count, "Costs.backward")
    weight = _per(costs.weight, count, "Costs.weight")
    activation = _per(costs.activation_bytes, count, "Costs.activation_bytes")
    # The warm-up: how much each device may hold, in whole micro-batches up to 2K of them
    # (ZB-H1 holds K, ZB-H2 2K-1), and the limit itself.
    unit = max(activation) or 1.0
    caps: list[list[float]] = []
    for held in [*range(virtual_stages, 2 * stages * virtual_stages + 1), None]:
        cap = [limit if held is None else min(held * unit, limit) for limit in limits]
        if cap not in caps:
            caps.append(cap)
    leads: list[int | None] = [None]
    placement = round_robin(stages, stages)
    if virtual_stages == 2:
        placement = v_shape(stages)
        leads = [*sorted({max(1, stages // 2), max(1, stages - 1), stages, stages + 1, 2 * stages})]
    built = []
    for cap in caps:
        for order in _ORDERS:
            for lead in leads:
                schedule = greedy(
                    "greedy",
                    placement,
                    microbatches,
                    limit=cap,
                    order=order,
                    lead=lead,
                    forward=forward,
                    backward=backward,
                    weight=weight,
                    transfer=costs.transfer,
                    activation=activation,
                )
                if schedule is not None:
                    built.append(schedule)
    return built
