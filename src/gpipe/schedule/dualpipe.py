"""DualPipeV (DeepSeek-V3's DualPipe cut in half): forwards and backwards issued in pairs.

DualPipe (DeepSeek-AI 2024, arXiv:2412.19437) feeds micro-batches into both ends of the
pipeline at once, so that every device has a forward of one stream and a backward of the
other to run together, and their computation and communication overlap. Cut in half (Sea
AI Lab's "cut-in-half"; DeepSeek's ``DualPipeV``, torch's ``ScheduleDualPipeV``), the two
streams become the two arms of a V: 2K stages on K devices, the same pairs on half the
devices, and each stage held once rather than twice.
"""

from __future__ import annotations

from collections import deque

from gpipe.schedule.action import BACKWARD, FORWARD, WEIGHT, Action
from gpipe.schedule.generate import _check
from gpipe.schedule.placement import v_shape
from gpipe.schedule.schedule import Schedule

__all__ = ["dualpipev"]


def dualpipev(stages: int, microbatches: int) -> Schedule:
    """DualPipeV: 2K stages in a V, a forward and a full backward fused in the steady phase.

    Device ``d`` holds stage ``d`` on the way down and ``2K-1-d`` on the way back up
    (:func:`~gpipe.schedule.v_shape`). It warms up with forwards, ``2(K-1-d)`` on its
    first stage, then ``d+1`` on each stage in turn, then ``K-1-d`` on its second stage,
    each after a full backward there. In the steady phase it issues a forward of one stage
    together with the full backward (input and weight gradient) of the other:
    ``Action.fuse(F, B, W)``, written ``0F3+3B1+3W1``, two micro-batches' work that the
    hardware may overlap. The last device runs its first pair one after the other: the
    forward's input is there well before the first gradient, so it runs the forward while
    it waits. A full backward outside a pair is a B followed at once by its W. In the
    cool-down the last K backwards of each device are input gradients only; their W's,
    oldest first, run where the device would wait for the next gradient, and the ones
    left end the step. For 2 devices and 4 micro-batches (4 stages), as
    :func:`~gpipe.schedule.format_grid` draws it, one row per step (a fused action takes
    three units of time, so a unit-time picture would be three times as wide)::

        step   0             1
           0   0F0
           1   0F1           1F0
           2   0F2           2F0
           3   3F0           1F1
           4   3B0           2F1
           5   3W0           1F2
           6   3F1           2B0
           7   0F3+3B1+3W1   2W0
           8                 2F2+1B0+1W0
           9   3F2+0B0+0W0   1F3+2B1+2W1
          10   3B2           2F3+1B1+1W1
          11   3W2           2B2
          12   3F3+0B1+0W1   2W2
          13   3B3           1B2
          14   3W3           1W2
          15   0B2           2B3
          16   0W2           1B3
          17   0B3           2W3
          18   0W3           1W3

    Published (the DualPipe README, with PP = 2K stages): a bubble of
    ``(K-1)(F&B + B - 3W)``, B the full backward, F&B a fused pair, and ``2K+1``
    stage-micro-batches of activations per device (``PP+1``). The simulator, with a
    micro-batch held from its F to its W, finds exactly ``2K+1`` on every device for
    every M >= 2K and any costs. Its idle time per step when steps run back to back (the
    most any device idles between its first and its last action) is the published
    bubble when pairs cost their parts' sum (``Costs(fused=1.0)``), F = B (input
    gradient) and W is 0 or B: ``2(K-1)`` with F = B = W, as DualPipe's figure draws it.
    With F <= B and a pair costing at least a full backward it is at most that.

    Simulated with F = B = W = 1 per stage on K = 4 devices (one step alone; peak in
    stage-micro-batches per device; torch's orders for both are ours):

    ==================  ===  ======  ======  ====
    schedule             M   time    bubble  peak
    ==================  ===  ======  ======  ====
    dualpipev, fused 1   8   54      11.1 %  9
    dualpipev, 0.9       8   51      9.6 %   9
    zb-v                 8   51      5.9 %   8
    dualpipev, fused 1  16   102     5.9 %   9
    dualpipev, 0.9      16   94.2    5.2 %   9
    zb-v                16   99      3.0 %   8
    ==================  ===  ======  ======  ====

    (``fused``: :attr:`Costs.fused <gpipe.analysis.Costs>`, what a pair takes as a
    fraction of its parts one after the other; the simulator runs a pair as one action,
    so neither part's result leaves the device before both are done.) With F = B = W,
    DualPipeV beats ZB-V only once a pair costs at most 0.89 (K = 8, M = 16) to 0.97
    (K = 2, M = 8) of its parts: the fewer micro-batches, the more overlap it needs, and
    it holds one more stage-micro-batch. Steps back to back, torch's ZB-V order idles
    nowhere, and the pair must cost at most 0.79 to 0.94. At F : B : W = 1 : 2 : 1
    (K = 4, M = 8) unfused DualPipeV takes 74 against ZB-V's 70, and beats it once a pair
    costs at most 0.88.

    Args:
        stages: K, the number of devices; the model is cut into 2K stages.
        microbatches: M, at least 2K.

    Returns:
        The schedule, named "dualpipev", with F, B and W actions, fused pairs and the V
        placement.

    Raises:
        ValueError: ``stages`` below 1, or fewer than 2K micro-batches (device 0 warms up
            with 2K-1 forwards of its first stage, then needs one more for a pair).
    """
    _check(stages, microbatches)
    if microbatches < 2 * stages:
        raise ValueError(
            f"dualpipev needs at least 2K = {2 * stages} micro-batches on {stages} devices "
            f"(2 stages each), got {microbatches}: pass chunks >= {2 * stages} (and batches "
            f"of at least {2 * stages} samples), or use schedule='zb-v', which runs any count"
        )
    actions = [_device(d, stages, microbatches) for d in range(stages)]
    return Schedule("dualpipev", actions, microbatches, 2 * stages, v_shape(stages))


