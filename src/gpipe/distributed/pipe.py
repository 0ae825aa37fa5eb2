"""DistributedGPipe: the SPMD front end, one pipeline device per process.

Every rank builds ``DistributedGPipe(model, ...)`` from the same arguments. Each keeps only
its own stages (materializing them if the model was built on the meta device), runs only its
own action list with the same StageWorker as the local pipe, and talks to the other ranks
through the point-to-point transport. The first stage's rank reads the inputs, the last
stage's rank computes the loss, and the loss comes back on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import os
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gpipe
from gpipe.analysis import Costs, Event, Timeline, Transfer, simulate
from gpipe.balance import balance_by_params
from gpipe.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm
from gpipe.checkpoint import check_checkpoint
from gpipe.distributed.clock import offsets_to_rank0
from gpipe.distributed.faults import Failure, FaultChannel, PipelineFailure
from gpipe.distributed.launch import device as default_device
from gpipe.distributed.link import measure_link
from gpipe.distributed.transport import P2PTransport
from gpipe.microbatch import batch_size, gather, scatter
from gpipe.partition import check_balance, split_module
from gpipe.randomness import draw_step_seed
from gpipe.runtime.caller import backward_into_input, to_stage
from gpipe.runtime.stages import Stages
from gpipe.runtime.state import Loss, StepState
from gpipe.runtime.step import Step
from gpipe.runtime.transport import ACTIVATION
from gpipe.schedule import BACKWARD, FORWARD, Action, Schedule, make_schedule, validate
from gpipe.structure import map_tensors

__all__ = ["DistributedGPipe"]

_COUNTER = itertools.count()


class DistributedGPipe(nn.Module):
    """Run an ``nn.Sequential`` as a pipeline with one device per process (torchrun).

    Every rank constructs it with the same arguments and calls the same methods in the same
    order (SPMD). The pipeline devices are the ranks of the job, in order: stage placement
    follows the schedule (device ``d`` is rank ``d``).

    Args:
        module: the model, an ``nn.Sequential``; it may live on the meta device, in which
            case only this rank's layers are ever materialized.
        balance: layers per model stage (``world_size * virtual_stages`` entries); None
            evens out parameter counts.
        chunks: M, micro-batches per mini-batch.
        checkpoint: "always", "except_last" or "never" (as :class:`gpipe.GPipe`).
        schedule: the schedule's name (as :class:`gpipe.GPipe`).
        virtual_stages: model stages per rank.
        init_fn: initializes this rank's layers after materialization from meta, applied
            like ``layer.apply(init_fn)``; by default each submodule's own
            ``reset_parameters()``.
        timeout: seconds a rank waits for a message before declaring its sender lost.
        track_memory: count the bytes each rank holds for backward (for the timeline).
        deferred_batch_norm: as :class:`gpipe.GPipe`.
        overlap: receive ahead of need and send in the background (the default). False
            makes every transfer wait for both sides, to measure what overlap is worth;
            only for schedules whose ranks consume each peer's messages in the order sent
            (gpipe's fill-drain).

    Raises:
        RuntimeError: the process group is not initialized (call ``gpipe.distributed.init()``).
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: a configuration that cannot run (more stages than layers, a balance
            that does not fit, ranks given different arguments...), raised on every rank
            before any step.
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | None = None,
        *,
        chunks: int = 1,
        checkpoint: str = "except_last",
        schedule: str = "gpipe",
        virtual_stages: int = 1,
        init_fn: Callable[[nn.Module], None] | None = None,
        timeout: float = 300.0,
        track_memory: bool = True,
        deferred_batch_norm: bool = False,
        overlap: bool = True,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedGPipe needs a process group: call gpipe.distributed.init() first "
                "(and launch with torchrun)"
            )
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"DistributedGPipe takes an nn.Sequential, got {type(module).__name__}")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.rank = dist.get_rank()
        self.ranks = list(range(dist.get_world_size()))
        self.device_index = self.ranks.index(self.rank)
        self.chunks = chunks
        self.checkpoint = check_checkpoint(checkpoint)
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self.track_memory = track_memory
        self.timeout = float(timeout)
        self.torch_device = default_device()
        devices = len(self.ranks)
        stages = devices * virtual_stages
        if stages > len(module):
            raise ValueError(
                f"{devices} ranks x {virtual_stages} virtual stages = {stages} stages, but the "
                f"model has {len(module)} layers: launch at most {len(module) // virtual_stages}"
                " processes, or split the model into more layers"
            )
        if balance is None:
            balance = balance_by_params(module, stages)
        self.balance = check_balance(module, balance)
        if len(self.balance) != stages:
            raise ValueError(
                f"balance lists {len(self.balance)} stages but the job has {devices} ranks x "
                f"{virtual_stages} virtual stages = {stages}: give one entry per stage, or "
                f"launch {len(self.balance) // virtual_stages} processes"
            )
        self._schedules: dict[int, Schedule] = {}
        placement = self._schedule_for(chunks).placement
        self._check_same_everywhere(module)

        if deferred_batch_norm:
            convert_deferred_batch_norm(module)
        partitions = split_module(module, self.balance)
        self.local_stages = [s for s in range(stages) if placement[s] == self.device_index]
        held: list[nn.Module | None] = []
        for stage, partition in enumerate(partitions):
            if stage in self.local_stages:
                _materialize(partition, self.torch_device, init_fn)
                held.append(partition)
            else:
                partition.to("meta")  # frees this rank's copy of layers it does not run
                held.append(None)
        self.partitions = nn.ModuleList([p for p in held if p is not None])
        self._deferred = [
            m for p in self.partitions for m in p.modules() if isinstance(m, DeferredBatchNorm)
        ]
        self._stages = Stages(held, [self.torch_device] * devices, placement)

        self._group, self._control = _process_groups(tuple(self.ranks), self.timeout)
        self._clock_offset_ns = offsets_to_rank0(self.ranks, self._control)
        self._link = _link_of(tuple(self.ranks), self._control)
        # NOTE: the default store is the one every rank already shares (torchrun's agent's
        # or rank 0's); torch offers no public accessor for it.
        store = dist.distributed_c10d._get_default_store()
        self._state: StepState | None = None
        me = weakref.ref(self)

        def on_failure(failure: Failure) -> None:  # the watcher must not keep the pipe alive
            pipe = me()
            if pipe is not None:
                pipe._on_failure(failure)

        self._faults = FaultChannel(store, f"gpipe/pipe{next(_COUNTER)}", self.rank, on_failure)
        self._transport = P2PTransport(
            placement,
            self.device_index,
            self.ranks,
            self.torch_device,
            self._group,
            self._control,
            self.timeout,
            self._faults.publish,
            overlap,
        )
        self._last: tuple[Step, Schedule] | None = None

    # -- training ----------------------------------------------------------------------

    def train_step(
        self,
        input: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """One pipelined forward and backward; every rank calls it.

        ``input`` is read on the first stage's rank and ``target`` on the last stage's;
        the other ranks may pass anything (None). Gradients accumulate in this rank's
        parameters; call ``optimizer.step()`` on every rank.

        Returns:
            The loss of the whole mini-batch (detached), on every rank.
        """
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        with self._failing_together():
            return self._train_step(input, target, loss_fn, reduction)

    def _train_step(
        self, input: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor], reduction: str
    ) -> torch.Tensor:
        first, last = self._holds(0), self._holds(self._stages.last)
        microbatches = scatter(input, self.chunks) if first else None
        count, total, seed = self._begin(
            None if microbatches is None else (len(microbatches), batch_size(input))
        )
        schedule = self._schedule_for(count)
        loss = None
        if last:
            if batch_size(target) != total:
                raise ValueError(
                    f"target has batch size {batch_size(target)} but the input has {total}; "
                    "give one target per sample"
                )
            targets = [_on(t, self.torch_device) for t in scatter(target, count)]
            weights = [batch_size(t) / total if reduction == "mean" else 1.0 for t in targets]
            loss = Loss(loss_fn, targets, weights)
        step = self._run(schedule, count, seed, grad=True, loss=loss, inputs=microbatches)
        if first and microbatches is not None:
            backward_into_input(step, microbatches)
        value = torch.zeros((), dtype=torch.float64)
        if loss is not None:
            parts = [w * v for w, v in zip(loss.weights, step.state.losses) if v is not None]
            value = torch.stack(parts).sum().double().cpu()
        source = self._rank_of(self._stages.last)
        self._collective(lambda: dist.broadcast(value, source, self._control, async_op=True))
        return value.to(self.torch_device)

    @torch.no_grad()
    def eval_step(self, input: Any) -> Any:
        """Forward only: the output on the last stage's rank, None on the others."""
        with self._failing_together():
            return self._eval_step(input)

    def _eval_step(self, input: Any) -> Any:
        first, last = self._holds(0), self._holds(self._stages.last)
        microbatches = scatter(input, self.chunks) if first else None
        count, _, seed = self._begin(
            None if microbatches is None else (len(microbatches), batch_size(input))
        )
        forwards = self._schedule_for(count).only([FORWARD])
        step = self._run(forwards, count, seed, grad=False, loss=None, inputs=microbatches)
        if not last:
            return None
        outputs = [
            step.transport.collect((ACTIVATION, self._stages.count, i)) for i in range(count)
        ]
        return gather(outputs)

    @property
    def timeline(self) -> Timeline:
        """The last step on every rank, on rank 0's clock, with the messages between ranks.

        A collective: every rank must ask for it, in the same order as its other calls.
        Each rank's events are shifted by its clock's offset from rank 0's (measured when
        the pipe was made), so the rows line up; ``transfers`` holds every message from its
        hand-over by the sender to its arrival at the receiver.
        """
        if self._last is None:
            raise RuntimeError("no step has run yet: call train_step or eval_step first")
        step, schedule = self._last
        offset = self._clock_offset_ns

        def seconds(ns: int) -> float:  # this rank's perf_counter_ns, on rank 0's clock
            return (ns - offset) / 1e9

        origin = seconds(step.state.origin_ns)
        mine = {
            "events": [
                (str(e.action), origin + e.start, origin + e.end, e.memory)
                for e in step.state.events[self.device_index]
            ],
            "sent": [(tag, peer, seconds(ns)) for tag, peer, ns in self._transport.sent],
            "received": [
                (t.tag, t.source, seconds(t.done_ns), t.nbytes) for t in self._transport.transfers
            ],
        }
        gathered: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(gathered, mine, group=self._control)
        zero = min((e[1] for g in gathered for e in g["events"]), default=origin)
        events = [
            [
                Event(Action.parse(a), start - zero, end - zero, m)
                for a, start, end, m in g["events"]
            ]
            for g in gathered
        ]
        device = {rank: d for d, rank in enumerate(self.ranks)}
        handed = {
            (tuple(tag), device[self.ranks[d]], device[peer]): at
            for d, g in enumerate(gathered)
            for tag, peer, at in g["sent"]
        }
        transfers = []
        for target, g in enumerate(gathered):
            for tag, source_rank, arrived, nbytes in g["received"]:
                source = device[source_rank]
                start = handed.get((tuple(tag), source, target), arrived)
                kind = FORWARD if tag[0] == ACTIVATION else BACKWARD
                transfers.append(
                    Transfer(
                        kind, tag[1], tag[2], source, target, start - zero, arrived - zero, nbytes
                    )
                )
        return Timeline(events, "s", schedule.name, transfers=transfers, processes=True)

    def predicted_timeline(self) -> Timeline:
        """The simulator's account of the last step, fed what this step measured.

        Each stage's F, B and W cost is the median of its measured durations; each message
        between ranks costs the link's latency plus its bytes over the link's bandwidth
        (both measured between the first two ranks when the job's first pipe was made), with
        each stage's median message size. Laid beside :attr:`timeline`
        (``timeline.plot(path, compare=pipe.predicted_timeline())``) it shows what the step
        lost to waiting and overhead. A collective, like :attr:`timeline`.
        """
        measured = self.timeline
        schedule = self._last[1] if self._last is not None else None
        assert schedule is not None
        sizes = [0.0] * schedule.stages  # what each stage receives, median over the step
        for stage in range(1, schedule.stages):
            came = [t.nbytes for t in measured.transfers if t.kind == FORWARD and t.stage == stage]
            sizes[stage] = statistics.median(came) if came else 0.0
        latency, bandwidth = self._link
        costs = dataclasses.replace(
            Costs.from_timeline(measured, stages=schedule.stages),
            latency=latency,
            bandwidth=bandwidth,
            gradient_bytes=sizes,
        )
        predicted = simulate(schedule, costs)
        predicted.unit, predicted.processes = "s", True
        return predicted

    # -- checkpoints -------------------------------------------------------------------

    def user_view(self) -> nn.Module:
        """This rank's layers under their names in the user's model (``state_dict`` keys)."""
        view = nn.Module()
        for partition in self.partitions:
            for name, layer in partition.named_children():
                view.add_module(name, layer)
        return view

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        optimizer: torch.optim.Optimizer | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Save a checkpoint any layout can load; see :func:`gpipe.distributed.checkpoint.save`."""
        from gpipe.distributed.checkpoint import save

        save(self, path, optimizer=optimizer, extra=extra)

    def load(
        self, path: str | os.PathLike[str], *, optimizer: torch.optim.Optimizer | None = None
    ) -> dict[str, Any]:
        """Load a checkpoint; return its ``extra`` (see gpipe.distributed.checkpoint.load)."""
        from gpipe.distributed.checkpoint import load

        return load(self, path, optimizer=optimizer)

    def close(self) -> None:
        """Stop this pipe's background threads (also done when it is garbage collected)."""
        self._faults.close()
        self._transport.close()

    def __del__(self) -> None:
        faults = self.__dict__.get("_faults")
        if faults is not None:
            self.close()

    # -- pieces ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _failing_together(self) -> Iterator[None]:
        """A step that fails on any rank fails on every rank, all naming the same cause."""
        try:
            yield
        except BaseException:
            if self._transport.failure is not None:
                self._faults.acknowledge(len(self.ranks))
            raise

    def _holds(self, stage: int) -> bool:
        return self._stages.placement[stage] == self.device_index

    def _rank_of(self, stage: int) -> int:
        return self.ranks[self._stages.placement[stage]]

    def _begin(self, mine: tuple[int, int] | None) -> tuple[int, int, int]:
        """Agree on the step: micro-batches and batch size (from the first stage), seed."""
        seed = draw_step_seed() if self.training else 0
        header = torch.tensor([0, 0, seed] if mine is None else [*mine, seed], dtype=torch.int64)
        source = self._rank_of(0)
        self._collective(lambda: dist.broadcast(header, source, self._control, async_op=True))
        count, total, seed = header.tolist()
        return count, total, seed

    def _run(
        self,
        schedule: Schedule,
        count: int,
        seed: int,
        *,
        grad: bool,
        loss: Loss | None,
        inputs: list[Any] | None,
    ) -> Step:
        state = StepState(
            count,
            len(self.ranks),
            grad=grad,
            checkpoint=self.checkpoint if (grad and self.training) else "never",
            seed=seed,
            loss=loss,
            split_backward=schedule.split_backward,
            track_memory=self.track_memory,
        )
        self._state = state
        step = Step(self._stages, self._transport, state)
        self._transport.expect(_inbound(schedule, self.device_index, with_loss=grad))
        if inputs is not None:
            for i, mb in enumerate(inputs):
                self._transport.send((ACTIVATION, 0, i), to_stage(mb))
        actions = [
            schedule.actions[d] if d == self.device_index else () for d in range(len(self.ranks))
        ]
        self._last = (step, schedule)
        step.run(actions)
        self._transport.finish()
        for layer in self._deferred:
            layer.commit()
        return step

    def _collective(self, start: Callable[[], Any]) -> None:
        """Run a collective (``start`` returns its Work) and wait for it, or for a failure.

        NOTE: a gloo wait cannot be interrupted, and a timed-out one breaks the link, so a
        thread waits for the Work while this one watches the fault channel: a rank that
        fails while the others sit in a collective still ends them all at once.

        Raises:
            PipelineFailure: a rank reported a failure, or a link broke (its cause named if
                the failing rank reported one).
        """
        done = threading.Event()
        broke: list[BaseException] = []

        def wait(work: Any) -> None:
            try:
                work.wait()
            except BaseException as error:
                broke.append(error)
            finally:
                done.set()

        threading.Thread(target=wait, args=(start(),), name="gpipe-collective", daemon=True).start()
        while not done.wait(0.05):
            if self._transport.failure is not None:
                raise PipelineFailure(self._transport.failure, self.rank)
        if broke:
            raise PipelineFailure(self._cause(broke[0]), self.rank) from broke[0]

    def _cause(self, error: BaseException) -> Failure:
        """Why a link broke: the failure some rank reported, if it comes within a second."""
        for _ in range(10):
            failure = self._transport.failure or self._faults.check()
            if failure is not None:
                return failure
            time.sleep(0.1)
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        return Failure(-1, f"a rank left the job without reporting why ({text})")

    def _on_failure(self, failure: Failure) -> None:
        state = self._state
        if state is not None:
            state.failed = True  # the worker stops before its next action
        self._transport._heard(failure)

    def _schedule_for(self, microbatches: int) -> Schedule:
        if microbatches not in self._schedules:
            devices = len(self.ranks)
            schedule = make_schedule(
                self.schedule, devices, microbatches, virtual_stages=self.virtual_stages
            )
            validate(schedule)
            self._schedules[microbatches] = schedule
        return self._schedules[microbatches]

    def _check_same_everywhere(self, module: nn.Sequential) -> None:
        """Every rank must build the same pipe: compare a fingerprint of the arguments."""
        mine = {
            "schedule": self.schedule,
            "balance": self.balance,
            "chunks": self.chunks,
            "checkpoint": self.checkpoint,
            "virtual_stages": self.virtual_stages,
            "layers": [type(layer).__name__ for layer in module],
            "torch": torch.__version__,
            "gpipe": gpipe.__version__,
        }
        everyone: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(everyone, mine)
        for rank, theirs in enumerate(everyone):
            differ = [key for key in mine if theirs[key] != everyone[0][key]]
            if differ:
                shown = ", ".join(
                    f"{key}: rank 0 has {everyone[0][key]!r}, rank {rank} has {theirs[key]!r}"
                    for key in differ
                )
                raise ValueError(
                    f"the ranks built different pipes ({shown}): every rank must construct "
                    "DistributedGPipe with the same model and arguments"
                )


