"""Section 5: what re-materialization saves in memory and costs in compute, measured."""

from __future__ import annotations

import copy
import statistics
from functools import partial

import torch
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from gpipe.balance import profile
from gpipe.bench.markdown import Document
from gpipe.bench.measure import peak_rss_during
from gpipe.bench.turns import Verdict, in_turns, judge
from gpipe.models import mlp
from gpipe.pipe import GPipe
from gpipe.report.config import ReportSettings, SectionResult
from gpipe.report.figures import COLORS, new_figure, save

__all__ = ["TITLE", "run"]

TITLE = "Re-materialization"
BLOCKS, WIDTH, BATCH, MICROBATCHES = 16, 128, 512, 8
MIB = 2**20

INTRO = """\
To compute gradients, autograd keeps what each layer's forward saved until its backward
runs. A stage of L/K layers running GPipe keeps that for all M micro-batches in flight:
O(N·L/K) for a mini-batch of N samples. GPipe's re-materialization (checkpointing) keeps
only each micro-batch's *stage input* and runs the stage's forward again during the
backward, so a device holds the N samples' stage inputs plus one micro-batch's full
activations while it recomputes: the paper's O(N + (L/K)·(N/M)). The price is one more
forward per micro-batch. Here an MLP of 16 blocks (Linear + GELU, 128 wide, a mini-batch
of 512 rows in 8 micro-batches) runs on K devices with and without checkpointing; memory
is counted exactly by the runtime (every tensor autograd saves, plus stashed inputs) and
as the process's peak resident memory, beside the paper's estimate from a profile."""


