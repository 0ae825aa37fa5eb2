"""The candidates: every layout the planner weighs, and what each is predicted to cost.

A candidate is a chunk count, stage count, schedule and checkpoint mode. Its costs come from
the profile at its micro-batch size, balanced on measured time, plus what the host and the
data-parallel replicas add; its step time from the simulator, its memory from the walk of
each device's actions.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpipe.analysis import Costs, Timeline, activation_peaks, search, simulate
from gpipe.balance import Profile
from gpipe.planning.host_model import host_share
from gpipe.planning.measurements import Measurements
from gpipe.planning.plan_report import Plan
from gpipe.schedule import Schedule, default_virtual_stages, make_schedule

__all__ = ["Replicas", "candidates", "evaluate", "splits", "stages_per_device"]


def stages_per_device(name: str) -> int:
    """The model stages per device a plan gives schedule ``name`` (see
    :func:`gpipe.schedule.default_virtual_stages`; "auto" searches one per device)."""
    return default_virtual_stages(name)


@functools.cache
def splits(name: str) -> bool:
    """Whether schedule ``name`` runs weight gradients as W actions, whose time the profile
    must then measure ("auto" may)."""
    if name == "auto":
        return True
    return make_schedule(name, 2, 8, virtual_stages=stages_per_device(name)).split_backward


@functools.cache
def _fits(name: str, stages: int, chunks: int) -> bool:
    """Whether schedule ``name`` runs ``chunks`` micro-batches on ``stages`` devices
    (dualpipev needs at least 2K)."""
    if name == "auto":
        return True
    try:
        make_schedule(name, stages, chunks, virtual_stages=stages_per_device(name))
    except ValueError:
        return False
    return True


def candidates(
    layouts: Sequence[Replicas],
    devices: int,
    layers: int,
    schedules: Sequence[str],
    modes: Sequence[str],
) -> list[tuple[Replicas, int, int, str, str]]:
    """Every (layout, chunks, stages, schedule, checkpoint mode) to weigh, on up to
    ``devices`` devices per replica.

    Raises:
        ValueError: no candidate at all (two-per-device schedules only, too few devices or
            layers).
    """
    found = [
        (layout, m, k, name, mode)
        for layout in layouts
        for m in layout.chunk_counts
        for k in layout.stage_counts(min(devices, layers))
        for name in schedules
        if stages_per_device(name) == 1 or 2 <= k <= layers // stages_per_device(name)
        if _fits(name, k, m)
        for mode in modes
    ]
    if not found:
        raise ValueError(
            f"nothing to plan: {', '.join(schedules)} on {devices} device(s) and "
            f"{layers} layer(s) gives no candidate (schedules with 2 stages per device, such "
            "as 'interleaved' and 'zb-v', need at least 2 devices and 2 layers per device; "
            "'dualpipev' needs at least 2 micro-batches per device); add devices, chunks "
            "or other schedules"
        )
    return found


def evaluate(
    measure: Measurements,
    chunks: int,
    stages: int,
    name: str,
    mode: str,
    devices: list[str],
    overhead: float,
    budget: int | None,
    replica: Replicas,
    time_scale: float = 1.0,
) -> Plan:
    """The plan of one candidate: its balance, simulated step time and peak memory per device,
    for one replica of ``replica``'s layout.

    ``overhead`` is added to every action, ``time_scale`` multiplies the profiled compute
    (both 0 and 1 unless calibrated by a verified run, see :mod:`gpipe.planning.verify`).
    """
    v = stages_per_device(name)
    size = math.ceil(replica.batch / chunks)
    measured = measure.at(size)
    balance = measure.balance(size, stages * v)
    bounds = [0]
    for count in balance:
        bounds.append(bounds[-1] + count)
    spans = list(itertools.pairwise(bounds))
    full = [measured.stage_activation_bytes(a, b) for a, b in spans]
    kept = [measured.input_bytes[a] for a, _ in spans]
    stored = [
        replica.model_state(
            sum(measured.parameter_bytes[a:b]),
            sum(measured.gradient_bytes[a:b]),
            sum(measured.optimizer_bytes[a:b]),
        )
        for a, b in spans
    ]
    placement = (
        make_schedule(name, stages, chunks, virtual_stages=v).placement
        if name != "auto"
        else tuple(range(stages))
    )
    share = host_share(measured, spans, devices, placement) * time_scale
    split = splits(name)
    costs = _stage_costs(measured, spans, split, mode, chunks, share, overhead, noisy=False)
    # NOTE: the same stages at the first quartile of their repeats: how far this host's noise could
    # move the prediction, so two plans within it are not told apart
    slow = _stage_costs(measured, spans, split, mode, chunks, share, overhead, noisy=True)
    if name == "auto":
        schedule = _search(stages, chunks, costs, full if mode == "never" else kept, stored, budget)
    else:
        schedule = make_schedule(name, stages, chunks, virtual_stages=v)
    timeline = simulate(schedule, costs)
    slow_timeline = simulate(schedule, slow)
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
        predicted_high=max(replica.step(slow_timeline, reduced), replica.step(timeline, reduced)),
        bubble=timeline.bubble,
        peak_memory=[f + a for f, a in zip(fixed, activations)],
        activation_memory=activations,
        built=schedule if name == "auto" else None,
        dp=replica.dp,
        zero=replica.zero,
        world_size=replica.world_size,
        data_parallel=replica.engine,
    )


def _stage_costs(
    measured: Profile,
    spans: list[tuple[int, int]],
    split: bool,
    mode: str,
    chunks: int,
    share: float,
    overhead: float,
    *,
    noisy: bool,
) -> Costs:
    """Per-stage F, B and W: sums over each stage's layers, times the host's share, plus the
    runtime's cost per action; with ``noisy``, each layer at the first quartile of its repeats."""
    layers = measured.layers
    widen = [1 + s for s in measured.spread] if noisy and measured.spread else [1.0] * layers
    weight = measured.weight or [0.0] * layers

    def total(values: list[float], a: int, b: int) -> float:
        return sum(v * f for v, f in zip(values[a:b], widen[a:b]))

    forward = [total(measured.forward, a, b) for a, b in spans]
    # NOTE: W is measured as the backward minus the input gradient alone; on a busy machine
    # that difference can come out above the backward itself, which would leave B negative.
    w = [
        min(max(total(weight, a, b), 0.0), total(measured.backward, a, b)) if split else 0.0
        for a, b in spans
    ]
    recomputed = {"always": 1.0, "except_last": (chunks - 1) / chunks, "never": 0.0}[mode]
    backward = [
        total(measured.backward, a, b) - w_s + recomputed * f
        for (a, b), w_s, f in zip(spans, w, forward)
    ]
    return Costs(
        forward=[t * share + overhead for t in forward],
        backward=[t * share + overhead for t in backward],
        weight=[t * share + overhead if split else 0.0 for t in w],
    )


