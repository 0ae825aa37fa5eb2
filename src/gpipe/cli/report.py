"""Measure the textbook analyses of pipeline parallelism on this machine, as a report."""

from __future__ import annotations

import argparse
from pathlib import Path

from gpipe.cli.options import CommandError, ensure_writable, positive_ints

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The report's options."""
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("report-out"),
        help="folder for report.md and its pictures (default report-out)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer points and repeats, for a first look (the full run takes about 15 minutes "
        "on 2 cores)",
    )
    parser.add_argument(
        "--sections",
        type=positive_ints,
        default=[1, 2, 3, 4, 5, 6, 7, 8],
        help="which sections, e.g. 2,3 (default all: 1 partitioning, 2 bubble, "
        "3 schedules, 4 accumulation, 5 re-materialization, 6 pipeline vs data parallel, "
        "7 scale, 8 the paper's tables)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the sections, write report.md, print what each found.

    Raises:
        CommandError: an unknown section, or an output folder that cannot be written.
    """
    from gpipe.report.build import write_report
    from gpipe.report.config import ReportSettings

    ensure_writable(args.out)
    settings = ReportSettings(out=args.out, quick=args.quick, sections=tuple(args.sections))
    try:
        path, results = write_report(settings)
    except ValueError as error:
        raise CommandError(str(error)) from None
    except OSError as error:
        raise CommandError(f"cannot write to --out {args.out}: {error.strerror}") from None
    print(f"\nWritten: {path} and {sum(len(r.figures) for r in results)} pictures beside it")
    values = {"sections": ",".join(str(r.number) for r in results)}
    values["seconds"] = f"{sum(r.seconds for r in results):.1f}"
    for result in results:
        values.update(result.values)
    print("RESULT " + " ".join(f"{key}={value}" for key, value in values.items()))
    return 0
