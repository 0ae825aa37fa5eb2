"""The ``gpipe`` command: simulate a schedule, tabulate bubbles, and the demo and planner.

``gpipe simulate`` and ``gpipe bubble`` live here. ``gpipe demo`` and ``gpipe plan`` live in
:mod:`gpipe.demo` and :mod:`gpipe.plan_command`, each exposing ``add_arguments(parser)`` and
``run(args) -> int``; a command whose module is missing is left out of the menu.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType

__all__ = ["build_parser", "main"]

_PLUGGED_COMMANDS = {"demo": "gpipe.demo", "plan": "gpipe.plan_command"}
_FORMULA_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gpipe`` command line.

    Args:
        argv: the arguments after the program name; by default ``sys.argv[1:]``.

    Returns:
        The exit code: 0 on success.

    Raises:
        SystemExit: with code 2 on bad arguments (after printing what to fix), or 0 after
            ``--help``, as argparse does.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (| head): not an error of ours
        # NOTE: point stdout at /dev/null, or flushing it at exit raises again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every available subcommand registered.

    Returns:
        The parser; each subcommand sets ``args.run`` to the function that runs it.
    """
    parser = argparse.ArgumentParser(
        prog="gpipe",
        description="Pipeline-parallel training for PyTorch: schedules, simulator, timelines.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in _PLUGGED_COMMANDS.items():
        module = _optional_module(module_name)
        if module is not None:
            summary = (module.__doc__ or name).strip().splitlines()[0]
            sub = commands.add_parser(name, help=summary, description=summary)
            module.add_arguments(sub)
            sub.set_defaults(run=module.run)
    _add_simulate(commands)
    _add_bubble(commands)
    return parser


def _optional_module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        # NOTE: only the command's own module may be missing; a missing import *inside* it
        # is a real bug and must not silently hide the command.
        if error.name == name:
            return None
        raise


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def _costs(text: str) -> tuple[float, float, float]:
    parts = text.split(",")
    try:
        values = [float(part) for part in parts]
    except ValueError:
        values = []
    if len(values) != 3 or not all(v >= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected three numbers >= 0 as F,B,W (forward, backward, weight-gradient "
            f"time per stage), e.g. --costs 1,2,0; got {text!r}"
        )
    return values[0], values[1], values[2]


def _schedule_names() -> list[str]:
    from gpipe.schedule import SCHEDULES

    return list(SCHEDULES)


# NOTE: the grid of K=128, M=1024 is 2.8 MB of text and takes 16 s to lay out.
_GRID_ACTIONS = 2000


def _add_simulate(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sub = commands.add_parser(
        "simulate",
        help="Simulate one schedule and draw its timeline.",
        description="Simulate one schedule under a cost model; print its step x device grid, "
        "its timeline as a chart, and a RESULT line.",
    )
    sub.add_argument(
        "--stages", "-K", type=_positive_int, required=True, help="K, the number of devices"
    )
    sub.add_argument(
        "--microbatches",
        "-M",
        type=_positive_int,
        required=True,
        help="M, the number of micro-batches",
    )
    sub.add_argument(
        "--schedule",
        "-s",
        default="gpipe",
        choices=_schedule_names(),
        help="the schedule (default: gpipe)",
    )
    sub.add_argument(
        "--virtual-stages",
        "-v",
        type=_positive_int,
        default=None,
        help="model stages per device (interleaved only; default 2 there, else 1)",
    )
    sub.add_argument(
        "--costs",
        type=_costs,
        default=(1.0, 1.0, 1.0),
        metavar="F,B,W",
        help="forward, backward and weight-gradient time per stage (default "
        "1,1,1); schedules without W actions run W inside B",
    )
    sub.add_argument(
        "--transfer",
        type=_non_negative_float,
        default=0.0,
        metavar="T",
        help="time to send an activation or gradient between devices (default 0)",
    )
    sub.add_argument("--plot", metavar="PNG", help="also save a PNG Gantt chart here")
    sub.add_argument(
        "--trace",
        metavar="JSON",
        help="also save a Chrome/Perfetto trace here (1 cost unit shown as 1 ms)",
    )
    sub.add_argument(
        "--width",
        type=_positive_int,
        default=None,
        help="chart width in characters (default: the terminal's)",
    )
    sub.add_argument("--no-color", action="store_true", help="plain text, no ANSI colours")
    sub.add_argument(
        "--grid",
        action="store_true",
        help=f"print the step x device grid even when it has over {_GRID_ACTIONS} actions",
    )
    sub.set_defaults(run=_run_simulate, parser=sub)


def _virtual_stages(name: str, requested: int | None) -> int:
    if requested is not None:
        return requested
    return 2 if name == "interleaved" else 1


def _run_simulate(args: argparse.Namespace) -> int:
    from gpipe.schedule import make_schedule
    from gpipe.simulate import Costs, simulate

    parser: argparse.ArgumentParser = args.parser
    forward, backward, weight = args.costs
    try:
        schedule = make_schedule(
            args.schedule,
            args.stages,
            args.microbatches,
            virtual_stages=_virtual_stages(args.schedule, args.virtual_stages),
        )
        costs = Costs(forward, backward, weight, transfer=args.transfer)
        began = time.perf_counter()
        timeline = simulate(schedule, costs)
        elapsed = time.perf_counter() - began
    except ValueError as error:
        parser.error(str(error))
    from gpipe.trace import format_chart

    if args.grid or len(schedule) <= _GRID_ACTIONS:
        print(schedule)
    else:
        print(f"(the step x device grid of {len(schedule)} actions is left out; --grid prints it)")
    print()
    print(format_chart(timeline, width=args.width, color=False if args.no_color else None))
    if args.plot:
        title = f"{args.schedule}, K={args.stages}, M={args.microbatches}"
        print(f"wrote {timeline.plot(args.plot, title=title)}")
    if args.trace:
        timeline.to_chrome_trace(args.trace)
        print(f"wrote {args.trace}")
    peaks = ",".join(f"{m:g}" for m in timeline.peak_memory)
    print(
        f"RESULT schedule={args.schedule} stages={args.stages} "
        f"microbatches={args.microbatches} makespan={timeline.makespan:g} "
        f"bubble={timeline.bubble:.4f} peak_memory={peaks} sim_seconds={elapsed:.6f}"
    )
    return 0


def _add_bubble(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    names = _schedule_names()
    sub = commands.add_parser(
        "bubble",
        help="Tabulate simulated bubble fractions beside their closed-form formulas.",
        description="For each schedule, a table of the simulated bubble fraction with equal "
        "costs F = B = W = 1 and no transfer time, next to the formula in parentheses.",
    )
    sub.add_argument(
        "--stages",
        "-K",
        type=_positive_int,
        nargs="+",
        default=[2, 4, 8, 16],
        help="values of K, the number of devices (default: 2 4 8 16)",
    )
    sub.add_argument(
        "--microbatches",
        "-M",
        type=_positive_int,
        nargs="+",
        default=[1, 2, 4, 8, 16, 32, 64],
        help="values of M (default: 1 2 4 8 16 32 64)",
    )
    sub.add_argument(
        "--schedule",
        "-s",
        nargs="+",
        choices=names,
        default=[n for n in _FORMULA_SCHEDULES if n in names],
        help="schedules to tabulate (default: all with a formula)",
    )
    sub.add_argument(
        "--virtual-stages",
        "-v",
        type=_positive_int,
        default=2,
        help="v for the interleaved schedule (default 2)",
    )
    sub.set_defaults(run=_run_bubble, parser=sub)


def _run_bubble(args: argparse.Namespace) -> int:
    from gpipe.schedule import make_schedule
    from gpipe.simulate import BUBBLE_FORMULAS, Costs, bubble_formula, simulate

    costs = Costs(1.0, 1.0, 1.0)
    worst = 0.0
    compared = built = 0
    for name in args.schedule:
        v = args.virtual_stages if name == "interleaved" else 1

        def cell(k: int, m: int, name: str = name, v: int = v) -> str:
            nonlocal worst, compared, built
            try:
                schedule = make_schedule(name, k, m, virtual_stages=v)
            except ValueError:
                return "-"
            built += 1
            simulated = simulate(schedule, costs).bubble
            formula = bubble_formula(name, k, m, v)
            if formula is None:
                return f"{simulated:.3f} (n/a)"
            compared += 1
            worst = max(worst, abs(simulated - formula))
            return f"{simulated:.3f} ({formula:.3f})"

        formula = BUBBLE_FORMULAS.get(name, "none known")
        suffix = f", v={v}" if name == "interleaved" else ""
        print(f"{name}{suffix}: simulated bubble (formula {formula})")
        print(_table(args.stages, args.microbatches, cell))
        print()
    print("-: the schedule cannot be built there; n/a: no closed form applies there")
    print(
        f"RESULT schedules={','.join(args.schedule)} "
        f"stages={','.join(map(str, args.stages))} "
        f"microbatches={','.join(map(str, args.microbatches))} "
        f"cells={built} compared={compared} max_abs_error={worst:.3g}"
    )
    return 0


def _table(rows: Sequence[int], columns: Sequence[int], cell: Callable[[int, int], str]) -> str:
    """Rows K, columns M, right-aligned."""
    body = [[cell(k, m) for m in columns] for k in rows]
    width = max([len(text) for line in body for text in line] + [len(str(m)) for m in columns])
    head = "K \\ M".rjust(6) + "".join(f"  {m:>{width}}" for m in columns)
    lines = [head]
    for k, line in zip(rows, body):
        lines.append(f"{k:>6}" + "".join(f"  {text:>{width}}" for text in line))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
