"""Train a character-level GPT on Shakespeare through a 4-stage pipeline, and measure it."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from gpipe.cli.options import (
    CommandError,
    ensure_writable,
    positive_int,
    schedule_names,
    seed,
)
from gpipe.recompute import CHECKPOINT_MODES

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options; the defaults need nothing but a CPU and finish in minutes."""
    parser.add_argument(
        "--stages", type=positive_int, help="pipeline stages (default 4; N with --distributed N)"
    )
    parser.add_argument(
        "--chunks",
        "--microbatches",
        type=positive_int,
        default=8,
        dest="chunks",
        help="micro-batches per mini-batch (default 8)",
    )
    parser.add_argument(
        "--schedule", default="gpipe", choices=schedule_names(), help="schedule (default gpipe)"
    )
    parser.add_argument(
        "--checkpoint",
        default="except_last",
        choices=CHECKPOINT_MODES,
        help="which micro-batches recompute their forward in the backward "
        "(default except_last, as in the GPipe paper)",
    )
    parser.add_argument(
        "--steps", type=positive_int, default=250, help="training steps (default 250)"
    )
    parser.add_argument(
        "--batch",
        type=positive_int,
        default=32,
        help="windows of 64 characters per mini-batch, at least one per micro-batch (default 32)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("demo-out"),
        help="folder for timeline.png, trace.json, loss.png and report.md (default demo-out)",
    )
    parser.add_argument(
        "--distributed",
        type=positive_int,
        metavar="N",
        help="run the N stages in N processes, started with torch's elastic launcher",
    )
    parser.add_argument("--seed", type=seed, default=0, help="random seed (default 0)")


def run(args: argparse.Namespace) -> int:
    """Train, show the progress, then print and write what was measured.

    Raises:
        CommandError: settings the demo cannot run (the message names the fix).
    """
    stages = args.stages
    if args.distributed:
        if stages is not None and stages != args.distributed:
            raise CommandError(
                f"--distributed {args.distributed} runs one stage per process, but --stages "
                f"is {stages}: drop --stages, or use --distributed {stages}"
            )
        if importlib.util.find_spec("gpipe.distributed") is None:
            raise CommandError(
                "--distributed needs gpipe.distributed, which this installation lacks: run "
                "without --distributed"
            )
        stages = args.distributed
    ensure_writable(args.out)
    from gpipe.demo import DemoSettings, run_demo

    settings = DemoSettings(
        stages=stages or 4,
        chunks=args.chunks,
        schedule=args.schedule,
        checkpoint=args.checkpoint,
        steps=args.steps,
        batch=args.batch,
        seed=args.seed,
        out=args.out,
        distributed=args.distributed or 0,
    )
    try:
        run_demo(settings)
    except ValueError as error:
        raise CommandError(str(error)) from None
    except OSError as error:
        raise CommandError(f"cannot write to --out {args.out}: {error.strerror}") from None
    return 0
