"""Section 1: cutting a model of uneven layers into stages: uniform, by time, by memory."""

from __future__ import annotations

import copy
import itertools
import os
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

from gpipe.analysis import Costs, Timeline, simulate
from gpipe.balance import balance_by_memory, balance_costs
from gpipe.bench.markdown import Document
from gpipe.bench.measure import layer_times
from gpipe.bench.turns import LoadMeter, judge
from gpipe.pipe import GPipe
from gpipe.report.config import ReportSettings, SectionResult
from gpipe.report.figures import COLORS, new_figure, save
from gpipe.schedule import make_schedule
from gpipe.units import format_bytes

__all__ = ["TITLE", "run", "uneven_model"]

TITLE = "Partitioning"
WIDTH = 256
STAGES, MICROBATCHES, ROWS = 4, 8, 64  # rows per micro-batch
ADAM = 2  # Adam keeps two tensors the size of each parameter

INTRO = """\
A pipeline is as fast as its slowest stage and needs as much memory as its fullest one,
so where the model is cut matters. Real models have uneven layers: an embedding table
holds many parameters but computes little, a wide MLP block computes a lot. Here a
12-layer model mixes both (three tables of 2048-4096 rows, nine residual MLP blocks 1-4x
wide, the widest together), cut into 4 stages three ways: the same number of layers each
(*uniform*), equal measured forward + backward time (`balance_by_time`'s rule, on the
least of three profiles), and equal memory: parameters, gradients, Adam's state and the
activations GPipe keeps for M micro-batches (`balance_by_memory`). Each runs K=4, M=8 on
this machine; bars show each stage's measured busy time in one step and the memory it
holds."""


