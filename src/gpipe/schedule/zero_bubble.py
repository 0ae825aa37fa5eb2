"""Zero-bubble schedules (Qi et al. 2024): the weight gradient W split off the backward B.

B, the input gradient, is what the previous stage waits for; W, the weight gradient, is
needed by nobody until the optimizer step, so it can fill the time a device would idle.

* ZB-H1 keeps 1F1B's order and memory and defers W's into 1F1B's idle time.
* ZB-H2 warms up with more forwards (more memory) so no device ever idles mid-step.
* ZB-V cuts the model into 2K stages laid out in a V, so the last stage sits on the first
  device and the backward starts where the forward began: the shortest step there can
  be, at 1F1B's memory.

Each docstring draws the generator's output with F = B = W = 1, one column per unit.
"""

from __future__ import annotations

from gpipe.schedule.action import BACKWARD, FORWARD, WEIGHT, Action
from gpipe.schedule.generate import _check, _one_f_one_b_order
from gpipe.schedule.greedy import greedy
from gpipe.schedule.placement import round_robin, v_shape
from gpipe.schedule.schedule import Schedule

__all__ = ["zb_h1", "zb_h2", "zb_v"]


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


def zb_h2(stages: int, microbatches: int) -> Schedule:
    """ZB-H2 (Qi et al. 2024): more forwards up front buy a step in which no device idles.

    Every device, whenever it is free, starts a B if one is ready, else an F while it holds
    fewer than 2K-1 micro-batches, else a W: device ``k`` warms up with up to ``2(K-k)-1``
    forwards, so the first gradient arrives before it runs out of work, and the W's left at
    the end run back to back. For 3 stages and 5 micro-batches, laid out in time::

        0: 0F0 0F1 0F2 0F3 0F4 0B0 0W0 0B1 0W1 0B2 0W2 0B3 0W3 0B4 0W4
        1:     1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1W0 1B3 1W1 1B4 1W2 1W3 1W4
        2:         2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2F4 2B4 2W0 2W1 2W2 2W3 2W4

    No device idles between its first and its last action: each is busy ``M(F+B+W)`` from
    its start, a parallelogram. That is the paper's zero bubble, ``(K-1)(F+B-2W)`` = 0 with
    F = B = W: when steps run back to back, device 0 starts the next step while the last
    device finishes this one. One step alone still takes ``3M + K-1`` units, like ZB-H1,
    since the last device cannot start before the first forward reaches it.

    Memory, counting a micro-batch from its F until its W: every device holds at most
    ``min(2K-1, M)`` (the paper's ``(2p-1)·M_B``), against 1F1B's K.

    Args:
        stages: K, one stage per device.
        microbatches: M.

    Returns:
        The schedule, named "zb-h2", with F, B and W actions.

    Raises:
        ValueError: ``stages`` or ``microbatches`` below 1.
    """
    _check(stages, microbatches)
    built = greedy("zb-h2", round_robin(stages, stages), microbatches, limit=2 * stages - 1)
    assert built is not None  # one stage per device and room for a micro-batch: never stuck
    return built


