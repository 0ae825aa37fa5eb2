"""Schedule generators without split backward: GPipe, 1F1B and interleaved 1F1B.

Each generator's docstring draws its output for a small case as the simulator lays it out
when every F, B and W takes one unit of time, one column per unit; the tests check that
these pictures are exact. The zero-bubble family lives in :mod:`gpipe.schedule.zero_bubble`,
the registry by name in :mod:`gpipe.schedule.registry`.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpipe.schedule.action import BACKWARD, FORWARD, Action
from gpipe.schedule.placement import round_robin
from gpipe.schedule.schedule import Schedule

__all__ = ["gpipe", "interleaved", "looped_order", "one_f_one_b", "round_sizes"]


def _check(stages: int, microbatches: int) -> None:
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")


def gpipe(
    stages: int,
    microbatches: int,
    *,
    virtual_stages: int = 1,
    placement: Sequence[int] | None = None,
) -> Schedule:
    """GPipe fill-drain: every forward, then every backward in reverse micro-batch order.

    The backward runs the newest micro-batch first: its activations are the freshest, and
    with ``checkpoint="except_last"`` the one micro-batch that kept its activations needs no
    recomputation. For 3 stages and 4 micro-batches, laid out in time::

        0: 0F0 0F1 0F2 0F3                 0B3 0B2 0B1 0B0
        1:     1F0 1F1 1F2 1F3         1B3 1B2 1B1 1B0
        2:         2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0

    With v virtual stages per device (by default device ``d`` holds ``d, d+K, ...``; any
    ``placement`` works), each device runs its stages' forwards in increasing stage order
    and their backwards in decreasing order: what ``pipe(x)`` runs on such a pipe.

    Args:
        stages: K, the number of devices.
        microbatches: M.
        virtual_stages: v, model stages per device.
        placement: the device of each of the K·v model stages; round-robin by default.

    Raises:
        ValueError: a count below 1, or a placement that does not give every device v stages.
    """
    _check(stages, microbatches)
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    count = stages * virtual_stages
    layout = tuple(placement) if placement is not None else round_robin(count, stages)
    held = [[s for s in range(count) if layout[s] == d] for d in range(stages)]
    if len(layout) != count or any(len(mine) != virtual_stages for mine in held):
        raise ValueError(
            f"placement {layout} must give each of the {stages} devices {virtual_stages} "
            f"of the {count} stages"
        )
    actions = []
    for mine in held:
        forward = [Action(FORWARD, s, i) for s in mine for i in range(microbatches)]
        backward = [
            Action(BACKWARD, s, i) for s in reversed(mine) for i in reversed(range(microbatches))
        ]
        actions.append(tuple(forward + backward))
    return Schedule("gpipe", tuple(actions), microbatches, count, layout)


gpipe.virtual = True  # type: ignore[attr-defined]


def round_sizes(devices: int, microbatches: int) -> list[int]:
    """Micro-batches per round of the looped schedules: ``M // K`` rounds (at least one),
    as even as can be, the larger first (a smaller round first would leave a device
    waiting on a chunk not yet computed)."""
    rounds = max(1, microbatches // devices)
    size, extra = divmod(microbatches, rounds)
    return [size + 1] * extra + [size] * (rounds - extra)


def looped_order(
    devices: int, v: int, sizes: Sequence[int], device: int
) -> tuple[list[Action], list[Action]]:
    """Device ``device``'s forwards and backwards in the looped schedules' order: round by
    round (``sizes`` micro-batches each), a round's forwards on its first stage, then its
    second, and so on; the backwards of each round in the opposite stage order."""
    order: list[tuple[int, int]] = []  # (chunk, micro-batch)
    first = 0
    for size in sizes:
        order += [(chunk, i) for chunk in range(v) for i in range(first, first + size)]
        first += size
    forwards = [Action(FORWARD, chunk * devices + device, i) for chunk, i in order]
    backwards = [Action(BACKWARD, (v - 1 - chunk) * devices + device, i) for chunk, i in order]
    return forwards, backwards


def _one_f_one_b_order(
    forwards: list[Action], backwards: list[Action], warmup: int
) -> list[Action]:
    """``warmup`` forwards, then one forward and one backward in turn, then the backwards left."""
    steady = len(forwards) - warmup
    order = forwards[:warmup]
    for j in range(steady):
        order += [forwards[warmup + j], backwards[j]]
    return order + backwards[steady:]


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): a backward as soon as possible, so few micro-batches wait.

    Device ``k`` warms up with ``min(K-k-1, M)`` forwards, then alternates one forward and
    one backward, then cools down with the backwards left. It holds at most ``min(K-k, M)``
    micro-batches of activations (GPipe holds M) and takes as long as GPipe. For 3 stages
    and 4 micro-batches, laid out in time::

        0: 0F0 0F1 0F2         0B0 0F3 0B1     0B2     0B3
        1:     1F0 1F1     1B0 1F2 1B1 1F3 1B2     1B3
        2:         2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3

    Args:
        stages: K, one stage per device.
        microbatches: M.

    Returns:
        The schedule, named "1f1b".

    Raises:
        ValueError: ``stages`` or ``microbatches`` below 1.
    """
    _check(stages, microbatches)
    actions = []
    for k in range(stages):
        forwards = [Action(FORWARD, k, i) for i in range(microbatches)]
        backwards = [Action(BACKWARD, k, i) for i in range(microbatches)]
        warmup = min(stages - k - 1, microbatches)
        actions.append(_one_f_one_b_order(forwards, backwards, warmup))
    return Schedule("1f1b", actions, microbatches)


