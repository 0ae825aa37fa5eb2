"""Section 3: every schedule on the same stages, side by side, measured and simulated."""

from __future__ import annotations

from gpipe.analysis import Costs, bubble_formula, memory_formula, simulate
from gpipe.bench.markdown import Document
from gpipe.report.config import ReportSettings, SectionResult
from gpipe.report.latency import WIDTH, sleep_pipeline
from gpipe.schedule import SCHEDULES, default_virtual_stages, make_schedule
from gpipe.units import format_bytes

__all__ = ["TITLE", "run"]

TITLE = "Schedules side by side"
STAGES, MICROBATCHES = 4, 8  # M = 2K: the fewest DualPipeV runs

INTRO = """\
GPipe runs every forward, then every backward ("F then B"): simple, but each stage holds
the activations of all M micro-batches until their backward comes. 1F1B starts each
micro-batch's backward as soon as it can, so a stage holds at most K - k micro-batches:
the same bubble, far less memory. Interleaved 1F1B gives each device two smaller stages
(v = 2), so the pipeline fills in half the time and the bubble shrinks by v. Looped BFS
holds the same two stages per device but runs every micro-batch through a device's first
stage before its second, GPipe-like: it holds every micro-batch, and in return each
stage's weights are needed in one stretch per direction, so FSDP gathers them once.
Zero-bubble ZB-H1 splits each backward into B (the input gradient, which the previous
stage waits for) and W (the weight gradient, which nobody waits for) and slots the Ws
into the bubble; ZB-H2 starts more forwards early to fill it entirely, at up to 2K - 1
micro-batches held; interleaved zero bubble does the same on two stages per device. ZB-V
puts the two stages of each device in a V (device d holds stage d and 2K-1-d), so the
first device both starts and ends each micro-batch: the bubble of interleaving at
1F1B's memory. V-Half and V-Min run on the same V with controllable memory: they delay
forwards so that a device holds about a half, or a third, of 1F1B's activations, for a
somewhat larger bubble. DualPipeV (DeepSeek's) also uses the V and, in its steady phase,
issues a forward of one micro-batch fused with the full backward of another, a pair that
a GPU can overlap (here, on a CPU, its parts run one after the other). Below, all of them
run on the same stages, each device's share sleeping F = B = W ms, measured by the
runtime; the simulator's bubble and memory, and their closed forms, sit beside them."""


def run(doc: Document, settings: ReportSettings) -> SectionResult:
    """Run every schedule at K=4, M=8 and stack their measured timelines."""
    ms = 3.0 if settings.quick else 5.0
    steps = 2 if settings.quick else 3
    rows_per_microbatch = 16
    microbatch_bytes = rows_per_microbatch * WIDTH * 4
    cases = [(name, default_virtual_stages(name)) for name in SCHEDULES if name != "auto"]
    timelines, rows = [], []
    for name, v in cases:
        measured = sleep_pipeline(
            STAGES,
            MICROBATCHES,
            ms,
            ms,
            weight_ms=ms,
            schedule=name,
            virtual_stages=v,
            steps=steps,
            rows_per_microbatch=rows_per_microbatch,
        )
        schedule = make_schedule(name, STAGES, MICROBATCHES, virtual_stages=v)
        simulated = simulate(schedule, Costs(forward=ms / v, backward=ms / v, weight=ms / v))
        bubble = bubble_formula(name, STAGES, MICROBATCHES, v)
        held = memory_formula(name, STAGES, MICROBATCHES, v)
        timelines.append(measured.timeline)
        rows.append(
            [
                name + (f" (v={v})" if v > 1 else ""),
                f"{measured.seconds * 1e3:.0f}",
                f"{measured.bubble:.3f}",
                f"{simulated.bubble:.3f}",
                "-" if bubble is None else f"{bubble:.3f}",
                format_bytes(max(measured.timeline.peak_memory)),
                f"{max(simulated.peak_memory):g}",
                "-" if held is None else f"{held:g}",
            ]
        )
    picture = "schedules.png"
    timelines[0].plot(
        settings.out / picture,
        compare=timelines[1:],
        names=[row[0] for row in rows],
        memory=False,
        title=f"measured: K={STAGES}, M={MICROBATCHES}, each device's F = B = W = {ms:g} ms",
    )
    doc.heading(f"3. {TITLE}")
    doc.paragraph(INTRO)
    doc.image(picture, f"{len(rows)} schedules, measured")
    doc.table(
        [
            "schedule",
            "step (ms)",
            "bubble measured",
            "simulated",
            "formula",
            "peak held, busiest device",
            "stage inputs held, simulated",
            "formula",
        ],
        rows,
    )
    gpipe_peak = max(timelines[0].peak_memory)
    shares = ", ".join(
        f"{row[0]} {max(t.peak_memory) / gpipe_peak:.0%}" for row, t in zip(rows[1:], timelines[1:])
    )
    doc.paragraph(
        "The formulas (`gpipe.analysis.bubble_formula` and `memory_formula`) assume equal "
        "costs, as here; DualPipeV's bubble has no closed form there. Memory is counted in "
        f"stage inputs: every stage's input is {format_bytes(microbatch_bytes)} here, "
        "whether a device holds one stage or two, so a device of two stages holds two per "
        "micro-batch (in a real model each would be half as large). The bytes held also "
        "count the gradients a backward receives and sends while it runs, and in the "
        "schedules with W what a B keeps for its W. Peak held on the busiest device, as a "
        f"share of GPipe's: {shares}."
    )
    bubbles = {row[0].split()[0]: row[2] for row in rows}
    return SectionResult(
        3,
        TITLE,
        "bubble measured: " + ", ".join(f"{n} {b}" for n, b in bubbles.items()),
        [picture],
        {f"bubble_{n.replace('-', '')}": b for n, b in bubbles.items()},
    )
