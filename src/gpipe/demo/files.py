"""What the demo writes: the timelines (PNG and Perfetto), the loss curve and a one-page report."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from gpipe.analysis import BUBBLE_FORMULAS, bubble_formula
from gpipe.bench.markdown import Document
from gpipe.demo.comparison import Comparison, comparison_rows
from gpipe.demo.recipe import DemoSettings
from gpipe.demo.speeches import TEMPERATURE, Speeches, speech_rows
from gpipe.demo.training import Run, virtual_stages
from gpipe.units import format_bytes

__all__ = ["Outcome", "write_files"]


@dataclass(frozen=True)
class Outcome:
    """Everything the demo measured."""

    settings: DemoSettings
    run: Run
    layer_names: list[str]
    balance: list[int]
    profiled_bubble: float
    validation: tuple[float, float]
    speeches: Speeches
    comparison: Comparison
    seconds: float

    def device_layers(self) -> list[str]:
        """Per device, the layers it ran, e.g. ``"0-1 Embedding, Block"``."""
        starts = [sum(self.balance[:stage]) for stage in range(len(self.balance) + 1)]
        out = []
        for events in self.run.timeline.events:
            stages = sorted({unit.stage for e in events for unit in e.action.units})
            parts = []
            for stage in stages:
                a, b = starts[stage], starts[stage + 1]
                span = f"{a}" if b - a == 1 else f"{a}-{b - 1}"
                parts.append(f"{span} {', '.join(_compact(self.layer_names[a:b]))}")
            out.append("; ".join(parts))
        return out


def _compact(names: list[str]) -> list[str]:
    """``["Block", "Block", "LayerNorm"]`` as ``["2 Block", "LayerNorm"]``."""
    out: list[str] = []
    for name in names:
        if out and out[-1].endswith(name) and (out[-1] == name or out[-1][0].isdigit()):
            count = int(out[-1].split()[0]) if out[-1][0].isdigit() else 1
            out[-1] = f"{count + 1} {name}"
        else:
            out.append(name)
    return out


def write_files(outcome: Outcome) -> list[tuple[Path, str]]:
    """Write ``timeline.png``, ``trace.json``, ``loss.png``, ``generation.png`` and ``report.md``.

    Returns:
        Each file written and what it shows.
    """
    out = outcome.settings.out
    out.mkdir(parents=True, exist_ok=True)
    run = outcome.run
    timeline = run.timeline.plot(
        out / "timeline.png",
        compare=run.predicted,
        title=f"last training step: {outcome.settings.schedule}, measured vs predicted",
    )
    trace = out / "trace.json"
    run.timeline.to_chrome_trace(trace)
    loss = _plot_loss(outcome, out / "loss.png")
    stats = outcome.speeches.stats
    generation = outcome.speeches.timeline.plot(
        out / "generation.png",
        title=f"writing the speeches: {stats.lanes} lanes taking turns through the pipe",
        memory=False,
    )
    report = _report(outcome).write(out / "report.md")
    return [
        (timeline, "the last step: measured, the simulator's prediction, memory held"),
        (trace, "the same step for Perfetto (ui.perfetto.dev) or chrome://tracing"),
        (loss, "training loss per step, validation loss at the start and the end"),
        (generation, "what each device ran while the pipe wrote the speeches"),
        (report, "this run on one page, with the pictures"),
    ]


def _plot_loss(outcome: Outcome, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    losses = outcome.run.losses
    figure = Figure(figsize=(8, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, color="#4c72b0", alpha=0.35, linewidth=0.8, label="training, per step")
    window = max(1, len(losses) // 25)
    smooth = [statistics.fmean(losses[max(0, i - window + 1) : i + 1]) for i in range(len(losses))]
    ax.plot(steps, smooth, color="#4c72b0", linewidth=2, label=f"training, mean of {window}")
    first, last = outcome.validation
    ax.plot([0, len(losses)], [first, last], "o", color="#dd8452", label="validation (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per character)")
    ax.set_title("character-level GPT on Shakespeare, trained through the pipe", loc="left")
    ax.grid(alpha=0.3)
    ax.legend()
    figure.savefig(path, format="png")
    return path


def _report(outcome: Outcome) -> Document:
    s, run, c = outcome.settings, outcome.run, outcome.comparison
    doc = Document("gpipe demo: a character-level GPT learns Shakespeare through a pipeline")
    where = f"{s.distributed} processes" if s.distributed else "one process, a thread per stage"
    doc.paragraph(
        f"{s.steps} training steps of a {len(outcome.layer_names)}-layer GPT cut into "
        f"{s.stages} stages (balance {outcome.balance}, {where}), each mini-batch of "
        f"{s.batch} windows of text split into {s.chunks} micro-batches, schedule "
        f"`{s.schedule}`, checkpoint `{s.checkpoint}`. The whole demo took "
        f"{outcome.seconds:.0f} s. Reproduce with:"
    )
    doc.code(_command(s), "sh")

    doc.heading("Loss")
    first, last = outcome.validation
    doc.paragraph(
        f"Training loss {run.losses[0]:.3f} → {run.losses[-1]:.3f}; validation loss on "
        f"held-out text {first:.3f} → {last:.3f} nats per character."
    )
    doc.image("loss.png", "loss curve")

    doc.heading("The last step: measured and predicted")
    k, m, v = s.stages, s.chunks, virtual_stages(s.schedule)
    formula = bubble_formula(s.schedule, k, m, v)
    recent = run.bubbles[len(run.bubbles) // 2 :] or run.bubbles
    doc.table(
        ["bubble", "value", "how"],
        [
            ["measured, last step", f"{run.timeline.bubble:.1%}", "the runtime's timeline"],
            [
                "measured, median",
                f"{statistics.median(recent):.1%}",
                f"the last {len(recent)} steps",
            ],
            [
                "formula",
                "n/a" if formula is None else f"{formula:.1%}",
                f"{BUBBLE_FORMULAS.get(s.schedule, 'none known')}: equal stages, free hand-offs",
            ],
            [
                "simulated, profiled costs",
                f"{outcome.profiled_bubble:.1%}",
                "each layer timed alone before training (the planner)",
            ],
            [
                "simulated, this step's costs",
                f"{run.predicted.bubble:.1%}",
                "median F and B per stage of the last step",
            ],
        ],
    )
    doc.image("timeline.png", "measured and predicted timeline")
    doc.table(
        ["device", "layers", "busy (ms)", "peak held for backward"],
        [
            [d, layers, round(busy * 1e3, 1), format_bytes(peak)]
            for d, (layers, busy, peak) in enumerate(
                zip(outcome.device_layers(), run.timeline.busy, run.timeline.peak_memory)
            )
        ],
    )
    doc.paragraph(
        "`trace.json` holds the same step for [Perfetto](https://ui.perfetto.dev) or "
        "chrome://tracing."
    )

    doc.heading("Plain training beside the pipe")
    doc.table(
        ["way", "step (ms)", "vs plain", "what it costs"],
        [
            [name, round(seconds * 1e3, 1), f"{seconds / c.plain:.2f}x", note]
            for name, seconds, note in comparison_rows(s, c)
        ],
    )
    doc.paragraph(f"Measured: {c.verdict}.")

    _report_speeches(doc, outcome)
    return doc


def _report_speeches(doc: Document, outcome: Outcome) -> None:
    speeches, s = outcome.speeches, outcome.settings
    doc.heading("Speeches: through the pipe and by the plain model")
    doc.paragraph(
        f"The trained model continues each speaker's line by {speeches.stats.tokens} "
        f"characters, as far as its {speeches.context} positions allow, sampling at "
        f"temperature {TEMPERATURE} from a generator seeded {s.seed}. Through "
        "the pipe (`pipe.generate`), each stage keeps its own KV cache and only hidden "
        "states cross stages; each speech is a lane, and the lanes take turns so that "
        "every stage has work. The plain model, in one process, recomputes everything so "
        "far for each new character and draws in the same turn from the same seed."
    )
    doc.code("\n\n".join(speech.rstrip() for speech in speeches.piped))
    doc.table(
        ["way", "seconds", "how"],
        [[name, round(seconds, 2), note] for name, seconds, note in speech_rows(speeches)],
    )
    if speeches.same:
        doc.paragraph("Both ways wrote the same speeches, to the character.")
    else:
        doc.paragraph(f"The two ways wrote different speeches for {', '.join(speeches.differing)}.")
    doc.image("generation.png", "what each device ran while the pipe wrote the speeches")


def _command(s: DemoSettings) -> str:
    default = DemoSettings()
    parts = ["gpipe demo"]
    if s.distributed:
        parts.append(f"--distributed {s.distributed}")
    elif s.stages != default.stages:
        parts.append(f"--stages {s.stages}")
    for option, value, base in [
        ("--chunks", s.chunks, default.chunks),
        ("--schedule", s.schedule, default.schedule),
        ("--checkpoint", s.checkpoint, default.checkpoint),
        ("--steps", s.steps, default.steps),
        ("--batch", s.batch, default.batch),
        ("--seed", s.seed, default.seed),
        ("--out", s.out, default.out),
    ]:
        if value != base:
            parts.append(f"{option} {value}")
    return " ".join(parts)
