"""Tabulate simulated bubble fractions (F = B = W = 1) beside their closed-form formulas, and
check each schedule's simulated peak memory against its own."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from gpipe.cli.options import positive_float, positive_int, schedule_names
from gpipe.cli.simulate import check_size

__all__ = ["add_arguments", "run"]

Held = tuple[int, int, float, "float | None"]  # K, M, simulated peak, its formula's value


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
        default=[n for n in names if n != "auto"],
        help="schedules to tabulate (default: every one but auto, which searches)",
    )
    sub.add_argument(
        "--virtual-stages",
        "-v",
        type=positive_int,
        default=2,
        help="v for the looped schedules (default 2; zb-v, v-half and v-min always have 2)",
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


def _stages_per_device(name: str, requested: int) -> int:
    """v for schedule ``name``: ``requested`` (at least what it needs) for the looped ones,
    which take any, else its own (:func:`gpipe.schedule.default_virtual_stages`)."""
    from gpipe.schedule import SCHEDULES, default_virtual_stages

    own = default_virtual_stages(name)
    generator = SCHEDULES[name]
    if own == 1 or getattr(generator, "virtual_stages", None) is not None:
        return own
    return max(requested, getattr(generator, "least_virtual_stages", 1))


def run(args: argparse.Namespace) -> int:
    """Print one table per schedule and a RESULT line with the largest error."""
    from gpipe.analysis import (
        BUBBLE_FORMULAS,
        MEMORY_FORMULAS,
        Costs,
        bubble_formula,
        memory_formula,
        simulate,
    )
    from gpipe.schedule import make_schedule

    v_most = max(_stages_per_device(name, args.virtual_stages) for name in args.schedule)
    check_size(max(args.stages), max(args.microbatches), v_most, search="auto" in args.schedule)
    costs = Costs(1.0, 1.0, 1.0)
    worst = worst_memory = 0.0
    compared = built = memory_compared = 0
    if args.memory_limit is not None and "auto" not in args.schedule:
        args.parser.error("--memory-limit is for -s auto only; add auto to --schedule")
    for name in args.schedule:
        v = _stages_per_device(name, args.virtual_stages)
        options = {"costs": costs, "memory_limit": args.memory_limit} if name == "auto" else {}
        held: list[Held] = []

        def cell(
            k: int,
            m: int,
            name: str = name,
            v: int = v,
            options: dict[str, Any] = options,
            held: list[Held] = held,
        ) -> str:
            nonlocal worst, compared, built
            try:
                schedule = make_schedule(name, k, m, virtual_stages=v, **options)
            except ValueError:
                return "-"
            built += 1
            timeline = simulate(schedule, costs)
            simulated = timeline.bubble
            held.append((k, m, max(timeline.peak_memory), memory_formula(name, k, m, v)))
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
        print(_memory_line(MEMORY_FORMULAS.get(name), held))
        print()
        for _, _, peak, peak_formula in held:
            if peak_formula is not None:
                memory_compared += 1
                worst_memory = max(worst_memory, abs(peak - peak_formula))
    print(
        "-: the schedule cannot be built there (dualpipev needs M >= 2K); n/a: no closed "
        "form applies there"
    )
    print(
        f"RESULT schedules={','.join(args.schedule)} "
        f"stages={','.join(map(str, args.stages))} "
        f"microbatches={','.join(map(str, args.microbatches))} "
        f"cells={built} compared={compared} max_abs_error={worst:.3g} "
        f"memory_compared={memory_compared} memory_max_abs_error={worst_memory:g}"
    )
    return 0


def _memory_line(form: str | None, held: Sequence[Held]) -> str:
    """Whether the simulated peak memory (the busiest device's, in stage-micro-batches)
    equals its formula in every cell that has one, naming the cells where it does not."""
    if form is None:
        return "peak memory: no formula known"
    known = [(k, m, got, want) for k, m, got, want in held if want is not None]
    wrong = [f"K={k} M={m}: {got:g} against {want:g}" for k, m, got, want in known if got != want]
    said = f"peak memory, formula {form}: "
    if not known:
        return said + "no cell it applies to"
    if wrong:
        return said + f"differs in {len(wrong)} of {len(known)} cells ({'; '.join(wrong[:3])})"
    return said + f"the simulated peak equals it in all {len(known)} cells"


def _table(rows: Sequence[int], columns: Sequence[int], cell: Callable[[int, int], str]) -> str:
    """Rows K, columns M, right-aligned."""
    body = [[cell(k, m) for m in columns] for k in rows]
    width = max([len(text) for line in body for text in line] + [len(str(m)) for m in columns])
    head = "K \\ M".rjust(6) + "".join(f"  {m:>{width}}" for m in columns)
    lines = [head]
    for k, line in zip(rows, body):
        lines.append(f"{k:>6}" + "".join(f"  {text:>{width}}" for text in line))
    return "\n".join(lines)
