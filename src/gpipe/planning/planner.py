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
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gpipe.balance.optimizer_state import OptimizerSpec
from gpipe.planning import host_model
from gpipe.planning.candidates import candidates, evaluate, splits
from gpipe.planning.layouts import layouts
from gpipe.planning.measurements import Measurements
from gpipe.planning.model_units import model_units
from gpipe.planning.plan_arguments import (
    check_action_overhead,
    check_engine,
    check_loss_target,
    check_plan_arguments,
    check_verify,
    checkpoint_modes,
    memory_budget,
)
from gpipe.planning.plan_report import Plan, PlanReport
from gpipe.planning.ranking import rank
from gpipe.planning.verify import Calibration, measure_plans, trial_steps, verified
from gpipe.runtime.devices import as_devices

__all__ = ["DEFAULT_CHECKPOINTS", "DEFAULT_SCHEDULES", "plan"]

DEFAULT_SCHEDULES = (
    "gpipe",
    "1f1b",
    "interleaved",
    "looped-bfs",
    "zb-h1",
    "zb-h2",
    "zb-v",
    "interleaved-zb",
    "v-half",
    "v-min",
    "dualpipev",
    "auto",
)
DEFAULT_CHECKPOINTS = ("never", "except_last", "always")


def plan(
    module: nn.Module,
    sample: Any,
    batch_size: int,
    devices: Sequence[torch.device | str | int],
    memory_per_device: int | str | None = None,
    *,
    optimizer: OptimizerSpec = None,
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
    data_parallel: str = "replicate",
    allreduce_bandwidth: float | None = None,
    headroom: float = 1.0,
    split_points: Sequence[str] | None = None,
    verify: bool = False,
    verify_top: int = 3,
    verify_steps: int = 5,
    calibration: Calibration | None = None,
    world_size: int | None = None,
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
        module: the model: an ``nn.Sequential`` (its layers are balanced), ``Stages``
            from :func:`gpipe.split` (its stages are grouped into the plan's), or any other
            module (cut by ``gpipe.split`` into its units, or at ``split_points``; each plan
            names the points it cuts at, and :meth:`gpipe.GPipe.from_plan` cuts there).
        sample: example input of any batch size; micro-batches are cut from it (repeating
            its rows along dim 0 as needed). For a model that is not an ``nn.Sequential``:
            a tensor (its one input), a tuple of positional inputs or a dict of inputs by
            name, as ``gpipe.split``'s ``example_inputs``, each batched along dim 0.
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
        data_parallel: the replicas' engine, as ``DistributedGPipe``'s: "replicate" and
            "ddp" hold each stage whole on every replica; "fsdp" holds 1/dp of its
            parameters and optimizer state, plus, within a step, its parameters gathered
            whole and its gradients unsharded.
        allreduce_bandwidth: bytes per second of the replicas' gradient all-reduce; None
            leaves its time out (memory is counted either way).
        headroom: what each predicted peak is multiplied by before it is checked against
            ``memory_per_device``: ``report.best.calibrate(pipe)`` after a real step of an
            earlier plan gives the measured peak over the predicted one. At least 1.
        split_points: for a model ``gpipe.split`` cuts, the submodule names a stage may
            begin with (None: the start of every unit); the plan balances among them.
        verify: run the ``verify_top`` best plans for ``verify_steps`` real training steps
            each, in turns; fit the per-action cost and a factor on the profiled compute to
            what they measured; predict every plan again with them; rank the verified plans
            by measured time (see :mod:`gpipe.planning.verify`). ``report.calibration``
            then holds the fit. Runs on the model itself; its gradients, buffers and the
            random generators are restored afterwards.
        verify_top: how many plans ``verify`` runs (and as many more, once, that the fit
            predicts faster than the fastest measured).
        verify_steps: timed steps per verified plan, after two untimed ones.
        calibration: ``report.calibration`` of an earlier verified plan on this host: its
            per-action cost, compute factor and memory headroom replace
            ``action_overhead`` and ``headroom``.
        world_size: plan a ``DistributedGPipe`` job of this many processes, one device
            each (like ``devices[0]``): every pipeline of K stages (K up to
            ``len(devices)``) with ``world_size / K`` replicas (``dp_size``) that splits
            ``batch_size`` evenly, weighed together. Each plan's ``world_size`` and ``dp``
            say its layout; ``DistributedGPipe.from_plan`` builds it. Not with ``dp``, nor
            ``verify`` (which runs plans in this process).

    Returns:
        The :class:`PlanReport`: ``.best``, the ranked plans, and ``.rejected``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` (or is one layer, with nothing to
            cut), ``split_points`` for an ``nn.Sequential`` or ``Stages``, or a count is
            not an int.
        ValueError: ``batch_size < 1``, no devices, an unknown schedule or checkpoint mode,
            chunk counts outside ``1..batch_size``, ``loss_fn`` without ``target``, a
            ``batch_size`` that ``dp`` does not divide, or a budget no candidate fits in (the
            message names the smallest predicted need).
    """
    check_plan_arguments(module, batch_size, top, dp, zero, allreduce_bandwidth, headroom)
    check_engine(data_parallel, zero)
    check_verify(verify, verify_top, verify_steps, calibration, action_overhead, headroom)
    if verify and world_size is not None:
        raise ValueError(
            f"verify runs plans in this process, and world_size={world_size} plans a job of "
            "processes: plan without verify, then time the job's steps itself (torchrun)"
        )
    names = [str(device) for device in as_devices(devices)]
    budget = None if memory_per_device is None else memory_budget(memory_per_device)
    modes = checkpoint_modes(schedules, checkpoints)
    check_loss_target(loss_fn, target)
    units = model_units(module, sample, split_points)
    laid_out = layouts(
        batch_size,
        len(names),
        units.count,
        dp=dp,
        zero=zero,
        bandwidth=allreduce_bandwidth,
        chunks=chunks,
        world_size=world_size,
        engine=data_parallel,
    )

    measure = Measurements(
        units.chain,
        units.sample,
        names[0],
        optimizer,
        loss_fn,
        target,
        split=any(splits(name) for name in schedules),
        repeats=repeats,
        sizes=[math.ceil(r.batch / m) for r in laid_out for m in r.chunk_counts],
    )
    weighed = candidates(laid_out, len(names), units.count, schedules, modes)
    from tqdm import tqdm

    check_action_overhead(action_overhead)
    scale = 1.0
    if calibration is not None:
        overhead, scale = calibration.action_overhead, calibration.time_scale
        headroom = calibration.headroom
    elif action_overhead is None:
        overhead = host_model.action_overhead(names[0])
    else:
        overhead = action_overhead

    def predict(overhead: float, scale: float, headroom: float, bar: bool = False) -> list[Plan]:
        return [
            units.planned(
                dataclasses.replace(
                    evaluate(measure, m, k, name, mode, names[:k], overhead, budget, layout, scale),
                    headroom=float(headroom),
                )
            )
            for layout, m, k, name, mode in tqdm(
                weighed, desc="planning", unit="plan", disable=not bar, file=sys.stderr
            )
        ]

    def rank_all(plans: list[Plan]) -> PlanReport:
        return rank(plans, budget, top, schedules, modes)

    report = rank_all(predict(overhead, scale, headroom, progress))
    if not verify:
        return report

    def predict_one(p: Plan, overhead: float) -> Plan:
        return evaluate(
            measure,
            p.chunks,
            p.stages,
            p.schedule,
            p.checkpoint,
            names[: p.stages],
            overhead,
            budget,
            laid_out[0],
        )

    # NOTE: one layout without world_size: each replica runs its share of the batch
    trial = trial_steps(module, units, sample, laid_out[0].batch, loss_fn, target)
    return verified(
        report,
        predict,
        predict_one,
        rank_all,
        lambda plans: measure_plans(plans, trial.build, trial.step, module, steps=verify_steps),
        overhead,
        headroom,
        verify_top,
    )
