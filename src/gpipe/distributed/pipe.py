"""DistributedGPipe: the SPMD front end, one pipeline device per process, replicas optional.

Every rank builds ``DistributedGPipe(model, ...)`` from the same arguments. Each keeps only
its own stages (materializing them if the model was built on the meta device), runs only its
own action list with the same StageWorker as the local pipe, and talks to the other ranks of
its pipeline through the point-to-point transport. The first stage's rank reads the inputs,
the last stage's rank computes the loss, and the loss comes back on every rank. With
``dp_size`` > 1 the job holds that many replicas of the pipeline (see
:mod:`gpipe.distributed.mesh` for the rank order), each on its part of the batch.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpipe.analysis import Timeline
from gpipe.arguments import (
    check_balance_type,
    check_flag,
    check_model,
    check_stages_balance,
    check_target_size,
    check_virtual,
    refuse_keywords,
)
from gpipe.balance import balance_by_params
from gpipe.batchnorm import (
    DeferredBatchNorm,
    committing,
    convert_deferred_batch_norm,
    refuse_reused_batch_norm,
)
from gpipe.dataflow import Stages, named_batch_dims
from gpipe.distributed.clipping import clip_grad_norm_
from gpipe.distributed.clock import offsets_to_rank0
from gpipe.distributed.executor import Executor
from gpipe.distributed.faults import Failure, FaultChannel, PipelineFailure, brief, wait_for
from gpipe.distributed.fingerprint import check_same_everywhere
from gpipe.distributed.link import measure_link
from gpipe.distributed.materialize import keep_only
from gpipe.distributed.mesh import (
    Layout,
    collective_device,
    everyone,
    groups_for,
    retire,
    retire_everyone,
)
from gpipe.distributed.mesh import device as default_device
from gpipe.distributed.naming import state_names, under_stage, user_view
from gpipe.distributed.protocol import Programs, settings_code, shapes_code
from gpipe.distributed.replicas import GradientSync, last_gradient_actions
from gpipe.distributed.ties import TiedWeights, find_ties, tie_groups
from gpipe.distributed.timeline import gather_timeline, predict
from gpipe.loss import check_loss_arguments, microbatch_weights, normalized, weighted_total
from gpipe.microbatch import (
    BatchDims,
    batch_size,
    check_batch_dims,
    gather,
    microbatch_sizes,
    scatter,
)
from gpipe.partition import check_balance, split_module
from gpipe.randomness import draw_step_seed
from gpipe.runtime.caller import backward_into_input, collect_outputs, feed
from gpipe.runtime.routes import Routes
from gpipe.runtime.stages import StageSet
from gpipe.runtime.state import Loss, StepState
from gpipe.runtime.step import Step
from gpipe.schedule import FORWARD, Action, Schedule, check_virtual_stages
from gpipe.settings import StepSettings
from gpipe.skip import has_skippables
from gpipe.skip import stages as skip_stages
from gpipe.structure import map_tensors

__all__ = ["DistributedGPipe", "close_all"]

_COUNTER = itertools.count()
_LINKS: dict[tuple[int, ...], tuple[float, float]] = {}
_OPEN: weakref.WeakSet[DistributedGPipe] = weakref.WeakSet()
_LOSS_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def close_all() -> bool:
    """Stop every open pipe's threads; whether none of them saw a failure.

    A pipe that failed may have threads still waiting in gloo: its groups are retired, so
    they end now, not as the interpreter finalizes (see mesh.end).
    """
    healthy = True
    for pipe in list(_OPEN):
        if pipe._transport.failure is None:
            pipe.close()
        else:
            healthy = False
            pipe._release()
    return healthy


class DistributedGPipe(StepSettings, nn.Module):
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
        module: nn.Sequential,
        balance: Sequence[int] | str | None = None,
        *,
        chunks: int = 1,
        checkpoint: str = "except_last",
        schedule: str | Schedule = "gpipe",
        virtual_stages: int = 1,
        dp_size: int = 1,
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
        # NOTE: the fault channel comes before the first collective of construction, so a
        # rank that fails while building (a bad init_fn, out of memory) ends every rank at
        # once, naming itself, instead of leaving them in a collective until the timeout.
        # The default store is the one every rank already shares (torchrun's agent's or rank
        # 0's); torch offers no public accessor for it.
        store = dist.distributed_c10d._get_default_store()
        self._state: StepState | None = None
        self._collective_waits = 0  # collectives this rank waits in now (see _progress)
        me = weakref.ref(self)

        def on_failure(failure: Failure) -> None:  # the watcher must not keep the pipe alive
            pipe = me()
            if pipe is not None:
                pipe._on_failure(failure)

        self.rank = dist.get_rank()
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        # NOTE: first, before any check that could fail on one rank alone: making a group
        # waits for every rank, and nothing could wake a rank waiting there
        try:
            self._everyone, token = everyone(float(timeout))
        except RuntimeError as error:  # NOTE: DistStoreError and gloo's errors alike
            raise RuntimeError(
                f"gpipe: not every rank began building the pipe within timeout={timeout:g} s "
                f"(a rank died, hung, or does not construct DistributedGPipe): {brief(error)}"
            ) from error
        self._faults = FaultChannel(
            store,
            f"gpipe/pipe{next(_COUNTER)}",
            self.rank,
            on_failure,
            dist.get_world_size(),
            token=token,
        )

        def progress() -> dict[str, Any]:  # NOTE: weakly, as on_failure
            pipe = me()
            return {} if pipe is None else pipe._progress()

        self._faults.progress = progress
        try:
            with self._faults.busy():
                self._construct(
                    module, balance, chunks, checkpoint, schedule, virtual_stages, dp_size,
                    zero, tied, init_fn, timeout, track_memory, deferred_batch_norm,
                    input_batch_dims, output_batch_dims, overlap,
                )  # fmt: skip
        except BaseException as error:
            if not isinstance(error, PipelineFailure):
                first = next(iter(str(error).splitlines()), "")
                self._faults.publish(
                    Failure(self.rank, f"{type(error).__name__} while building the pipe: {first}")
                )
            self._faults.acknowledge(dist.get_world_size())
            self._faults.close()
            # NOTE: a collective of construction may still be posted here (the others'
            # barrier when this rank failed, or ours when another did)
            groups = self.__dict__.get("groups")
            if groups is not None:
                retire(groups, self.__dict__.get("_tie_groups", ()))
            if "_everyone" in self.__dict__:
                retire_everyone(self._everyone)
            raise

    def _construct(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | str | None,
        chunks: int,
        checkpoint: str,
        schedule: str | Schedule,
        virtual_stages: int,
        dp_size: int,
        zero: bool,
        tied: Sequence[tuple[str, str]],
        init_fn: Callable[[nn.Module], None] | None,
        timeout: float,
        track_memory: bool,
        deferred_batch_norm: bool,
        input_batch_dims: BatchDims,
        output_batch_dims: BatchDims,
        overlap: bool,
    ) -> None:
        """The constructor's work, once the fault channel is up (see ``__init__``)."""
        flow = module if isinstance(module, Stages) else None
        if flow is None:
            check_model(module, "DistributedGPipe")
        check_virtual(virtual_stages)
        check_virtual_stages(schedule, virtual_stages)
        check_balance_type(balance)
        for name, flag in [("zero", zero), ("track_memory", track_memory)]:
            check_flag(name, flag)
        check_flag("deferred_batch_norm", deferred_batch_norm)
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"dp_size must be a whole number >= 1, got {dp_size!r}")
        world = dist.get_world_size()
        if world % dp_size:
            raise ValueError(
                f"the job has {world} ranks, which dp_size={dp_size} replicas cannot share "
                f"equally: launch a multiple of {dp_size} processes"
            )
        self.layout = Layout(dp_size, world // dp_size, dist.get_rank())
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.input_batch_dims = check_batch_dims(input_batch_dims, "input_batch_dims")
        self.output_batch_dims = check_batch_dims(output_batch_dims, "output_batch_dims")
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self.zero = zero
        self.track_memory = track_memory
        self.timeout = float(timeout)
        self.torch_device = default_device()
        pp = self.layout.pp
        stages = pp * virtual_stages
        if flow is None and has_skippables(module) and stages <= len(module):
            # NOTE: as GPipe does, so each skip goes straight to the rank popping it; run as
            # a chain, a rank would pop a skip stashed on another rank and find nothing.
            flow = skip_stages(module, check_balance(module, _balance(module, balance, stages)))
            module, balance = flow, None  # type: ignore[assignment]  # the Stages path below
        # NOTE: kept off the module tree: its other stages are freed to meta below, and as a
        # submodule they would be in parameters(), so the optimizer, ZeRO and checkpoints
        # took every rank's parameters for this rank's.
        self.__dict__["_flow"] = flow
        self._routes = None if flow is None else Routes(flow.dataflow)
        self.balance: list[int]
        if flow is not None:
            self.balance = _stages_balance(flow, balance, pp, virtual_stages, dp_size)
        elif stages > len(module):
            raise ValueError(
                f"{pp} pipeline ranks x {virtual_stages} virtual stages = {stages} stages, but "
                f"the model has {len(module)} layers: launch at most "
                f"{len(module) // virtual_stages * dp_size} processes, or split the model "
                "into more layers"
            )
        else:
            self.balance = check_balance(module, _balance(module, balance, stages))
        if len(self.balance) != stages:
            raise ValueError(
                f"balance lists {len(self.balance)} stages but the job has {pp} pipeline ranks "
                f"x {virtual_stages} virtual stages = {stages}: give one entry per stage, or "
                f"launch {len(self.balance) // virtual_stages * dp_size} processes"
            )
        self._schedules: dict[int, Schedule] = {}
        placement = self._schedule_for(self.chunks).placement
        check_same_everywhere(
            {
                "schedule": schedule if isinstance(schedule, str) else "a Schedule",
                "balance": self.balance,
                "chunks": self.chunks,
                "checkpoint": self.checkpoint,
                "virtual_stages": virtual_stages,
                "dp_size": dp_size,
                "zero": zero,
                "layers": [type(layer).__name__ for layer in module],
                "tensors": _tensor_kinds(module),
                "dataflow": None if flow is None else repr(flow.dataflow),
            },
            self._wait,
            self._everyone,
        )

        if deferred_batch_norm:
            refuse_reused_batch_norm(module)
            convert_deferred_batch_norm(module)
        partitions = list(module) if flow is not None else list(split_module(module, self.balance))
        # NOTE: the stage modules of gpipe.split and gpipe.skip.stages hold the user's layers
        # under their names in the user's model, so ties and checkpoints read those names;
        # only stage modules whose names clash are told apart as "stage.name" (see user_view).
        self._by_stage = flow is not None and state_names(partitions) is None
        self.ties = find_ties(
            [under_stage(s, p) for s, p in enumerate(partitions)] if self._by_stage else partitions,
            placement,
            tied,
        )
        self.local_stages = [s for s in range(stages) if placement[s] == self.layout.position]
        held = [p if s in self.local_stages else None for s, p in enumerate(partitions)]
        keep_only(partitions, held, self.torch_device, init_fn)
        # NOTE: every rank built its stages (init_fn ran) before any makes groups: a rank
        # that failed has said so, and the others hear it here
        self._wait(dist.barrier(self._everyone, async_op=True))
        self.partitions = nn.ModuleList([p for p in held if p is not None])
        self._deferred = [
            m for p in self.partitions for m in p.modules() if isinstance(m, DeferredBatchNorm)
        ]
        self._stages = StageSet(
            held, [self.torch_device] * pp, placement, routes=self._routes, balance=self.balance
        )
        self._reader = 0 if self._routes is None else _first_reader(self._routes)
        self._programs = Programs(self._routes, self.layout.position)

        self.groups = groups_for(self.layout, self.timeout, self.torch_device.type)
        self.mesh = self.groups.mesh
        self._tie_groups = tie_groups(
            self.ties, self.layout.grid(), datetime.timedelta(seconds=self.timeout)
        )
        self._tied = TiedWeights(
            self.ties,
            self._tie_groups,
            self.local_stages,
            self.layout.position,
            self.layout.pipeline,
            self.user_view(),
        )
        self._tied.start_alike()
        pipeline = self.layout.pipeline
        self._clock_offset_ns = offsets_to_rank0(pipeline, self.groups.control)
        if tuple(pipeline) not in _LINKS:
            _LINKS[tuple(pipeline)] = measure_link(
                pipeline, self.groups.pipeline, self.torch_device
            )
        self._link = _LINKS[tuple(pipeline)]
        self._transport = Executor(
            placement,
            self.layout.position,
            pipeline,
            self.torch_device,
            self.groups.pipeline,
            self.timeout,
            self._faults.publish,
            overlap,
            partial(self._faults.culprit, ranks=pipeline),
        )
        self._last: tuple[Step, Schedule] | None = None
        self._shapes = 0  # the step's input shapes, as a number (see _begin)
        self._announced: Any = None  # this rank's step header, while it may be in flight
        self._ran = False  # whether this rank ran its actions of the step under way
        _OPEN.add(self)

    # -- training ----------------------------------------------------------------------

    def train_step(
        self,
        input: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
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
            input, target, loss_fn, reduction, microbatch_weight, target_batch_dims: as
                :meth:`gpipe.GPipe.train_step`.
            local_batch: ``input`` and ``target`` are this replica's part, not the whole.
            kwargs: for ``Stages``, the keyword inputs (an attention mask...).

        Returns:
            The loss of the whole batch (detached), on every rank.
        """
        check_loss_arguments(loss_fn, reduction, microbatch_weight)
        check_batch_dims(target_batch_dims, "target_batch_dims")
        check_flag("local_batch", local_batch)
        if not torch.is_grad_enabled():
            raise RuntimeError("train_step needs autograd: call it outside torch.no_grad()")
        with self._failing_together():
            first, last = self._reads_input(), self._holds(self._stages.last)
            input = self._bind(input, kwargs) if first else None
            dims = self._input_dims()
            part = self._part_of(input, dims, "input", local_batch, first)
            microbatches = scatter(part, self.chunks, dims) if first else None
            count, total, seed = self._begin(part, microbatches)
            schedule = self._schedule_for(count)
            loss = None
            if last:
                self._given(target, "target", "last stage and computes the loss")
                mine = self._part_of(target, target_batch_dims, "target", local_batch, last)
                loss = self._loss(
                    mine, target_batch_dims, count, total, loss_fn, reduction, microbatch_weight
                )
            sync = self._gradient_sync(schedule)
            # NOTE: summed and sent in float64 for precision, with the loss's own dtype code
            # beside it, so every rank returns the dtype plain training returns. The other
            # ranks post their receive before the step: the loss goes out the moment the last
            # stage has it, and the first stage finds it there when its own step ends
            # (broadcast after the step, it cost the first stage 0.5-1 ms of wake-ups).
            value = torch.zeros(2, dtype=torch.float64)
            source = self._rank_of(self._stages.last)
            heard = None
            if self.rank != source:
                heard = dist.broadcast(value, source, self.groups.control, async_op=True)
            step = self._run(
                schedule,
                count,
                seed,
                grad=True,
                loss=loss,
                inputs=microbatches,
                after=None if sync is None else sync.after,
            )
            if sync is not None:
                sync.finish(self._wait)
            self._tied.sum_gradients(self._wait)
            if microbatches is not None:
                backward_into_input(step, microbatches, self._holds)
            if loss is not None:
                total_loss = weighted_total(loss.weights, step.state.losses)
                value[0] = total_loss.detach().double().cpu()
                if self.layout.dp > 1:
                    value[0] = self._summed(value[0], self.groups.replicas)
                if total_loss.dtype in _LOSS_DTYPES:
                    value[1] = _LOSS_DTYPES.index(total_loss.dtype)
            self._announced_wait()
            if heard is None:
                self._collective(
                    lambda: dist.broadcast(value, source, self.groups.control, async_op=True)
                )
            else:
                self._wait(heard)
            dtype = _LOSS_DTYPES[int(value[1])]
            return value[0].to(device=self.torch_device, dtype=dtype)

    @torch.no_grad()
    def eval_step(
        self, input: Any, *, local_batch: bool = False, kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Forward only: the output on the last stage's rank, None on the others.

        With replicas, each replica runs its part of the batch and its last stage's rank
        returns that part's output. ``input`` and ``kwargs`` as :meth:`train_step`.
        """
        with self._failing_together():
            first, last = self._reads_input(), self._holds(self._stages.last)
            input = self._bind(input, kwargs) if first else None
            dims = self._input_dims()
            part = self._part_of(input, dims, "input", local_batch, first)
            microbatches = scatter(part, self.chunks, dims) if first else None
            count, total, seed = self._begin(part, microbatches)
            forwards = self._schedule_for(count).only([FORWARD])
            step = self._run(forwards, count, seed, grad=False, loss=None, inputs=microbatches)
            self._announced_wait()
            if not last:
                return None
            outputs = collect_outputs(step, count)
            sizes = microbatch_sizes(total, self.chunks)
            return gather(outputs, self.output_batch_dims, sizes=sizes)

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
        the same total norm and scales its gradients alike. Every rank must call it, after
        ``train_step`` (the replicas' gradients are already summed then).

        Raises:
            RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf (on every rank).
        """
        elsewhere = self._tied.counted_elsewhere()
        parameters = list(self.parameters())
        return clip_grad_norm_(
            [p for p in parameters if id(p) not in elsewhere],
            parameters,
            max_norm,
            self.groups.control,
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
        if self._last is None:
            raise RuntimeError("no step has run yet: call train_step or eval_step first")
        step, schedule = self._last
        return gather_timeline(
            step,
            schedule,
            self._transport,
            self.layout.position,
            self.layout.pipeline,
            self._clock_offset_ns,
            self.groups.control,
        )

    def predicted_timeline(self) -> Timeline:
        """The simulator's account of the last step, fed what this step measured.

        Each stage's F, B and W cost is the median of its measured durations; each message
        between ranks costs the link's latency plus its bytes over the link's bandwidth
        (both measured between the first two ranks when the job's first pipe was made).
        A collective, like :attr:`timeline`.
        """
        measured = self.timeline
        assert self._last is not None
        flow = self._flow
        skips: list[tuple[int, int]] = []
        if flow is not None:
            skips = [(s, r) for s, r, _ in flow.dataflow.skips() if s >= 0]
        return predict(measured, self._last[1], self._link, skips)

    # -- checkpoints -------------------------------------------------------------------

    def user_view(self) -> nn.Module:
        """This rank's layers under their names in the user's model (``state_dict`` keys).

        For ``Stages`` (from :func:`gpipe.split` or :func:`gpipe.skip.stages`), the stage
        modules' parameters and buffers under their own names, which are the user's; only
        if two stage modules use one name for different tensors, each stage's under
        ``"stage.name"`` (see :mod:`gpipe.distributed.naming`).
        """
        if self._flow is None:
            return user_view(list(self.partitions), None, False)
        local = [self._stages.module(stage) for stage in self.local_stages]
        return user_view(local, self.local_stages, self._by_stage)

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
        self._faults.close()
        transport = self.__dict__.get("_transport")
        if transport is not None:  # NOTE: none if building the pipe failed
            transport.close()
        _OPEN.discard(self)

    def _release(self) -> None:
        """After a failed step: end everything this pipe made (threads, process groups), so
        a job that builds a new pipe and retries leaks nothing (see mesh.retire)."""
        self._faults.close()
        retire(self.groups, self._tie_groups)
        self._transport.release()
        _OPEN.discard(self)

    def __del__(self) -> None:
        if self.__dict__.get("_faults") is not None:
            self.close()

    # -- a step's pieces ---------------------------------------------------------------

    def _part_of(self, value: Any, dims: BatchDims, what: str, local: bool, needed: bool) -> Any:
        """This replica's part of the batch (the whole batch without replicas)."""
        if not needed or local or self.layout.dp == 1:
            return value
        parts = scatter(value, self.layout.dp, dims, what=what)
        if len(parts) < self.layout.dp:
            raise ValueError(
                f"the {what} batch has {len(parts)} samples for {self.layout.dp} replicas: "
                "give each replica at least one"
            )
        return parts[self.layout.replica]

    def _begin(self, part: Any, microbatches: list[Any] | None) -> tuple[int, int, int]:
        """Agree on the step: micro-batches and samples (from the first stage), the seed."""
        seed = draw_step_seed() if self.training else 0
        known = (
            [0, 0, 0]
            if microbatches is None
            else [
                len(microbatches),
                batch_size(part, self._input_dims()),
                shapes_code(microbatches),
            ]
        )
        code = self._settings_code()
        header = torch.tensor([*known, seed, code], dtype=torch.int64)
        source = self._rank_of(self._reader)
        work = dist.broadcast(header, source, self.groups.control, async_op=True)
        if self.rank == source:
            # NOTE: the source knows the header already: it starts its actions at once and
            # makes sure of the broadcast after the step (waiting here cost the first
            # stage, so the whole pipeline, 1.5 ms per step measured on two cores).
            self._announced = work
        else:
            self._wait(work)
        count, total, shapes, seed, theirs = header.tolist()
        self._shapes = shapes
        if theirs != code:
            failure = self._transport.fail(
                Failure(
                    self.rank,
                    f"rank {self.rank} runs schedule={self._schedule_name()!r}, "
                    f"checkpoint={self.checkpoint!r}, chunks={self.chunks}, unlike rank "
                    f"{source}: set pipe.schedule, pipe.checkpoint and pipe.chunks alike on "
                    "every rank",
                )
            )
            raise PipelineFailure(failure, self.rank)
        return count, total, seed

    def _schedule_name(self) -> str:
        schedule = self.schedule
        return schedule if isinstance(schedule, str) else f"a Schedule ({schedule.name})"

    def _settings_code(self) -> int:
        """A number standing for the settings every rank's step must share."""
        return settings_code(self.schedule, self.checkpoint, self.chunks)

    def _announced_wait(self) -> None:
        """Wait for this rank's own step header to have gone (see :meth:`_begin`)."""
        work, self._announced = self._announced, None
        if work is not None:
            self._wait(work)

    def _loss(
        self,
        target: Any,
        dims: BatchDims,
        count: int,
        total: int,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        reduction: str,
        microbatch_weight: Callable[[Any], Any] | None,
    ) -> Loss:
        """The loss on the last stage: targets cut like the input, weighted over the batch."""
        size = batch_size(target, dims, what="target")
        check_target_size(size, total)
        targets = scatter(target, count, dims, what="target")
        weights = microbatch_weights(
            targets, microbatch_sizes(total, self.chunks), reduction, microbatch_weight
        )
        if reduction == "mean":
            whole = torch.tensor(sum(weights), dtype=torch.float64)
            if self.layout.dp > 1:  # normalized over every replica's part of the batch
                whole = self._summed(whole, self.groups.replicas)
            weights = normalized(weights, float(whole))
        return Loss(loss_fn, [_on(t, self.torch_device) for t in targets], weights)

    def _run(
        self,
        schedule: Schedule,
        count: int,
        seed: int,
        *,
        grad: bool,
        loss: Loss | None,
        inputs: list[Any] | None,
        after: Callable[[Action], None] | None = None,
    ) -> Step:
        state = StepState(
            count,
            self.layout.pp,
            grad=grad,
            checkpoint=self.checkpoint if (grad and self.training) else "never",
            seed=seed,
            loss=loss,
            split_backward=schedule.split_backward,
            track_memory=self.track_memory,
            microbatch_offset=self.layout.replica * self.chunks,
            after=after,
        )
        transport = self._transport
        if after is None:
            state.after = transport.ran
        else:

            def both(action: Action) -> None:
                transport.ran(action)
                after(action)

            state.after = both
        self._state = state
        step = Step(self._stages, transport, state)
        key = (grad, self.training, count, self._shapes)
        transport.begin(self._programs.of(schedule), key=key)
        if inputs is not None:
            feed(step, inputs, self._holds)
        actions = [
            schedule.actions[d] if d == self.layout.position else () for d in range(self.layout.pp)
        ]
        self._last = (step, schedule)
        with committing(self._deferred):
            step.run(actions)
            self._transport.finish()
        self._ran = True
        return step

    def _gradient_sync(self, schedule: Schedule) -> GradientSync | None:
        if self.layout.dp == 1:
            return None
        parameters = {
            stage: [p for p in self._stages.module(stage).parameters() if p.requires_grad]
            for stage in self.local_stages
        }
        last = last_gradient_actions(schedule, self.layout.position)
        return GradientSync(parameters, last, self.groups.replicas)

    def _pipeline_devices(self) -> int:
        return self.layout.pp

    def _holds(self, stage: int) -> bool:
        return self._stages.placement[stage] == self.layout.position

    def _reads_input(self) -> bool:
        """Whether this rank holds a stage that reads the pipe's inputs."""
        if self._routes is None:
            return self._holds(0)
        return any(self._holds(stage) for stage in self._routes.reading_input)

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

    def _input_dims(self) -> BatchDims:
        if self._flow is None:
            return self.input_batch_dims
        return named_batch_dims(self.input_batch_dims, self._flow.dataflow.inputs)

    def _rank_of(self, stage: int) -> int:
        return self.layout.pipeline[self._stages.placement[stage]]

    # -- failures ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _failing_together(self) -> Iterator[None]:
        """A step that fails on any rank fails on every rank, all naming the same cause."""
        self._ran = False
        if self.groups.retired:
            raise RuntimeError(
                "this pipe's process groups were ended after a step of another pipe over "
                "them failed: build a new DistributedGPipe"
            )
        try:
            with self._faults.busy():
                yield
        except BaseException as error:
            self._announced = None
            if self._transport.failure is None and not self._ran:
                # NOTE: raised on this rank alone before its actions ran (a bad target given
                # to the last rank): the others wait for its messages, so it tells them. An
                # error after them (an eval output that cannot be gathered) is this rank's.
                self._transport.abort(error)
            if self._transport.failure is not None or isinstance(error, PipelineFailure):
                self._faults.acknowledge(dist.get_world_size())
                self._release()
            raise

    def _summed(self, scalar: torch.Tensor, group: Any) -> torch.Tensor:
        """``scalar`` summed over ``group``'s ranks, on the device its backend takes (a CUDA
        tensor on NCCL), back on the CPU."""
        here = scalar.to(collective_device(group))
        self._collective(lambda: dist.all_reduce(here, group=group, async_op=True))
        return here.cpu()

    def _collective(self, start: Callable[[], Any]) -> None:
        """Run a collective (``start`` returns its Work) and wait for it, or for a failure."""
        self._wait(start())

    def _wait(self, work: Any) -> None:
        transport = self.__dict__.get("_transport")
        failed = (lambda: transport.failure) if transport else (lambda: self._faults.failure)
        self._collective_waits += 1
        try:
            wait_for(work, self._faults, failed, self.rank)
        finally:
            self._collective_waits -= 1

    def _progress(self) -> dict[str, Any]:
        """How far this rank got, for its fault channel's beats (read from their thread)."""
        transport = self.__dict__.get("_transport")
        done = 0 if transport is None else transport.done
        waiting = self._collective_waits > 0 or (transport is not None and transport.waiting)
        return {"done": done, "waiting": waiting, "doing": "a step" if transport else "building"}

    def _on_failure(self, failure: Failure) -> None:
        state = self._state
        if state is not None:
            state.failed = True  # the worker stops before its next action
        transport = self.__dict__.get("_transport")
        if transport is not None:  # NOTE: none yet while the pipe is being built
            transport.fail(failure)


def _tensor_kinds(module: nn.Module) -> list[list[Any]]:
    """Every parameter's and buffer's name, shape and dtype (meta ones too): ranks built with
    another width or dtype differ here."""
    tensors = itertools.chain(module.named_parameters(), module.named_buffers())
    return [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in tensors]


def _balance(module: nn.Sequential, balance: Any, stages: int) -> Any:
    """Layers per stage: as given, or evened out by parameter count."""
    if balance is None or balance == "params":
        return balance_by_params(module, stages)
    if isinstance(balance, str):
        raise ValueError(
            f"DistributedGPipe takes balance=None, 'params' or a list of layers per stage, got "
            f"{balance!r}; measure one in a single process (gpipe.balance_by_time(model, "
            f"sample, {stages})) and pass the list it returns to every rank"
        )
    return balance


def _on(value: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: t.to(device), value)


def _stages_balance(
    stages: Stages, balance: Any, pp: int, virtual_stages: int, dp_size: int
) -> list[int]:
    """The balance of ``stages``, which must have one stage per rank (``v`` when interleaved)."""
    check_stages_balance(balance, stages.balance)
    if len(stages) != pp * virtual_stages:
        raise ValueError(
            f"the Stages hold {len(stages)} stages but the job has {pp} pipeline ranks x "
            f"{virtual_stages} virtual stages = {pp * virtual_stages}: launch "
            f"{len(stages) // virtual_stages * dp_size} processes (one stage per rank, "
            f"{virtual_stages} per rank interleaved), or split the model into "
            f"{pp * virtual_stages} stages"
        )
    return list(stages.balance)


def _first_reader(routes: Routes) -> int:
    """The first stage that reads the pipe's inputs (its rank tells the others the batch)."""
    if not routes.reading_input:
        raise ValueError(
            f"no stage of the dataflow reads the pipe's inputs {routes.dataflow.inputs}: "
            "a pipe needs at least one stage that does"
        )
    return min(routes.reading_input)
