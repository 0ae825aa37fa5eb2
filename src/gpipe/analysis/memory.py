"""The memory model: what each device holds for backward as it walks its actions."""

from __future__ import annotations

from gpipe.checkpoint import checkpointed
from gpipe.schedule import BACKWARD, FORWARD, WEIGHT, Schedule

__all__ = ["activation_peaks", "kept_microbatches"]


def activation_peaks(
    schedule: Schedule, full: list[int], kept: list[int], checkpoint: str
) -> list[int]:
    """Per device, the most activation bytes held, walking its actions as the runtime does.

    Finer than :func:`simulate`'s memory, which knows no re-materialization: this is what
    the planner predicts and ``balance="memory"`` weighs.

    A forward keeps the stage's activations (``full``), or only its input (``kept``) when the
    micro-batch is checkpointed; the backward of a checkpointed micro-batch holds its full
    activations again while it recomputes; B frees, or W in schedules that split them.

    Args:
        schedule: the schedule.
        full: per model stage, what one micro-batch keeps without re-materialization.
        kept: per model stage, what a checkpointed micro-batch keeps (its stage input).
        checkpoint: the re-materialization mode.
    """
    frees = WEIGHT if schedule.split_backward else BACKWARD
    peaks = []
    for actions in schedule.actions:
        held = peak = 0
        for action in actions:
            s, i = action.stage, action.microbatch
            again = checkpointed(checkpoint, i, schedule.microbatches)
            size = kept[s] if again else full[s]
            if action.kind == FORWARD:
                held += size
                peak = max(peak, held)
            elif action.kind == BACKWARD and again:
                peak = max(peak, held + full[s] - kept[s])
            if action.kind == frees:
                held -= size
        peaks.append(peak)
    return peaks


def kept_microbatches(schedule: Schedule, checkpoint: str) -> list[int]:
    """Micro-batches of activations each model stage holds at its peak under ``schedule``.

    The memory walk with one unit per micro-batch and nothing for a checkpointed one's
    input: re-materialization then holds one micro-batch at a time, the one being
    recomputed. A device's peak is shared among the stages it holds.
    """
    stages, per_device = schedule.stages, schedule.virtual_stages
    peaks = activation_peaks(schedule, [1] * stages, [0] * stages, checkpoint)
    return [-(-peaks[schedule.placement[s]] // per_device) for s in range(stages)]
