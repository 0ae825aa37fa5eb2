"""Plan a pipeline: the fastest stages, chunks, checkpointing and schedule that fit in memory.

The planner profiles the model once per micro-batch size, balances every stage count with
the exact balancer on measured time, simulates every schedule with the measured per-stage
costs, predicts each device's peak memory from the same action order the runtime follows,
and ranks what fits::

    report = plan(model, sample, batch_size=64, devices=["cuda:0", "cuda:1"],
                  memory_per_device="12GB", optimizer="adam")
    print(report)
    pipe = GPipe.from_plan(model, report.best)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe.analysis import Costs, Timeline, activation_peaks, search, simulate
from gpipe.balance import balance_costs
from gpipe.balance.profiler import Profile, profile
from gpipe.checkpoint import check_checkpoint
from gpipe.planning.report import Plan, PlanReport, Rejection
from gpipe.runtime.devices import as_devices
from gpipe.schedule import SCHEDULES, Schedule, make_schedule
from gpipe.structure import map_tensors
from gpipe.units import format_bytes, parse_bytes

__all__ = ["plan"]

DEFAULT_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "auto")
# Schedules with separate weight-gradient (W) actions, whose W time the profile must measure.
_SPLIT = ("zb-h1", "zb-h2", "zb-v", "auto")
# Schedules with two stages per device.
_TWO_PER_DEVICE = ("interleaved", "zb-v")
DEFAULT_CHECKPOINTS = ("never", "except_last", "always")


def plan(
    module: nn.Sequential,
    sample: Any,
    batch_size: int,
    devices: Sequence[torch.device | str | int],
    memory_per_device: int | str | None = None,
    *,
    optimizer: str | type[torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    schedules: Sequence[str] = DEFAULT_SCHEDULES,
    chunks: Sequence[int] | None = None,
    checkpoints: Sequence[str] = DEFAULT_CHECKPOINTS,
    top: int = 5,
    progress: bool = True,
    repeats: int = 5,
    action_overhead: float | None = None,
    dp: int = 1,
    zero: bool = False,
    allreduce_bandwidth: float | None = None,
    headroom: float = 1.0,
) -> PlanReport:
    """Search pipeline configurations and rank those that fit by simulated step time.

    Candidates: every stage count from 1 to ``len(devices)`` (on the first K devices), every
    chunk count, checkpoint mode and schedule ("interleaved" and "zb-v" with 2 stages per
    device, when there are at least ``2K`` layers and ``K >= 2``; "auto" searched under
    this candidate's costs and what the budget leaves each device for activations). Each
    is balanced by the exact balancer
    on measured forward + backward time, then simulated with per-stage costs from a profile
    taken at its micro-batch size (each size profiled once, on ``devices[0]``; the devices
    are assumed alike). A checkpointed micro-batch's backward also pays its forward again.
    Every action also pays the runtime's own cost per action, measured once on ``devices[0]``,
    and "cpu" stages that compute share the host's cores.
    For the zero-bubble schedules, W is measured: backward time minus the time of the input
    gradient alone.

    Memory per device: parameters, gradients and optimizer state of its stages, plus the
    activations it holds at its peak, found by walking its actions in schedule order: a
    forward adds the stage's activations (only its input if checkpointed), a backward (or W
    in split schedules) frees them, and a recomputation holds one micro-batch's full
    activations while it runs.

    Data parallelism (``dp`` replicas, as ``gd.DistributedGPipe(..., dp_size=dp)``): each
    replica pipelines ``batch_size / dp`` samples on devices like ``devices``; with
    ``zero=True`` each holds ``1/dp`` of the optimizer state (ZeRO-1, as ``zero=True``
    there). Given ``allreduce_bandwidth``, each device's gradients are then all-reduced
    (a ring: ``2 (dp - 1) / dp`` of their bytes over the link) after its last backward,
    which the step waits for.

    Args:
        module: the model, an ``nn.Sequential``.
        sample: example input of any batch size; micro-batches are cut from it (repeating
            its rows along dim 0 as needed).
        batch_size: samples per mini-batch.
        devices: the devices available, one per pipeline stage (of each replica).
        memory_per_device: the budget per device, in bytes or as text ("200MB", "8GiB");
            None for no budget.
        optimizer: whose state to count ("adam", "sgd", ... or a torch.optim class).
        loss_fn: ``loss_fn(output, target)``: its time and saved tensors count on the last
            stage. Needs ``target``.
        target: example targets, cut like ``sample``.
        schedules: schedules to consider.
        chunks: chunk counts to consider; by default every divisor of ``batch_size``.
        checkpoints: checkpoint modes to consider.
        top: how many plans the report ranks; the rest go to ``rejected``.
        progress: show a progress bar over candidates.
        repeats: timed runs per layer when profiling.
        action_overhead: seconds the runtime adds to every action; None measures it on
            ``devices[0]`` (two one-weight stages, a few steps), 0 leaves it out.
        dp: data-parallel replicas of the pipeline; ``batch_size`` is the global batch.
        zero: shard the optimizer state over the replicas (ZeRO-1).
        allreduce_bandwidth: bytes per second of the replicas' gradient all-reduce; None
            leaves its time out (memory is counted either way).
        headroom: what each predicted peak is multiplied by before it is checked against
            ``memory_per_device``: ``report.best.calibrate(pipe)`` after a real step of an
            earlier plan gives the measured peak over the predicted one. At least 1.

    Returns:
        The :class:`PlanReport`: ``.best``, the ranked plans, and ``.rejected``.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, or a count is not an int.
        ValueError: ``batch_size < 1``, no devices, an unknown schedule or checkpoint mode,
            chunk counts outside ``1..batch_size``, ``loss_fn`` without ``target``, a
            ``batch_size`` that ``dp`` does not divide, or a budget no candidate fits in (the
            message names the smallest predicted need).
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"plan needs an nn.Sequential, got {type(module).__name__}; wrap the layers: "
            "nn.Sequential(*layers)"
        )
    if len(module) == 0:
        raise ValueError("plan needs a module with at least one layer, got an empty one")
    _check_int("batch_size", batch_size)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 (samples per mini-batch), got {batch_size}")
    _check_int("top", top)
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    _check_int("dp", dp)
    if dp < 1 or batch_size % dp:
        raise ValueError(
            f"dp={dp} must be >= 1 and divide batch_size={batch_size} (each replica takes "
            f"batch_size / dp samples); pick a batch size that is a multiple of {max(dp, 1)}"
        )
    if not isinstance(zero, bool):
        raise TypeError(f"zero must be True or False, got {zero!r}")
    if allreduce_bandwidth is not None and not allreduce_bandwidth > 0:
        raise ValueError(
            f"allreduce_bandwidth must be > 0 bytes per second, got {allreduce_bandwidth!r}"
        )
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)):
        raise TypeError(f"headroom must be a number, got {headroom!r}")
    if not 1.0 <= headroom < math.inf:
        raise ValueError(
            f"headroom must be a finite factor >= 1 on the predicted peaks, got {headroom!r}: "
            "take it from report.best.calibrate(pipe) after a real step"
        )
    replica = _Replicas(dp, zero, allreduce_bandwidth)
    batch_size //= dp  # from here on, one replica's batch
    names = [str(device) for device in as_devices(devices)]
    budget = None if memory_per_device is None else _budget(memory_per_device)
    for name in schedules:
        if name not in SCHEDULES:
            raise ValueError(f"unknown schedule {name!r}; choose from {sorted(SCHEDULES)}")
    modes = [check_checkpoint(mode) for mode in checkpoints]
    if not schedules or not modes:
        raise ValueError("give at least one schedule and one checkpoint mode")
    counts = _chunk_counts(batch_size, chunks)
    if loss_fn is not None and target is None:
        raise ValueError("loss_fn needs example targets: pass target=<targets like sample's>")

    measure = _Measurements(
        module,
        sample,
        batch_size,
        names[0],
        optimizer,
        loss_fn,
        target,
        split=any(name in _SPLIT for name in schedules),
        repeats=repeats,
    )
    layers = len(module)
    candidates = [
        (m, k, name, mode)
        for m in counts
        for k in range(1, min(len(names), layers) + 1)
        for name in schedules
        if not (name in _TWO_PER_DEVICE and (k < 2 or 2 * k > layers))
        for mode in modes
    ]
    if not candidates:
        raise ValueError(
            f"nothing to plan: {', '.join(schedules)} on {len(names)} device(s) and "
            f"{layers} layer(s) gives no candidate ('interleaved' and 'zb-v' need at least 2 "
            "devices and 2 layers per device); add devices or other schedules"
        )
    from tqdm import tqdm

    if action_overhead is not None and not action_overhead >= 0:
        raise ValueError(f"action_overhead must be >= 0 seconds, got {action_overhead!r}")
    overhead = _action_overhead(names[0]) if action_overhead is None else action_overhead
    evaluated = [
        dataclasses.replace(
            _evaluate(measure, m, k, name, mode, names[:k], overhead, budget, replica),
            headroom=float(headroom),
        )
        for m, k, name, mode in tqdm(
            candidates, desc="planning", unit="plan", disable=not progress, file=sys.stderr
        )
    ]
    return _rank(evaluated, budget, top, schedules, modes)


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")