def interleaved(stages: int, microbatches: int, *, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): v model stages per device make the bubble v× smaller.

    The model is cut into K·v stages; device ``d`` holds stages ``d, d+K, d+2K, ...``. Work
    goes in rounds of K micro-batches: a device runs the forwards of a round on its first
    stage, then on its second, and so on, and the backwards of each round in the opposite
    stage order. Device ``d`` warms up with ``2(K-d-1) + (v-1)·G`` forwards (``G`` = the
    first round's size; all forwards if there are fewer), then alternates one forward and one
    backward, then runs the backwards left. With ``v = 1`` the warm-up is ``K-d-1``: 1F1B.

    Any M works. When K does not divide M, the micro-batches go in ``M // K`` rounds (one
    if M < K) of sizes that differ by at most one, the larger first (a smaller round first
    would leave devices waiting on a chunk that is not yet computed, and deadlock), as
    torch's ``ScheduleInterleaved1F1B`` does: the first round's extra micro-batches cost
    ``(v-1)`` more warm-up forwards each, so more memory, and rounds of even size keep
    that least. With equal stage costs the bubble is ``(K-1) / (v·M + K-1)`` for every
    M >= K. For 2 devices, 4 micro-batches and v = 2, laid out in time::

        0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1     2B2     2B3 0B2 0B3
        1:     1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3

    Args:
        stages: K, the number of devices.
        microbatches: M, any number >= 1.
        virtual_stages: v, model stages per device.

    Returns:
        The schedule, named "interleaved", with K·v stages placed round-robin.

    Raises:
        ValueError: ``stages``, ``microbatches`` or ``virtual_stages`` below 1.
    """
    _check(stages, microbatches)
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    devices, v = stages, virtual_stages
    sizes = round_sizes(devices, microbatches)
    actions = []
    for d in range(devices):
        forwards, backwards = looped_order(devices, v, sizes, d)
        # NOTE: with v > 1, twice K-d-1 because the first backward has to come back from
        # the last device, plus (v-1)·G so the first round is in flight on every chunk but
        # the last; fewer and a device waits on a forward while holding a needed backward.
        warmup = devices - d - 1 if v == 1 else 2 * (devices - d - 1) + (v - 1) * sizes[0]
        actions.append(_one_f_one_b_order(forwards, backwards, min(warmup, len(forwards))))
    return Schedule("interleaved", actions, microbatches, devices * v)


interleaved.virtual = True  # type: ignore[attr-defined]
