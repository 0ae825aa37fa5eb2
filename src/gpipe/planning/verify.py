"""Verification: run the planner's top plans for real, and calibrate its time model.

A prediction is the simulator on costs profiled one layer at a time. What it cannot see
(hand-offs between stage threads, stages competing for cores, the allocator) shows only
when the plan runs. So ``plan(..., verify=True)`` builds the pipe of each of its top plans,
runs a few real training steps of each in turns (one step of each plan per round, so a
change of load hits all of them alike), and keeps each plan's median step and quartiles.

Then it fits two numbers that make the predictions meet those measurements: a factor on the
profiled compute and a cost added to every action. Both are what the profile is blind to,
one growing with the work, the other with the number of actions (more micro-batches,
zero-bubble's separate W). Every candidate is predicted again with them; the verified plans
are ranked by what they measured. :class:`Calibration` carries the two numbers, and the
headroom the real steps' memory showed, to a later ``plan(..., calibration=...)``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe.balance.profiler import preserved
from gpipe.planning.measurements import with_rows
from gpipe.planning.model_units import Units, call_inputs
from gpipe.planning.plan_report import Plan, PlanReport
from gpipe.structure import leaves

__all__ = [
    "Calibration",
    "Measured",
    "default_loss",
    "fit",
    "measure_plans",
    "trial_steps",
    "verified",
]


@dataclass(frozen=True)
class Calibration:
    """What real steps taught the planner, for a later ``plan(..., calibration=...)``.

    Attributes:
        action_overhead: seconds the runtime adds to every action on this host.
        time_scale: the factor on the profiled compute (above 1 when stages ran slower
            together than each layer alone).
        headroom: the measured memory peak over the predicted one, at least 1 (see
            :meth:`Plan.calibrate`).
        plans: how many verified plans the fit rests on.
    """

    action_overhead: float
    time_scale: float
    headroom: float = 1.0
    plans: int = 0

    def __str__(self) -> str:
        return (
            f"per-action cost {self.action_overhead * 1e3:.3f} ms, compute x"
            f"{self.time_scale:.2f}, memory headroom x{self.headroom:.2f} (fitted to "
            f"{self.plans} verified plan{'s' if self.plans != 1 else ''})"
        )


@dataclass(frozen=True)
class Measured:
    """One verified plan's real steps."""

    plan: Plan
    seconds: list[float]
    headroom: float

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def quartiles(self) -> tuple[float, float]:
        if len(self.seconds) < 2:
            return self.seconds[0], self.seconds[0]
        q1, _, q3 = statistics.quantiles(self.seconds, n=4, method="inclusive")
        return q1, q3


def measure_plans(
    plans: Sequence[Plan],
    build: Callable[[Plan], Any],
    step: Callable[[Any], object],
    module: nn.Module,
    *,
    steps: int,
    warmup: int = 2,
) -> list[Measured]:
    """Run each plan's pipe ``warmup`` untimed steps, then ``steps`` timed steps in turns.

    Args:
        plans: the plans to run.
        build: makes a plan's pipe (``GPipe.from_plan``).
        step: one training step of a pipe.
        module: the user's model: its gradients, buffers (BatchNorm statistics) and random
            number generators are as they were afterwards.
        steps: timed steps per plan.
        warmup: untimed steps per plan first (the first step allocates and warms caches).

    Returns:
        One :class:`Measured` per plan, in order.
    """
    device = _device_of(module)
    with preserved(module, device):
        pipes = [build(p) for p in plans]
        for pipe in pipes:
            for _ in range(warmup):
                _timed(step, pipe, module)
        seconds: list[list[float]] = [[] for _ in plans]
        for turn in range(steps):
            # NOTE: the order turns around every round, so no plan always runs first
            order = range(len(pipes)) if turn % 2 == 0 else reversed(range(len(pipes)))
            for i in order:
                seconds[i].append(_timed(step, pipes[i], module))
        found = [Measured(p, s, _headroom(p, pipe)) for p, s, pipe in zip(plans, seconds, pipes)]
    return found


