"""``gpipe plan --generate LENGTH[,ROWS]``: what fits while generating in the best plan's
layout (see :meth:`gpipe.GPipe.generation_fit`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from gpipe.cli.options import CommandError
from gpipe.units import format_bytes

if TYPE_CHECKING:
    from torch import nn

__all__ = ["generation_argument", "generation_fit_lines"]


def generation_argument(text: str) -> tuple[int, int]:
    """``--generate LENGTH[,ROWS]`` as (length, rows)."""
    parts = text.split(",")
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (1, 2) or min(numbers) < 1:
        raise argparse.ArgumentTypeError(
            f"expected LENGTH or LENGTH,ROWS as positive ints (e.g. 512,8), got {text!r}"
        )
    return numbers[0], numbers[1] if len(numbers) == 2 else 1


def generation_fit_lines(
    model: nn.Module, report: Any, memory: int | None, length: int, rows: int
) -> str:
    """Print what fits while generating in the best plan's layout; its RESULT fields."""
    from gpipe.pipe import GPipe

    if memory is None:
        raise CommandError("--generate needs --memory-per-device: the budget the cache fills")
    pipe = GPipe.from_plan(model, report.best)
    try:
        fits = pipe.generation_fit(memory, length=length, rows=rows)
    except (TypeError, ValueError) as error:
        raise CommandError(f"--generate: {error}") from None
    finally:
        pipe.close()
    print(f"generation in this layout, {length} positions a row, {rows} row(s):")
    print("  device  weights      KV per position  rows that fit  positions for the rows")
    for each in fits:
        per_token = f"{each.per_token} B/row"
        print(
            f"  {each.device:<7} {format_bytes(each.weights):<12} {per_token:<16} "
            f"{_count(each.rows):<14} {_count(each.positions)}"
        )
    fitting = [f.rows for f in fits if f.rows is not None]
    longest = [f.positions for f in fits if f.positions is not None]
    rows_fit = min(fitting) if fitting else -1
    positions_fit = min(longest) if longest else -1
    return f" generate_rows_fit={rows_fit} generate_positions_fit={positions_fit}"


def _count(value: int | None) -> str:
    return "no limit" if value is None else str(value)
