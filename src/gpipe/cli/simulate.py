"""Simulate one schedule under a cost model: its step x device grid, its chart, a RESULT line."""

from __future__ import annotations

import argparse
import time
from typing import Any

from gpipe.cli.options import (
    CommandError,
    costs,
    non_negative_float,
    positive_float,
    positive_int,
    schedule_names,
)

__all__ = ["add_arguments", "run"]

# NOTE: a larger step x device grid is too big to read and slow to lay out; --grid forces it.
_GRID_ACTIONS = 2000
# NOTE: the simulator's time and memory grow with the actions: more than this would take
# minutes and gigabytes, so it is refused up front instead of seeming to hang.
MAX_ACTIONS = 4_000_000
# "auto" builds and simulates a few dozen schedules, so its limit is lower.
MAX_SEARCH_ACTIONS = 100_000


def check_size(
    stages: int, microbatches: int, virtual_stages: int = 1, *, search: bool = False
) -> None:
    """Raise CommandError when a K x M (x v) schedule is too large to simulate promptly."""
    actions = 3 * stages * microbatches * virtual_stages  # F, B and W of every micro-batch
    most, what = (MAX_SEARCH_ACTIONS, "searched") if search else (MAX_ACTIONS, "simulated")
    if actions > most:
        raise CommandError(
            f"K={stages} x M={microbatches} x v={virtual_stages} makes up to {actions:,} "
            f"actions, more than the {most:,} {what} in seconds: use fewer stages "
            "or micro-batches (the bubble depends on their ratio)"
        )


def add_arguments(sub: argparse.ArgumentParser) -> None:
    """Register ``gpipe simulate``'s options."""
    sub.add_argument(
        "--stages", "-K", type=positive_int, required=True, help="K, the number of devices"
    )
    sub.add_argument(
        "--microbatches",
        "-M",
        type=positive_int,
        required=True,
        help="M, the number of micro-batches",
    )
    sub.add_argument(
        "--schedule",
        "-s",
        default="gpipe",
        choices=schedule_names(),
        help="the schedule (default: gpipe)",
    )
    sub.add_argument(
        "--virtual-stages",
        "-v",
        type=positive_int,
        default=None,
        help="model stages per device (default 2 for interleaved and zb-v, else 1; auto "
        "takes 1 or 2)",
    )
    sub.add_argument(
        "--costs",
        type=costs,
        default=(1.0, 1.0, 1.0),
        metavar="F,B,W",
        help="forward, backward and weight-gradient time per stage (default "
        "1,1,1); schedules without W actions run W inside B",
    )
    sub.add_argument(
        "--transfer",
        type=non_negative_float,
        default=0.0,
        metavar="T",
        help="time to send an activation or gradient between devices (default 0)",
    )
    sub.add_argument(
        "--memory-limit",
        type=positive_float,
        default=None,
        metavar="N",
        help="for -s auto: the most each device may hold, in micro-batches of one stage "
        "(default: what 1F1B holds, K; 2K with -v 2)",
    )
    sub.add_argument("--plot", metavar="PNG", help="also save a PNG Gantt chart here")
    sub.add_argument(
        "--trace",
        metavar="JSON",
        help="also save a Chrome/Perfetto trace here (1 cost unit shown as 1 ms)",
    )
    sub.add_argument(
        "--width",
        type=positive_int,
        default=None,
        help="chart width in characters (default: the terminal's)",
    )
    sub.add_argument("--no-color", action="store_true", help="plain text, no ANSI colours")
    sub.add_argument(
        "--grid",
        action="store_true",
        help=f"print the step x device grid even when it has over {_GRID_ACTIONS} actions",
    )
    sub.set_defaults(parser=sub)


def _virtual_stages(name: str, requested: int | None) -> int:
    if requested is not None:
        return requested
    return 2 if name in ("interleaved", "zb-v") else 1


def run(args: argparse.Namespace) -> int:
    """Simulate, print the grid (if small), the chart and a RESULT line."""
    from gpipe.analysis import Costs, simulate
    from gpipe.schedule import make_schedule

    parser: argparse.ArgumentParser = args.parser
    forward, backward, weight = args.costs
    v = _virtual_stages(args.schedule, args.virtual_stages)
    check_size(args.stages, args.microbatches, v, search=args.schedule == "auto")
    costs = Costs(forward, backward, weight, transfer=args.transfer)
    options = search_options(parser, args.schedule, costs, args.memory_limit)
    try:
        schedule = make_schedule(
            args.schedule, args.stages, args.microbatches, virtual_stages=v, **options
        )
        began = time.perf_counter()
        timeline = simulate(schedule, costs)
        elapsed = time.perf_counter() - began
    except ValueError as error:
        parser.error(str(error))
    from gpipe.analysis.chart import format_chart

    if args.grid or len(schedule) <= _GRID_ACTIONS:
        print(schedule)
    else:
        print(f"(the step x device grid of {len(schedule)} actions is left out; --grid prints it)")
    print()
    print(format_chart(timeline, width=args.width, color=False if args.no_color else None))
    try:
        if args.plot:
            title = f"{args.schedule}, K={args.stages}, M={args.microbatches}"
            print(f"wrote {timeline.plot(args.plot, title=title)}")
        if args.trace:
            timeline.to_chrome_trace(args.trace)
            print(f"wrote {args.trace}")
    except OSError as error:
        raise CommandError(f"cannot write {error.filename}: {error.strerror}") from None
    peaks = ",".join(f"{m:g}" for m in timeline.peak_memory)
    print(
        f"RESULT schedule={args.schedule} stages={args.stages} "
        f"microbatches={args.microbatches} makespan={timeline.makespan:g} "
        f"bubble={timeline.bubble:.4f} steady_bubble={timeline.steady_bubble:.4f} "
        f"peak_memory={peaks} sim_seconds={elapsed:.6f}"
    )
    return 0


def search_options(
    parser: argparse.ArgumentParser, name: str, costs: Any, memory_limit: float | None
) -> dict[str, Any]:
    """What ``make_schedule`` needs beyond K and M: for "auto", the costs and the limit."""
    if name == "auto":
        return {"costs": costs, "memory_limit": memory_limit}
    if memory_limit is not None:
        parser.error(f"--memory-limit is for -s auto only; {name!r} has a fixed memory use")
    return {}