def _timed(step: Callable[[Any], object], pipe: Any, module: nn.Module) -> float:
    began = time.perf_counter()
    step(pipe)
    for device in getattr(pipe, "devices", []):
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
    took = time.perf_counter() - began
    for p in module.parameters():
        p.grad = None
    return took


def _headroom(plan: Plan, pipe: Any) -> float:
    """The memory headroom the pipe's last step showed, 1.0 where it cannot say."""
    try:
        return plan.calibrate(pipe)
    except ValueError:  # a pipe that counts no memory, or one laid out unlike the plan
        return 1.0


def _device_of(module: nn.Module) -> torch.device:
    for tensor in [*module.parameters(), *module.buffers()]:
        return tensor.device
    return torch.device("cpu")


def fit(
    measured: Sequence[float],
    compute: Sequence[float],
    actions: Sequence[float],
    fallback_overhead: float,
) -> tuple[float, float]:
    """The (time_scale, action_overhead) that make ``scale * compute + overhead * actions``
    meet ``measured`` best, in relative error, both at least 0 (the scale above 0).

    Args:
        measured: seconds each verified plan took a step.
        compute: its prediction with no cost per action and the compute as profiled.
        actions: how many actions its predicted step waits on (the critical path).
        fallback_overhead: the per-action cost to keep when one plan (or plans alike)
            cannot separate the two: then only the scale is fitted.
    """
    u = [c / m for c, m in zip(compute, measured)]
    v = [a / m for a, m in zip(actions, measured)]
    uu, uv, vv = sum(x * x for x in u), sum(x * y for x, y in zip(u, v)), sum(y * y for y in v)
    su, sv = sum(u), sum(v)
    determinant = uu * vv - uv * uv

    def overhead_at(scale: float) -> float:
        """The best per-action cost for a fixed scale, at least 0."""
        return max(0.0, (sv - scale * uv) / vv) if vv > 0 else 0.0

    if len(measured) >= 2 and determinant > 1e-9 * max(uu * vv, 1e-30):
        scale = (su * vv - sv * uv) / determinant
        overhead = (uu * sv - uv * su) / determinant
        if overhead < 0:  # the work alone explains the times better than any action cost
            scale, overhead = su / uu, 0.0
    else:
        # one plan, or plans that cannot tell work from actions: keep the measured
        # per-action cost and fit the scale to what is left
        overhead = fallback_overhead
        rest = sum(x * (1 - overhead * y) for x, y in zip(u, v))
        scale = rest / uu if rest > 0 else su / uu
        if rest <= 0:
            overhead = 0.0
    # NOTE: a few noisy steps can trade one term for the other without bound (a factor of
    # 0.06 on the compute and all the time in the actions); a profile is not that far off
    if not SCALE_BOUNDS[0] <= scale <= SCALE_BOUNDS[1]:
        scale = min(max(scale, SCALE_BOUNDS[0]), SCALE_BOUNDS[1])
        overhead = overhead_at(scale)
    return scale, overhead


#: How far a fit may move the profiled compute: a factor between these.
SCALE_BOUNDS = (0.25, 4.0)


def default_loss(output: Any, target: Any) -> torch.Tensor:
    """A stand-in loss for timing a model planned without ``loss_fn``: the mean of every
    floating output (its backward runs the whole graph, like any loss)."""
    del target
    means = [t.float().mean() for t in leaves(output) if isinstance(t, torch.Tensor)]
    floating = [m for m in means if m.requires_grad]
    return torch.stack(floating or means).sum()


