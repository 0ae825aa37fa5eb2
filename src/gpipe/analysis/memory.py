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
from itertools import chain, pairwise

import numpy as np

from gpipe.analysis.columns import ActionColumns
from gpipe.recompute import checkpointed
from gpipe.schedule import BACKWARD, FORWARD, KINDS, Schedule

__all__ = ["activation_peaks", "kept_microbatches", "memory_columns", "memory_per_action"]

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

    Raises:
        IndexError: an action on a stage the schedule does not have.
    """
    columns = ActionColumns.of(schedule)
    if len(columns.stage) and int(columns.stage.max()) >= schedule.stages:
        raise IndexError("an action on a stage the schedule does not have")
    most = memory_columns(
        columns, schedule, full, kept, checkpoint, gradient=gradient, deferred=deferred
    )[0]
    memory = columns.listed(most, "max").tolist()
    offsets = columns.listed_offsets(schedule)
    return [memory[a:b] for a, b in pairwise(offsets)]


def memory_columns(
    columns: ActionColumns,
    schedule: Schedule,
    full: Sizes,
    kept: Sizes,
    checkpoint: str,
    *,
    gradient: Sizes | None = None,
    deferred: Sizes | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`memory_per_action` of ``schedule``'s actions given as columns, in one array,
    and beside it what each action leaves held once it has ended (``Event.left``).

    The walk's sums run in its order (a cumulative sum per device), so the figures are
    those of walking the actions one by one, to the last bit. Whole numbers in, whole
    numbers out (int64); otherwise float64.
    """
    stages, m = schedule.stages, schedule.microbatches
    grads = list(gradient) if gradient is not None else [0] * stages
    later = list(deferred) if deferred is not None else [0] * stages
    split = columns.split_backward
    exact = all(type(v) is int for v in chain(full, kept, grads, later))
    dtype = np.int64 if exact else np.float64
    full_, kept_ = np.array(full, dtype), np.array(kept, dtype)
    sent = np.array(grads, dtype)
    received = np.append(sent[1:], np.zeros(1, dtype))  # the next stage's input gradient
    keeps = np.array(later, dtype) if split else np.zeros(stages, dtype)
    # NOTE: a stage that sends no input gradient defers its whole backward to W, keeping
    # the gradient it received: already counted in ``received``.
    fresh = np.where(sent != 0, keeps, np.maximum(0, keeps - received))
    again = np.array(
        [checkpoint != "never" and checkpointed(checkpoint, i, m) for i in range(m)], bool
    )
    s, i = columns.stage, columns.microbatch
    forward, backward = columns.kind == KINDS.index(FORWARD), columns.kind == KINDS.index(BACKWARD)
    allocated, recomputed = full_[s], np.zeros(1, dtype)
    if again.any():
        again_i = again[i]
        allocated = np.where(again_i, kept_[s], allocated)
        recomputed = np.where(again_i, full_[s] - kept_[s], 0)
    # What each action changes: F allocates; B frees (keeps what W needs, when split); W
    # frees the micro-batch, its input, activations and gradients.
    if split:
        freed = np.where(backward, recomputed + keeps[s], -(full_[s] + keeps[s]))
    else:
        freed = np.where(backward, -allocated, -(full_[s] + keeps[s]))
    delta = np.where(forward, allocated, freed)
    held = np.empty_like(delta)  # after each action
    for a, b in zip(columns.offsets, columns.offsets[1:]):
        np.cumsum(delta[a:b], out=held[a:b])
    before = np.empty_like(held)
    before[1:] = held[:-1]
    before[[a for a, b in zip(columns.offsets, columns.offsets[1:]) if b > a]] = 0  # starts empty
    during = before + recomputed + received[s] + sent[s] + fresh[s]
    return np.where(forward, held, np.where(backward, during, before)), held


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