_GROUPS: dict[tuple[tuple[int, ...], float], tuple[Any, Any]] = {}
_LINKS: dict[tuple[int, ...], tuple[float, float]] = {}


def _link_of(ranks: tuple[int, ...], group: Any) -> tuple[float, float]:
    """The link's latency and bandwidth, measured by the job's first pipe over ``ranks``."""
    if ranks not in _LINKS:
        _LINKS[ranks] = measure_link(list(ranks), group)
    return _LINKS[ranks]


def _process_groups(ranks: tuple[int, ...], timeout: float) -> tuple[Any, Any]:
    """The groups a pipe's messages travel in: tensors, and headers (gloo, on the CPU).

    Made once per set of ranks and timeout, and shared by every pipe over them: making a
    group connects every pair of its ranks, which costs more than a step. Pipes on the same
    groups must not run steps at the same time (SPMD code never does).
    """
    key = (ranks, timeout)
    if key not in _GROUPS:
        limit = datetime.timedelta(seconds=timeout)
        tensors = dist.new_group(list(ranks), timeout=limit)
        headers = (
            tensors
            if dist.get_backend() == "gloo"
            else dist.new_group(list(ranks), timeout=limit, backend="gloo")
        )
        _GROUPS[key] = (tensors, headers)
    return _GROUPS[key]