def _budget(value: int | str) -> int:
    size = parse_bytes(value) if isinstance(value, str) else value
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(
            f"memory_per_device must be a positive byte count or text like '200MB', got {value!r}"
        )
    return size


def _chunk_counts(batch_size: int, chunks: Sequence[int] | None) -> list[int]:
    if chunks is None:
        return [m for m in range(1, batch_size + 1) if batch_size % m == 0]
    counts = sorted(set(chunks))
    if not counts or any(isinstance(m, bool) or not isinstance(m, int) for m in counts):
        raise TypeError(f"chunks must list ints, got {chunks!r}")
    if counts[0] < 1 or counts[-1] > batch_size:
        raise ValueError(f"chunks must be between 1 and batch_size={batch_size}, got {chunks!r}")
    return counts


class _Measurements:
    """Per micro-batch size, the profile (with W times for zero-bubble), measured once."""

    def __init__(
        self,
        module: nn.Sequential,
        sample: Any,
        batch_size: int,
        device: str,
        optimizer: Any,
        loss_fn: Any,
        target: Any,
        *,
        split: bool,
        repeats: int,
    ) -> None:
        self.module, self.sample, self.batch_size = module, sample, batch_size
        self.device, self.optimizer, self.split, self.repeats = device, optimizer, split, repeats
        self.loss_fn, self.target = loss_fn, target
        self._profiles: dict[int, Profile] = {}
        self._balances: dict[tuple[int, int], list[int]] = {}

    def at(self, chunks: int) -> Profile:
        """The profile for the largest micro-batch of ``chunks``."""
        size = math.ceil(self.batch_size / chunks)
        if size not in self._profiles:
            sample = _rows(self.sample, size)
            model = self.module
            if self.loss_fn is not None:
                loss = _LossLayer(self.loss_fn, _rows(self.target, size))
                model = nn.Sequential(*self.module, loss)
            measured = profile(
                model,
                sample,
                device=self.device,
                repeats=self.repeats,
                optimizer=self.optimizer,
                split_backward=self.split,
            )
            if self.loss_fn is not None:
                measured = _fold_loss(measured)
            self._profiles[size] = measured
        return self._profiles[size]

    def balance(self, chunks: int, stages: int) -> list[int]:
        size = math.ceil(self.batch_size / chunks)
        if (size, stages) not in self._balances:
            self._balances[size, stages] = balance_costs(self.at(chunks).costs("time"), stages)
        return self._balances[size, stages]