dualpipev.virtual_stages = 2  # type: ignore[attr-defined]


def _device(d: int, devices: int, microbatches: int) -> list[Action]:
    """Device ``d``'s list: warm-up, first backwards, steady pairs, drain, cool-down."""
    down, up = d, 2 * devices - 1 - d  # its stage on the way down, and on the way back up
    rest = devices - 1 - d  # hops to the V's bottom, where the forward turns back up
    forwards = {down: 0, up: 0}  # next micro-batch of each stage's F
    backwards = {down: 0, up: 0}  # and of its B
    deferred: deque[Action] = deque()  # W's of input-only backwards, oldest first
    order: list[Action] = []

    def forward(stage: int) -> Action:
        forwards[stage] += 1
        return Action(FORWARD, stage, forwards[stage] - 1)

    def backward(stage: int) -> tuple[Action, Action]:
        backwards[stage] += 1
        i = backwards[stage] - 1
        return Action(BACKWARD, stage, i), Action(WEIGHT, stage, i)

    def full(stage: int) -> list[Action]:
        return list(backward(stage))

    def pair(forward_stage: int, backward_stage: int) -> Action:
        return Action.fuse(forward(forward_stage), *backward(backward_stage))

    # Warm-up: forwards while the first micro-batch goes down the V and back up to its
    # loss on device 0, and its gradient comes back to this device's second stage.
    order += [forward(down) for _ in range(2 * rest)]
    for _ in range(d + 1):
        order += [forward(down), forward(up)]
    for _ in range(rest):
        order += [*full(up), forward(up)]
    # Steady phase: a forward of one stage with a full backward of the other.
    for i in range(microbatches - 2 * devices + d + 1):
        if i == 0 and rest == 0:
            # NOTE: unfused, the forward runs while the device waits for its first gradient.
            order += [forward(down), *full(up)]
        else:
            order.append(pair(down, up))
        order.append(pair(up, down))
    for _ in range(rest):
        order += [*full(up), pair(up, down)]
    # Cool-down: the backwards left, the two stages in turn, then the first stage's. The
    # first d+1 are full; the last K are input gradients only and their W's wait, oldest
    # first: one runs before each of the last K-1-d backwards, the other d+1 end the step.
    left = [up, down] * (d + 1) + [down] * rest
    for n, stage in enumerate(left):
        if n < d + 1:
            order += full(stage)
            continue
        if n >= 2 * (d + 1):
            order.append(deferred.popleft())
        b, w = backward(stage)
        order.append(b)
        deferred.append(w)
    return order + list(deferred)
