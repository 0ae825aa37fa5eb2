"""The greedy builder: whenever a device is free, it starts the ready action its rule ranks first.

This is list scheduling, the way Qi et al. (2024) build zero-bubble schedules: forwards as
long as memory allows, a backward as soon as its gradient arrives, weight gradients (W) in
whatever time is left. The builder runs a timing model as it goes (each action takes its
stage's F, B or W time, a hand-off between devices ``transfer``), so the order it writes down
fits those costs; with unit costs it yields ZB-H2 and ZB-V (:mod:`gpipe.schedule.zero_bubble`),
and :func:`gpipe.analysis.search` runs it over several rules and costs to find a schedule.

The order it writes is valid whatever the real costs turn out to be: the run it simulated
is a witness that every device's list can finish. Messages keep their order between each
pair of devices too: with one stage per device a pair carries only activations or only
gradients, each in micro-batch order; with two stages per device in a V, each pair also
carries the other kind, and the ``lead`` rule keeps the two in one fixed pattern on every
device, so what one device sends is what its neighbour takes next.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence

from gpipe.schedule.action import BACKWARD, FORWARD, WEIGHT, Action
from gpipe.schedule.schedule import Schedule

__all__ = ["greedy"]

PerStage = float | Sequence[float]


def _per_stage(value: PerStage, stages: int, what: str) -> list[float]:
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
    deadline: float | None = None,
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
        deadline: give up as soon as some device cannot finish by then (its clock plus
            the work it has left is later, by more than rounding), timed as it builds:
            a search need not finish a schedule that cannot beat one it has.

    Returns:
        The schedule, or None when the devices get stuck (``limit`` too small to hold what
        a backward needs) or it cannot finish by ``deadline``.

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
    f = _per_stage(forward, stages, "forward")
    b = _per_stage(backward, stages, "backward")
    w = _per_stage(weight, stages, "weight")
    act = _per_stage(activation, stages, "activation")
    caps = _per_stage(limit, devices, "limit")
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
    # The work each device has left; with nothing negative, its clock plus this is the
    # soonest it can finish.
    left = [0.0] * devices
    for s in range(stages):
        left[placement[s]] += m * (f[s] + b[s] + w[s])
    latest = math.inf if deadline is None else deadline + 1e-9 * abs(deadline) + 1e-12
    while remaining:
        while ranked and ranked[0][2] != version[ranked[0][1]]:
            heapq.heappop(ranked)
        if not ranked:
            return None
        (start, _, _, kind, s), device, _ = heapq.heappop(ranked)
        if kind == FORWARD:
            i = next_f[s]
            next_f[s] += 1
            took = f[s]
            end = start + took
            f_end[s * m + i] = end
            held[device] += act[s]
            touched = [device] + ([placement[s + 1]] if s + 1 < stages else [])
        elif kind == BACKWARD:
            i = next_b[s]
            next_b[s] += 1
            took = b[s]
            end = start + took
            b_end[s * m + i] = end
            weights[device].append(s * m + i)
            touched = [device] + ([placement[s - 1]] if s > 0 else [])
        else:
            i = weights[device].popleft() % m
            took = w[s]
            end = start + took
            held[device] -= act[s]
            touched = [device]
        lists[device].append(Action(kind, s, i))
        free[device] = end
        remaining -= 1
        left[device] -= took
        if end + left[device] > latest:
            return None
        for d in set(touched):
            version[d] += 1
            found = best(d)
            if found is not None:
                heapq.heappush(ranked, (found, d, version[d]))
    return Schedule(name, lists, microbatches, stages, tuple(placement))