class _LossLayer(nn.Module):
    """The loss on fixed targets, profiled as if it were one more layer."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], target: Any) -> None:
        super().__init__()
        self.loss_fn, self.target = loss_fn, target

    def forward(self, output: Any) -> torch.Tensor:
        return self.loss_fn(output, self.target)


def _rows(value: Any, size: int) -> Any:
    """``value`` with exactly ``size`` rows along dim 0: repeated or cut, contiguous."""

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] == 0:
            raise ValueError(f"sample tensors need a batch dimension, got shape {tuple(t.shape)}")
        times = -(-size // t.shape[0])
        return t.repeat(times, *([1] * (t.dim() - 1)))[:size].clone()

    return map_tensors(resize, value)


# What the loss layer costs joins the last model layer; its other entries are dropped.
_FOLDED = ("forward", "backward", "activation_bytes", "cpu", "weight", "deferred_bytes")


def _fold_loss(measured: Profile) -> Profile:
    """The profile with the loss's time and saved bytes charged to the last layer."""
    changes = {}
    for field in dataclasses.fields(measured):
        values = getattr(measured, field.name)
        if values:
            folded = field.name in _FOLDED
            changes[field.name] = [*values[:-2], values[-2] + values[-1]] if folded else values[:-1]
    return dataclasses.replace(measured, **changes)


