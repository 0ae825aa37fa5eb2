"""Looped schedules: v stages per device, round-robin (device ``d`` holds ``d, d+K, ...``).

* Interleaved zero bubble (torch's ``ScheduleInterleavedZeroBubble``, the zero-bubble paper's
  ZB-1P on this layout): interleaved 1F1B with the weight gradient split off and deferred.
* Looped BFS (Lamy-Poirier 2023, torch's ``ScheduleLoopedBFS``): every forward of one
  local stage before the next, the backwards in reverse: what FSDP wants.

Each docstring draws the generator's output with every F, B and W taking one unit of time,
one column per unit; the tests check that these pictures are exact.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from gpipe.schedule.action import WEIGHT, Action
from gpipe.schedule.generate import _check, gpipe, looped_order, round_sizes
from gpipe.schedule.schedule import Schedule

__all__ = ["interleaved_zb", "looped_bfs"]


def interleaved_zb(stages: int, microbatches: int, *, virtual_stages: int = 2) -> Schedule:
    """Interleaved zero bubble (ZB-1P looped): v stages per device, the weight gradient deferred.

    Device ``d`` holds stages ``d, d+K, ...``. The micro-batches go in rounds of about K
    (``M // K`` rounds, sizes differing by at most one, the larger first): a device runs a
    round's forwards on its first stage, then on its second, and so on, and the backwards
    (B, the input gradient only) of each round in the opposite stage order. Device ``d``
    warms up with ``(v-1)·G + K-1-d`` forwards (``G`` = the first round's size), then
    alternates one forward and one B; from its ``d+1``-th B on, each B is followed by the
    W (weight gradient) of the oldest B whose W is still due, so its W's run ``d`` B's late,
    where it would otherwise idle; the W's left run at the end. For 3 devices, 3
    micro-batches and v = 2, laid out in time::

        0: 0F0 0F1 0F2 3F0 3F1 3F2         3B0 3W0 3B1 3W1 3B2 3W2 0B0 0W0 0B1 0W1 0B2 0W2
        1:     1F0 1F1 1F2 4F0 4F1     4B0 4F2 4B1 4W0 4B2 4W1 1B0 4W2 1B1 1W0 1B2 1W1 1W2
        2:         2F0 2F1 2F2 5F0 5B0 5F1 5B1 5F2 5B2 5W0 2B0 5W1 2B1 5W2 2B2 2W0 2W1 2W2

    With F = B = W = 1 per stage and M >= K, one step takes ``3vM + K-1`` units, the least
    possible (the last device waits K-1 for its first input, then works 3vM): a bubble of
    ``(K-1) / (3vM + K-1)``, about 1/v of ZB-H1's. Memory, counting a stage's micro-batch
    from its F to its W: at most ``(v-1)·G + K`` stage-micro-batches per device (all
    ``v·M`` when M < K). That is ``v·K`` when K divides M, each a v-th of a device's share,
    so 1F1B's K micro-batches; otherwise ``(v-1)·(G-K)`` more, the price of rounds of more
    than K, which keep the time least. Torch's version takes only an M that its equal
    rounds divide, and there builds this same order, action for action.

    Args:
        stages: K, the number of devices.
        microbatches: M, any number >= 1.
        virtual_stages: v >= 2, model stages per device.

    Returns:
        The schedule, named "interleaved-zb", with F, B and W actions and K·v stages placed
        round-robin.

    Raises:
        ValueError: ``stages`` or ``microbatches`` below 1, or ``virtual_stages`` below 2.
    """
    _check(stages, microbatches)
    if virtual_stages < 2:
        raise ValueError(
            f"interleaved-zb needs virtual_stages >= 2, got {virtual_stages}: pass "
            "virtual_stages=2 (and two balance entries per device), or use schedule='zb-h1' "
            "for one stage per device"
        )
    devices, v = stages, virtual_stages
    sizes = round_sizes(devices, microbatches)
    actions = []
    for d in range(devices):
        forwards, backwards = looped_order(devices, v, sizes, d)
        warmup = min((v - 1) * sizes[0] + devices - 1 - d, len(forwards))
        mine = forwards[:warmup]
        due: deque[Action] = deque()  # B's whose W has not run
        for j, backward in enumerate(backwards):
            if warmup + j < len(forwards):
                mine.append(forwards[warmup + j])
            mine.append(backward)
            due.append(backward)
            if j >= d:
                done = due.popleft()
                mine.append(Action(WEIGHT, done.stage, done.microbatch))
        mine += [Action(WEIGHT, b.stage, b.microbatch) for b in due]
        actions.append(mine)
    return Schedule("interleaved-zb", actions, microbatches, devices * v)


interleaved_zb.virtual = True  # type: ignore[attr-defined]
interleaved_zb.least_virtual_stages = 2  # type: ignore[attr-defined]


def looped_bfs(stages: int, microbatches: int, *, virtual_stages: int = 2) -> Schedule:
    """Looped BFS (breadth-first): each local stage runs every micro-batch before the next.

    Device ``d`` holds stages ``d, d+K, ...`` (round-robin, like interleaved 1F1B). It runs
    the forwards of all micro-batches on its first stage, then on its second, and so on,
    then the backwards stage by stage in reverse order, the newest micro-batch first:
    torch's ``ScheduleLoopedBFS`` order, action for action. For 2 devices, 4 micro-batches
    and v = 2, laid out in time::

        0: 0F0 0F1 0F2 0F3 2F0 2F1 2F2 2F3         2B3 2B2 2B1 2B0 0B3 0B2 0B1 0B0
        1:     1F0 1F1 1F2 1F3 3F0 3F1 3F2 3F3 3B3 3B2 3B1 3B0 1B3 1B2 1B1 1B0

    Its point is FSDP (data parallelism with sharded parameters): a device works on one
    stage at a time, so each stage's parameters are gathered (unsharded) once per step for
    the forwards and once for the backwards, and its gradients reduced once, after its last
    backward; interleaved 1F1B moves between stages every few actions. It takes as long as
    interleaved 1F1B: with equal stage costs and M >= K, ``2(vM + K-1)`` units of F = B = 1
    (the simulator agrees for every M). Memory is GPipe's: every micro-batch of every
    stage, ``v·M`` stage-micro-batches per device at the turn.

    Args:
        stages: K, the number of devices.
        microbatches: M.
        virtual_stages: v, model stages per device.

    Returns:
        The schedule, named "looped-bfs", with K·v stages placed round-robin.

    Raises:
        ValueError: ``stages``, ``microbatches`` or ``virtual_stages`` below 1.
    """
    # NOTE: GPipe's fill-drain over a round-robin placement is exactly this order; the name
    # is what tells a reader (and FSDP) the stage-by-stage intent.
    built = gpipe(stages, microbatches, virtual_stages=virtual_stages)
    return dataclasses.replace(built, name="looped-bfs")


looped_bfs.virtual = True  # type: ignore[attr-defined]
