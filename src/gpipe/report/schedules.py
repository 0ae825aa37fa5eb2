"""Section 3: GPipe, 1F1B, interleaved 1F1B and ZB-H1 on the same stages, side by side."""

from __future__ import annotations

from gpipe.analysis import Costs, simulate
from gpipe.bench.markdown import Document
from gpipe.report.config import ReportSettings, SectionResult
from gpipe.report.latency import WIDTH, sleep_pipeline
from gpipe.schedule import make_schedule
from gpipe.units import format_bytes

__all__ = ["TITLE", "run"]

TITLE = "Schedules side by side"
CASES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
STAGES, MICROBATCHES = 4, 8

INTRO = """\
GPipe runs every forward, then every backward ("F then B"): simple, but each stage holds
the activations of all M micro-batches until their backward comes. 1F1B starts each
micro-batch's backward as soon as it can, so a stage holds at most K - k micro-batches:
the same bubble, far less memory. Interleaved 1F1B gives each device two smaller stages
(v = 2), so the pipeline fills in half the time and the bubble shrinks by v. Zero-bubble
ZB-H1 splits each backward into B (the input gradient, which the previous stage waits
for) and W (the weight gradient, which nobody waits for) and slots the Ws into the
bubble. Below, the four run on the same stages, each device's share sleeping F = B = W
ms, measured by the runtime; the simulator's bubble and memory sit beside them."""


def run(doc: Document, settings: ReportSettings) -> SectionResult:
    """Run the four schedules at K=4, M=8 and stack their measured timelines."""
    ms = 3.0 if settings.quick else 5.0
    steps = 2 if settings.quick else 5
    rows_per_microbatch = 16
    microbatch_bytes = rows_per_microbatch * WIDTH * 4
    timelines, rows = [], []
    for name, v in CASES:
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
        # The simulator counts a stage's activations as 1 per micro-batch; a device of v
        # stages holds v of its halves per micro-batch.
        held = max(simulated.peak_memory) / v
        timelines.append(measured.timeline)
        rows.append(
            [
                name + (f" (v={v})" if v > 1 else ""),
                f"{measured.seconds * 1e3:.0f}",
                f"{measured.bubble:.3f}",
                f"{simulated.bubble:.3f}",
                format_bytes(max(measured.timeline.peak_memory)),
                f"{held:g}",
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
    doc.image(picture, "four schedules, measured")
    doc.table(
        [
            "schedule",
            "step (ms)",
            "bubble measured",
            "bubble simulated",
            "peak held, busiest device",
            "micro-batches held (simulated)",
        ],
        rows,
    )
    gpipe_peak = max(timelines[0].peak_memory)
    shares = ", ".join(
        f"{row[0]} {max(t.peak_memory) / gpipe_peak:.0%}" for row, t in zip(rows[1:], timelines[1:])
    )
    doc.paragraph(
        f"A micro-batch's stage input is {format_bytes(microbatch_bytes)} here; the bytes "
        "held also count the gradients a backward receives and sends while it runs, and "
        "in ZB-H1 what a B keeps for its W. Peak held on the busiest device, as a share "
        f"of GPipe's: {shares}."
    )
    bubbles = {row[0].split()[0]: row[2] for row in rows}
    return SectionResult(
        3,
        TITLE,
        "bubble measured: " + ", ".join(f"{n} {b}" for n, b in bubbles.items()),
        [picture],
        {f"bubble_{n.replace('-', '')}": b for n, b in bubbles.items()},
    )
