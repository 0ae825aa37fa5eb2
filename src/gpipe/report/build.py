"""Run the report's sections and write ``report.md`` with a summary on top."""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gpipe.bench.markdown import Document
from gpipe.bench.progress import progress
from gpipe.report import (
    accumulation,
    bubble,
    paper,
    parallelism,
    partitioning,
    rematerialization,
    scale,
    schedules,
)
from gpipe.report.config import ReportSettings, SectionResult

__all__ = ["SECTIONS", "write_report"]

Section = Callable[[Document, ReportSettings], SectionResult]

SECTIONS: dict[int, tuple[str, Section]] = {
    1: (partitioning.TITLE, partitioning.run),
    2: (bubble.TITLE, bubble.run),
    3: (schedules.TITLE, schedules.run),
    4: (accumulation.TITLE, accumulation.run),
    5: (rematerialization.TITLE, rematerialization.run),
    6: (parallelism.TITLE, parallelism.run),
    7: (scale.TITLE, scale.run),
    8: (paper.TITLE, paper.run),
}

PREFACE = """\
Every number and picture below was measured on this machine by `{command}`, with the
formula and the simulator beside it. Timings on a shared machine vary from run to run:
each is a median of repeated steps, and where latency is the point the stages sleep a
known time instead of computing, so the schedule and the runtime, not the machine's
load, decide the result."""


def write_report(
    settings: ReportSettings, *, log: Callable[[str], None] = print
) -> tuple[Path, list[SectionResult]]:
    """Run the chosen sections, write their pictures and ``report.md`` into ``settings.out``.

    Args:
        settings: where to write and how thoroughly to measure.
        log: where to say what each section found as it finishes.

    Returns:
        The path of ``report.md`` and each section's result.

    Raises:
        ValueError: an unknown section number, or an output folder that is a file.
    """
    unknown = sorted(set(settings.sections) - SECTIONS.keys())
    if unknown:
        raise ValueError(
            f"no section {', '.join(map(str, unknown))}: choose from 1-{len(SECTIONS)}, "
            "e.g. --sections 2,3"
        )
    if settings.out.exists() and not settings.out.is_dir():
        raise ValueError(f"--out {settings.out} is a file: give a folder, e.g. --out report-out")
    import torch

    # NOTE: one intra-op thread: the pipelines' stages are threads, and more threads than
    # cores make every stage slower (idle OpenMP workers spin on a loaded machine).
    torch.set_num_threads(1)
    settings.out.mkdir(parents=True, exist_ok=True)
    body = Document("")
    results = []
    began = time.perf_counter()
    for number in sorted(settings.sections):
        title, section = SECTIONS[number]
        log(f"{number}. {title} ...")
        started = time.perf_counter()
        with progress(f"measuring section {number}"):
            result = section(body, settings)
        result.seconds = time.perf_counter() - started
        log(f"   {result.headline} ({result.seconds:.0f} s)")
        results.append(result)
    total = time.perf_counter() - began

    doc = Document("Pipeline parallelism, measured: the GPipe report")
    command = "gpipe report" + (" --quick" if settings.quick else "")
    doc.paragraph(PREFACE.format(command=command))
    doc.table(
        ["section", "what it found", "seconds"],
        [[f"{r.number}. {r.title}", r.headline, round(r.seconds)] for r in results],
    )
    doc.paragraph(_machine(total))
    doc.blocks += body.blocks[1:]
    return doc.write(settings.out / "report.md"), results


def _machine(seconds: float) -> str:
    import torch

    load = ""
    if hasattr(os, "getloadavg"):
        load = ", load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"Machine: {platform.machine()} {platform.system()}, {os.cpu_count()} cores{load}; "
        f"Python {sys.version.split()[0]}, torch {torch.__version__}; {when}; "
        f"{seconds:.0f} s in all."
    )
