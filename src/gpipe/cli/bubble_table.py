"""Tabulate simulated bubble fractions (F = B = W = 1) beside their closed-form formulas."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from gpipe.cli.options import positive_float, positive_int, schedule_names
from gpipe.cli.simulate import check_size

__all__ = ["add_arguments", "run"]

_FORMULA_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v")


def add_arguments(sub: argparse.ArgumentParser) -> None:
    """Register ``gpipe bubble``'s options."""
    names = schedule_names()
    sub.add_argument(
        "--stages",
        "-K",
        type=positive_int,
        nargs="+",
        default=[2, 4, 8, 16],
        help="values of K, the number of devices (default: 2 4 8 16)",
    )
    sub.add_argument(
        "--microbatches",
        "-M",
        type=positive_int,
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
        type=positive_int,
        default=2,
        help="v for the interleaved schedule (default 2; zb-v always has 2)",
    )
    sub.add_argument(
        "--memory-limit",
        type=positive_float,
        default=None,
        metavar="N",
        help="for -s auto: the most each device may hold, in micro-batches of one stage "
        "(default: what 1F1B holds, K)",
    )
    sub.set_defaults(parser=sub)


def run(args: argparse.Namespace) -> int:
    """Print one table per schedule and a RESULT line with the largest error."""
    from gpipe.analysis import BUBBLE_FORMULAS, Costs, bubble_formula, simulate
    from gpipe.schedule import make_schedule

    v_most = max(args.virtual_stages, 2 if "zb-v" in args.schedule else 1)
    check_size(max(args.stages), max(args.microbatches), v_most, search="auto" in args.schedule)
    costs = Costs(1.0, 1.0, 1.0)
    worst = 0.0
    compared = built = 0
    if args.memory_limit is not None and "auto" not in args.schedule:
        args.parser.error("--memory-limit is for -s auto only; add auto to --schedule")
    for name in args.schedule:
        v = {"interleaved": args.virtual_stages, "zb-v": 2}.get(name, 1)
        options = {"costs": costs, "memory_limit": args.memory_limit} if name == "auto" else {}

        def cell(
            k: int, m: int, name: str = name, v: int = v, options: dict[str, Any] = options
        ) -> str:
            nonlocal worst, compared, built
            try:
                schedule = make_schedule(name, k, m, virtual_stages=v, **options)
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
        suffix = f", v={v}" if v > 1 else ""
        if name == "auto":
            limit = args.memory_limit
            suffix += f", memory limit {limit:g}" if limit is not None else ", memory limit K"
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
