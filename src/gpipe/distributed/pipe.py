"""DistributedGPipe: the SPMD front end, one pipeline device per process, replicas optional.

Every rank builds ``DistributedGPipe(model, ...)`` from the same arguments. Each keeps only
its own stages (materializing them if the model was built on the meta device), runs only its
own action list with the same step core as the local pipe, and talks to the other ranks of
its pipeline through the point-to-point transport. The first stage's rank reads the inputs,
the last stage's rank computes the loss, and the loss comes back on every rank. With
``dp_size`` > 1 the job holds that many replicas of the pipeline (see
:mod:`gpipe.distributed.mesh` for the rank order), each on its part of the batch.

Where each part lives: building a rank's stages in :mod:`~gpipe.distributed.construction`,
failure wiring in :mod:`~gpipe.distributed.guard`, the step header in
:mod:`~gpipe.distributed.header`, saving in :mod:`~gpipe.distributed.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpipe.analysis import Timeline
from gpipe.arguments import check_flag, refuse_keywords
from gpipe.core.pipe_core import PipeCore
from gpipe.core.targets import LossFn, check_train_arguments, weighted_loss
from gpipe.dataflow import Stages
from gpipe.distributed.clipping import clip_grad_norm_
from gpipe.distributed.construction import (
    barrier,
    build_stages,
    check_alike,
    connect,
    data_parallel_for,
    first_reader,
    job_layout,
    model_balance,
    planned,
)
from gpipe.distributed.data_parallel import check_data_parallel, check_untied
from gpipe.distributed.failure import PipelineFailure
from gpipe.distributed.generation import DistributedGeneration
from gpipe.distributed.guard import PipeGuard
from gpipe.distributed.header import Header, LossBroadcast, agree
from gpipe.distributed.mesh import device as default_device
from gpipe.distributed.naming import user_view
from gpipe.distributed.rank_timelines import gather_timeline
from gpipe.loss import weighted_total
from gpipe.microbatch import Batch, BatchDims, gather, microbatch_sizes
from gpipe.runtime.caller import backward_into_input, collect_outputs
from gpipe.runtime.routes import Routes
from gpipe.runtime.step import Step
from gpipe.schedule import FORWARD, Action, Schedule

__all__ = ["DistributedGPipe"]


class DistributedGPipe(PipeCore, DistributedGeneration):
    """Run an ``nn.Sequential`` (or :class:`~gpipe.Stages`) as a pipeline with one device per
    process (torchrun).

    Every rank constructs it with the same arguments and calls the same methods in the same
    order (SPMD). Pipeline device ``d`` of replica ``r`` is rank ``r * pp + d``, where
    ``pp = world_size / dp_size``; stages go to devices as the schedule places them.

    A model that is not a chain comes as :class:`~gpipe.Stages`: one stage per rank (``v``
    per rank when interleaved); each rank keeps only its own stage modules, and values go
    directly from the rank that makes them to every rank that reads them. Every rank
    holding a stage that reads the inputs must be given them.

    Args:
        module: the model, an ``nn.Sequential`` or ``Stages``; it may live on the meta
            device, in which case only this rank's layers are ever materialized.
        balance: layers per model stage (``pp * virtual_stages`` entries); None or
            "params" evens out parameter counts.
        chunks: M, micro-batches per mini-batch (of each replica).
        checkpoint: "always", "except_last" or "never" (as :class:`gpipe.GPipe`).
        schedule: a schedule name or a :class:`~gpipe.schedule.Schedule` (as
            :class:`gpipe.GPipe`).
        virtual_stages: model stages per rank (2 for "zb-v").
        dp_size: replicas of the pipeline; each runs on its part of the batch and the
            gradients are summed over them.
        data_parallel: how the replicas sum their gradients: "replicate" (gpipe's own
            all-reduce, the default), "ddp" (torch's DistributedDataParallel per stage) or
            "fsdp" (torch's ``fully_shard`` per stage: parameters, gradients and optimizer
            state sharded over the replicas, gradients as DTensors); see
            :mod:`gpipe.distributed.data_parallel` for what each runs.
        fsdp_reshard_after_forward: with "fsdp", free each stage's gathered parameters
            after every forward (less memory, one all-gather per forward); False keeps
            them gathered through the step's forwards and backwards.
        zero: with ``make_optimizer``, shard optimizer state over the replicas
            (``torch.distributed.optim.ZeroRedundancyOptimizer``).
        tied: pairs of parameter names (as in the user's model) to keep tied; a Parameter
            object used by stages on different ranks is tied without asking.
        init_fn: initializes this rank's layers after materialization from meta, applied
            like ``layer.apply(init_fn)``; by default each submodule's own
            ``reset_parameters()``.
        timeout: seconds a rank waits for a message before declaring its sender lost.
        track_memory: count the bytes each rank holds for backward (for the timeline).
        deferred_batch_norm: as :class:`gpipe.GPipe`.
        input_batch_dims: where the input is batched (as :class:`gpipe.GPipe`).
        output_batch_dims: where ``eval_step``'s output is batched.
        overlap: receive ahead of need and send in the background (the default). False
            makes every transfer wait for both sides, to measure what overlap is worth;
            only for schedules whose ranks consume each peer's messages in the order sent
            (gpipe's fill-drain).

    Raises:
        RuntimeError: the process group is not initialized (call ``gpipe.distributed.init()``).
        TypeError: ``module`` is not an ``nn.Sequential``, or an argument of the wrong type.
        ValueError: a configuration that cannot run (a world size that does not fit, more
            stages than layers, a balance that does not fit, ranks given different
            arguments...), raised on every rank before any step.
    """

    _flow: Stages | None  # every stage of a dataflow model, not a submodule (see __init__)

    def __init__(
        self,
        module: nn.Sequential | Stages,
        balance: Sequence[int] | str | None = None,
        *,
        chunks: int = 1,
        checkpoint: str = "except_last",
        schedule: str | Schedule = "gpipe",
        virtual_stages: int = 1,
        dp_size: int = 1,
        data_parallel: str = "replicate",
        fsdp_reshard_after_forward: bool = True,
        zero: bool = False,
        tied: Sequence[tuple[str, str]] = (),
        init_fn: Callable[[nn.Module], None] | None = None,
        timeout: float = 300.0,
        track_memory: bool = True,
        deferred_batch_norm: bool = False,
        input_batch_dims: BatchDims = 0,
        output_batch_dims: BatchDims = 0,
        overlap: bool = True,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedGPipe needs a process group: call gpipe.distributed.init() first "
                "(and launch with torchrun)"
            )
        self.rank = dist.get_rank()
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self._guard = PipeGuard(self.timeout)
        with self._guard.building():
            self._configure(
                module,
                balance,
                "DistributedGPipe",
                chunks=chunks,
                checkpoint=checkpoint,
                schedule=schedule,
                virtual_stages=virtual_stages,
                track_memory=track_memory,
                deferred_batch_norm=deferred_batch_norm,
                input_batch_dims=input_batch_dims,
                output_batch_dims=output_batch_dims,
            )
            check_flag("zero", zero)
            self.zero = zero
            self.layout = job_layout(dp_size)
            self.torch_device = default_device()
            module, self.balance = model_balance(module, balance, self.layout, virtual_stages)
            flow = module if isinstance(module, Stages) else None
            # Kept off the module tree: its other stages are freed to meta below, and as
            # submodules they would be in parameters(), so the optimizer, ZeRO and
            # checkpoints would take every rank's parameters for this rank's.
            self.__dict__["_flow"] = flow
            routes = None if flow is None else Routes(flow.dataflow)
            self._schedules: dict[int, Schedule] = {}
            placement = self._schedule_for(self.chunks).placement
            check_data_parallel(
                data_parallel, fsdp_reshard_after_forward, dp=self.layout.dp, zero=zero
            )
            check_alike(
                module,
                {
                    "schedule": schedule if isinstance(schedule, str) else "a Schedule",
                    "balance": self.balance,
                    "chunks": self.chunks,
                    "checkpoint": self.checkpoint,
                    "virtual_stages": virtual_stages,
                    "dp_size": dp_size,
                    "data_parallel": [data_parallel, fsdp_reshard_after_forward],
                    "zero": zero,
                },
                self._guard,
            )
            self._convert_batch_norm(module, deferred_batch_norm)
            self._rank = build_stages(
                module,
                self.balance,
                placement,
                self.layout,
                self.torch_device,
                tied,
                init_fn,
                routes,
            )
            check_untied(data_parallel, self.layout.dp, self._rank)
            barrier(self._guard)
            self.partitions = nn.ModuleList([p for p in self._rank.held if p is not None])
            self._keep_deferred(self.partitions)
            self._stages = self._rank.stage_set
            self.ties = self._rank.ties
            self.local_stages = self._rank.local
            self._reader = first_reader(routes)
            self._connections = connect(
                self._guard,
                self._rank,
                self.layout,
                self.torch_device,
                self.timeout,
                overlap,
                routes,
            )
            self.groups = self._connections.groups
            self.mesh = self.groups.mesh
            self._transport = self._connections.transport
            self._data_parallel = data_parallel_for(
                data_parallel,
                fsdp_reshard_after_forward,
                self._rank,
                self.layout,
                self.groups,
            )
            # NOTE: under "fsdp" the tied copies are DTensor Parameters now
            self._connections.tied.reread(self._rank.user_view())
            self._ran = False  # whether this rank ran its actions of the step under way

    # -- training ----------------------------------------------------------------------

    def train_step(
        self,
        input: Any,
        target: Any,
        loss_fn: LossFn,
        *,
        reduction: str = "mean",
        microbatch_weight: Callable[[Any], Any] | None = None,
        target_batch_dims: BatchDims = 0,
        local_batch: bool = False,
        kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """One pipelined forward and backward; every rank calls it.

        ``input`` is read on the first stage's ranks and ``target`` on the last stage's;
        the other ranks may pass anything (None). For :class:`~gpipe.Stages`, ``input`` is
        the first positional input or a tuple of them, ``kwargs`` the keyword inputs, read
        on every rank holding a stage that reads them. With replicas, each replica takes its
        part of the batch (the batch split into ``dp_size`` parts along its batch dims), or,
        with ``local_batch=True``, the batch given to it is its own part. The micro-batch
        losses are weighted over the whole batch of every replica, so the loss and the
        gradients equal plain training on the whole batch. Gradients accumulate in this
        rank's parameters; call ``optimizer.step()`` on every rank.

        Args:
            input: the batch, read on the ranks holding a stage that reads it.
            target: the targets, read on the last stage's ranks.
            loss_fn: ``loss_fn(output, target) -> scalar`` for one micro-batch.
            reduction: "mean" or "sum", as :meth:`gpipe.GPipe.train_step`.
            microbatch_weight: what one micro-batch's loss averages over, as
                :meth:`gpipe.GPipe.train_step`.
            target_batch_dims: where ``target`` is batched.
            local_batch: ``input`` and ``target`` are this replica's part, not the whole.
            kwargs: for ``Stages``, the keyword inputs (an attention mask...).

        Returns:
            The loss of the whole batch (detached), on every rank.
        """
        check_train_arguments(loss_fn, reduction, microbatch_weight, target_batch_dims)
        check_flag("local_batch", local_batch)
        with self._guard.stepping(lambda: self._ran):
            batch, header = self._begin(input, kwargs, local_batch, "train_step")
            self._data_parallel.check_microbatches(header.microbatches, self._guard.wait)
            schedule = self._schedule_for(header.microbatches)
            loss = None
            if self._holds(self._stages.last):
                self._given(target, "target", "last stage and computes the loss")
                loss = weighted_loss(
                    target,
                    target_batch_dims,
                    microbatch_sizes(header.total, header.microbatches),
                    loss_fn,
                    reduction,
                    microbatch_weight,
                    self.torch_device,
                    replicas=1 if local_batch else self.layout.dp,
                    replica=self.layout.replica,
                    whole=self._whole_batch,
                )
            sync = self._data_parallel.sync(schedule)
            shared = LossBroadcast(
                self._guard,
                self._rank_of(self._stages.last),
                self.groups.control,
                self.torch_device,
            )
            step = self._step(
                schedule,
                header,
                batch,
                grad=True,
                loss=loss,
                after=None if sync is None else sync.after,
            )
            if sync is not None:
                sync.finish(self._guard.wait)
            self._connections.tied.sum_gradients(self._guard.wait)
            if batch is not None:
                backward_into_input(step, batch.parts, self._holds)
            if loss is not None:
                shared.send(
                    weighted_total(loss.weights, step.state.losses),
                    self.groups.replicas if self.layout.dp > 1 else None,
                )
            header.settle(self._guard)
            return shared.result()

    @torch.no_grad()
    def eval_step(
        self, input: Any, *, local_batch: bool = False, kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Forward only: the output on the last stage's rank, None on the others.

        With replicas, each replica runs its part of the batch and its last stage's rank
        returns that part's output. ``input`` and ``kwargs`` as :meth:`train_step`.
        """
        with self._guard.stepping(lambda: self._ran):
            batch, header = self._begin(input, kwargs, local_batch, "eval_step")
            self._data_parallel.check_microbatches(header.microbatches, self._guard.wait)
            forwards = self._schedule_for(header.microbatches).only([FORWARD])
            step = self._step(forwards, header, batch, grad=False)
            self._data_parallel.settle()
            header.settle(self._guard)
            if not self._holds(self._stages.last):
                return None
            outputs = collect_outputs(step, header.microbatches)
            return gather(
                outputs,
                self.output_batch_dims,
                sizes=microbatch_sizes(header.total, header.microbatches),
            )

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], **kwargs: Any) -> Any:
        """An optimizer over this rank's parameters: sharded over the replicas with ``zero``.

        ``pipe.make_optimizer(torch.optim.AdamW, lr=1e-3)`` is ``AdamW(pipe.parameters(),
        lr=1e-3)``, or with ``zero=True`` a ``ZeroRedundancyOptimizer`` that keeps only
        this rank's share of the state (the same trajectory, 1/dp_size of the memory).
        """
        if not self.zero or self.layout.dp == 1:
            return optimizer_class(self.parameters(), **kwargs)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            self.parameters(),
            optimizer_class=optimizer_class,
            process_group=self.groups.replicas,
            **kwargs,
        )

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """Clip the gradients of the whole model by their total norm, on every rank.

        The norm is over every parameter of every stage (a tied weight counted once), as
        ``torch.nn.utils.clip_grad_norm_`` on the plain model computes it; every rank gets
        the same total norm and scales its gradients alike (under ``data_parallel="fsdp"``,
        each rank its shards). Every rank must call it, after ``train_step`` (the replicas'
        gradients are already summed then).

        Raises:
            RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf (on every rank).
        """
        with self._guard.stepping(lambda: True):
            self._agree_on("clip_grad_norm_")
        elsewhere = self._connections.tied.counted_elsewhere()
        parameters = list(self.parameters())
        return clip_grad_norm_(
            [p for p in parameters if id(p) not in elsewhere],
            parameters,
            max_norm,
            self.groups.control,
            shards_over=self._data_parallel.shards_over,
            norm_type=norm_type,
            error_if_nonfinite=error_if_nonfinite,
            foreach=foreach,
        )

    # -- timelines ---------------------------------------------------------------------

    @property
    def timeline(self) -> Timeline:
        """The last step on every rank of this pipeline, on its first rank's clock.

        A collective over the pipeline: each of its ranks must ask, in the same order as its
        other calls. ``transfers`` holds every message between the ranks.
        """
        step, schedule = self._last_step()
        with self._guard.stepping(lambda: True):
            self._agree_on("timeline")
        return gather_timeline(
            step,
            schedule,
            self._transport,
            self.layout.position,
            self.layout.pipeline,
            self._connections.clock_offset_ns,
            self.groups.control,
        )

    def predicted_timeline(self) -> Timeline:
        """The simulator's account of the last step, fed what this step measured.

        Each stage's F, B and W cost is the median of its measured durations; each message
        between ranks costs the link's latency plus its bytes over the link's bandwidth
        (both measured between the first two ranks when the job's first pipe was made).
        A collective, like :attr:`timeline`.
        """
        return self._predicted(self.timeline, link=self._connections.link)

    # -- checkpoints -------------------------------------------------------------------

    @classmethod
    def from_plan(cls, module: nn.Module, plan: Any, **kwargs: Any) -> DistributedGPipe:
        """The pipe a :func:`gpipe.plan` result describes, on this job's processes: its
        stages, replicas (``dp_size``, ``zero``), chunks, checkpointing and schedule.

        Args:
            module: the model that was planned (see :meth:`gpipe.GPipe.from_plan`).
            plan: a ``Plan`` (from ``plan(..., world_size=N)``, or one with ``stages * dp``
                equal to this job's size), or the whole report (its best plan).
            kwargs: the other arguments of ``DistributedGPipe`` (``timeout``, ``tied``...).

        Raises:
            ValueError: the plan is laid out for another number of processes.
        """
        built, settings = planned(module, plan)
        return cls(built, **settings, **kwargs)

    def user_view(self) -> nn.Module:
        """This rank's layers under their names in the user's model (``state_dict`` keys).

        For ``Stages`` (from :func:`gpipe.split` or :func:`gpipe.skip.stages`), the stage
        modules' parameters and buffers under their own names, which are the user's; only
        if two stage modules use one name for different tensors, each stage's under
        ``"stage.name"`` (see :mod:`gpipe.distributed.naming`).
        """
        if self._flow is None:
            return user_view(list(self.partitions), None, False)
        return self._rank.user_view()

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        optimizer: Any = None,
        extra: dict[str, Any] | None = None,
        keep: int | None = 2,
    ) -> os.PathLike[str]:
        """Save the next checkpoint in the folder ``path``, any layout can load it; keep the
        newest ``keep`` (see :mod:`gpipe.distributed.checkpoint`)."""
        from gpipe.distributed.checkpoint import save

        return save(self, path, optimizer=optimizer, extra=extra, keep=keep)

    def load(self, path: str | os.PathLike[str], *, optimizer: Any = None) -> dict[str, Any]:
        """Load the newest complete checkpoint in ``path``; return its ``extra`` (see
        :func:`gpipe.distributed.checkpoint.load`, and its trust model)."""
        from gpipe.distributed.checkpoint import load

        return load(self, path, optimizer=optimizer)

    def close(self) -> None:
        """Stop this pipe's background threads (also done when it is garbage collected)."""
        self._guard.close()

    def __del__(self) -> None:
        if self.__dict__.get("_guard") is not None:
            self.close()

    # -- a step's pieces ---------------------------------------------------------------

    def _begin(
        self, input: Any, kwargs: dict[str, Any] | None, local_batch: bool, call: str
    ) -> tuple[Batch | None, Header]:
        """This rank's micro-batches (if it reads the inputs) and the step's header."""
        self._ran = False
        batch = None
        stepping = call in ("train_step", "eval_step")
        if self._reads_input() and stepping:
            batch = self._split(
                self._bind(input, kwargs),
                replicas=1 if local_batch else self.layout.dp,
                replica=self.layout.replica,
            )
        header = agree(
            self._guard,
            batch,
            self._seed() if stepping else 0,  # NOTE: only a step draws from the generator
            (self.schedule, self.checkpoint, self.chunks),
            self._rank_of(self._reader),
            self.groups.control,
            call,
        )
        return batch, header

    def _agree_on(self, call: str) -> None:
        """Begin ``call`` (not a step) with the header every call begins with, so ranks
        that make different calls meet there (see :mod:`gpipe.distributed.header`).

        Raises:
            PipelineFailure: the ranks did not all make this call; the failure names the
                fix (most often one rank called it alone, ``if rank == 0:``).
        """
        try:
            self._begin(None, None, False, call)
        except PipelineFailure as error:
            named = "read pipe.timeline" if call == "timeline" else f"call pipe.{call}()"
            hint = (
                f" -- {call} is a collective: every rank of the pipeline must {named}, in "
                "the same order as its other calls"
            )
            told = dataclasses.replace(error.failure, error=error.failure.error + hint)
            raise PipelineFailure(told, self.rank) from error

    def _whole_batch(self, weight: float) -> float:
        """``weight`` summed over every replica's part of the batch."""
        if self.layout.dp == 1:
            return weight
        whole = torch.tensor(weight, dtype=torch.float64)
        return float(self._guard.summed(whole, self.groups.replicas))

    def _step(
        self,
        schedule: Schedule,
        header: Header,
        batch: Batch | None,
        *,
        grad: bool,
        loss: Any = None,
        after: Callable[[Action], None] | None = None,
    ) -> Step:
        """Run this rank's actions of ``schedule``; every message through the transport."""
        transport = self._transport
        ran = transport.ran if after is None else _both(transport.ran, after)
        step = self._new_step(
            schedule,
            header.microbatches,
            self.layout.pp,
            grad=grad,
            seed=header.seed,
            loss=loss,
            microbatch_offset=self.layout.replica * self.chunks,
            after=ran,
        )
        self._guard.state = step.state
        key = (grad, self.training, header.microbatches, header.shapes)
        transport.begin(self._connections.programs.of(schedule), key=key)
        self._run(
            step,
            schedule,
            None if batch is None else batch.parts,
            position=self.layout.position,
            finish=transport.finish,
        )
        self._ran = True
        return step

    def _pipeline_devices(self) -> int:
        return self.layout.pp

    def _holds(self, stage: int) -> bool:
        return self._stages.placement[stage] == self.layout.position

    def _reads_input(self) -> bool:
        """Whether this rank holds a stage that reads the pipe's inputs."""
        routes = self._stages.routes
        if routes is None:
            return self._holds(0)
        return any(self._holds(stage) for stage in routes.reading_input)

    def _bind(self, input: Any, kwargs: dict[str, Any] | None) -> Any:
        """The input of a step: as given for a Sequential, named for ``Stages``."""
        if self._flow is None:
            if kwargs is not None:
                refuse_keywords(kwargs)
            self._given(input, "input", "first stage and reads the input")
            return input
        positional = input if isinstance(input, tuple) else (input,)
        return self._flow.bind(*positional, **(kwargs or {}))

    def _given(self, value: Any, name: str, role: str) -> None:
        """Refuse ``name=None`` on this rank, which holds the ``role``."""
        if value is None:
            raise ValueError(
                f"{name}=None on rank {self.rank}, which holds the {role}: pass the {name} "
                "on this rank (every rank may pass it; the others ignore it)"
            )

    def _rank_of(self, stage: int) -> int:
        return self.layout.pipeline[self._stages.placement[stage]]


def _both(
    first: Callable[[Action], None], then: Callable[[Action], None]
) -> Callable[[Action], None]:
    """Call ``first``, then ``then``, with each action a worker finished."""

    def both(action: Action) -> None:
        first(action)
        then(action)

    return both
