"""GPipe: the user-facing module that runs an nn.Sequential (or :class:`~gpipe.Stages`) as a
pipeline."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from gpipe.analysis import Costs, Timeline, kept_microbatches, simulate, skips_from_timeline
from gpipe.arguments import (
    check_balance_type,
    check_flag,
    check_model,
    check_stages_balance,
    check_target_size,
    check_virtual,
    refuse_keywords,
)
from gpipe.balance import balance_by_memory, balance_by_params, balance_by_time
from gpipe.batchnorm import (
    DeferredBatchNorm,
    committing,
    convert_deferred_batch_norm,
    refuse_reused_batch_norm,
)
from gpipe.dataflow import Stages, named_batch_dims
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
from gpipe.runtime.caller import PipelineBackward, backward_into_input, collect_outputs, feed
from gpipe.runtime.devices import as_devices
from gpipe.runtime.mailbox import LocalTransport
from gpipe.runtime.routes import Routes
from gpipe.runtime.stages import StageSet
from gpipe.runtime.state import Loss, StepState
from gpipe.runtime.step import Step
from gpipe.schedule import (
    BACKWARD,
    FORWARD,
    Schedule,
    check_virtual_stages,
    make_schedule,
)
from gpipe.settings import StepSettings
from gpipe.skip import has_skippables
from gpipe.skip import stages as skip_stages
from gpipe.structure import leaves, map_tensors
from gpipe.tied import TiedParameters

__all__ = ["GPipe"]

Device = torch.device | str | int

_MOVING_DENIED = (
    "the pipe owns device placement: pass devices=[...] to GPipe instead of moving it with "
    ".to(device)/.cuda()/.cpu() (.to(dtype) is fine)"
)


def _default_stage_count(module: nn.Sequential) -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(1, min(len(module), gpus or 2))


def _empty_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 0


class _TooFewDevices(ValueError, IndexError):
    """``balance`` and ``devices`` disagree, most often fewer devices than stages: a
    ValueError, and an IndexError as torchgpipe raises for too few devices."""


class GPipe(StepSettings, nn.Module):
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
            ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "auto": searched
            with unit costs under 1F1B's memory), or a :class:`~gpipe.schedule.Schedule`
            built for ``chunks`` micro-batches (e.g. by :func:`gpipe.analysis.search` with
            your costs). The schedule also says which device holds each stage (zb-v: a V).
            ``pipe(x)`` followed by ``loss.backward()`` always runs GPipe's fill-drain.
        virtual_stages: model stages per device (interleaved schedules, 2 for zb-v);
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
        optimizer: Any = None,
        track_memory: bool = True,
        deferred_batch_norm: bool = False,
        input_batch_dims: BatchDims = 0,
        output_batch_dims: BatchDims = 0,
    ) -> None:
        super().__init__()
        check_virtual(virtual_stages)
        check_virtual_stages(schedule, virtual_stages)
        check_balance_type(balance)
        if not isinstance(module, Stages):
            check_model(module, "GPipe")
        check_flag("track_memory", track_memory)
        check_flag("deferred_batch_norm", deferred_batch_norm)
        if isinstance(module, nn.Sequential) and has_skippables(module):
            # NOTE: so each skip goes straight to the stage popping it.
            module = skip_stages(module, balance)
        self.checkpoint = checkpoint
        self.chunks = chunks
        self.input_batch_dims = check_batch_dims(input_batch_dims, "input_batch_dims")
        self.output_batch_dims = check_batch_dims(output_batch_dims, "output_batch_dims")
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self.track_memory = track_memory
        self._schedules: dict[int, Schedule] = {}
        self._fill_drain: dict[int, tuple[Schedule, Schedule, Schedule]] = {}
        self._last: Step | None = None
        self._last_schedule: Schedule | None = None
        self._flow: Stages | None = None
        if isinstance(module, Stages):
            self._init_stages(module, balance, devices, deferred_batch_norm)
            return

        if len(module) == 0 and (balance is None or _empty_list(balance)):
            balance, devices = [], []  # torchgpipe's empty pipe: the identity, no stage
        if devices is None:
            count = None
            if balance is not None and not isinstance(balance, str):
                count = len(balance) // virtual_stages
            devices = ["cpu"] * (count or _default_stage_count(module))
        # torchgpipe's empty pipe has no stage, so no device to check
        self.devices = as_devices(devices) if len(module) or devices else []
        if balance is None or isinstance(balance, str):
            balance = self._find_balance(
                module, balance or "params", len(self.devices) * virtual_stages, sample, optimizer
            )
        balance = check_balance(module, balance)
        self.devices = self.devices[: math.ceil(len(balance) / virtual_stages)]  # extras unused
        stage_count = len(self.devices) * virtual_stages
        if len(balance) != stage_count:
            raise _TooFewDevices(
                f"balance lists {len(balance)} stages but devices lists {len(self.devices)} "
                f"devices (x {virtual_stages} virtual stages = {stage_count}); give one "
                "balance entry per stage, or one device per stage"
            )
        self.balance = balance
        # Validate the schedule now, not at the first step; it also places the stages.
        placement = self._schedule_for(self.chunks).placement if balance else ()

        # Refuse a tensor that two devices cannot share before changing the user's model.
        TiedParameters(split_module(module, balance), placement, self.devices)
        if deferred_batch_norm:
            refuse_reused_batch_norm(module)
            convert_deferred_batch_norm(module)
        self._deferred = [m for m in module.modules() if isinstance(m, DeferredBatchNorm)]
        self._module = [module]  # kept unregistered: the partitions own the layers
        self.partitions = split_module(module, balance)
        tied = TiedParameters(self.partitions, placement, self.devices)
        tied.place(self.partitions)
        self._stages = StageSet(
            list(self.partitions), self.devices, placement, tied=tied if len(tied) else None
        )
        self._transport = LocalTransport(placement, self.devices)

    def _init_stages(
        self,
        stages: Stages,
        balance: Any,
        devices: Sequence[Device] | None,
        deferred_batch_norm: bool,
    ) -> None:
        """The pipe over ``stages``: their balance, devices (unless given) and dataflow."""
        count, v = len(stages), self.virtual_stages
        if count == 0:
            raise ValueError("the Stages hold no stage: split the model into at least one")
        check_stages_balance(balance, stages.balance)
        if count % v:
            raise ValueError(
                f"{count} stages cannot be spread over devices with virtual_stages={v}: "
                f"the stage count must be a multiple of {v}"
            )
        if devices is None:
            devices = stages.devices if stages.devices is not None else ["cpu"] * (count // v)
        self.devices = as_devices(devices)[: count // v]  # extras unused
        if len(self.devices) * v != count:
            raise _TooFewDevices(
                f"the Stages hold {count} stages but devices lists {len(self.devices)} devices "
                f"(x {v} virtual stages = {len(self.devices) * v}): give one device per "
                f"{v} stage(s)"
            )
        self.balance = list(stages.balance)
        placement = self._schedule_for(self.chunks).placement
        TiedParameters(stages, placement, self.devices)  # refuses before changing anything
        if deferred_batch_norm:
            refuse_reused_batch_norm(stages)
            convert_deferred_batch_norm(stages)
        self._deferred = [m for m in stages.modules() if isinstance(m, DeferredBatchNorm)]
        self._flow = stages
        self.partitions = stages
        tied = TiedParameters(stages, placement, self.devices)
        tied.place(stages)
        routes = Routes(stages.dataflow)
        self._stages = StageSet(
            list(stages),
            self.devices,
            placement,
            routes=routes,
            balance=stages.balance,
            tied=tied if len(tied) else None,
        )
        self._transport = LocalTransport(placement, self.devices, routes)

    @classmethod
    def from_plan(cls, module: nn.Sequential, plan: Any) -> GPipe:
        """The pipe a :func:`gpipe.plan` result describes: stages, chunks, schedule...

        Args:
            module: the model that was planned.
            plan: a ``Plan``, or the whole report (its best plan is used).
        """
        plan = getattr(plan, "best", plan)
        return cls(module, **plan.pipe_kwargs())

    def _find_balance(
        self, module: nn.Sequential, how: str, stages: int, sample: Any, optimizer: Any
    ) -> list[int]:
        if stages > len(module):
            raise ValueError(
                f"more stages ({stages}) than layers ({len(module)}): use at most "
                f"{len(module)} devices"
            )
        if how == "params":
            return balance_by_params(module, stages)
        if how not in ("time", "memory"):
            raise ValueError(
                f"balance must be a list of layers per stage or one of 'params', 'time', "
                f"'memory'; got {how!r}"
            )
        if sample is None:
            raise ValueError(
                f"balance={how!r} measures the model: pass sample=<a mini-batch> as well"
            )
        microbatch = scatter(sample, self.chunks, self.input_batch_dims)[0]
        if how == "time":
            return balance_by_time(module, microbatch, stages)
        kept = kept_microbatches(self._schedule_for(self.chunks), self.checkpoint)
        return balance_by_memory(
            module, microbatch, stages, optimizer=optimizer, kept_microbatches=kept
        )

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
        state["_last"] = state["_last_schedule"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._transport = LocalTransport(self._stages.placement, self.devices, self._stages.routes)

    # -- running -----------------------------------------------------------------------

    @property
    def timeline(self) -> Timeline:
        """What the last step did: per device, each action's start and end (seconds)."""
        if self._last is None or self._last_schedule is None:
            raise RuntimeError("no step has run yet: call pipe(x) or pipe.train_step(...) first")
        timeline = self._last.timeline(self._last_schedule.name)
        timeline.transfers = self._transport.transfers(self._last.state.origin_ns)
        return timeline

    @property
    def cuda_memory(self) -> dict[torch.device, int]:
        """The CUDA allocator's peak bytes on each GPU during the last step (the timeline's
        ``memory`` is what the stages hold for backward; this is everything allocated).

        With ``track_memory`` on, each step resets each of the pipe's GPUs' peak statistics
        (``torch.cuda.reset_peak_memory_stats``) as it begins; empty when it is off.
        """
        if self._last is None:
            raise RuntimeError("no step has run yet: call pipe(x) or pipe.train_step(...) first")
        return dict(self._last.state.cuda_peaks)

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
        measured = self.timeline
        schedule = self._last_schedule
        assert schedule is not None
        costs = Costs.from_timeline(measured, stages=schedule.stages)
        skips = skips_from_timeline(measured, self._skip_pairs())
        predicted = simulate(schedule, dataclasses.replace(costs, transfer=transfer), skips)
        counted = {
            (device, event.action): event.memory
            for device, events in enumerate(measured.events)
            for event in events
        }
        events = [
            [dataclasses.replace(e, memory=counted.get((device, e.action), 0)) for e in events]
            for device, events in enumerate(predicted.events)
        ]
        return Timeline(events, "s", predicted.schedule, transfers=predicted.transfers)

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
        microbatches, sizes = self._scatter(input)
        grad = torch.is_grad_enabled()
        m = len(microbatches)
        if m not in self._fill_drain:  # the whole schedule, its forwards, its backwards
            whole = make_schedule(
                "gpipe",
                len(self.devices),
                m,
                virtual_stages=self.virtual_stages,
                placement=self._stages.placement,
            )
            self._fill_drain[m] = (whole, whole.only([FORWARD]), whole.only([BACKWARD]))
        schedule, forwards, backwards = self._fill_drain[m]
        step = self._new_step(m, grad=grad, schedule=schedule)
        feed(step, microbatches)
        self._run_committing(step, forwards)
        outputs = collect_outputs(step, m)
        if grad:
            outputs = PipelineBackward.connect(step, backwards, microbatches, outputs)
        return gather(outputs, self.output_batch_dims, sizes=sizes)

    def train_step(
        self,
        input: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
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
        check_loss_arguments(loss_fn, reduction, microbatch_weight)
        if not torch.is_grad_enabled():
            raise RuntimeError("train_step needs autograd: call it outside torch.no_grad()")
        check_batch_dims(target_batch_dims, "target_batch_dims")
        positional = input if self._flow is not None and isinstance(input, tuple) else (input,)
        input = self._bind(positional, kwargs or {}, keywords=kwargs is not None)
        if not self.partitions:  # the empty pipe: the loss of the input itself
            value = loss_fn(input, target)
            value.backward()
            return value.detach()
        microbatches, sizes = self._scatter(input)
        total = sum(sizes)
        target_size = batch_size(target, target_batch_dims, what="target")
        check_target_size(target_size, total)
        targets = scatter(target, len(microbatches), target_batch_dims, what="target")
        weights = microbatch_weights(targets, sizes, reduction, microbatch_weight)
        if reduction == "mean":
            weights = normalized(weights, sum(weights))
        last_device = self._stages.device_of(self._stages.last)
        loss = Loss(loss_fn, [_on(t, last_device) for t in targets], weights)
        schedule = self._schedule_for(len(microbatches))
        step = self._new_step(len(microbatches), grad=True, loss=loss, schedule=schedule)
        feed(step, microbatches)
        self._run_committing(step, schedule)
        backward_into_input(step, microbatches)
        return weighted_total(weights, step.state.losses)

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

    def _scatter(self, input: Any) -> tuple[list[Any], list[int]]:
        """The micro-batches of ``input``, and how many samples each holds."""
        self._check_placement()
        dims = self.input_batch_dims
        if self._flow is not None:
            dims = named_batch_dims(dims, self._flow.dataflow.inputs)
        microbatches = scatter(input, self.chunks, dims)
        sizes = microbatch_sizes(batch_size(input, dims), self.chunks)
        return microbatches, sizes

    def _new_step(
        self,
        microbatches: int,
        *,
        grad: bool,
        loss: Loss | None = None,
        schedule: Schedule,
    ) -> Step:
        state = StepState(
            microbatches,
            len(self.devices),
            grad=grad,
            checkpoint=self.checkpoint if (grad and self.training) else "never",
            seed=draw_step_seed() if self.training else 0,
            loss=loss,
            split_backward=schedule.split_backward,
            track_memory=self.track_memory,
        )
        step = Step(self._stages, self._transport, state)
        self._last = step
        self._last_schedule = schedule
        return step

    def _run_committing(self, step: Step, schedule: Schedule) -> None:
        """Run ``schedule``; deferred batch norm folds its statistics in if the step succeeds."""
        with committing(self._deferred):
            step.run(schedule.actions)

    def _skip_pairs(self) -> list[tuple[int, int]]:
        """(sending stage, reading stage) of each message between stages that are not
        neighbours (the pipe's inputs come from the caller, and cost nothing)."""
        if self._flow is None:
            return []
        return [(s, r) for s, r, _ in self._flow.dataflow.skips() if s >= 0]

    def _check_placement(self) -> None:
        tied = self._stages.tied
        for stage, partition in enumerate(self.partitions):
            device = self._stages.device_of(stage)
            for name, tensor in [*partition.named_parameters(), *partition.named_buffers()]:
                if tied is not None:  # what the stage reads: a tied Parameter's copy
                    tensor = tied.read_by(stage, tensor)
                if tensor.device != device and not (
                    device.type == tensor.device.type and device.index is None
                ):
                    raise ValueError(
                        f"{name!r} of stage {stage} is on {tensor.device} but the stage runs "
                        f"on {device}: the pipe owns device placement, so don't move its "
                        "layers after wrapping; pass devices=[...] to GPipe instead"
                    )


def _on(value: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: t.to(device), value)


def _identity(input: Any) -> Any:
    """The empty pipe's output: its input, which must hold a tensor (as in torchgpipe)."""
    if not any(isinstance(leaf, torch.Tensor) for leaf in leaves(input)):
        raise TypeError(
            f"expected a tensor, or a tuple/list/dict holding tensors, got {type(input).__name__}"
        )
    return input