def _evaluate(
    measure: _Measurements,
    chunks: int,
    stages: int,
    name: str,
    mode: str,
    devices: list[str],
    overhead: float,
    budget: int | None,
    replica: _Replicas,
) -> Plan:
    v = 2 if name in _TWO_PER_DEVICE else 1
    measured = measure.at(chunks)
    weight = measured.weight or [0.0] * measured.layers
    balance = measure.balance(chunks, stages * v)
    bounds = [0]
    for count in balance:
        bounds.append(bounds[-1] + count)
    spans = list(itertools.pairwise(bounds))
    split = name in _SPLIT
    forward = [sum(measured.forward[a:b]) for a, b in spans]
    # NOTE: W is measured as the backward minus the input gradient alone; on a busy machine
    # that difference can come out above the backward itself, which would leave B negative.
    w = [
        min(max(sum(weight[a:b]), 0.0), sum(measured.backward[a:b])) if split else 0.0
        for a, b in spans
    ]
    recomputed = {"always": 1.0, "except_last": (chunks - 1) / chunks, "never": 0.0}[mode]
    backward = [
        sum(measured.backward[a:b]) - w_s + recomputed * f
        for (a, b), w_s, f in zip(spans, w, forward)
    ]
    full = [measured.stage_activation_bytes(a, b) for a, b in spans]
    kept = [measured.input_bytes[a] for a, _ in spans]
    stored = [
        sum(measured.parameter_bytes[a:b] + measured.gradient_bytes[a:b])
        + replica.optimizer_share(sum(measured.optimizer_bytes[a:b]))
        for a, b in spans
    ]
    placement = (
        make_schedule(name, stages, chunks, virtual_stages=v).placement
        if name != "auto"
        else tuple(range(stages))
    )
    share = _host_share(measured, spans, devices, placement)
    forward, backward = (
        [t * share + overhead for t in forward],
        [t * share + overhead for t in backward],
    )
    w = [t * share + overhead if split else 0.0 for t in w]
    costs = Costs(forward=forward, backward=backward, weight=w)
    if name == "auto":
        schedule = _search(stages, chunks, costs, full if mode == "never" else kept, stored, budget)
    else:
        schedule = make_schedule(name, stages, chunks, virtual_stages=v)
    timeline = simulate(schedule, costs)
    # NOTE: the mini-batch takes no gradient; every later stage sends one back, the size of
    # its input. A stage sending none defers its whole backward, keeping what it received.
    gradient = [0, *kept[1:]]
    deferred = None
    if measured.deferred_bytes:
        deferred = [sum(measured.deferred_bytes[a:b]) for a, b in spans]
        deferred[0] = gradient[1] if len(spans) > 1 else 0
    peaks = activation_peaks(schedule, full, kept, mode, gradient=gradient, deferred=deferred)
    activations = [int(peak) for peak in peaks]  # whole bytes in, whole bytes out
    fixed = [0] * stages
    reduced = [0] * stages
    for s, held in enumerate(stored):
        fixed[schedule.placement[s]] += held
        reduced[schedule.placement[s]] += sum(measured.gradient_bytes[spans[s][0] : spans[s][1]])
    return Plan(
        stages=stages,
        chunks=chunks,
        checkpoint=mode,
        schedule=name,
        virtual_stages=v,
        balance=list(balance),
        devices=devices,
        predicted_step=replica.step(timeline, reduced),
        bubble=timeline.bubble,
        peak_memory=[f + a for f, a in zip(fixed, activations)],
        activation_memory=activations,
        built=schedule if name == "auto" else None,
        dp=replica.dp,
        zero=replica.zero,
    )


