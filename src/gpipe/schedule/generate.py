"""Schedule generators: one small pure function per schedule, and the registry by name.

Each generator's docstring draws its output for a small case as the simulator lays it out
when every F, B and W takes one unit of time, one column per unit; the tests check that
these pictures are exact.
"""

from __future__ import annotations

from collections.abc import Callable

from gpipe.schedule.action import BACKWARD, FORWARD, WEIGHT, Action
from gpipe.schedule.schedule import Schedule

__all__ = ["SCHEDULES", "gpipe", "interleaved", "make_schedule", "one_f_one_b", "zb_h1"]


def _check(stages: int, microbatches: int) -> None:
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")


def gpipe(stages: int, microbatches: int, *, virtual_stages: int = 1) -> Schedule:
    """GPipe fill-drain: every forward, then every backward in reverse micro-batch order.

    The backward runs the newest micro-batch first: its activations are the freshest, and
    with ``checkpoint="except_last"`` the one micro-batch that kept its activations needs no
    recomputation. For 3 stages and 4 micro-batches, laid out in time::

        0: 0F0 0F1 0F2 0F3                 0B3 0B2 0B1 0B0
        1:     1F0 1F1 1F2 1F3         1B3 1B2 1B1 1B0
        2:         2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0

    With v virtual stages per device (device ``d`` holds ``d, d+K, ...``), each device runs
    its stages' forwards in increasing stage order and their backwards in decreasing order:
    what ``pipe(x)`` runs on an interleaved pipe.

    Args:
        stages: K, the number of devices.
        microbatches: M.
        virtual_stages: v, model stages per device.
    """
    _check(stages, microbatches)
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    count = stages * virtual_stages
    actions = []
    for device in range(stages):
        held = range(device, count, stages)
        forward = [Action(FORWARD, s, i) for s in held for i in range(microbatches)]
        backward = [
            Action(BACKWARD, s, i) for s in reversed(held) for i in reversed(range(microbatches))
        ]
        actions.append(tuple(forward + backward))
    return Schedule("gpipe", tuple(actions), microbatches, count)


gpipe.virtual = True  # type: ignore[attr-defined]


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
    goes in groups of K micro-batches: a device runs the forwards of a group on its first
    stage, then on its second, and so on, and the backwards of each group in the opposite
    stage order. Device ``d`` warms up with ``2(K-d-1) + (v-1)·G`` forwards (``G`` = the
    first group's size; all forwards if there are fewer), then alternates one forward and one
    backward, then runs the backwards left. With ``v = 1`` the warm-up is ``K-d-1``: 1F1B.

    Any M works. When K does not divide M, the first group takes the ``M mod K`` extra
    micro-batches (a smaller group, last, would leave devices waiting on a chunk that is
    not yet computed, and deadlock); the price is ``(v-1)·(M mod K)`` more warm-up forwards,
    so more memory. With equal stage costs the bubble is ``(K-1) / (v·M + K-1)`` for every
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
    groups, extra = divmod(microbatches, devices)
    sizes = [devices + extra] + [devices] * (groups - 1) if groups else [extra]
    # One device's forward order as (chunk, micro-batch): group by group, chunk by chunk.
    order: list[tuple[int, int]] = []
    first = 0
    for size in sizes:
        order += [(chunk, i) for chunk in range(v) for i in range(first, first + size)]
        first += size
    actions = []
    for d in range(devices):
        forwards = [Action(FORWARD, chunk * devices + d, i) for chunk, i in order]
        backwards = [Action(BACKWARD, (v - 1 - chunk) * devices + d, i) for chunk, i in order]
        # NOTE: with v > 1, twice K-d-1 because the first backward has to come back from
        # the last device, plus (v-1)·G so the first group is in flight on every chunk but
        # the last; fewer and a device waits on a forward while holding a needed backward.
        warmup = devices - d - 1 if v == 1 else 2 * (devices - d - 1) + (v - 1) * sizes[0]
        actions.append(_one_f_one_b_order(forwards, backwards, min(warmup, len(order))))
    return Schedule("interleaved", actions, microbatches, devices * v)


interleaved.virtual = True  # type: ignore[attr-defined]


def zb_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1 (zero bubble, Qi et al. 2024): 1F1B with the weight gradient split off and deferred.

    Each backward is split into B, the input gradient that the previous stage waits for,
    and W, the weight gradient nobody waits for. Forwards and B's keep the 1F1B order, so
    gradients travel back without waiting for weight gradients; device ``k`` runs its W's
    ``k`` backwards late, where it would otherwise sit idle, and the W's left at the end
    fill the cool-down. With F = B = W the bubble is ``(K-1) / (3M + K-1)`` for M >= K, a
    third of 1F1B's; for M < K the step takes ``2(M+K) - 1`` units (the formula would be
    shorter than one micro-batch's own path down, back and through its W). For 3 stages
    and 4 micro-batches, laid out in time::

        0: 0F0 0F1 0F2         0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3
        1:     1F0 1F1     1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3
        2:         2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3

    Memory, counting a micro-batch as held from its F until its W: every device holds at
    most ``min(K, M)``, the peak of 1F1B's first device, so the peak over devices is 1F1B's.
    Later devices hold more than under 1F1B (up to ``k`` W's wait there), and they must:
    held to 1F1B's ``min(K-k, M)``, the last device would have to run F, B and W of one
    micro-batch after another, and the last gradient could not reach device 0 in time.

    Args:
        stages: K, one stage per device.
        microbatches: M.

    Returns:
        The schedule, named "zb-h1", with F, B and W actions.

    Raises:
        ValueError: ``stages`` or ``microbatches`` below 1.
    """
    _check(stages, microbatches)
    actions = []
    for k in range(stages):
        warmup = min(stages - k - 1, microbatches)
        forwards = [Action(FORWARD, k, i) for i in range(microbatches)]
        backwards = [Action(BACKWARD, k, i) for i in range(microbatches)]
        order: list[Action] = []
        weights = 0  # W's run so far; W j follows B j+k
        for action in _one_f_one_b_order(forwards, backwards, warmup):
            order.append(action)
            if action.kind == BACKWARD and action.microbatch >= k:
                order.append(Action(WEIGHT, k, weights))
                weights += 1
        order += [Action(WEIGHT, k, i) for i in range(weights, microbatches)]
        actions.append(order)
    return Schedule("zb-h1", actions, microbatches)


Generator = Callable[..., Schedule]

SCHEDULES: dict[str, Generator] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
}


def make_schedule(
    name: str, stages: int, microbatches: int, *, virtual_stages: int = 1
) -> Schedule:
    """Build the named schedule for ``stages`` devices and ``microbatches`` micro-batches.

    Args:
        name: one of :data:`SCHEDULES` ("gpipe", "1f1b", "interleaved", "zb-h1").
        stages: K, the number of devices.
        microbatches: M.
        virtual_stages: model stages per device; only interleaved schedules take more than 1.

    Raises:
        ValueError: an unknown name, or ``virtual_stages`` the schedule does not support.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    generator = SCHEDULES[name]
    if getattr(generator, "virtual", False):
        return generator(stages, microbatches, virtual_stages=virtual_stages)
    if virtual_stages != 1:
        raise ValueError(
            f"schedule {name!r} runs one stage per device; use schedule='interleaved' for "
            f"virtual_stages={virtual_stages}"
        )
    return generator(stages, microbatches)