def zb_v(stages: int, microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2024): 2K stages in a V, zero bubble at 1F1B's memory.

    Device ``d`` holds stages ``d`` and ``2K-1-d`` (:func:`~gpipe.schedule.v_shape`), so a
    micro-batch goes down the devices and back up, and its loss and first backward are on
    device 0, where its forward began. With at least 2K-1 micro-batches it runs the
    paper's ZB-V order (:func:`_zb_v_order`, the one torch's ``ScheduleZBVZeroBubble``
    runs). With fewer, that order leaves gaps (K = 4, M = 5: 34 units against 33), and a
    greedy order is shorter: every device, whenever it is free,
    starts a B if one is ready, else an F while it holds fewer than 2K stage-micro-batches,
    else a W, with the F's of one stage at most K micro-batches ahead of the B's of its
    other stage. For 3 devices and 3 micro-batches (6 stages), laid out in time::

        0: 0F0 0F1 0F2         5F0 5B0 5F1 5B1 5F2 5B2 0B0 5W0 0B1 5W1 0B2 5W2 0W0 0W1 0W2
        1:     1F0 1F1 1F2 4F0     4F1 4B0 4F2 4B1 1B0 4B2 1B1 4W0 1B2 4W1 1W0 4W2 1W1 1W2
        2:         2F0 3F0 2F1 3F1 2F2 3F2 3B0 2B0 3B1 2B1 3B2 2B2 3W0 2W0 3W1 2W1 3W2 2W2

    Each action is on half a device's share of the model. With F = B = W and M >= K, one
    step takes ``6M + K-1`` of these units, the least possible (the last device waits
    ``K-1`` for its first input, then works ``6M``): a bubble of ``(K-1) / (6M + K-1)``,
    half of ZB-H1's. Memory: at most ``2K`` stage-micro-batches per device, on every
    device once M >= K; each is half of a 1F1B stage, so that is 1F1B's K micro-batches
    (the paper's ``p·M_B``). With M >= 2K-1 and steps back to back, no device idles.

    Args:
        stages: K, the number of devices; the model is cut into 2K stages.
        microbatches: M.

    Returns:
        The schedule, named "zb-v", with F, B and W actions and the V placement.

    Raises:
        ValueError: ``stages`` or ``microbatches`` below 1.
    """
    _check(stages, microbatches)
    if microbatches >= 2 * stages - 1:
        return _zb_v_order(stages, microbatches)
    built = greedy("zb-v", v_shape(stages), microbatches, limit=2 * stages, lead=stages)
    assert built is not None  # room for both stages of a micro-batch: never stuck
    return built


def _zb_v_order(stages: int, microbatches: int) -> Schedule:
    """The paper's ZB-V order, phase by phase, on each device ``d`` of K.

    With ``a`` = stage ``d`` (the way down) and ``b`` = stage ``2K-1-d`` (the way up):

    1. ``2(K-d)-1`` forwards of ``a``, then ``d`` pairs of an ``b`` forward and an ``a``
       forward: the way down fills first, the way up as its inputs come back;
    2. ``K-d`` rounds of ``b``'s forward, B and W: the first backwards, started as soon as
       each loss is known;
    3. the steady state: an ``a`` forward (while any is left), ``a``'s B and W, then
       ``b``'s forward, B and W, until every forward ran;
    4. ``d`` pairs of B's of ``a`` and ``b``, then ``K-d`` rounds of ``a``'s B with its
       oldest W due, then the W's left, ``b``'s first.

    The order is written for at least ``2K-1`` micro-batches, the steady state's; with
    fewer (as torch runs it), the actions of micro-batches that do not exist are left out.
    """
    k, m = stages, microbatches
    padded = max(2 * k - 1, m)
    rows = [_zb_v_device(k, d, padded) for d in range(k)]
    rows = [[action for action in row if action.microbatch < m] for row in rows]
    return Schedule("zb-v", rows, m, 2 * k, v_shape(k))


def _zb_v_device(k: int, d: int, padded: int) -> list[Action]:
    """Device ``d``'s list of :func:`_zb_v_order` for ``padded`` micro-batches."""
    down, up = d, 2 * k - 1 - d
    made = {(down, FORWARD): 0, (down, BACKWARD): 0, (up, FORWARD): 0, (up, BACKWARD): 0}
    row: list[Action] = []

    def run(stage: int, kind: str, *, with_weight: bool = False) -> None:
        i = made[stage, kind]
        made[stage, kind] = i + 1
        row.append(Action(kind, stage, i))
        if with_weight:
            row.append(Action(WEIGHT, stage, i))

    for _ in range(2 * (k - d) - 1):
        run(down, FORWARD)
    for _ in range(d):
        run(up, FORWARD)
        run(down, FORWARD)
    for _ in range(k - d):
        run(up, FORWARD)
        run(up, BACKWARD, with_weight=True)
    while made[down, FORWARD] < padded or made[up, FORWARD] < made[down, FORWARD]:
        if made[down, FORWARD] < padded:
            run(down, FORWARD)
        run(down, BACKWARD, with_weight=True)
        run(up, FORWARD)
        run(up, BACKWARD, with_weight=True)
    weights = {down: made[down, BACKWARD], up: made[up, BACKWARD]}  # the next W due
    for _ in range(d):
        run(down, BACKWARD)
        run(up, BACKWARD)
    for _ in range(k - d):
        run(down, BACKWARD)
        row.append(Action(WEIGHT, down, weights[down]))
        weights[down] += 1
    for stage in (up, down):
        row += [Action(WEIGHT, stage, i) for i in range(weights[stage], made[stage, BACKWARD])]
    return row


zb_v.virtual_stages = 2  # type: ignore[attr-defined]