@dataclass(frozen=True)
class _Replicas:
    """What data parallelism adds to one replica's pipeline: a share of the optimizer state
    (ZeRO) and the wait for the gradient all-reduce."""

    dp: int
    zero: bool
    bandwidth: float | None

    def optimizer_share(self, nbytes: int) -> int:
        return -(-nbytes // self.dp) if self.zero else nbytes

    def step(self, timeline: Timeline, gradient_bytes: list[int]) -> float:
        """The step: each device's last action, then its all-reduce (ring, over the link)."""
        if self.dp == 1 or self.bandwidth is None:
            return timeline.makespan
        ring = 2 * (self.dp - 1) / self.dp / self.bandwidth
        ends = [
            (device[-1].end if device else 0.0) + ring * nbytes
            for device, nbytes in zip(timeline.events, gradient_bytes)
        ]
        return max(ends) - timeline.start


def _search(
    stages: int,
    chunks: int,
    costs: Costs,
    activation: list[int],
    stored: list[int],
    budget: int | None,
) -> Schedule:
    """The "auto" schedule under what the budget leaves each device for activations.

    One stage per device, so each stage's parameters, gradients and optimizer state come off
    its device's budget. Without a budget the search may hold every micro-batch (then it is
    the fastest schedule there is); with one the parameters alone fill, it searches under
    1F1B's memory, and the plan is rejected as over the budget like any other.
    """
    costs = dataclasses.replace(costs, activation_bytes=[max(a, 1) for a in activation])
    if budget is None:
        return search(stages, chunks, costs=costs, memory_limit=chunks * max(activation))
    if all(budget > held for held in stored):
        try:
            return search(
                stages, chunks, costs=costs, memory_limit=[budget - held for held in stored]
            )
        except ValueError:  # nothing fits: the plan goes over the budget
            pass
    return search(stages, chunks, costs=costs)


def _action_overhead(device: str, microbatches: int = 8, steps: int = 5) -> float:
    """Seconds the runtime adds to every action on this host, measured, not assumed.

    Two stages of a one-weight layer on ``device`` run a few steps: with nothing to compute,
    a step is hand-offs, bookkeeping and Python, along a critical path of M + K - 1
    forwards and as many backwards. A schedule with more actions (more micro-batches,
    zero-bubble's separate W, interleaving) pays this more often, which the profile of the
    layers alone cannot show.
    """
    from gpipe.pipe import GPipe  # the planner sits above the pipe, like the command line

    pipe = GPipe(
        nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)),
        [1, 1],
        devices=[device, device],
        chunks=microbatches,
        checkpoint="never",
        track_memory=False,
    )
    x = torch.zeros(microbatches, 1, device=device)
    seconds = []
    for run in range(steps + 2):
        began = time.perf_counter()
        pipe.train_step(x, x.to(pipe.devices[-1]), nn.functional.mse_loss)
        if run >= 2:
            seconds.append(time.perf_counter() - began)
    return statistics.median(seconds) / (2 * (microbatches + 1))


