"""torch.distributed.pipelining on the same model, for comparison in the same run.

One process per device (gloo on 127.0.0.1, a port picked here), as that library requires,
holding one stage, two in a V (zb-v, dualpipev), or v round-robin (the looped schedules).
Every process is joined or killed before returning; a stuck run ends with an error.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

# our schedule names -> torch.distributed.pipelining's schedule classes, where it has one:
# one stage per rank, or (zb-v, dualpipev) two in a V, rank r holding stages r and 2K-1-r
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "zb-v": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
# The looped ones: v stages per rank, round-robin (rank r holds r, r+K, ...); the caller
# gives v (``virtual_stages``), so a caller that knows only K stages never runs them.
TORCH_LOOPED_SCHEDULES = {
    "interleaved": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
}
_V_SHAPED = {"zb-v", "dualpipev"}


def torch_schedule(stages: Any, schedule: str, microbatches: int, loss_fn: Callable) -> Any:
    """torch.distributed.pipelining's runner of our ``schedule`` name over this rank's
    ``stages`` (one PipelineStage, or a list of them)."""
    from torch.distributed import pipelining

    kind = getattr(pipelining, {**TORCH_SCHEDULES, **TORCH_LOOPED_SCHEDULES}[schedule])
    return kind(stages, microbatches, loss_fn=loss_fn)


def torch_runner(
    module: nn.Module, rank: int, world: int, schedule: str, microbatches: int, loss_fn: Callable
) -> Any:
    """torch.distributed.pipelining's runner of ``schedule`` for this rank's one stage,
    ``module``, of a ``world``-stage pipeline on CPU (a process group already set up)."""
    from torch.distributed import pipelining

    stage = pipelining.PipelineStage(module, rank, world, torch.device("cpu"))
    return torch_schedule(stage, schedule, microbatches, loss_fn)


def run_step(runner: Any, first: bool, last: bool, x: Any, target: Any) -> None:
    """One step of a torch.distributed.pipelining schedule on this rank: the rank holding
    the first stage gives the input, the one holding the last the target (and takes the
    losses), the others neither."""
    if first and last:
        runner.step(x, target=target, losses=[])
    elif first:
        runner.step(x)
    elif last:
        runner.step(target=target, losses=[])
    else:
        runner.step()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class _Job:
    """What every stage process needs, sent to each as one picklable value."""

    world: int
    port: int
    factory: Callable[..., nn.Sequential]
    factory_args: tuple
    balance: list[int]
    per_rank: int  # stages each rank holds
    schedule: str
    runs: tuple[tuple[int, tuple[torch.Tensor, torch.Tensor]], ...]  # (M, batch) each
    loss_fn: Callable
    steps: int
    threads: int


def _stage(rank: int, job: _Job, results: Any) -> None:
    from torch.distributed import pipelining

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(job.port)
    torch.set_num_threads(job.threads)
    dist.init_process_group(
        "gloo", rank=rank, world_size=job.world, timeout=datetime.timedelta(seconds=120)
    )
    try:
        torch.manual_seed(0)
        model = job.factory(*job.factory_args)
        count = len(job.balance)
        held = _held(rank, job.world, job.per_rank, job.schedule)
        submodules = []
        for index in held:
            start = sum(job.balance[:index])
            submodules.append(nn.Sequential(*list(model)[start : start + job.balance[index]]))
        first, last = 0 in held, count - 1 in held

        def runner_for(microbatches: int) -> Any:
            # NOTE: stages of its own: a schedule sizes its stages' buffers for its own M.
            stages = [
                pipelining.PipelineStage(submodule, index, count, torch.device("cpu"))
                for submodule, index in zip(submodules, held)
            ]
            held_stages = stages[0] if len(stages) == 1 else stages
            return torch_schedule(held_stages, job.schedule, microbatches, job.loss_fn)

        runners = {microbatches: runner_for(microbatches) for microbatches, _ in job.runs}
        measured: dict[int, list[float]] = {microbatches: [] for microbatches, _ in job.runs}
        # NOTE: rounds over every M (the first warms up), so machine noise lands on all alike.
        for _ in range(job.steps + 1):
            for microbatches, (x, target) in job.runs:
                runner = runners[microbatches]
                dist.barrier()
                began = time.perf_counter()
                run_step(runner, first, last, x, target)
                dist.barrier()
                measured[microbatches].append(time.perf_counter() - began)
                for submodule in submodules:
                    submodule.zero_grad()
        measured = {microbatches: times[1:] for microbatches, times in measured.items()}
        if rank == 0:
            results.put(measured)
    finally:
        dist.destroy_process_group()


def _held(rank: int, world: int, per_rank: int, schedule: str) -> list[int]:
    """The stages ``rank`` holds: in a V for zb-v and dualpipev, else round-robin."""
    if schedule in _V_SHAPED:
        return [rank, 2 * world - 1 - rank]
    return [rank + j * world for j in range(per_rank)]


def step_times(
    factory: Callable[..., nn.Sequential],
    factory_args: tuple,
    balance: list[int],
    *,
    schedule: str,
    microbatches: int,
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable,
    steps: int = 5,
    timeout: float = 300.0,
    threads: int | None = None,
    virtual_stages: int = 1,
) -> list[float]:
    """Per-step seconds of torch.distributed.pipelining running ``schedule`` on the model.

    One process per device: one stage each; two in a V for "zb-v" and "dualpipev"
    (``balance`` then lists 2K stages for K processes); ``virtual_stages`` v round-robin for
    the looped schedules of :data:`TORCH_LOOPED_SCHEDULES` (``balance`` lists K·v). Each
    process uses ``threads`` intra-op threads (default: this process's count, so both sides
    compute alike).

    Raises:
        RuntimeError: a stage process failed or the run did not finish within ``timeout``.
    """
    runs = step_times_by_microbatches(
        factory,
        factory_args,
        balance,
        schedule=schedule,
        batches={microbatches: batch},
        loss_fn=loss_fn,
        steps=steps,
        timeout=timeout,
        threads=threads,
        virtual_stages=virtual_stages,
    )
    return runs[microbatches]


def step_times_by_microbatches(
    factory: Callable[..., nn.Sequential],
    factory_args: tuple,
    balance: list[int],
    *,
    schedule: str,
    batches: dict[int, tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable,
    steps: int = 5,
    timeout: float = 300.0,
    threads: int | None = None,
    virtual_stages: int = 1,
) -> dict[int, list[float]]:
    """Per-step seconds for each micro-batch count M in ``batches`` (M -> (input, target)).

    Like :func:`step_times`, but every M runs in the same stage processes, one after the
    other, so starting the processes (seconds each) is paid once.

    Raises:
        ValueError: a looped schedule with ``virtual_stages`` below 2.
        RuntimeError: a stage process failed or the run did not finish within ``timeout``.
    """
    per_rank = 2 if schedule in _V_SHAPED else virtual_stages
    if schedule in TORCH_LOOPED_SCHEDULES and per_rank < 2:
        raise ValueError(f"{schedule!r} runs v >= 2 stages per rank: pass virtual_stages")
    world = len(balance) // per_rank
    threads = threads or torch.get_num_threads()
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    job = _Job(
        world,
        free_port(),
        factory,
        factory_args,
        balance,
        per_rank,
        schedule,
        tuple(batches.items()),
        loss_fn,
        steps,
        threads,
    )
    procs = [
        context.Process(
            target=_stage,
            args=(rank, job, results),
            daemon=True,
        )
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        failed = [p.exitcode for p in procs if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"torch.distributed.pipelining run failed: exit codes {failed}")
        return results.get()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