class _Block(nn.Module):
    """A residual MLP block, ``wide`` times as wide inside: compute-heavy."""

    def __init__(self, wide: int) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, WIDTH * wide)
        self.down = nn.Linear(WIDTH * wide, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class _Table(nn.Module):
    """A table of ``rows`` learned rows, one added to the input: memory-heavy, cheap."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(rows, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table[0]


def uneven_model() -> nn.Sequential:
    """Twelve layers of very different time and memory."""
    torch.manual_seed(0)
    return nn.Sequential(
        _Table(4096),
        _Table(4096),
        _Block(1),
        _Block(1),
        _Block(1),
        _Block(1),
        _Block(4),
        _Block(4),
        _Block(4),
        _Table(2048),
        _Block(2),
        _Block(2),
    )


def run(doc: Document, settings: ReportSettings) -> SectionResult:
    """Balance three ways, run each, and draw time and memory per stage."""
    model = uneven_model()
    x = torch.randn(MICROBATCHES * ROWS, WIDTH)
    target = torch.randn_like(x)
    microbatch = x[:ROWS]
    forward, backward = layer_times(model, microbatch)
    balances = {
        "uniform": [len(model) // STAGES] * STAGES,
        "by time": balance_costs([f + b for f, b in zip(forward, backward)], STAGES),
        "by memory": balance_by_memory(
            model, microbatch, STAGES, optimizer="adam", kept_microbatches=MICROBATCHES
        ),
    }
    steps = 3 if settings.quick else 9
    pipes = {
        name: GPipe(copy.deepcopy(model), balance, devices=["cpu"] * STAGES, chunks=MICROBATCHES)
        for name, balance in balances.items()
    }
    times: dict[str, list[float]] = {name: [] for name in pipes}
    timelines: dict[str, list[Timeline]] = {name: [] for name in pipes}
    # NOTE: one step of each per round, so a change in the machine's load hits all three.
    meter = LoadMeter()
    for round_ in range(steps + 1):
        for name, pipe in pipes.items():
            began = time.perf_counter()
            pipe.train_step(x, target, F.mse_loss)
            pipe.zero_grad(set_to_none=True)
            if round_:
                times[name].append(time.perf_counter() - began)
                timelines[name].append(pipe.timeline)
    load = meter.stop()
    step = {name: statistics.median(values) for name, values in times.items()}
    busy = {
        name: [statistics.median(t.busy[d] for t in tls) for d in range(STAGES)]
        for name, tls in timelines.items()
    }
    memory = {name: _stage_memory(pipe, timelines[name][-1]) for name, pipe in pipes.items()}
    simulated = {
        name: _simulated_step(balance, forward, backward) for name, balance in balances.items()
    }

    figure, (ax_time, ax_memory) = new_figure(10, 3.8, ncols=2)
    bar = 0.8 / len(balances)
    for i, (color, name) in enumerate(zip(COLORS, balances)):
        xs = [d + (i - 1) * bar for d in range(STAGES)]
        label = f"{name} {balances[name]}: step {step[name] * 1e3:.0f} ms"
        ax_time.bar(xs, [b * 1e3 for b in busy[name]], bar, color=color, label=label)
        ax_memory.bar(xs, [m / 2**20 for m in memory[name]], bar, color=color, label=name)
    ax_time.set_title("busy time per stage, one step", loc="left", fontsize=10)
    ax_time.set_ylabel("ms")
    ax_memory.set_title(
        "memory per stage: weights, gradients, Adam, activations", loc="left", fontsize=10
    )
    ax_memory.set_ylabel("MiB")
    for ax in (ax_time, ax_memory):
        ax.set_xticks(range(STAGES), [f"stage {d}" for d in range(STAGES)])
        ax.grid(axis="y", alpha=0.3)
    ax_time.legend(fontsize=8)
    picture = save(figure, settings.out, "partitioning.png")

    doc.heading(f"1. {TITLE}")
    doc.paragraph(INTRO)
    doc.image(picture, "time and memory per stage for three balances")
    doc.table(
        [
            "balance",
            "layers per stage",
            "step (ms)",
            "simulated step (ms)",
            "slowest stage (ms)",
            "fullest stage",
        ],
        [
            [
                name,
                str(balances[name]),
                f"{step[name] * 1e3:.0f}",
                f"{simulated[name] * 1e3:.0f}",
                f"{max(busy[name]) * 1e3:.0f}",
                format_bytes(max(memory[name])),
            ]
            for name in balances
        ],
    )
    fastest, runner_up = sorted(step, key=step.__getitem__)[:2]
    verdict = judge(runner_up, times[runner_up], fastest, times[fastest], load)
    measured = (
        f"Fastest step: {fastest} ({verdict})"
        if verdict.told
        else f"Fastest step: {verdict}, so this run names none"
    )
    same = sorted(step, key=step.__getitem__) == sorted(simulated, key=simulated.__getitem__)
    agree = "as the runtime did," if same else "otherwise than the runtime did here,"
    leanest = min(memory, key=lambda n: max(memory[n]))
    doc.paragraph(
        f"{measured}. Smallest fullest stage (counted bytes, whatever the load): "
        f"{leanest}. Balancing by time "
        "evens out the bars on the left and so the step; balancing by memory evens out "
        "the bars on the right, which decides whether the model fits at all. "
        f"Median of {steps} steps each, taken in alternation. The simulated step is the "
        "GPipe schedule run on each layer's forward and backward time, timed alone before "
        f"(the recomputation of `except_last` included): it ranks the balances {agree} "
        "and comes out shorter because here the 4 stages share "
        f"{os.cpu_count()} cores."
    )
    return SectionResult(
        1,
        TITLE,
        ", ".join(
            f"{name} {balances[name]} {step[name] * 1e3:.0f} ms / {format_bytes(max(memory[name]))}"
            for name in balances
        ),
        [picture],
        {f"step_{name.replace('by ', '')}": f"{step[name]:.4f}" for name in balances},
    )


def _simulated_step(balance: list[int], forward: list[float], backward: list[float]) -> float:
    """Seconds the simulator gives one GPipe step on these stages, from the layers' times."""
    bounds = [sum(balance[:stage]) for stage in range(len(balance) + 1)]
    spans = list(itertools.pairwise(bounds))
    f = [sum(forward[a:b]) for a, b in spans]
    recomputed = (MICROBATCHES - 1) / MICROBATCHES  # except_last, GPipe's default
    b = [sum(backward[a:b_]) + recomputed * fs for (a, b_), fs in zip(spans, f)]
    schedule = make_schedule("gpipe", len(balance), MICROBATCHES)
    return simulate(schedule, Costs(forward=f, backward=b)).makespan


def _stage_memory(pipe: GPipe, timeline: Timeline) -> list[float]:
    """Per stage: parameters, their gradients and Adam's two moments, plus the peak held
    for backward in the step (one stage per device here)."""
    fixed = [
        (2 + ADAM) * sum(p.numel() * p.element_size() for p in partition.parameters())
        for partition in pipe.partitions
    ]
    return [f + held for f, held in zip(fixed, timeline.peak_memory)]
