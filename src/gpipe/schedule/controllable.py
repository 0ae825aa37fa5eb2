"""Controllable-memory V schedules (Qi et al. 2024, "Pipeline Parallelism with Controllable
Memory", arXiv 2405.15362): V-Half and V-Min, 2K stages in a V at 1/2 and 1/3 of 1F1B's memory.

The paper builds a schedule from one building block: on each device, the slots (in units
of one F, B or W) of micro-batch 0's forward and backward on its two stages. Micro-batch
``i`` repeats the block ``6i`` slots later, so every device runs F, B and W of both stages
once per 6 slots; a micro-batch is held from its F to its W, so the block's lifespan sets
the memory. The W's fill the free slots, each after its B, oldest first. Then the schedule
is squeezed: taking the F's and B's in block order, each moves to the earliest free slot
after what it waits for (and its stage's previous micro-batch), unless a device would then
hold more than the most any device held before, its W's still filling what is free. The
published code squeezes twice, in phases; this one pass is never slower in the simulator,
and holds no more. The order on each device is what the runtime runs; the simulator times
it, so the slots themselves are never kept.

Each docstring draws the generator's output with F = B = W = 1 per stage, one column per
unit; the tests check that these pictures are exact.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from gpipe.schedule.action import BACKWARD, FORWARD, WEIGHT, Action, dependencies
from gpipe.schedule.generate import _check
from gpipe.schedule.placement import v_shape
from gpipe.schedule.schedule import Schedule

__all__ = ["v_half", "v_min"]

_PERIOD = 6  # slots between two micro-batches' blocks: F, B and W of two stages
Block = Callable[[int, int], tuple[int, int, int, int]]


def _half_block(devices: int, d: int) -> tuple[int, int, int, int]:
    """V-Half's slots on device ``d``: F of its first stage, F of its second, B of its second,
    B of its first. The gap (even K) keeps a device's four slots apart modulo the period."""
    gap = 3 if devices % 2 == 0 else 0
    k = devices
    return (2 * d, 3 * k - d - 2, 3 * k + gap + 2 * d - 1, 6 * k + gap - d - 2)


def _min_block(devices: int, d: int) -> tuple[int, int, int, int]:
    """V-Min's slots on device ``d``, as :func:`_half_block`'s (the gap: K a multiple of 3)."""
    gap = 2 if devices % 3 == 0 else 0
    k = devices
    return (d, 2 * k - d - 1, 2 * k + gap + d, 4 * k + gap - d - 1)


def v_half(stages: int, microbatches: int) -> Schedule:
    """V-Half (Qi et al. 2024): 2K stages in a V at half 1F1B's activation memory.

    Device ``d`` holds stages ``d`` and ``2K-1-d`` (:func:`~gpipe.schedule.v_shape`), and
    runs micro-batch ``i``'s F on stage ``d`` in slot ``2d + 6i``, its F on stage ``2K-1-d``
    in ``3K-d-2 + 6i``, and the B's in ``3K+g+2d-1 + 6i`` and ``6K+g-d-2 + 6i`` (``g`` = 3
    for even K, else 0), squeezed as the module says. For 2 devices and 3 micro-batches
    (4 stages), laid out in time::

        0: 0F0 0F1     3F0 3B0 3F1 3W0 0F2 0B0 3B1 0W0 3F2 3B2 0B1 3W1 0B2 3W2 0W1 0W2
        1:     1F0 2F0 1F1 2F1 2B0 1B0 2W0 1F2 1W0 2F2 2B1 1B1 2B2 1B2 2W1 1W1 2W2 1W2

    Each action is on half a device's share of the model. Memory, a stage's micro-batch
    held from its F to its W: at most ``2·⌊(K+2)/2⌋`` stage-micro-batches per device
    (``2M`` when fewer), that is ``⌊(K+2)/2⌋`` device shares, the paper's ``(p+2)//2``,
    against 1F1B's K. With F = B = W per stage and M >= K, one step takes ``6M + I`` units,
    ``I = 3K-4`` for odd K >= 3, ``3K-7`` for even K >= 4 (K-1 below); 1F1B idles
    ``6(K-1)`` in these units, so about half as much, the paper's bubble rate ``~p/(2m)``.

    Args:
        stages: K, the number of devices; the model is cut into 2K stages.
        microbatches: M.

    Returns:
        The schedule, named "v-half", with F, B and W actions and the V placement.

    Raises:
        ValueError: ``stages`` or ``microbatches`` below 1.
    """
    return _build("v-half", stages, microbatches, _half_block)


v_half.virtual_stages = 2  # type: ignore[attr-defined]


