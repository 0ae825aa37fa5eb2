"""Stages of known latency, one per process: gpipe vs torch.distributed.pipelining vs ideal.

Each stage is a SleepLayer (forward F ms, backward B ms, releasing the GIL as an accelerator
kernel would), one per process, so what is left is the runtime itself: messages between
processes, bookkeeping and waits. For every K (processes) and M (micro-batches) and both
schedules (GPipe and 1F1B, whose ideal is the same: (M + K - 1)(F + B)), the same stages run
under gpipe's DistributedGPipe and under torch.distributed.pipelining's ScheduleGPipe and
Schedule1F1B, in the same run, with the processes started the same way (torch's elastic
launcher). Reported: median step time after a warm-up step, efficiency = ideal / measured,
the simulator's prediction from the step's own measured action times and the measured link
(``pipe.predicted_timeline()``), and the ratio torch / ours (above 1: ours is faster).

    python benchmarks/latency.py --distributed          # K = 2, 4, 8; M = 4, 8, 16, 32
    python benchmarks/latency_distributed.py --stages 4 --microbatches 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

import gpipe.distributed as gd
from gpipe.models import sleep_stages
from torch_reference import run_step, torch_runner

SCHEDULES = ("gpipe", "1f1b")


def ours(k: int, f: float, b: float, ms: list[int], steps: int) -> dict[str, Any]:
    """On every rank: seconds per train_step for each schedule and M, and the prediction."""
    rank, _ = gd.init()
    out: dict[str, Any] = {}
    for schedule in SCHEDULES:
        for m in ms:
            pipe = gd.DistributedGPipe(
                sleep_stages(k, f, b), [1] * k, chunks=m, schedule=schedule, checkpoint="never"
            )
            x, y = torch.randn(m, 4), torch.randn(m, 4)
            times = []
            for step in range(steps + 1):
                began = time.perf_counter()
                pipe.train_step(x, y, F.mse_loss)
                if step:
                    times.append(time.perf_counter() - began)
            predicted = pipe.predicted_timeline().makespan
            out[f"{schedule}/{m}"] = (statistics.median(times), predicted)
            pipe.close()
    return out if rank == 0 else {}


def torch_step(k: int, f: float, b: float, m: int, schedule: str) -> Callable[[], None]:
    """This rank's step of torch.distributed.pipelining on its sleep stage (gradients zeroed
    after each), for ``schedule`` ("gpipe" or "1f1b") over ``m`` micro-batches."""
    import torch.distributed as dist
    from torch import nn

    rank = dist.get_rank()
    torch.manual_seed(0)
    layer = nn.Sequential(*list(sleep_stages(k, f, b))[rank : rank + 1])
    runner = torch_runner(layer, rank, k, schedule, m, F.mse_loss)
    x, y = torch.randn(m, 4), torch.randn(m, 4)

    def step() -> None:
        run_step(runner, rank == 0, rank == k - 1, x, y)
        layer.zero_grad()

    return step


def theirs(k: int, f: float, b: float, ms: list[int], steps: int) -> dict[str, Any]:
    """On every rank: seconds per step of torch.distributed.pipelining, same stages."""
    import torch.distributed as dist

    rank, _ = gd.init()
    out: dict[str, Any] = {}
    for schedule in SCHEDULES:
        for m in ms:
            step_once = torch_step(k, f, b, m, schedule)
            times = []
            for step in range(steps + 1):
                dist.barrier()
                began = time.perf_counter()
                step_once()
                if step:
                    times.append(time.perf_counter() - began)
            out[f"{schedule}/{m}"] = statistics.median(times)
    return out if rank == 0 else {}


def both(
    k: int, f: float, b: float, ms: list[int], steps: int, rounds: int, torch_too: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """On every rank: ours and torch's in turns, ``rounds`` times, in the same processes.

    NOTE: run one after the other (two launches), the two sides met different loads on
    this shared machine: the same command's ratio moved by several percent. In turns,
    both see the same drift; each side's figure is the median over its rounds.
    """
    mine: dict[str, list[Any]] = {}
    torch_runs: dict[str, list[float]] = {}
    for _ in range(rounds):
        for key, value in ours(k, f, b, ms, steps).items():
            mine.setdefault(key, []).append(value)
        if torch_too:
            for key, seconds in theirs(k, f, b, ms, steps).items():
                torch_runs.setdefault(key, []).append(seconds)
    measured = {
        key: (statistics.median(t for t, _ in runs), statistics.median(p for _, p in runs))
        for key, runs in mine.items()
    }
    return measured, {key: statistics.median(runs) for key, runs in torch_runs.items()}


def run(args: argparse.Namespace) -> None:
    """The grid, then one RESULT line (the headline cell) and one per cell."""
    f, b = args.forward_ms, args.backward_ms
    rows = []
    for k in args.stages:
        mine, torch_times = gd.spawn(
            both,
            k,
            k,
            f,
            b,
            args.microbatches,
            args.steps,
            args.rounds,
            not args.no_torch,
            threads=1,
        )[0]
        for schedule in SCHEDULES:
            for m in args.microbatches:
                measured, predicted = mine[f"{schedule}/{m}"]
                ideal = (m + k - 1) * (f + b) / 1e3
                torch_s = torch_times.get(f"{schedule}/{m}")
                rows.append((schedule, k, m, ideal, measured, predicted, torch_s))
    print(
        f"distributed, one stage per process, F={f} B={b} ms; ratio = torch / ours (> 1: ours "
        "faster)"
    )
    print(
        f"{'schedule':>8} {'K':>3} {'M':>3} {'ideal ms':>9} {'ours ms':>9} {'eff':>6} "
        f"{'sim ms':>8} {'error':>7} {'torch ms':>9} {'ratio':>6}"
    )
    for schedule, k, m, ideal, measured, predicted, torch_s in rows:
        shown = (
            f"{torch_s * 1e3:9.1f} {torch_s / measured:6.3f}" if torch_s else f"{'-':>9} {'-':>6}"
        )
        print(
            f"{schedule:>8} {k:>3} {m:>3} {ideal * 1e3:9.1f} {measured * 1e3:9.1f} "
            f"{ideal / measured:6.3f} {predicted * 1e3:8.1f} {measured / predicted - 1:+7.2%} "
            f"{shown}"
        )
    for schedule, k, m, ideal, measured, predicted, torch_s in rows:
        ratio = f" torch_ms={torch_s * 1e3:.1f} ratio={torch_s / measured:.3f}" if torch_s else ""
        print(
            f"RESULT distributed=1 schedule={schedule} stages={k} microbatches={m} "
            f"ideal_ms={ideal * 1e3:.1f} ours_ms={measured * 1e3:.1f} "
            f"efficiency={ideal / measured:.3f} predicted_ms={predicted * 1e3:.1f}{ratio}"
        )
    head = [r for r in rows if (r[1], r[2]) == tuple(args.headline)]
    parts = []
    for schedule, _, _, ideal, measured, _, torch_s in head:
        parts.append(f"{schedule}_efficiency={ideal / measured:.3f}")
        if torch_s:
            parts.append(f"{schedule}_ratio_vs_torch={torch_s / measured:.3f}")
    if head:
        print(
            f"RESULT distributed=1 stages={head[0][1]} microbatches={head[0][2]} " + " ".join(parts)
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--backward-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument(
        "--rounds", type=int, default=3, help="turns of ours then torch's, in the same processes"
    )
    parser.add_argument("--headline", type=int, nargs=2, default=[4, 16], metavar=("K", "M"))
    parser.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args())
