"""Section 7: pipeline efficiency as K and M grow: measured where the machine allows,
simulated beyond it."""

from __future__ import annotations

from gpipe.analysis import Costs, simulate
from gpipe.bench.markdown import Document
from gpipe.bench.turns import LoadMeter, spread
from gpipe.report.config import ReportSettings, SectionResult
from gpipe.report.figures import new_figure, save
from gpipe.report.latency import sleep_pipeline
from gpipe.schedule import make_schedule

__all__ = ["TITLE", "run"]

TITLE = "Efficiency at scale"
SIMULATED_STAGES = (2, 4, 8, 16, 32, 64)
SIMULATED_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

INTRO = """\
Efficiency is the share of the devices' time spent on work: the ideal step (each device
doing only its own M forwards and backwards) over the real one, 1 - bubble with nothing
else lost. For GPipe it is M/(M+K-1) with equal stages and free hand-offs, so keeping it
high as K grows needs M to grow with K. A real runtime also pays for every action it
hands over. Here K stages sleep F ms forward and B ms backward: measured with the local
runtime where this machine can host the stages (threads that sleep cost no cores), and
simulated beyond, up to K = 64, with the per-action overhead the measurements showed.
Filled markers are measured; lines are simulated."""


def run(doc: Document, settings: ReportSettings) -> SectionResult:
    """Measure efficiency on sleeping stages, fit the runtime's per-action cost, extrapolate."""
    forward_ms, backward_ms = (2.0, 4.0) if settings.quick else (4.0, 8.0)
    measured_stages = (2, 4, 8) if settings.quick else (2, 4, 8, 16, 32)
    measured_counts = (1, 4, 16) if settings.quick else (1, 4, 16, 32)
    steps = 2 if settings.quick else 5
    measured = {}
    overheads = []
    meter = LoadMeter()
    for k in measured_stages:
        for m in measured_counts:
            step = sleep_pipeline(k, m, forward_ms, backward_ms, steps=steps)
            ideal = m * (forward_ms + backward_ms) / 1e3
            measured[(k, m)] = ideal / step.seconds
            # The critical path runs 2(M + K - 1) actions; what the step took beyond the
            # ideal schedule's time is the runtime's, per action on that path.
            scheduled = (m + k - 1) * (forward_ms + backward_ms) / 1e3
            overheads.append(max(0.0, step.seconds - scheduled) / (2 * (m + k - 1)))
    overhead_low, overhead_ms, overhead_high = (o * 1e3 for o in spread(overheads))
    load = meter.stop()
    costs = Costs(forward=forward_ms + overhead_ms, backward=backward_ms + overhead_ms)

    simulated = {}
    for k in SIMULATED_STAGES:
        for m in SIMULATED_COUNTS:
            timeline = simulate(make_schedule("gpipe", k, m), costs)
            simulated[(k, m)] = m * (forward_ms + backward_ms) / timeline.makespan

    figure, ax = new_figure(8, 4.4)
    from matplotlib import colormaps

    palette = colormaps["viridis"]
    for i, k in enumerate(SIMULATED_STAGES):
        color = palette(i / (len(SIMULATED_STAGES) - 1) * 0.9)
        ax.plot(
            SIMULATED_COUNTS,
            [simulated[(k, m)] for m in SIMULATED_COUNTS],
            "-",
            color=color,
            label=f"K={k}",
        )
        if k in measured_stages:
            ax.plot(
                measured_counts,
                [measured[(k, m)] for m in measured_counts],
                "o",
                color=color,
                markersize=7,
            )
    ax.plot([], [], "o", color="gray", label="measured")
    ax.plot([], [], "-", color="gray", label="simulated")
    ax.set_xscale("log", base=2)
    ax.set_xticks(SIMULATED_COUNTS, [str(m) for m in SIMULATED_COUNTS])
    ax.set_xlabel("micro-batches M")
    ax.set_ylabel("efficiency (ideal step ÷ step)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncols=2)
    ax.set_title(
        f"GPipe efficiency, F={forward_ms:g} ms, B={backward_ms:g} ms, "
        f"+{overhead_ms:.2f} ms per action",
        loc="left",
        fontsize=10,
    )
    picture = save(figure, settings.out, "scale.png")

    doc.heading(f"7. {TITLE}")
    doc.paragraph(INTRO)
    doc.image(picture, "efficiency vs K and M")
    table_counts = (1, 4, 16, 64, 256)
    doc.table(
        ["K", *[f"M={m}" for m in table_counts]],
        [
            [
                k,
                *[
                    f"{measured[(k, m)]:.2f} (measured)"
                    if (k, m) in measured
                    else f"{simulated[(k, m)]:.2f}"
                    for m in table_counts
                ],
            ]
            for k in SIMULATED_STAGES
        ],
    )
    gaps = [abs(measured[key] - simulated[key]) for key in measured if key in simulated]
    formula = 256 / (256 + 64 - 1)  # GPipe's M/(M+K-1): the schedule alone, any host
    doc.paragraph(
        f"The runtime's cost per action, fitted from the measured points: {overhead_ms:.2f} ms "
        f"(median over {len(overheads)} runs of {steps} steps; the middle half of the fits "
        f"{overhead_low:.2f}-{overhead_high:.2f} ms, {load}). With it the simulator "
        f"lands within {max(gaps):.2f} of every measured point. Unmarked cells are "
        "simulated. At K = 64, M = 256 the schedule alone, on any host, leaves "
        f"{1 - formula:.0%} of the time idle (efficiency M/(M+K-1) = {formula:.2f}); the "
        f"simulation with this host's per-action cost leaves {1 - simulated[(64, 256)]:.0%}. "
        "The first is the lesson: deep pipelines need many micro-batches, or a schedule "
        "with a smaller bubble (section 3). The difference is this runtime on this host "
        "at this load, and moves with it."
    )
    return SectionResult(
        7,
        TITLE,
        f"K=8, M=16 measured {measured.get((8, 16), float('nan')):.2f}; "
        f"K=64, M=256 simulated {simulated[(64, 256)]:.2f}; {overhead_ms:.2f} ms per action",
        [picture],
        {
            "efficiency_k8m16": f"{measured.get((8, 16), float('nan')):.3f}",
            "overhead_ms": f"{overhead_ms:.3f}",
        },
    )