@dataclass(frozen=True)
class Replicas:
    """One layout of replicas: what each pipelines, and what data parallelism adds to it (a
    share of the optimizer state under ZeRO, the wait for the gradient all-reduce).

    Attributes:
        dp: replicas of the pipeline.
        zero: the optimizer state sharded over them (ZeRO-1).
        bandwidth: bytes per second of their gradient all-reduce; None leaves its time out.
        batch: samples one replica pipelines per step.
        chunk_counts: the micro-batch counts to weigh.
        stages: the one stage count of a job of ``world_size`` processes (``stages * dp``
            of them); None: every count up to the devices given.
        world_size: the processes of a ``DistributedGPipe`` job laid out this way; None for
            a layout that is not tied to a job's size.
        engine: how the replicas combine gradients (``DistributedGPipe``'s
            ``data_parallel``): "replicate" and "ddp" hold each stage whole, "fsdp" shards it.
    """

    dp: int
    zero: bool
    bandwidth: float | None
    batch: int = 1
    chunk_counts: tuple[int, ...] = (1,)
    stages: int | None = None
    world_size: int | None = None
    engine: str = "replicate"

    def stage_counts(self, most: int) -> range:
        """The stage counts this layout allows, up to ``most``."""
        if self.stages is None:
            return range(1, most + 1)
        return range(self.stages, self.stages + 1) if self.stages <= most else range(0)

    def optimizer_share(self, nbytes: int) -> int:
        """What one replica holds of ``nbytes`` of optimizer state: 1/dp of it under ZeRO."""
        return -(-nbytes // self.dp) if self.zero else nbytes

    def model_state(self, parameters: int, gradients: int, optimizer: int) -> int:
        """The most of a stage's parameters, gradients and optimizer state one device holds
        during a step.

        Held whole, they are all there all along (ZeRO: 1/dp of the optimizer state). Under
        FSDP a device keeps 1/dp of the parameters and optimizer state, and within a step
        it also holds the stage's parameters gathered whole and its gradients unsharded:
        the micro-batches accumulate into them until the stage's last backward, when they
        are reduce-scattered (measured so in ``benchmarks/runs/scale_out.txt``).
        """
        if self.engine == "fsdp" and self.dp > 1:
            return -(-parameters // self.dp) + parameters + gradients + -(-optimizer // self.dp)
        return parameters + gradients + self.optimizer_share(optimizer)

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