def verified(
    report: PlanReport,
    predict: Callable[[float, float, float], list[Plan]],
    predict_one: Callable[[Plan, float], Plan],
    rank_all: Callable[[list[Plan]], PlanReport],
    run: Callable[[Sequence[Plan]], list[Measured]],
    overhead: float,
    headroom: float,
    count: int,
) -> PlanReport:
    """``report`` with its top ``count`` plans run for real and every plan predicted again
    with the time model fitted to them; verified plans ranked by what they measured.

    A second round runs the plans the calibrated model now predicts faster than the
    fastest measured one (up to ``count`` more), so a plan the first predictions ranked low
    for the profile's blind spots still gets its turn.

    Args:
        report: the ranking of the plain predictions.
        predict: every candidate at (per-action cost, compute factor, headroom).
        predict_one: one plan predicted again at a per-action cost, compute as profiled.
        rank_all: the report of a list of candidates.
        run: the real steps of some plans.
        overhead: the per-action cost the first predictions used.
        headroom: the memory headroom they used.
        count: how many plans to run in the first round.
    """
    measured: dict[str, Measured] = {}
    todo = list(report.plans[:count])
    current = report
    calibration = Calibration(overhead, 1.0, headroom, 0)
    for _ in range(2):
        for m in run(todo):
            measured[m.plan.describe()] = m
        calibration = _calibrate(list(measured.values()), predict_one, overhead, headroom)
        plans = [
            _with_measurement(p, measured.get(p.describe()))
            for p in predict(
                calibration.action_overhead, calibration.time_scale, calibration.headroom
            )
        ]
        current = rank_all(plans)
        fastest = min(m.median for m in measured.values())
        fits = [
            *current.plans,
            *(r.plan for r in current.rejected if r.reason.startswith("slower")),
        ]
        todo = sorted(
            (p for p in fits if p.measured_step is None and p.predicted_step < fastest),
            key=lambda p: p.predicted_step,
        )[:count]
        if not todo:
            break
    current.calibration = calibration
    current.notes.append(f"calibrated by the verified plans: {calibration}")
    return current


# The per-action cost at which the count of actions on a critical path is read (seconds).
_PROBE = 1e-4


def _calibrate(
    found: list[Measured],
    predict_one: Callable[[Plan, float], Plan],
    overhead: float,
    headroom: float,
) -> Calibration:
    """The time model fitted to ``found``, and the highest memory headroom they showed."""
    compute = [predict_one(m.plan, 0.0).predicted_step for m in found]
    probed = [predict_one(m.plan, _PROBE).predicted_step for m in found]
    actions = [(p - c) / _PROBE for p, c in zip(probed, compute)]
    scale, per_action = fit([m.median for m in found], compute, actions, overhead)
    worst = max([headroom, *(m.headroom for m in found)])
    return Calibration(per_action, scale, worst, len(found))


def _with_measurement(plan: Plan, measured: Measured | None) -> Plan:
    if measured is None:
        return plan
    return dataclasses.replace(
        plan, measured_step=measured.median, measured_range=measured.quartiles
    )


@dataclass(frozen=True)
class Trial:
    """How verification builds a plan's pipe and runs one training step of it."""

    module: nn.Module
    units: Units
    input: Any
    kwargs: dict[str, Any]
    target: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]

    def build(self, plan: Plan) -> Any:
        from gpipe.pipe import GPipe  # the planner sits above the pipe, like the CLI

        return GPipe(plan.pipe_module(self.module), **plan.pipe_kwargs())

    def step(self, pipe: Any) -> object:
        if self.kwargs:
            return pipe.train_step(self.input, self.target, self.loss_fn, kwargs=self.kwargs)
        return pipe.train_step(self.input, self.target, self.loss_fn)


def trial_steps(
    module: nn.Module,
    units: Units,
    sample: Any,
    batch_size: int,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    target: Any,
) -> Trial:
    """A mini-batch of ``batch_size`` rows cut from (or repeated out of) ``sample`` and
    ``target``; without ``loss_fn``, the mean of the outputs stands in for the loss."""
    if loss_fn is None:
        loss_fn, target = default_loss, torch.zeros(batch_size)
    else:
        target = with_rows(target, batch_size)
    if units.kind == "sequential":
        return Trial(module, units, with_rows(sample, batch_size), {}, target, loss_fn)
    args, kwargs = call_inputs(sample)
    args = tuple(with_rows(a, batch_size) for a in args)
    kwargs = {name: with_rows(value, batch_size) for name, value in kwargs.items()}
    given = args[0] if len(args) == 1 else args
    return Trial(module, units, given, kwargs, target, loss_fn)
