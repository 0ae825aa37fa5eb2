"""The CSV form of a schedule, to save, edit and load.

The CSV form has one row per device, holding that device's actions in order as compact
action texts (``2F0`` = stage 2, forward, micro-batch 0). Empty cells are ignored, so rows
of different lengths may be padded. Lines starting with ``#`` carry what the rows cannot:
``# name: 1f1b``, ``# microbatches: 4``, ``# stages: 8`` and ``# placement: 0 1 2 3 0 1 2 3``
(the device of each model stage), and for a decode ``# wrap: 4`` (its lanes). Every one of
them is optional: without it, the name is ``"csv"`` (or the ``name`` argument),
micro-batches and stages are one more than the largest seen, each stage lives on the
device whose row runs it, and wrap is 0::

    # name: 1f1b
    # microbatches: 2
    # stages: 2
    # placement: 0 1
    0F0,0F1,0B0,0B1
    1F0,1B0,1F1,1B1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpipe.schedule.action import Action

if TYPE_CHECKING:
    from gpipe.schedule.schedule import Schedule

__all__ = ["CsvMeta", "parse_csv", "to_csv"]


def to_csv(schedule: Schedule) -> str:
    """The schedule in the CSV form described in this module's docstring.

    Args:
        schedule: the schedule to write.

    Returns:
        The CSV text, ending with a newline; ``Schedule.from_csv`` reads it back unchanged.
    """
    lines = [
        f"# name: {schedule.name}",
        f"# microbatches: {schedule.microbatches}",
        f"# stages: {schedule.stages}",
        f"# placement: {' '.join(str(d) for d in schedule.placement)}",
    ]
    if schedule.wrap:
        lines.append(f"# wrap: {schedule.wrap}")
    lines += [",".join(str(a) for a in actions) for actions in schedule.actions]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class CsvMeta:
    """What the ``#`` lines of a CSV schedule say, with the gaps filled from its rows."""

    name: str
    microbatches: int
    stages: int
    placement: tuple[int, ...]
    wrap: int = 0


def parse_csv(text: str) -> tuple[list[list[Action]], CsvMeta]:
    """The rows and metadata of the CSV form described in this module's docstring.

    :meth:`Schedule.from_csv <gpipe.schedule.Schedule.from_csv>` builds the schedule from them.

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
    wrap = int(meta.get("wrap", 0))
    return rows, CsvMeta(meta.get("name", "csv"), microbatches, stages, placement, wrap)


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