def run(doc: Document, settings: ReportSettings) -> SectionResult:
    """Measure memory per device and step time for K in 1..8, checkpoint never/always."""
    counts = (1, 2, 4) if settings.quick else (1, 2, 4, 8)
    steps = 3 if settings.quick else 9
    torch.manual_seed(0)
    model = mlp(BLOCKS, WIDTH)
    x = torch.randn(BATCH, WIDTH)
    target = torch.randn(BATCH, WIDTH)
    layers = profile(model, x[: BATCH // MICROBATCHES], repeats=1, warmup=0)

    rows: list[tuple[int, dict[str, float], dict[str, int], dict[str, int | None], Verdict]] = []
    flops: dict[str, int] = {}
    for k in counts:
        per = len(model) // k
        spans = [(s * per, (s + 1) * per) for s in range(k)]
        full = max(layers.stage_activation_bytes(a, b) for a, b in spans)
        kept = max(layers.input_bytes[a] for a, _ in spans)
        estimate = {"never": MICROBATCHES * full, "always": MICROBATCHES * kept + full}
        pipes = {
            mode: GPipe(
                copy.deepcopy(model),
                [per] * k,
                devices=["cpu"] * k,
                chunks=MICROBATCHES,
                checkpoint=mode,
            )
            for mode in ("never", "always")
        }
        counted, rss = {}, {}
        for mode, pipe in pipes.items():
            pipe.train_step(x, target, F.mse_loss)  # warm-up: threads and caches
            pipe.zero_grad(set_to_none=True)
            rss[mode] = peak_rss_during(partial(pipe.train_step, x, target, F.mse_loss))
            counted[mode] = max(pipe.timeline.peak_memory)
            pipe.zero_grad(set_to_none=True)
        if not flops:  # the same work whatever K: counted once, on one device
            for mode, pipe in pipes.items():
                with FlopCounterMode(display=False) as counter:
                    pipe.train_step(x, target, F.mse_loss)
                pipe.zero_grad(set_to_none=True)
                flops[mode] = counter.get_total_flops()

        def step(pipe: GPipe) -> None:
            pipe.train_step(x, target, F.mse_loss)
            pipe.zero_grad(set_to_none=True)

        never, always, load = in_turns(
            partial(step, pipes["never"]), partial(step, pipes["always"]), steps, warmup=0
        )
        rows.append((k, counted, estimate, rss, judge("never", never, "always", always, load)))

    figure, (ax, ax_ratio) = new_figure(10, 3.8, ncols=2)
    ks = [r[0] for r in rows]
    for color, mode in zip(COLORS, ("never", "always")):
        ax.plot(ks, [r[1][mode] / MIB for r in rows], "o-", color=color, label=f"{mode}: counted")
        ax.plot(ks, [r[2][mode] / MIB for r in rows], "--", color=color, label=f"{mode}: estimate")
        peaks = [r[3][mode] for r in rows]
        if all(peak is not None for peak in peaks):
            ax.plot(
                ks,
                [(peak or 0) / k / MIB for peak, k in zip(peaks, ks)],
                "s",
                color=color,
                fillstyle="none",
                label=f"{mode}: process peak ÷ K",
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("devices K")
    ax.set_ylabel("MiB per device")
    ax.set_title("activation memory per device", loc="left", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax_ratio.bar(
        [str(k) + ("" if r[4].told else "?") for k, r in zip(ks, rows)],
        [r[4].ratio for r in rows],
        color=[COLORS[1] if r[4].told else "lightgray" for r in rows],
    )
    ax_ratio.axhline(flops["always"] / flops["never"], color=COLORS[0], linestyle="--")
    ax_ratio.axhline(1.0, color="black", linewidth=0.8)
    ax_ratio.set_xlabel("devices K")
    ax_ratio.set_title(
        "step time, always ÷ never (gray ?: this run cannot tell; dashed: FLOPs)",
        loc="left",
        fontsize=9,
    )
    ax_ratio.grid(axis="y", alpha=0.3)
    picture = save(figure, settings.out, "rematerialization.png")

    def mib(value: float | None) -> str:
        return "n/a" if value is None else f"{value / MIB:.2f}"

    doc.heading(f"5. {TITLE}")
    doc.paragraph(INTRO)
    doc.image(picture, "activation memory and compute cost of checkpointing")
    doc.table(
        [
            "K",
            "never: counted",
            "never: estimate",
            "always: counted",
            "always: estimate",
            "process peak never / always (all devices)",
            "step always ÷ never (? cannot tell)",
        ],
        [
            [
                k,
                mib(c["never"]),
                mib(e["never"]),
                mib(c["always"]),
                mib(e["always"]),
                f"{mib(r['never'])} / {mib(r['always'])}",
                verdict.short,
            ]
            for k, c, e, r, verdict in rows
        ],
    )
    saving = rows[0][1]["never"] / rows[0][1]["always"]
    ratios = [r[4].ratio for r in rows]
    told = [r[4] for r in rows if r[4].told]
    extra = flops["always"] / flops["never"]
    if len(told) == len(rows):
        timed = (
            f"Measured, recomputing costs {min(ratios):.2f}-{max(ratios):.2f}x the step time, "
            f"each K's never and always in {steps} turns; at K={rows[0][0]}, {rows[0][4]}. "
        )
    else:
        k_unsure, unsure = next((r[0], r[4]) for r in rows if not r[4].told)
        timed = (
            f"Measured, {len(rows) - len(told)} of {len(rows)} device counts cannot tell the "
            f"step times apart (marked ?); at K={k_unsure}, {unsure}. "
        )
    doc.paragraph(
        f"Memory in MiB per device. On one device, checkpointing holds {saving:.1f}x less. "
        "Without it memory falls as 1/K, each device holding fewer layers; with it, it "
        "falls towards the O(N) term, the stage inputs of all N samples "
        f"({BATCH * WIDTH * 4 / MIB:.2f} MiB here), which every device keeps whatever K. "
        "The estimate counts each "
        "micro-batch's saved activations (never) or stage input plus one micro-batch's "
        "activations (always), from a profile of the layers; the runtime's count also "
        "holds the gradients a backward receives and sends. The process peak adds what "
        "the count leaves out: temporaries inside each operation, and the allocator. "
        f"Counted with FlopCounterMode, which does not depend on the host, checkpointing "
        f"runs {extra:.2f}x the FLOPs: one more forward on top of a forward and a backward "
        "(about 2 forwards' work), so ~1.33x is the textbook figure. " + timed
    )
    one = rows[-1]
    return SectionResult(
        5,
        TITLE,
        f"K=1: never {mib(rows[0][1]['never'])} MiB, always {mib(rows[0][1]['always'])} "
        f"MiB per device; K={one[0]}: {mib(one[1]['never'])} / {mib(one[1]['always'])}; "
        f"FLOPs x{extra:.2f}; step time "
        + (f"x{min(ratios):.2f}-{max(ratios):.2f}" if len(told) == len(rows) else "cannot tell"),
        [picture],
        {
            "remat_saving_k1": f"{saving:.2f}",
            "remat_time_ratio": f"{statistics.median(ratios):.2f}",
            "remat_flops_ratio": f"{extra:.3f}",
            "remat_time_told": f"{len(told)}/{len(rows)}",
        },
    )