def v_min(stages: int, microbatches: int) -> Schedule:
    """V-Min (Qi et al. 2024): 2K stages in a V at a third of 1F1B's activation memory.

    As :func:`v_half`, with a shorter block: micro-batch ``i``'s F's on device ``d`` in
    slots ``d + 6i`` and ``2K-d-1 + 6i``, its B's in ``2K+g+d + 6i`` and ``4K+g-d-1 + 6i``
    (``g`` = 2 when 3 divides K, else 0). For 2 devices and 3 micro-batches (4 stages),
    laid out in time::

        0: 0F0 0F1     3F0 3B0 3F1 3B1 0B0 3W0 0F2 0B1 3W1 0W0 3F2 3B2 0W1 3W2 0B2 0W2
        1:     1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 2W0 1F2 1W0 2F2 2W1 1W1 2B2 1B2 2W2 1W2

    Memory: at most ``2·⌊(K+4)/3⌋`` stage-micro-batches per device (``2M`` when fewer),
    ``⌊(K+4)/3⌋`` device shares, the paper's ``(p+4)//3``, against 1F1B's K. With F = B
    = W per stage and M >= K, one step takes ``6M + I`` units, ``I = 4K-5`` when K mod 3
    is 1, else ``4K-7`` (0 for K = 1); 1F1B idles ``6(K-1)``, so about two thirds as
    much, the paper's bubble rate ``~2p/(3m)``.

    Args:
        stages: K, the number of devices; the model is cut into 2K stages.
        microbatches: M.

    Returns:
        The schedule, named "v-min", with F, B and W actions and the V placement.

    Raises:
        ValueError: ``stages`` or ``microbatches`` below 1.
    """
    return _build("v-min", stages, microbatches, _min_block)


v_min.virtual_stages = 2  # type: ignore[attr-defined]


def _build(name: str, devices: int, microbatches: int, block: Block) -> Schedule:
    _check(devices, microbatches)
    stages = 2 * devices
    placement = v_shape(devices)
    slot: dict[Action, int] = {}
    for d in range(devices):
        first, second = d, stages - 1 - d
        f_first, f_second, b_second, b_first = block(devices, d)
        for i in range(microbatches):
            shift = _PERIOD * i
            slot[Action(FORWARD, first, i)] = f_first + shift
            slot[Action(FORWARD, second, i)] = f_second + shift
            slot[Action(BACKWARD, second, i)] = b_second + shift
            slot[Action(BACKWARD, first, i)] = b_first + shift
    rows = _squeeze(slot, placement, stages)
    return Schedule(
        name, [list(_with_weights(row)) for row in rows], microbatches, stages, placement
    )


Row = list[Action | None]  # one device's slots: the F or B in each, None where free


def _squeeze(slot: dict[Action, int], placement: tuple[int, ...], stages: int) -> list[Row]:
    """Move each action, in block order, to the earliest free slot after what it waits for
    (and its stage's previous micro-batch), if the device then holds no more than the
    most any device held before; return each device's slots."""
    devices = max(placement) + 1
    width = max(slot.values()) + 1
    rows: list[Row] = [[None] * width for _ in range(devices)]
    for action, at in slot.items():
        rows[placement[action.stage]][at] = action
    limit = max(max((held for _, held in _walk(row)), default=0) for row in rows)
    for action in sorted(slot, key=lambda a: (slot[a], placement[a.stage])):
        row = rows[placement[action.stage]]
        waits = list(dependencies(action, stages))
        if action.microbatch > 0:
            waits.append(Action(action.kind, action.stage, action.microbatch - 1))
        was = slot[action]
        for at in range(max((slot[w] + 1 for w in waits), default=0), was):
            if row[at] is not None:
                continue
            row[at], row[was] = action, None
            if _fits(row, limit):
                slot[action] = at
                break
            row[at], row[was] = None, action
    return rows


def _walk(row: Row) -> Iterator[tuple[Action, int]]:
    """The device's actions in order, W's in the free slots (each after its B, oldest B's
    first) and the W's left at the end, each with what the device holds after it."""
    due: deque[Action] = deque()
    held = 0
    for action in row:
        if action is None:
            if due:
                done = due.popleft()
                held -= 1
                yield Action(WEIGHT, done.stage, done.microbatch), held
            continue
        if action.kind == FORWARD:
            held += 1
        else:
            due.append(action)
        yield action, held
    while due:
        done = due.popleft()
        held -= 1
        yield Action(WEIGHT, done.stage, done.microbatch), held


def _fits(row: Row, limit: int) -> bool:
    """Whether the device never holds more than ``limit`` (:func:`_walk`'s count, unrolled:
    the squeeze asks this for every slot it tries)."""
    held = due = 0
    for action in row:
        if action is None:
            if due:
                due -= 1
                held -= 1
        elif action.kind == FORWARD:
            held += 1
            if held > limit:
                return False
        else:
            due += 1
    return True


def _with_weights(row: Row) -> Iterator[Action]:
    return (action for action, _ in _walk(row))
