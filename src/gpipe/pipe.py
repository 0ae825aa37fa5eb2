"""GPipe: the user-facing module that runs an nn.Sequential (or :class:`~gpipe.Stages`) as a
pipeline."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from gpipe.analysis import Timeline, kept_microbatches
from gpipe.arguments import refuse_keywords
from gpipe.balance.optimizer_state import OptimizerSpec
from gpipe.core.pipe_core import PipeCore
from gpipe.core.targets import LossFn, check_train_arguments, weighted_loss
from gpipe.dataflow import Stages
from gpipe.generation.local import LocalGeneration
from gpipe.local_layout import (
    Device,
    check_placement,
    find_balance,
    fit_devices,
    given_devices,
    refuse_meta,
    stages_layout,
)
from gpipe.loss import weighted_total
from gpipe.microbatch import Batch, BatchDims, gather
from gpipe.partition import split_module
from gpipe.runtime.caller import PipelineBackward, backward_into_input, collect_outputs
from gpipe.runtime.mailbox import LocalTransport
from gpipe.runtime.routes import Routes
from gpipe.runtime.stage_set import StageSet
from gpipe.schedule import BACKWARD, FORWARD, Schedule, make_schedule
from gpipe.skip import has_skippables
from gpipe.skip import stages as skip_stages
from gpipe.structure import leaves
from gpipe.tied import TiedParameters

if TYPE_CHECKING:  # planning sits above the pipe: only its types are named here
    from gpipe.planning.plan_report import Plan, PlanOrReport

__all__ = ["GPipe"]

_MOVING_DENIED = (
    "the pipe owns device placement: pass devices=[...] to GPipe instead of moving it with "
    ".to(device)/.cuda()/.cpu() (.to(dtype) is fine)"
)


class GPipe(PipeCore, LocalGeneration):
    """Run an ``nn.Sequential`` (or :class:`~gpipe.Stages`) as a pipeline of stages over
    micro-batches (GPipe).

    The module is cut into consecutive stages, one per device. Each mini-batch is split into
    ``chunks`` micro-batches that flow through the stages concurrently (one worker thread per
    device, kept until :meth:`close` or until the pipe is garbage collected); gradients of
    all micro-batches accumulate in the user's own parameters, so a step equals training on
    the whole mini-batch.

    A model that is not a chain comes as :class:`~gpipe.Stages` (from :func:`gpipe.split`,
    or built by hand): one module per stage and a :class:`~gpipe.dataflow.Dataflow` saying
    which named values each stage reads from where. Its stages are the pipe's (its
    ``balance`` and ``devices`` too); each value goes directly from the stage that makes it
    to every stage that reads it, and ``pipe(*args, **kwargs)`` takes the model's inputs.

    Args:
        module: the model, an ``nn.Sequential``, or :class:`~gpipe.Stages`; its layers are
            moved to their devices.
        balance: layers per stage (``[3, 2, 3]``); or how to find it: "params" (also
            None) evens out parameter counts, "time" measured forward + backward time,
            "memory" the memory each stage holds under the schedule (both need ``sample``).
        devices: one device per stage (extra ones go unused); None puts every stage on "cpu"
            (as many stages as ``balance`` lists, else one per GPU, else 2). Stages on one
            GPU run on one thread, in one order; every other device gets a thread of its own.
        chunks: M, the number of micro-batches per mini-batch (an int; ``8.0`` is taken).
        checkpoint: "always", "except_last" or "never": which micro-batches keep only their
            stage input and recompute the stage forward in the backward.
        schedule: the schedule ``train_step`` runs: a name in ``gpipe.schedule.SCHEDULES``
            ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "interleaved-zb",
            "looped-bfs", "v-half", "v-min", "dualpipev", "auto": searched with unit costs
            under 1F1B's memory), or a :class:`~gpipe.schedule.Schedule` built for ``chunks``
            micro-batches (e.g. by :func:`gpipe.analysis.search` with your costs). The
            schedule also says which device holds each stage (zb-v, v-half, v-min,
            dualpipev: a V).
            ``pipe(x)`` followed by ``loss.backward()`` always runs GPipe's fill-drain.
        virtual_stages: model stages per device (the looped schedules: interleaved,
            interleaved-zb from 2, looped-bfs; 2 for zb-v, v-half, v-min and dualpipev);
            ``balance`` then lists ``len(devices) * virtual_stages`` entries.
        sample: a mini-batch like the ones to train on, for ``balance="time"|"memory"``.
        optimizer: the optimizer whose state ``balance="memory"`` counts ("adam", ...).
        track_memory: count the bytes each device holds for backward, for the timeline.
            Exact (a hook on every tensor autograd saves), so it costs a few percent on
            models made of many tiny ops; turn it off there once you have looked. On GPUs
            each step also resets their peak memory statistics, so :attr:`cuda_memory`
            gives the allocator's peak of the last step.
        deferred_batch_norm: replace the model's BatchNorm layers by
            :class:`~gpipe.batchnorm.DeferredBatchNorm`, whose running statistics are
            updated once per mini-batch, as in plain training, instead of once per
            micro-batch (each micro-batch is still normalized by its own statistics).
        input_batch_dims: where the input is batched: an int (the batch dim of every
            tensor), None (not batched: given whole to every micro-batch), or a
            tuple/list/dict of them shaped like the input or a prefix of it. Default 0.
        output_batch_dims: the same for the output, which ``pipe(x)`` concatenates along
            these dims; None marks a tensor that is the same in every micro-batch, returned
            once. An LSTM's ``(out, (h, c))`` is ``(0, 1)``. Default 0.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential`` or ``Stages``, ``balance`` is not
            a list or a name, a device is not a device, name or index, or a flag is not a
            bool.
        ValueError: an inconsistent balance, devices, chunks, checkpoint or schedule, a
            device this machine does not have (or "meta"), a layer object or a buffer that
            stages on two devices would share, or a ``balance`` that differs from the
            ``Stages``'.

    A Parameter that stages on different devices share (an embedding tied to the head)
    stays the user's, on the device of the first stage holding it; every other device
    reads a copy, refreshed from it at each ``pipe(x)`` or ``train_step``, whose gradients
    are added into its ``.grad``. ``pipe.parameters()`` and ``state_dict()`` hold only it.
    """

    partitions: nn.ModuleList | Stages  # one module per stage, holding the user's layers

    def __init__(
        self,
        module: nn.Sequential | Stages,
        balance: Sequence[int] | str | None = None,
        *,
        devices: Sequence[Device] | None = None,
        chunks: int = 1,
        checkpoint: str = "except_last",
        schedule: str | Schedule = "gpipe",
        virtual_stages: int = 1,
        sample: Any = None,
        optimizer: OptimizerSpec = None,
        track_memory: bool = True,
        deferred_batch_norm: bool = False,
        input_batch_dims: BatchDims = 0,
        output_batch_dims: BatchDims = 0,
    ) -> None:
        super().__init__()
        self._configure(
            module,
            balance,
            "GPipe",
            chunks=chunks,
            checkpoint=checkpoint,
            schedule=schedule,
            virtual_stages=virtual_stages,
            track_memory=track_memory,
            deferred_batch_norm=deferred_batch_norm,
            input_batch_dims=input_batch_dims,
            output_batch_dims=output_batch_dims,
        )
        if isinstance(module, nn.Sequential) and has_skippables(module):
            module = skip_stages(module, balance)  # so each skip goes straight to its reader
        self._fill_drain: dict[int, tuple[Schedule, Schedule, Schedule]] = {}
        if isinstance(module, Stages):
            self._flow = module
            self.balance, self.devices = stages_layout(module, balance, devices, virtual_stages)
            self._schedules: dict[int, Schedule] = {}
            self._place(module, deferred_batch_norm, routes=Routes(module.dataflow))
            return
        self._flow = None
        self._schedules = {}
        balance, self.devices = given_devices(module, balance, devices, virtual_stages)
        if balance is None or isinstance(balance, str):
            balance = find_balance(
                module,
                balance or "params",
                len(self.devices) * virtual_stages,
                sample=sample,
                optimizer=optimizer,
                chunks=self.chunks,
                batch_dims=self.input_batch_dims,
                kept=lambda: kept_microbatches(self._schedule_for(self.chunks), self.checkpoint),
            )
        self.balance, self.devices = fit_devices(module, balance, self.devices, virtual_stages)
        self._module = [module]  # kept unregistered: the partitions own the layers
        self._place(module, deferred_batch_norm)

    def _place(
        self, model: nn.Sequential | Stages, deferred_batch_norm: bool, routes: Routes | None = None
    ) -> None:
        """Put each stage module on its device, sharing tied Parameters, and make the
        workers' stage set and transport."""
        # Validate the schedule now, not at the first step; it also places the stages.
        placement = self._schedule_for(self.chunks).placement if self.balance else ()

        def stage_modules() -> nn.ModuleList | Stages:
            if isinstance(model, Stages):
                return model
            return split_module(model, self.balance)

        refuse_meta(model)
        # Refuse a tensor that two devices cannot share before changing the user's model.
        TiedParameters(stage_modules(), placement, self.devices)
        self._convert_batch_norm(model, deferred_batch_norm)
        self.partitions = stage_modules()  # after the conversion: its layers are the new ones
        self._keep_deferred(self.partitions)
        tied = TiedParameters(self.partitions, placement, self.devices)
        tied.place(self.partitions)
        self._stages = StageSet(
            list(self.partitions),
            self.devices,
            placement,
            routes=routes,
            balance=self.balance if routes is not None else None,
            tied=tied if len(tied) else None,
        )
        self._transport = LocalTransport(placement, self.devices, routes)

    @classmethod
    def from_plan(cls, module: nn.Module, plan: PlanOrReport) -> GPipe:
        """The pipe a :func:`gpipe.plan` result describes: stages, chunks, schedule...

        Args:
            module: the model that was planned: an ``nn.Sequential``, ``Stages`` (grouped
                into the plan's stages), or any other model (cut by :func:`gpipe.split` at
                the plan's ``split_points``, traced on the planner's sample again).
            plan: a ``Plan``, or the whole report (its best plan is used).

        Raises:
            TypeError: ``module`` is not the kind of model the plan was made for.
        """
        chosen = cast("Plan", getattr(plan, "best", plan))
        # NOTE: a plan-like object of one's own (pipe_kwargs only) pipes the module as given
        built = chosen.pipe_module(module) if hasattr(chosen, "pipe_module") else module
        return cls(cast("nn.Sequential | Stages", built), **chosen.pipe_kwargs())

    # -- nn.Sequential-like access to the user's layers --------------------------------

    def __len__(self) -> int:
        if self._flow is not None:  # Stages: no flat list of layers, the stage modules
            return len(self._flow)
        return sum(len(p) for p in self._partition_list)

    def __iter__(self) -> Iterator[nn.Module]:
        if self._flow is not None:
            yield from self._flow
            return
        for partition in self._partition_list:
            yield from partition

    @property
    def _partition_list(self) -> list[nn.Sequential]:
        return list(self.partitions)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> nn.Module:
        layers = list(self)
        if not -len(layers) <= index < len(layers):
            raise IndexError(f"layer index {index} out of range for {len(layers)} layers")
        return layers[index]

    # -- the pipe owns device placement ------------------------------------------------

    def cuda(self, device: Any = None) -> GPipe:
        raise TypeError(_MOVING_DENIED)

    def cpu(self) -> GPipe:
        raise TypeError(_MOVING_DENIED)

    def to(self, *args: Any, **kwargs: Any) -> GPipe:
        """Only dtype conversions: ``pipe.to(torch.float64)``; devices are set at creation."""
        if "device" in kwargs or "tensor" in kwargs:
            raise TypeError(_MOVING_DENIED)
        if args and (isinstance(args[0], (torch.device, str, int, torch.Tensor))):
            raise TypeError(_MOVING_DENIED)
        return super().to(*args, **kwargs)

    # -- copies and pickles: the model and settings, not the last step ----------------

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy``, ``pickle`` and ``torch.save`` carry: all but the last step.

        The last step (its timeline, its workers' state) and the transport between the
        workers (locks and conditions, which cannot be copied) stay behind: a copy has run
        no step yet, and gets its own transport.
        """
        state = self.__dict__.copy()
        del state["_transport"]
        state["_last"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._transport = LocalTransport(self._stages.placement, self.devices, self._stages.routes)

    # -- running -----------------------------------------------------------------------

    @property
    def timeline(self) -> Timeline:
        """What the last step did: per device, each action's start and end (seconds)."""
        step, schedule = self._last_step()
        timeline = step.timeline(schedule.name)
        timeline.transfers = self._transport.transfers(step.state.origin_ns)
        return timeline

    @property
    def cuda_memory(self) -> dict[torch.device, int]:
        """The CUDA allocator's peak bytes on each GPU during the last step (the timeline's
        ``memory`` is what the stages hold for backward; this is everything allocated).

        With ``track_memory`` on, each step resets each of the pipe's GPUs' peak statistics
        (``torch.cuda.reset_peak_memory_stats``) as it begins; empty when it is off.
        """
        return dict(self._last_step()[0].state.cuda_peaks)

    def predicted_timeline(self, transfer: float = 0.0) -> Timeline:
        """The simulator's timeline of the last step's schedule, fed its measured costs.

        Each stage's F, B and W cost is the median of its measured durations, so laying this
        beside :attr:`timeline` (``timeline.plot(path, compare=pipe.predicted_timeline())``)
        shows what the runtime lost to waiting, hand-offs and overhead. Each action's memory
        is the bytes the step counted for it: the count follows the action order and the
        sizes, never the timing (see ``gpipe.analysis.memory``), so it is the same.

        A model that is not a chain also sends values past the stages in between: the
        prediction shows each of those as its own transfer too.

        Args:
            transfer: seconds one hand-off between devices takes, for the prediction.

        Raises:
            RuntimeError: no step has run yet.
            ValueError: a negative ``transfer``.
        """
        if not transfer >= 0:  # also rejects nan
            raise ValueError(f"transfer must be seconds >= 0, got {transfer!r}")
        return self._predicted(self.timeline, transfer=transfer)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the input through the pipeline; the output lands on the last device.

        ``pipe(x)`` for an ``nn.Sequential``; ``pipe(*args, **kwargs)`` as the model is
        called for :class:`~gpipe.Stages` (named by ``Stages.bind``). Under autograd (grad
        enabled) the returned output is connected to a pipelined backward:
        ``loss.backward()`` runs each stage's backward on its own worker. The micro-batch
        outputs are concatenated along ``output_batch_dims``.
        """
        input = self._bind(args, kwargs)
        if not self.partitions:
            return _identity(input)
        batch = self._split_checked(input)
        grad = torch.is_grad_enabled()
        m = batch.microbatches
        schedule, forwards, backwards = self._fill_drain_for(m)
        step = self._new_step(schedule, m, len(self.devices), grad=grad, seed=self._seed())
        self._run(step, forwards, batch.parts)
        outputs = collect_outputs(step, m)
        if grad:
            outputs = PipelineBackward.connect(step, backwards, batch.parts, outputs)
        return gather(outputs, self.output_batch_dims, sizes=batch.sizes)

    def _fill_drain_for(self, microbatches: int) -> tuple[Schedule, Schedule, Schedule]:
        """GPipe's fill-drain for ``pipe(x)``: the whole schedule, its forwards, its backwards."""
        if microbatches not in self._fill_drain:
            whole = make_schedule(
                "gpipe",
                len(self.devices),
                microbatches,
                virtual_stages=self.virtual_stages,
                placement=self._stages.placement,
            )
            self._fill_drain[microbatches] = (
                whole,
                whole.only([FORWARD]),
                whole.only([BACKWARD]),
            )
        return self._fill_drain[microbatches]

    def train_step(
        self,
        input: Any,
        target: Any,
        loss_fn: LossFn,
        *,
        reduction: str = "mean",
        microbatch_weight: Callable[[Any], Any] | None = None,
        target_batch_dims: BatchDims = 0,
        kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """One pipelined forward and backward with the loss computed on the last stage.

        Gradients accumulate in the parameters (call ``optimizer.step()`` and
        ``zero_grad()`` yourself). Runs the pipe's ``schedule``.

        Args:
            input: the mini-batch (tensor, tuple/list or dict of tensors). For
                :class:`~gpipe.Stages`: the first positional input, or a tuple of the
                positional inputs.
            target: the targets, split into micro-batches like ``input``.
            loss_fn: ``loss_fn(output, target) -> scalar`` for one micro-batch.
            reduction: how ``loss_fn`` reduces over samples. "mean": each micro-batch loss is
                weighted by its share of the batch, so the result equals ``loss_fn`` on the
                whole batch even for uneven splits, when ``loss_fn`` is a mean over samples
                (see ``microbatch_weight`` otherwise). "sum": micro-batch losses are added.
            microbatch_weight: for a loss that is a mean over something other than samples:
                ``microbatch_weight(target) -> number`` (or 0-dim tensor) is what one
                micro-batch's loss averages over, e.g. ``lambda t: (t != -100).sum()`` for
                ``cross_entropy(..., ignore_index=-100)``. Micro-batch losses are weighted by
                it, normalized by its sum over the batch; a micro-batch of weight 0 adds
                nothing (not even the nan of a mean over no tokens).
            target_batch_dims: where ``target`` is batched (see ``input_batch_dims``).
            kwargs: for :class:`~gpipe.Stages`, the keyword inputs (an attention mask...).

        Returns:
            The loss of the whole mini-batch (detached), on the last device.

        Raises:
            ValueError: a target batch that does not match the input, a bad reduction, or
                a weight that is negative, not finite, or zero for every micro-batch.
            TypeError: a weight that is not a number or a 0-dim tensor, or a ``loss_fn``
                that is not callable.
        """
        check_train_arguments(loss_fn, reduction, microbatch_weight, target_batch_dims)
        positional = input if self._flow is not None and isinstance(input, tuple) else (input,)
        input = self._bind(positional, kwargs or {}, keywords=kwargs is not None)
        if not self.partitions:  # the empty pipe: the loss of the input itself
            value = loss_fn(input, target)
            value.backward()
            return value.detach()
        batch = self._split_checked(input)
        last_device = self._stages.device_of(self._stages.last)
        loss = weighted_loss(
            target,
            target_batch_dims,
            batch.sizes,
            loss_fn,
            reduction,
            microbatch_weight,
            last_device,
        )
        schedule = self._schedule_for(batch.microbatches)
        step = self._new_step(
            schedule,
            batch.microbatches,
            len(self.devices),
            grad=True,
            seed=self._seed(),
            loss=loss,
        )
        self._run(step, schedule, batch.parts)
        backward_into_input(step, batch.parts)
        return weighted_total(loss.weights, step.state.losses)

    def close(self) -> None:
        """End the pipe's worker threads now instead of when the pipe is garbage collected.

        A later step starts them again. A Parameter tied across devices is read by every
        module that holds it again, not by the pipe's copy (see :mod:`gpipe.tied`), so the
        model called directly after ``close()`` computes what plain PyTorch would.
        """
        self._stages.threads.close()
        if self._stages.tied is not None:
            self._stages.tied.release()

    # -- pieces ------------------------------------------------------------------------

    def _pipeline_devices(self) -> int:
        return len(self.devices)

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any], keywords: bool = True) -> Any:
        """The input of a call: the one input of a Sequential, the named inputs of Stages.

        Raises:
            TypeError: not one input for a Sequential, or inputs the Stages do not take.
        """
        if self._flow is not None:
            return self._flow.bind(*args, **kwargs)
        if keywords and kwargs:
            if args or list(kwargs) != ["input"]:
                refuse_keywords(kwargs)
            return kwargs["input"]
        if len(args) != 1:
            raise TypeError(
                f"a pipe over an nn.Sequential takes one input, got {len(args)}: pass a tuple "
                "of tensors as one input, or split the model into gpipe.Stages"
            )
        return args[0]

    def _split_checked(self, input: Any) -> Batch:
        """``input`` cut into micro-batches, once every stage is where the pipe put it."""
        check_placement(self.partitions, self._stages)
        return self._split(input)


def _identity(input: Any) -> Any:
    """The empty pipe's output: its input, which must hold a tensor (as in torchgpipe)."""
    if not any(isinstance(leaf, torch.Tensor) for leaf in leaves(input)):
        raise TypeError(
            f"expected a tensor, or a tuple/list/dict holding tensors, got {type(input).__name__}"
        )
    return input
