"""Text forms of a schedule: the step × device grid, and CSV to save, edit and load.

The CSV form has one row per device, holding that device's actions in order as compact
action texts (``2F0`` = stage 2, forward, micro-batch 0). Empty cells are ignored, so rows
of different lengths may be padded. Lines starting with ``#`` carry what the rows cannot:
``# name: 1f1b``, ``# microbatches: 4``, ``# stages: 8`` and ``# placement: 0 1 2 3 0 1 2 3``
(the device of each model stage). Every one of them is optional: without it, the name is
``"csv"`` (or the ``name`` argument), micro-batches and stages are one more than the largest
seen, and each stage lives on the device whose row runs it::

    # name: 1f1b
    # microbatches: 2
    # stages: 2
    # placement: 0 1
    0F0,0F1,0B0,0B1
    1F0,1B0,1F1,1B1
"""

from __future__ import annotations

from collections.abc import Iterable

from gpipe.schedule.action import Action, Schedule
from gpipe.schedule.steps import run_in_steps

__all__ = ["format_grid", "from_csv", "to_csv"]


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

    table = [["step", *(str(d) for d in range(schedule.devices))]]
    for t, row in enumerate(steps.rows):
        table.append([str(t), *(cell(d, p) for d, p in enumerate(row))])
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


def to_csv(schedule: Schedule) -> str:
    """The schedule in the CSV form described in this module's docstring.

    Args:
        schedule: the schedule to write.

    Returns:
        The CSV text, ending with a newline; :func:`from_csv` reads it back unchanged.
    """
    lines = [
        f"# name: {schedule.name}",
        f"# microbatches: {schedule.microbatches}",
        f"# stages: {schedule.stages}",
        f"# placement: {' '.join(str(d) for d in schedule.placement)}",
    ]
    lines += [",".join(str(a) for a in actions) for actions in schedule.actions]
    return "\n".join(lines) + "\n"


def from_csv(text: str, name: str | None = None) -> Schedule:
    """Read the CSV form described in this module's docstring.

    Args:
        text: the CSV text, with or without ``#`` metadata lines.
        name: the schedule's name; overrides a ``# name:`` line.

    Returns:
        The schedule. It is not validated; call :func:`~gpipe.schedule.validate` for that.

    Raises:
        ValueError: an unparsable action or metadata line, or a stage whose device cannot
            be inferred (no placement line and no row or several rows run it).
    """
    meta: dict[str, str] = {}
    rows: list[list[Action]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            key, sep, value = stripped[1:].partition(":")
            if not sep:
                raise ValueError(f"line {number}: expected '# key: value', got {line!r}")
            meta[key.strip()] = value.strip()
            continue
        if not stripped:
            continue
        rows.append([Action.parse(cell) for cell in stripped.split(",") if cell.strip()])

    seen = [a for row in rows for a in row]
    microbatches = int(meta.get("microbatches", 1 + max((a.microbatch for a in seen), default=0)))
    stages = int(meta.get("stages", 1 + max((a.stage for a in seen), default=len(rows) - 1)))
    if "placement" in meta:
        placement = tuple(int(d) for d in meta["placement"].split())
    else:
        placement = _infer_placement(rows, stages)
    return Schedule(name or meta.get("name", "csv"), rows, microbatches, stages, placement)


def _infer_placement(rows: list[list[Action]], stages: int) -> tuple[int, ...]:
    owners: list[set[int]] = [set() for _ in range(stages)]
    for device, row in enumerate(rows):
        for action in row:
            owners[action.stage].add(device)
    for stage, devices in enumerate(owners):
        if len(devices) != 1:
            where = f"rows {sorted(devices)}" if devices else "no row"
            raise ValueError(
                f"cannot tell which device holds stage {stage}: {where} run it; "
                "add a '# placement: ...' line listing each stage's device"
            )
    return tuple(devices.pop() for devices in owners)
