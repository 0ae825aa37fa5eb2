"""The memory model: what each device holds as it walks its actions, as the runtime counts it.

One walk serves the simulator's timelines, the planner's prediction and ``balance="memory"``,
and it follows the rule the runtime counts by (see ``gpipe.runtime.saved`` and the guide):

- a forward keeps the stage's activations (``full``: its input and what autograd saves), or
  only its input (``kept``) when the micro-batch is checkpointed;
- a backward holds, while it runs, the recomputed activations of a checkpointed micro-batch
  (``full - kept``), the gradient it receives from the next stage and the one it sends
  back (``gradient`` of the next stage's input and of its own);
- without W actions the backward frees the micro-batch. With them (zero-bubble), B keeps
  what W needs until W frees it: the recomputed activations, and ``deferred`` bytes of
  gradients at the parameter forks (a stage whose input takes no gradient defers its whole
  backward, keeping the output gradient it received instead).
"""

from __future__ import annotations

from collections.abc import Sequence

from gpipe.checkpoint import checkpointed
from gpipe.schedule import BACKWARD, FORWARD, WEIGHT, Schedule

__all__ = ["activation_peaks", "kept_microbatches", "memory_per_action"]

Sizes = Sequence[float]


def memory_per_action(
    schedule: Schedule,
    full: Sizes,
    kept: Sizes,
    checkpoint: str,
    *,
    gradient: Sizes | None = None,
    deferred: Sizes | None = None,
) -> list[list[float]]:
    """Per device, per action in list order, the most bytes held while the action runs.

    Args:
        schedule: the schedule.
        full: per model stage, what one micro-batch keeps without re-materialization.
        kept: per model stage, what a checkpointed micro-batch keeps (its stage input).
        checkpoint: the re-materialization mode.
        gradient: per model stage, the bytes of the gradient of its input, which its B sends
            back and the previous stage's B receives; None for none (gradients not modelled).
        deferred: per model stage, what B keeps for W besides recomputed activations (split
            schedules); None for nothing.

    Returns:
        ``memory[d][j]`` for action ``schedule.actions[d][j]``.
    """
    stages = schedule.stages
    grads = list(gradient) if gradient is not None else [0] * stages
    later = list(deferred) if deferred is not None else [0] * stages
    split = schedule.split_backward
    m = schedule.microbatches
    memory: list[list[float]] = []
    for actions in schedule.actions:
        held: float = 0
        row: list[float] = []
        for action in actions:
            s, i = action.stage, action.microbatch
            again = checkpoint != "never" and checkpointed(checkpoint, i, m)
            if action.kind == FORWARD:
                held += kept[s] if again else full[s]
                row.append(held)
            elif action.kind == BACKWARD:
                recomputed = full[s] - kept[s] if again else 0
                received = grads[s + 1] if s + 1 < stages else 0
                sent = grads[s]
                keeps = later[s] if split else 0
                # NOTE: a stage that sends no input gradient defers its whole backward to W,
                # keeping the gradient it received: already counted in ``received``.
                fresh = keeps if sent else max(0, keeps - received)
                row.append(held + recomputed + received + sent + fresh)
                if split:  # W frees the micro-batch: its input, activations and gradients
                    held += recomputed + keeps
                else:
                    held -= kept[s] if again else full[s]
            else:
                row.append(held)
                if action.kind == WEIGHT:
                    held -= full[s] + later[s]
        memory.append(row)
    return memory


def activation_peaks(
    schedule: Schedule,
    full: Sizes,
    kept: Sizes,
    checkpoint: str,
    *,
    gradient: Sizes | None = None,
    deferred: Sizes | None = None,
) -> list[float]:
    """Per device, the most bytes held at any action: the peak of :func:`memory_per_action`.

    This is what the planner predicts and ``balance="memory"`` weighs; the arguments are
    those of :func:`memory_per_action`.
    """
    walked = memory_per_action(
        schedule, full, kept, checkpoint, gradient=gradient, deferred=deferred
    )
    return [max(row, default=0) for row in walked]


def kept_microbatches(schedule: Schedule, checkpoint: str) -> list[int]:
    """Micro-batches of activations each model stage holds at its peak under ``schedule``.

    The memory walk with one unit per micro-batch and nothing for a checkpointed one's
    input: re-materialization then holds one micro-batch at a time, the one being
    recomputed. A device's peak is shared among the stages it holds.
    """
    stages, per_device = schedule.stages, schedule.virtual_stages
    peaks = activation_peaks(schedule, [1] * stages, [0] * stages, checkpoint)
    return [-(-int(peaks[schedule.placement[s]]) // per_device) for s in range(stages)]
