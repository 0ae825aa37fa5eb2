"""What each simulated action waits for: the actions before it, the transfers between
devices, a decode's token, and a fused action's parts waiting as one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpipe.analysis.columns import ActionColumns
from gpipe.analysis.costs import Costs, Skip
from gpipe.schedule import BACKWARD, FORWARD, KINDS

__all__ = ["Waits", "action_waits", "fused_groups", "merge_fused_waits", "wrap_around"]


@dataclass(frozen=True)
class Waits:
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


def action_waits(
    kind: np.ndarray,
    stage: np.ndarray,
    mb: np.ndarray,
    stages: int,
    microbatches: int,
    edge: list[float],
    skips: Sequence[Skip],
    placement: tuple[int, ...],
    costs: Costs,
) -> Waits:
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
    return Waits(key, extra, sender, nbytes, none, np.zeros(len(kind), bool))


def wrap_around(
    waits: Waits,
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


def fused_groups(columns: ActionColumns) -> list[tuple[int, int]]:
    """(first row, rows) of each fused action, in row order."""
    if columns.parts is None:
        return []
    last = np.cumsum(columns.parts)
    fused = np.flatnonzero(columns.parts > 1)
    return [(int(last[i] - columns.parts[i]), int(columns.parts[i])) for i in fused]


def merge_fused_waits(
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
