"""Simulate one schedule under a cost model: its step x device grid, its chart, its bubble and
memory beside their closed forms, and a RESULT line."""

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
        help="model stages per device (default 2 for interleaved, interleaved-zb, looped-bfs, "
        "zb-v, v-half and v-min, else 1; auto takes 1 or 2)",
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
        "--fused",
        type=positive_float,
        default=None,
        metavar="F",
        help="what a fused action (dualpipev's forward and backward issued together) takes, "
        "as a fraction of its parts one after the other (default 1: no overlap, as on one "
        "CPU; a GPU that overlaps them takes less)",
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


def run(args: argparse.Namespace) -> int:
    """Simulate, print the grid (if small), the chart, the bubble and memory beside their
    formulas, and a RESULT line."""
    from gpipe.analysis import Costs, simulate
    from gpipe.schedule import FUSED, default_virtual_stages, make_schedule

    parser: argparse.ArgumentParser = args.parser
    forward, backward, weight = args.costs
    v = args.virtual_stages or default_virtual_stages(args.schedule)
    k, m = args.stages, args.microbatches
    check_size(k, m, v, search=args.schedule == "auto")
    if args.schedule == "dualpipev" and m < 2 * k:
        parser.error(
            f"dualpipev needs at least 2K = {2 * k} micro-batches on K={k} devices (its "
            f"first device warms up with 2K-1 forwards), got -M {m}: pass -M {2 * k} or "
            "more, or -s zb-v, which runs any count on the same V of stages"
        )
    fused = 1.0 if args.fused is None else args.fused
    costs = Costs(forward, backward, weight, transfer=args.transfer, fused=fused)
    options = search_options(parser, args.schedule, costs, args.memory_limit)
    try:
        schedule = make_schedule(args.schedule, k, m, virtual_stages=v, **options)
        has_fused = any(a.kind == FUSED for actions in schedule.actions for a in actions)
        if args.fused is not None and not has_fused:
            parser.error(
                f"--fused prices fused actions, and {args.schedule!r} has none: use it with "
                "-s dualpipev"
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
            title = f"{args.schedule}, K={k}, M={m}"
            print(f"wrote {timeline.plot(args.plot, title=title)}")
        if args.trace:
            timeline.to_chrome_trace(args.trace)
            print(f"wrote {args.trace}")
    except OSError as error:
        raise CommandError(f"cannot write {error.filename}: {error.strerror}") from None
    equal = forward == backward == weight and args.transfer == 0 and fused == 1.0
    bubble, memory = _formulas(schedule.name, k, m, v, equal=equal)
    for line in _compared(timeline.bubble, max(timeline.peak_memory), bubble, memory):
        print(line)
    peaks = ",".join(f"{x:g}" for x in timeline.peak_memory)
    print(
        f"RESULT schedule={args.schedule} stages={k} "
        f"microbatches={m} makespan={timeline.makespan:g} "
        f"bubble={timeline.bubble:.4f} steady_bubble={timeline.steady_bubble:.4f} "
        f"peak_memory={peaks} formula_bubble={_value(bubble[0], '.4f')} "
        f"formula_memory={_value(memory[0], 'g')} sim_seconds={elapsed:.6f}"
    )
    return 0


_Formula = tuple[float | None, str]  # a value (None: none here) and its form


def _formulas(
    name: str, k: int, m: int, v: int, *, equal: bool = True
) -> tuple[_Formula, _Formula]:
    """Schedule ``name``'s closed-form bubble and memory at K, M, v: each its value (None
    where none applies) and its form, or why it has no value here.

    Args:
        equal: whether the costs are the formulas' own (F = B = W, no transfer, fused
            actions at their parts' sum); the bubble's value is given only then.
    """
    from gpipe.analysis import (
        BUBBLE_FORMULAS,
        MEMORY_FORMULAS,
        bubble_formula,
        memory_formula,
    )

    def one(form: str | None, value: float | None) -> _Formula:
        if form is None:
            return None, "none known"
        if value is None:
            return None, f"{form}; not at K={k}, M={m}"
        return value, form

    bubble = one(BUBBLE_FORMULAS.get(name), bubble_formula(name, k, m, v))
    if bubble[0] is not None and not equal:
        bubble = None, f"{bubble[1]}; not with these costs"
    memory = one(MEMORY_FORMULAS.get(name), memory_formula(name, k, m, v))
    return bubble, memory


def _compared(
    bubble: float, memory: float, bubble_form: _Formula, memory_form: _Formula
) -> list[str]:
    """A small table: the simulated bubble and the busiest device's peak, each beside its
    formula's value and form."""
    return [
        f"{'':8}{'simulated':>10}{'formula':>9}",
        f"{'bubble':8}{bubble:>10.4f}{_value(bubble_form[0], '.4f'):>9}  {bubble_form[1]}",
        f"{'memory':8}{memory:>10g}{_value(memory_form[0], 'g'):>9}  {memory_form[1]} "
        "(stage-micro-batches, the busiest device)",
    ]


def _value(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def search_options(
    parser: argparse.ArgumentParser, name: str, costs: Any, memory_limit: float | None
) -> dict[str, Any]:
    """What ``make_schedule`` needs beyond K and M: for "auto", the costs and the limit."""
    if name == "auto":
        return {"costs": costs, "memory_limit": memory_limit}
    if memory_limit is not None:
        parser.error(f"--memory-limit is for -s auto only; {name!r} has a fixed memory use")
    return {}
