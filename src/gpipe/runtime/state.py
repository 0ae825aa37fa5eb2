"""One step's settings, and what its workers share while it runs."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gpipe.analysis import Event
from gpipe.runtime.context import CallerContext
from gpipe.runtime.split_backward import WeightGradient
from gpipe.schedule import Action

__all__ = ["Loss", "Saved", "StepState"]


@dataclass
class Loss:
    """The loss computed on the last stage: ``fn(output, targets[i]) * weights[i]``."""

    fn: Callable[[Any, Any], torch.Tensor]
    targets: list[Any]
    weights: list[float]


@dataclass
class Saved:
    """What one (stage, micro-batch) keeps between its forward and its backward."""

    inputs: Any
    outputs: Any  # the backward roots (outputs, or the weighted loss); None if checkpointed
    nbytes: int
    weight: WeightGradient | None = None  # set by B when W runs separately


@dataclass
class StepState:
    """The settings of one step and the state its workers share.

    Args:
        microbatches: M, the number of micro-batches in this step.
        devices: K, the number of pipeline devices (one event list each).
        grad: whether the step builds autograd graphs (training) or only runs forward.
        checkpoint: the re-materialization mode.
        seed: the step's random seed (see :mod:`gpipe.randomness`).
        loss: the loss to compute on the last stage (train_step), or None.
        split_backward: run weight gradients as separate W actions (zero-bubble).
        track_memory: count the bytes each device holds for backward.
        microbatch_offset: micro-batches of the whole batch before this step's first (a
            data-parallel replica runs one part of the batch): random streams are keyed by
            a micro-batch's place in the whole batch.
        after: called by a worker with each action it has finished (a data-parallel pipe
            starts a stage's gradient all-reduce after its last backward).
    """

    microbatches: int
    devices: int
    grad: bool
    checkpoint: str
    seed: int
    loss: Loss | None = None
    split_backward: bool = False
    track_memory: bool = True
    microbatch_offset: int = 0
    after: Callable[[Action], None] | None = None
    # The caller's thread-local state (autocast, modes, hooks...) for the run under way, and
    # the autocast of the run that did the forwards: a recomputation runs under the latter,
    # as torch.utils.checkpoint does. Captured by Step.run.
    context: CallerContext | None = None
    forward_context: CallerContext | None = None
    saved: dict[tuple[int, int], Saved] = field(default_factory=dict)
    losses: list[torch.Tensor | None] = field(default_factory=list)
    events: list[list[Event]] = field(default_factory=list)
    failed: bool = False  # set at the first failure: workers stop before their next action
    retain_graph: bool = False  # the backward keeps every micro-batch for another backward
    origin_ns: int = field(default_factory=time.perf_counter_ns)
    # Actions run on a GPU, timed by CUDA events until settle() reads them: (device, index
    # in its events, the GPU's clock, start mark, end mark).
    timed: list[tuple[int, int, Any, Any, Any]] = field(default_factory=list)
    # The CUDA allocator's peak on each GPU since the step began (track_memory only).
    cuda_peaks: dict[torch.device, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.losses = [None] * self.microbatches
        self.events = [[] for _ in range(self.devices)]

    def settle(self) -> None:
        """Give each action run on a GPU the times the GPU ran it (waiting for it to).

        Its start and end are its CUDA events, read on the host's clock by the device's
        :class:`~gpipe.runtime.copies.GpuClock` (from an event recorded as its run began);
        so a GPU that was still busy with earlier work then shows its actions late by as much.
        """
        for device, index, clock, start, end in self.timed:
            event = self.events[device][index]
            self.events[device][index] = dataclasses.replace(
                event,
                start=(clock.ns(start) - self.origin_ns) / 1e9,
                end=(clock.ns(end) - self.origin_ns) / 1e9,
            )
        self.timed.clear()
