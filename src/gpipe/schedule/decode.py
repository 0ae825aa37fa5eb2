"""Generation as schedule data: every lane's forward of every new token, lanes in turn.

A pipe that generates runs forwards only: for each new token, each lane (a group of
sequences decoding together) runs one forward through every stage, and the last stage
samples the lane's next token, which goes back to stage 0 for the lane's next forward. As
data, micro-batch ``i`` is token ``i // L`` of lane ``i % L`` (L lanes), and the schedule's
``wrap`` (L) adds the one dependency training does not have: F(0, i) waits for
F(last, i - L). The validator, the simulator, the lowering, the timeline and the pictures
then cover generation as they cover training.

With one lane, one stage works at a time. With L >= K·v lanes, lane ``l``'s next token
enters stage 0 as soon as its last one left the last stage, and in the steady state no
device idles; a forward of the whole batch per token (fill, then drain, every token) keeps
the devices busy ``L / (L + K - 1)`` of the time at best.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from gpipe.schedule.action import FORWARD, Action
from gpipe.schedule.placement import round_robin
from gpipe.schedule.schedule import Schedule

__all__ = ["decode"]


def decode(
    stages: int,
    lanes: int,
    tokens: int,
    *,
    virtual_stages: int = 1,
    placement: Sequence[int] | None = None,
) -> Schedule:
    """The forwards that generate ``tokens`` new tokens for each of ``lanes`` lanes.

    Each device runs, whenever it is free, its ready forward of the oldest micro-batch (the
    earliest token, then the first lane), the order a pipe kept full by its lanes runs them.
    For 2 devices, 2 lanes and 3 tokens, the grid (one row per unit of time)::

        step   0     1
           0   0F0
           1   0F1   1F0
           2   0F2   1F1
           3   0F3   1F2
           4   0F4   1F3
           5   0F5   1F4
           6         1F5

    Args:
        stages: K, the number of devices.
        lanes: L, the groups of sequences that decode in turn (at least 1).
        tokens: the new tokens each lane generates (at least 1).
        virtual_stages: model stages per device, as the pipe holds them.
        placement: the device of each of the K·v stages (the pipe's, e.g. zb-v's V);
            round robin by default.

    Returns:
        The schedule, named "decode", of forwards only, with ``wrap`` = L and
        ``microbatches`` = L · tokens.

    Raises:
        ValueError: a count below 1, or a placement that does not give every device v
            stages.
    """
    for name, value in (("stages", stages), ("lanes", lanes), ("tokens", tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    count = stages * virtual_stages
    layout = tuple(placement) if placement is not None else round_robin(count, stages)
    if len(layout) != count or any(
        sum(1 for d in layout if d == device) != virtual_stages for device in range(stages)
    ):
        raise ValueError(
            f"placement {layout} must give each of the {stages} devices {virtual_stages} "
            f"of the {count} stages"
        )
    microbatches = lanes * tokens
    last = count - 1
    lists: list[list[Action]] = [[] for _ in range(stages)]
    # Lock step, one unit per forward: each device runs its ready forward of the oldest
    # micro-batch. A forward's one dependency (the stage before, or for stage 0 the last
    # stage's forward of the lane's previous token) makes it ready one step later.
    ready: list[list[tuple[int, int]]] = [[] for _ in range(stages)]
    for i in range(min(lanes, microbatches)):
        heapq.heappush(ready[layout[0]], (i, 0))
    left = count * microbatches
    while left:
        ran = [heapq.heappop(queue) for queue in ready if queue]
        left -= len(ran)
        for i, stage in ran:
            lists[layout[stage]].append(Action(FORWARD, stage, i))
        for i, stage in ran:
            if stage < last:
                heapq.heappush(ready[layout[stage + 1]], (i, stage + 1))
            elif i + lanes < microbatches:
                heapq.heappush(ready[layout[0]], (i + lanes, 0))
    return Schedule("decode", lists, microbatches, count, layout, wrap=lanes)
