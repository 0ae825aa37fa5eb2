"""The cost model: what each action costs per stage, and reading it off a measured timeline."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from gpipe.analysis.timeline import Timeline
from gpipe.schedule import BACKWARD, FORWARD, WEIGHT

__all__ = ["Costs", "PerStage", "Skip", "costs_from_timeline", "skips_from_timeline"]

PerStage = float | Sequence[float]
Skip = tuple[int, int, float]  # (sending stage, reading stage, bytes per micro-batch)


@dataclass(frozen=True)
class Costs:
    """What each action costs, per model stage, in any one unit of time (or bytes).

    Args:
        forward: time of one micro-batch's forward on a stage; one number for every
            stage, or a list with one number per model stage.
        backward: time of its backward (the input gradient, in a schedule with W actions).
        weight: time of its weight gradient. A schedule without W actions runs it inside
            B, so there B takes ``backward + weight``.
        transfer: time to move one activation or gradient between two different devices;
            a hand-off between stages on the same device is free.
        latency: time per message between devices, added to ``transfer``.
        bandwidth: bytes per unit of time between devices (inf: free). A message between
            stages ``s`` and ``s+1`` on different devices takes ``transfer + latency +
            gradient_bytes[s+1] / bandwidth``: stage ``s+1``'s input going forward, or its
            gradient, of the same size, coming back.
        activation_bytes: what one micro-batch's forward on a stage keeps for its backward.
        gradient_bytes: the gradient of a stage's input, which its backward sends back and
            the previous stage's backward receives; both hold it while they run.
        deferred_bytes: what a backward keeps for its W (schedules with W actions): the
            gradients at the parameter forks. See :mod:`gpipe.analysis.memory`.
        fused: what a fused action (a forward and a backward issued together, DualPipeV)
            takes, as a fraction of its parts run one after another: 1.0 when they do not
            overlap at all (one device's CPU), less where the hardware overlaps them.
    """

    forward: PerStage = 1.0
    backward: PerStage = 1.0
    weight: PerStage = 0.0
    transfer: float = 0.0
    activation_bytes: PerStage = 1
    gradient_bytes: PerStage = 0
    deferred_bytes: PerStage = 0
    latency: float = 0.0
    bandwidth: float = math.inf
    fused: float = 1.0

    @classmethod
    def from_timeline(cls, timeline: Timeline, stages: int | None = None) -> Costs:
        """The median F, B and W durations per stage of a measured timeline.

        See :func:`costs_from_timeline`.
        """
        return costs_from_timeline(timeline, stages)


def costs_from_timeline(timeline: Timeline, stages: int | None = None) -> Costs:
    """The median F, B and W duration of each model stage in a (measured) timeline.

    Feeding the result to :func:`simulate` predicts the timeline from its own parts, so
    prediction and measurement can be compared. Transfer time is left at 0.

    A fused event (a forward and a backward issued together) has no time per part, so it
    is left out of the medians; ``fused`` is the median, over fused events, of its
    duration over what its parts take one after another (its forward's stage's median F
    plus its backward's stage's median B, and W if it carries one), clamped to [0.25, 2].
    Events whose parts' stages have no plain events of those kinds are left out of it.

    Args:
        timeline: any timeline; the stage of each event is its action's stage.
        stages: the number of model stages; by default one more than the largest seen.

    Returns:
        Per-stage costs; a stage or kind with no events gets 0. ``weight`` is the median W
        time if the timeline has W events, else 0 (B then already includes it). ``fused``
        is 1.0 without fused events to measure it from.
    """
    seen = [e for device in timeline.events for e in device]
    most = max((u.stage for e in seen for u in e.action.units), default=-1)
    count = stages if stages is not None else 1 + most
    durations: dict[str, list[list[float]]] = {
        kind: [[] for _ in range(count)] for kind in (FORWARD, BACKWARD, WEIGHT)
    }
    for event in seen:
        if not event.action.parts:
            durations[event.action.kind][event.action.stage].append(event.duration)

    median = {
        kind: [statistics.median(d) if d else 0.0 for d in per_stage]
        for kind, per_stage in durations.items()
    }
    ratios = []
    for event in seen:
        parts = event.action.parts
        if parts and all(durations[u.kind][u.stage] for u in parts):
            alone = sum(median[u.kind][u.stage] for u in parts)
            if alone > 0:
                ratios.append(event.duration / alone)
    fused = min(max(statistics.median(ratios), 0.25), 2.0) if ratios else 1.0
    return Costs(
        forward=median[FORWARD],
        backward=median[BACKWARD],
        weight=median[WEIGHT],
        fused=fused,
    )


def skips_from_timeline(timeline: Timeline, pairs: Sequence[tuple[int, int]]) -> list[Skip]:
    """The skips ``pairs`` (sending stage, reading stage) with the median bytes a measured
    timeline's transfers carried between them (0 where none crossed devices), for
    :func:`simulate`."""
    skips: list[Skip] = []
    for sender, reader in pairs:
        sizes = [
            t.nbytes
            for t in timeline.transfers
            if t.kind == FORWARD and t.sender == sender and t.stage == reader
        ]
        skips.append((sender, reader, statistics.median(sizes) if sizes else 0.0))
    return skips
