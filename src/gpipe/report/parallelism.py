"""Section 6: pipeline parallelism against data parallelism on the same model and batch."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from gpipe.bench.markdown import Document
from gpipe.bench.measure import PeakMemory
from gpipe.bench.turns import Load, host_load, judge
from gpipe.report.config import ReportSettings, SectionResult
from gpipe.report.figures import COLORS, new_figure, save

__all__ = ["TITLE", "run"]

TITLE = "Pipeline vs data parallel"
BATCH, MICROBATCHES = 32, 8
MIB = 2**20

INTRO = """\
Data parallelism (DP) puts a whole copy of the model on every device, gives each a slice
of the mini-batch, and averages the gradients with an all-reduce: no idle time, but every
device holds all the parameters, gradients and optimizer state. Pipeline parallelism (PP)
gives each device a slice of the *model*: each holds only its layers' state, and the
activations pass from device to device, at the price of the bubble. Here the demo's
character-level GPT (1.3 M parameters, 7 layers) trains on the same global batch of 32
windows in 2 (and 4) processes: PP as `DistributedGPipe` (8 micro-batches, GPipe
schedule, one stage per process), DP as PyTorch's `DistributedDataParallel`, and on 4
processes PP×DP as two replicas of a 2-stage pipeline (`DistributedGPipe(...,
dp_size=2)`), all over gloo on this machine's CPU cores. Memory per device is each
process's peak resident memory above what it held before building the model."""


@dataclass(frozen=True)
class _Job:
    """What every process of one measurement is told."""

    kind: str  # "pp", "dp" or "ppdp" (2 replicas of a pipeline)
    steps: int
    seed: int = 0


def run(doc: Document, settings: ReportSettings) -> SectionResult:
    """Train PP and DP in 2 (and 4) processes; throughput and memory per device."""
    doc.heading(f"6. {TITLE}")
    doc.paragraph(INTRO)
    import gpipe.distributed as gd

    processes = (2,) if settings.quick else (2, 4)
    steps = 4 if settings.quick else 20
    launches = 1 if settings.quick else 2
    best: dict[tuple[int, str], tuple[float, int | None, int]] = {}
    steps_seconds: dict[tuple[int, str], list[float]] = {}
    load_before = host_load()
    # NOTE: PP and DP launched in alternation, each kept at its fastest launch: other work
    # on a shared machine only ever slows a run, and alternating spreads it over both.
    for _ in range(launches):
        for n in processes:
            for kind in ("pp", "dp", "ppdp") if n == 4 else ("pp", "dp"):
                results = gd.spawn(_rank, n, _Job(kind, steps), threads=1)
                seconds = max(r["seconds"] for r in results.values())
                # a step lasts until its slowest rank is done
                each = [max(times) for times in zip(*(r["times"] for r in results.values()))]
                steps_seconds.setdefault((n, kind), []).extend(each)
                peaks = [r["peak"] for r in results.values()]
                peak = None if None in peaks else max(peaks)
                parameters = max(r["parameters"] for r in results.values())
                if (n, kind) not in best or seconds < best[n, kind][0]:
                    best[n, kind] = (seconds, peak, parameters)
    load = Load(load_before, host_load(), os.cpu_count() or 1)
    names = {"pp": "PP", "dp": "DP", "ppdp": "PP×DP"}
    rows = [
        (n, names[kind], BATCH / seconds, seconds, peak, parameters)
        for (n, kind), (seconds, peak, parameters) in best.items()
    ]

    figure, (ax_speed, ax_memory) = new_figure(10, 3.6, ncols=2)
    labels = [f"{kind}, {n} proc" for n, kind, *_ in rows]
    shade = {"PP": COLORS[0], "DP": COLORS[2], "PP×DP": COLORS[1]}
    colors = [shade[kind] for _, kind, *_ in rows]
    ax_speed.bar(labels, [r[2] for r in rows], color=colors)
    ax_speed.set_title("throughput (samples/s)", loc="left", fontsize=10)
    ax_memory.bar(labels, [(r[4] or 0) / MIB for r in rows], color=colors)
    ax_memory.set_title("peak memory per device (MiB)", loc="left", fontsize=10)
    for ax in (ax_speed, ax_memory):
        ax.grid(axis="y", alpha=0.3)
    picture = save(figure, settings.out, "parallelism.png")

    doc.image(picture, "throughput and memory, pipeline vs data parallel")
    doc.table(
        [
            "processes",
            "way",
            "samples/s",
            "step (ms)",
            "peak memory per device (MiB)",
            "parameters per device",
        ],
        [
            [
                n,
                kind,
                f"{speed:.0f}",
                f"{seconds * 1e3:.0f}",
                "n/a" if peak is None else f"{peak / MIB:.1f}",
                f"{params:,}",
            ]
            for n, kind, speed, seconds, peak, params in rows
        ],
    )
    verdicts = []
    for n in processes:
        pp = next(r for r in rows if r[0] == n and r[1] == "PP")
        dp = next(r for r in rows if r[0] == n and r[1] == "DP")
        verdict = judge(
            "PP", steps_seconds[n, "pp"], "DP", steps_seconds[n, "dp"], load, unit="steps"
        )
        memory = ""
        if pp[4] is not None and dp[4] is not None:
            leaner = "PP" if pp[4] < dp[4] else "DP"
            memory = f"; {leaner} needs less memory per device ({pp[4] / MIB:.1f} MiB for PP, "
            memory += f"{dp[4] / MIB:.1f} for DP)"
        verdicts.append(f"on {n} processes, step time: {verdict}{memory}")
        both = [r for r in rows if r[0] == n and r[1] == "PP×DP"]
        if both:
            verdicts.append(
                f"PP×DP (2 replicas of 2 stages) reaches {both[0][2]:.0f} samples/s with "
                + ("n/a" if both[0][4] is None else f"{both[0][4] / MIB:.1f} MiB")
                + " per device"
            )
    doc.paragraph(
        "Measured: "
        + "; ".join(verdicts)
        + ". DP wins on speed when the model fits on each device and the all-reduce is "
        "cheap against the compute: it has no bubble. PP wins when the model does not fit: "
        "each device holds only its share of the parameters (see the last column), and "
        "activations cross the links only at stage boundaries. Here every process shares "
        f"the same few cores, so neither gets faster hardware by adding processes. "
        f"The table: median of {steps} steps after a warm-up, the faster of {launches} "
        "launches of each, made in alternation; the verdicts pool every step of every launch. "
        "Memory is counted by the kernel and holds whatever the load: the per-device "
        "parameter counts are the part that does not depend on the host at all."
    )
    pp2 = next(r for r in rows if r[0] == 2 and r[1] == "PP")
    dp2 = next(r for r in rows if r[0] == 2 and r[1] == "DP")
    return SectionResult(
        6,
        TITLE,
        f"2 processes: PP {pp2[2]:.0f} samples/s, DP {dp2[2]:.0f} samples/s",
        [picture],
        {"pp2_samples_s": f"{pp2[2]:.1f}", "dp2_samples_s": f"{dp2[2]:.1f}"},
    )