def _host_share(
    measured: Profile,
    spans: list[tuple[int, int]],
    devices: list[str],
    placement: Sequence[int] | None = None,
) -> float:
    """How much slower each stage runs when "cpu" stages share this host's cores.

    The profile timed each layer alone and noted how much of that time its thread spent
    computing: near all of it for a layer that computes on the CPU (with every intra-op
    thread busy alongside), near none for one that waits on an accelerator (or sleeps).
    While the pipeline is full every stage runs at once, so when the CPU stages together
    want more cores than the host has, each runs ``wanted / cores`` times slower. Stages on
    accelerators compete for nothing.
    """
    if not measured.cpu:
        return 1.0
    cores = os.cpu_count() or 1
    threads = min(torch.get_num_threads(), cores)
    cpu = [0.0] * len(devices)
    busy = [0.0] * len(devices)
    for stage, (a, b) in enumerate(spans):
        device = placement[stage] if placement is not None else stage % len(devices)
        cpu[device] += sum(measured.cpu[a:b])
        busy[device] += sum(measured.forward[a:b]) + sum(measured.backward[a:b])
    wanted = 0.0
    for c, t, name in zip(cpu, busy, devices):
        if name.startswith("cpu") and t > 0:
            # r = the share of the time its thread computed. A stage that computes throughout
            # (r = 1) keeps every intra-op thread busy; one that mostly waits spends its
            # little CPU time in Python, on one core: interpolate between the two.
            r = min(1.0, c / t)
            wanted += r * (1 + (threads - 1) * r)
    return max(1.0, wanted / cores)


def _rank(
    plans: list[Plan],
    budget: int | None,
    top: int,
    schedules: Sequence[str],
    modes: Sequence[str],
) -> PlanReport:
    def key(p: Plan) -> tuple[float, int, int, int, int]:
        # NOTE: equal simulated times are common (GPipe and 1F1B take as long); the tie goes
        # to the plan that holds less, then to the simpler one.
        return (
            p.predicted_step,
            max(p.needed_memory),
            p.stages,
            list(schedules).index(p.schedule),
            list(modes).index(p.checkpoint),
        )

    fits = sorted((p for p in plans if budget is None or max(p.needed_memory) <= budget), key=key)
    over = [p for p in plans if budget is not None and max(p.needed_memory) > budget]
    if not fits:
        smallest = min(plans, key=lambda p: max(p.needed_memory))
        assert budget is not None
        with_headroom = (
            f" (the predicted peak x headroom {smallest.headroom:.2f})"
            if smallest.headroom != 1.0
            else ""
        )
        raise ValueError(
            f"no plan fits in memory_per_device={format_bytes(budget)}: the smallest "
            f"predicted need is {format_bytes(max(smallest.needed_memory))} per device"
            f"{with_headroom} ({smallest.describe()}); raise the budget to at least "
            f"{max(smallest.needed_memory)} bytes, add devices, or use a smaller batch_size"
        )
    best = fits[0].predicted_step
    rejected = [
        Rejection(
            p,
            f"slower: +{(p.predicted_step / best - 1) * 100:.1f}% "
            f"({p.predicted_step * 1e3:.2f} ms)",
        )
        for p in fits[top:]
    ]
    for p in sorted(over, key=key):
        assert budget is not None
        needed = p.needed_memory
        device = max(range(len(needed)), key=lambda d: needed[d])
        excess = needed[device] - budget
        reason = f"over the memory budget by {format_bytes(excess)} on device {device}"
        if p.headroom != 1.0:
            reason += (
                f" (predicted {format_bytes(p.peak_memory[device])} x headroom {p.headroom:.2f})"
            )
        rejected.append(Rejection(p, reason))
    rejected.sort(key=lambda r: (not r.reason.startswith("over"), key(r.plan)))
    return PlanReport(fits[:top], rejected, budget)