def _inbound(schedule: Schedule, device: int, *, with_loss: bool) -> dict[int, int]:
    """How many messages ``device`` receives from each other device in one step."""
    placement, last = schedule.placement, schedule.stages - 1
    counts: dict[int, int] = {}
    for action in schedule.actions[device]:
        stage = action.stage
        if action.kind == FORWARD and stage > 0:
            source = placement[stage - 1]
        elif action.kind == BACKWARD and stage < last:
            source = placement[stage + 1]
        else:
            continue
        if source != device:
            counts[source] = counts.get(source, 0) + 1
    del with_loss  # the last stage's backward starts from its own loss, never a message
    return counts


def _materialize(
    partition: nn.Module, device: torch.device, init_fn: Callable[[nn.Module], None] | None
) -> None:
    """Move ``partition`` to ``device``; if it was on meta, allocate and initialize it."""
    on_meta = any(t.is_meta for t in [*partition.parameters(), *partition.buffers()])
    if not on_meta:
        partition.to(device)
        return
    partition.to_empty(device=device)
    with torch.no_grad():
        for layer in partition.children():
            if init_fn is not None:
                layer.apply(init_fn)
            else:
                for sub in layer.modules():
                    reset = getattr(sub, "reset_parameters", None)
                    if callable(reset):
                        reset()


def _on(value: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: t.to(device), value)