def _rank(job: _Job) -> dict[str, Any]:
    """One process: build the model its way, train ``job.steps`` steps, time and measure."""
    from torch.nn.parallel import DistributedDataParallel

    import gpipe.distributed as gd
    from gpipe.balance import balance_by_params
    from gpipe.demo.recipe import Corpus, DemoSettings
    from gpipe.models import gpt, gpt_loss

    rank, world = gd.init()
    torch.set_num_threads(1)
    corpus = Corpus.load(job.seed)
    batches = corpus.batches(DemoSettings(steps=job.steps + 1, batch=BATCH, seed=job.seed))
    memory = PeakMemory()
    memory.start()
    torch.manual_seed(job.seed)
    if job.kind in ("pp", "ppdp"):
        dp = 2 if job.kind == "ppdp" else 1
        with torch.device("meta"):
            model = gpt(corpus.config)
        balance = balance_by_params(model, world // dp)
        runner: Any = gd.DistributedGPipe(model, balance, chunks=MICROBATCHES // dp, dp_size=dp)

        def step(ids: torch.Tensor, targets: torch.Tensor) -> None:
            runner.train_step(ids, targets, gpt_loss)

    else:
        runner = DistributedDataParallel(gpt(corpus.config))

        def step(ids: torch.Tensor, targets: torch.Tensor) -> None:
            share = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
            gpt_loss(runner(ids[share]), targets[share]).backward()

    optimizer = torch.optim.AdamW(runner.parameters(), lr=1e-3)
    times = []
    for ids, targets in batches:
        began = time.perf_counter()
        step(ids, targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
    parameters = sum(p.numel() for p in runner.parameters())
    if job.kind != "dp":
        runner.close()
    return {
        "seconds": statistics.median(times[1:]),
        "times": times[1:],
        "peak": memory.peak(),
        "parameters": parameters,
    }
