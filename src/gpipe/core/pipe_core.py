"""PipeCore: the step both pipes run, written once; GPipe and DistributedGPipe stand on it.

It holds the settings every step reads, binds a call's inputs and cuts them into
micro-batches, makes a step's state, binds the schedule's actions to the stages this
process runs and runs them, and predicts the step from its measured costs. A pipe adds
only where its stages live (one process or one per rank) and how messages travel.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from gpipe.analysis import Timeline
from gpipe.analysis.prediction import predict
from gpipe.arguments import check_balance_type, check_flag, check_model, check_virtual
from gpipe.batchnorm import (
    DeferredBatchNorm,
    committing,
    convert_deferred_batch_norm,
    refuse_reused_batch_norm,
)
from gpipe.core.step_settings import StepSettings
from gpipe.dataflow import Stages, named_batch_dims
from gpipe.microbatch import Batch, BatchDims, check_batch_dims, split_batch
from gpipe.randomness import draw_step_seed
from gpipe.runtime.caller import feed
from gpipe.runtime.stage_set import StageSet
from gpipe.runtime.state import Loss, StepState
from gpipe.runtime.step import Step
from gpipe.schedule import Action, Schedule, check_virtual_stages

__all__ = ["PipeCore"]


class PipeCore(StepSettings, nn.Module):
    """What a pipe's steps share: settings, input binding, micro-batches, running, prediction.

    A subclass sets, before its first step: ``_stages`` (the stage modules and their
    placement), ``_transport`` (what carries messages), ``_flow`` (the dataflow of a
    :class:`~gpipe.Stages` model, None for a chain) and ``_deferred`` (its deferred batch
    norms, see :meth:`_convert_batch_norm`).
    """

    _stages: StageSet
    _transport: Any
    _flow: Stages | None
    _deferred: list[DeferredBatchNorm]
    _last: tuple[Step, Schedule] | None
    _told_fewer: bool
    input_batch_dims: BatchDims
    output_batch_dims: BatchDims
    track_memory: bool

    def _configure(
        self,
        module: nn.Sequential | Stages,
        balance: Sequence[int] | str | None,
        who: str,
        *,
        chunks: int,
        checkpoint: str,
        schedule: str | Schedule,
        virtual_stages: int,
        track_memory: bool,
        deferred_batch_norm: bool,
        input_batch_dims: BatchDims,
        output_batch_dims: BatchDims,
    ) -> None:
        """Check and keep the arguments every pipe takes (``who`` names the pipe in errors).

        Raises:
            TypeError, ValueError: an argument that no pipe could run with.
        """
        check_virtual(virtual_stages)
        check_virtual_stages(schedule, virtual_stages)
        check_balance_type(balance)
        if not isinstance(module, Stages):
            check_model(module, who)
        check_flag("track_memory", track_memory)
        check_flag("deferred_batch_norm", deferred_batch_norm)
        self.checkpoint = checkpoint
        self.chunks = chunks
        self.input_batch_dims = check_batch_dims(input_batch_dims, "input_batch_dims")
        self.output_batch_dims = check_batch_dims(output_batch_dims, "output_batch_dims")
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self.track_memory = track_memory
        self._last = None
        self._told_fewer = False  # whether a batch smaller than chunks was said

    def _convert_batch_norm(self, module: nn.Module, deferred: bool) -> None:
        """With ``deferred``, make the model's BatchNorms deferred (refusing a reused one)."""
        if deferred:
            refuse_reused_batch_norm(module)
            convert_deferred_batch_norm(module)

    def _keep_deferred(self, modules: nn.Module) -> None:
        """Remember the deferred BatchNorms this process runs, to fold their statistics in
        after each step that succeeds."""
        self._deferred = [m for m in modules.modules() if isinstance(m, DeferredBatchNorm)]

    # -- a call's inputs ---------------------------------------------------------------

    def _input_dims(self) -> BatchDims:
        """Where the inputs are batched: by name for ``Stages``, as given for a chain."""
        if self._flow is None:
            return self.input_batch_dims
        return named_batch_dims(self.input_batch_dims, self._flow.dataflow.inputs)

    def _split(self, input: Any, *, replicas: int = 1, replica: int = 0) -> Batch:
        """``input`` (of this replica) cut into ``chunks`` micro-batches; a batch with fewer
        samples than ``chunks`` runs one micro-batch a sample, said once per pipe."""
        batch = split_batch(
            input, self.chunks, self._input_dims(), replicas=replicas, replica=replica
        )
        if batch.microbatches < self.chunks and not self._told_fewer:
            self._told_fewer = True
            warnings.warn(
                f"chunks={self.chunks} but the batch has {batch.total} samples: this step "
                f"runs {batch.microbatches} micro-batches of one sample (said once per "
                "pipe); give a larger batch or fewer chunks",
                UserWarning,
                stacklevel=3,
            )
        return batch

    def _skip_pairs(self) -> list[tuple[int, int]]:
        """(sending stage, reading stage) of each message between stages that are not
        neighbours (the pipe's inputs come from the caller, and cost nothing)."""
        if self._flow is None:
            return []
        return [(s, r) for s, r, _ in self._flow.dataflow.skips() if s >= 0]

    # -- running a step ----------------------------------------------------------------

    def _seed(self) -> int:
        """The step's random seed: fresh in training, fixed in eval (no dropout draws)."""
        return draw_step_seed() if self.training else 0

    def _new_step(
        self,
        schedule: Schedule,
        microbatches: int,
        devices: int,
        *,
        grad: bool,
        seed: int,
        loss: Loss | None = None,
        microbatch_offset: int = 0,
        after: Callable[[Action], None] | None = None,
    ) -> Step:
        """A step of ``schedule`` over ``microbatches``, kept as the pipe's last step."""
        state = StepState(
            microbatches,
            devices,
            grad=grad,
            checkpoint=self.checkpoint if (grad and self.training) else "never",
            seed=seed,
            loss=loss,
            split_backward=schedule.split_backward,
            track_memory=self.track_memory,
            microbatch_offset=microbatch_offset,
            after=after,
        )
        step = Step(self._stages, self._transport, state)
        self._last = (step, schedule)
        return step

    def _run(
        self,
        step: Step,
        schedule: Schedule,
        inputs: list[Any] | None,
        *,
        position: int | None = None,
        finish: Callable[[], None] | None = None,
    ) -> None:
        """Feed ``inputs`` to the stages that read them and run the schedule's actions.

        ``position``: run only that pipeline device's actions (one rank of a distributed
        pipe), every device's if None. ``finish`` runs after the actions, before deferred
        batch norms fold their statistics in, which they do only if the step succeeded.
        """
        if inputs is not None:
            feed(step, inputs, None if position is None else self._holds)
        actions: Sequence[Sequence[Action]] = schedule.actions
        if position is not None:
            actions = [actions[d] if d == position else () for d in range(len(actions))]
        with committing(self._deferred):
            step.run(actions)
            if finish is not None:
                finish()

    def _holds(self, stage: int) -> bool:
        """Whether this process holds ``stage`` (every stage, in one process)."""
        return True

    # -- observing ---------------------------------------------------------------------

    def _last_step(self) -> tuple[Step, Schedule]:
        if self._last is None:
            raise RuntimeError(
                "no step has run yet: call pipe(x), pipe.train_step(...) or eval_step first"
            )
        return self._last

    def _predicted(
        self,
        measured: Timeline,
        *,
        transfer: float = 0.0,
        link: tuple[float, float] | None = None,
    ) -> Timeline:
        """The simulator's timeline of the last step, fed its measured costs."""
        return predict(
            measured,
            self._last_step()[1],
            skips=self._skip_pairs(),
            transfer=transfer,
            link=link,
        )
