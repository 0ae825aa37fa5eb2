"""Run the demo and tell what happened: in the terminal, and in files (see ``files``)."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

from gpipe.analysis import BUBBLE_FORMULAS, bubble_formula
from gpipe.bench.progress import progress
from gpipe.bench.sparkline import sparkline
from gpipe.demo.comparison import compare, comparison_rows
from gpipe.demo.files import Outcome, write_files
from gpipe.demo.forecast import partition
from gpipe.demo.recipe import Corpus, DemoSettings, check
from gpipe.demo.speeches import TEMPERATURE, Speeches, speech_rows, write_speeches
from gpipe.demo.training import (
    build_model,
    train_distributed,
    train_local,
    validation_loss,
    virtual_stages,
)
from gpipe.units import format_bytes

__all__ = ["run_demo"]


def run_demo(settings: DemoSettings) -> Outcome:
    """Train, then print and write what the run measured.

    Returns:
        What the demo measured, as written to ``settings.out``.

    Raises:
        ValueError: settings the demo cannot run (the message names the fix).
    """
    began = time.perf_counter()
    corpus = Corpus.load(settings.seed)
    model = build_model(settings, corpus)
    check(settings, len(model))
    names = [type(layer).__name__ for layer in model]
    print(
        f"Shakespeare: {len(corpus.train) * 10 // 9:,} characters, {corpus.tokenizer.vocab} "
        f"distinct; the last tenth held out. Model: a character-level GPT of "
        f"{sum(p.numel() for p in model.parameters()):,} parameters in {len(model)} layers.",
        flush=True,
    )
    with progress("profiling each layer, to predict the pipeline before it runs"):
        parts = partition(settings, corpus, model)
    where = (
        f"{settings.distributed} processes" if settings.distributed else "threads of this process"
    )
    print(
        f"Pipeline: {settings.stages} stage{'s' if settings.stages > 1 else ''} ({where}), "
        f"balance {parts.balance} by parameters, {settings.chunks} micro-batches of "
        f"{settings.batch // settings.chunks}, "
        f"schedule {settings.schedule}, checkpoint {settings.checkpoint}."
    )
    start_loss = validation_loss(model, corpus)
    train = train_distributed if settings.distributed else train_local
    run = train(settings, corpus, list(parts.balance))
    model.load_state_dict(run.state)
    end_loss = validation_loss(model, corpus)
    # NOTE: one thread: a token at a time is too small to share, and after training in
    # several processes more threads than free cores make sampling many times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with progress("writing speeches through the pipe and by the plain model"):
            speeches = write_speeches(settings, corpus, model, list(parts.balance))
    finally:
        torch.set_num_threads(threads)
    with progress("timing plain training beside the pipe"):
        comparison = compare(settings, corpus, list(parts.balance), run.state, run.seconds)
    outcome = Outcome(
        settings=settings,
        run=run,
        layer_names=names,
        balance=list(parts.balance),
        profiled_bubble=parts.predicted.bubble,
        validation=(start_loss, end_loss),
        speeches=speeches,
        comparison=comparison,
        seconds=0.0,
    )
    outcome = dataclasses.replace(outcome, seconds=time.perf_counter() - began)
    files = write_files(outcome)
    _print(outcome)
    print(f"\nWritten to {settings.out}/:")
    for path, what in files:
        print(f"  {path.name:<15} {what}")
    _print_result(outcome)
    return outcome


def _print(outcome: Outcome) -> None:
    s, run, comparison = outcome.settings, outcome.run, outcome.comparison
    first, last = outcome.validation
    print(
        f"\nloss   {run.losses[0]:.2f} {sparkline(run.losses)} {run.losses[-1]:.2f}   "
        f"({s.steps} steps, {sum(run.seconds):.0f} s of training)"
    )
    print(f"validation loss on held-out text: {first:.3f} at the start, {last:.3f} at the end")

    k, m, v = s.stages, s.chunks, virtual_stages(s.schedule)
    formula = bubble_formula(s.schedule, k, m, v)
    recent = run.bubbles[len(run.bubbles) // 2 :] or run.bubbles
    print("\nbubble (the share of the stages' time spent idle):")
    rows = [
        (
            "measured, last step",
            f"{run.timeline.bubble:.1%}",
            f"median of the last {len(recent)} steps {statistics.median(recent):.1%}",
        ),
        (
            f"formula {BUBBLE_FORMULAS.get(s.schedule, 'none known')}",
            "n/a" if formula is None else f"{formula:.1%}",
            "equal stages, free hand-offs",
        ),
        (
            "simulated, profiled costs",
            f"{outcome.profiled_bubble:.1%}",
            "each layer timed alone before training, summed per stage",
        ),
        (
            "simulated, this step's costs",
            f"{run.predicted.bubble:.1%}",
            "the last step's median F and B per stage (timeline.png)",
        ),
    ]
    for name, value, note in rows:
        print(f"  {name:<34} {value:>6}   {note}")

    print("\nper device, last step:")
    print(f"  {'device':<7} {'layers':<34} {'busy':>8} {'peak held for backward':>24}")
    for device, (layers, busy, peak) in enumerate(
        zip(outcome.device_layers(), run.timeline.busy, run.timeline.peak_memory)
    ):
        print(f"  {device:<7} {layers:<34} {busy * 1e3:>6.0f} ms {format_bytes(peak):>24}")

    _print_speeches(outcome.speeches, s)

    print(f"\nstep time, the same model and {m} micro-batches of {s.batch // m}:")
    for name, seconds, note in comparison_rows(s, comparison):
        ratio = seconds / comparison.plain
        print(f"  {name:<28} {seconds * 1e3:>6.0f} ms  {ratio:>5.2f}x  {note}")
    print(f"  {comparison.verdict}")
    cores = os.cpu_count() or 1
    if cores < k:
        print(
            f"  (the {k} stages share {cores} CPU cores here: on one device per stage they "
            "would not wait for each other's cores)"
        )


def _print_speeches(speeches: Speeches, s: DemoSettings) -> None:
    print(
        f"\nspeeches, through the pipe and by the plain model (temperature {TEMPERATURE}, "
        f"seed {s.seed}):\n"
    )
    for speech in speeches.piped:
        print("  " + speech.rstrip().replace("\n", "\n  ") + "\n")
    for name, seconds, note in speech_rows(speeches):
        print(f"  {name:<17} {seconds:>5.2f} s  {note}")
    if speeches.same:
        print("  the same speeches both ways, to the character")
    else:
        print(f"  the two ways wrote different speeches for {', '.join(speeches.differing)}")


def _print_result(outcome: Outcome) -> None:
    s, run, c = outcome.settings, outcome.run, outcome.comparison
    formula = bubble_formula(s.schedule, s.stages, s.chunks, virtual_stages(s.schedule))
    fields = {
        "stages": s.stages,
        "chunks": s.chunks,
        "steps": s.steps,
        "first_loss": f"{run.losses[0]:.4f}",
        "last_loss": f"{run.losses[-1]:.4f}",
        "val_start": f"{outcome.validation[0]:.4f}",
        "val_end": f"{outcome.validation[1]:.4f}",
        "bubble": f"{run.timeline.bubble:.4f}",
        "bubble_formula": "none" if formula is None else f"{formula:.4f}",
        "bubble_profiled": f"{outcome.profiled_bubble:.4f}",
        "bubble_predicted": f"{run.predicted.bubble:.4f}",
        "plain_step": f"{c.plain:.4f}",
        "pipe_step": f"{c.pipe:.4f}",
        "speeches_same": "yes" if outcome.speeches.same else "no",
        "generate_seconds": f"{outcome.speeches.stats.seconds:.3f}",
        "plain_generate_seconds": f"{outcome.speeches.plain_seconds:.3f}",
        "seconds": f"{outcome.seconds:.1f}",
    }
    print("RESULT " + " ".join(f"{key}={value}" for key, value in fields.items()))
