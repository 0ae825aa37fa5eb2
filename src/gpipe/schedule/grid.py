"""The step × device grid: a schedule as a table, the way a person reads a pipeline."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from gpipe.schedule.steps import run_in_steps

if TYPE_CHECKING:
    from gpipe.schedule.schedule import Schedule

__all__ = ["format_grid"]


def format_grid(schedule: Schedule, mark: Iterable[tuple[int, int]] = ()) -> str:
    """The schedule as a table: one row per unit-time step, one column per device.

    Steps come from :func:`~gpipe.schedule.steps.run_in_steps`: a device runs its next action
    as soon as the actions it depends on ran in an earlier step; an idle cell is blank. If
    the devices get stuck, a last row ``stuck`` shows the action each unfinished device
    waits at. For a 1F1B schedule with 2 devices and 2 micro-batches::

        step  0    1
           0  0F0
           1  0F1  1F0
           2       1B0
           3  0B0  1F1
           4       1B1
           5  0B1

    Args:
        schedule: any schedule, valid or not.
        mark: ``(device, position)`` cells to highlight as ``>2F0<``, where ``position``
            indexes the device's action list (the validator marks what it rejects).

    Returns:
        The table, lines joined by newlines, without a trailing newline.
    """
    marked = set(mark)
    steps = run_in_steps(schedule)

    def cell(device: int, position: int | None) -> str:
        if position is None:
            return ""
        text = str(schedule.actions[device][position])
        return f">{text}<" if (device, position) in marked else text

    table: list[list[str]] = [["step", *(str(d) for d in range(schedule.devices))]]
    for t, step_row in enumerate(steps.rows):
        table.append([str(t), *(cell(d, p) for d, p in enumerate(step_row))])
    if not steps.finished(schedule):
        stuck = [
            cell(d, p) if p < len(schedule.actions[d]) else "" for d, p in enumerate(steps.next)
        ]
        table.append(["stuck", *stuck])
    # NOTE: marked cells are two characters wider; pad plain cells by one on the left so
    # the action texts of a column still line up under each other.
    padded = [
        [row[0]] + [f" {c}" if c and not c.startswith(">") else c for c in row[1:]] for row in table
    ]
    widths = [max(len(row[c]) for row in padded) for c in range(len(padded[0]))]
    lines = []
    for row in padded:
        first = row[0].rjust(widths[0])
        rest = [c.ljust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join([first, *rest]).rstrip())
    return "\n".join(lines)
