"""The terminal chart of a timeline: a row per device, time across.

Every drawing (this chart, :mod:`gpipe.analysis.plot`, :mod:`gpipe.analysis.perfetto`) takes a
:class:`~gpipe.analysis.timeline.Timeline`, whether the simulator predicted it (unit
``"cost"``) or the runtime measured it (unit ``"s"``), and draws it the same way, so a
prediction and a measurement can be read side by side. A terminal chart of GPipe with 3
devices and 4 micro-batches (F=B=1, 64 columns) looks like::

    gpipe: 3 devices, 4 micro-batches, makespan 12 cost, bubble 33.33%
    0 |F0>>>F1>>>F2>>>F3>>>                    B3<<<B2<<<B1<<<B0<<<|
    1 |     F0>>>F1>>>F2>>>F3>>>          B3<<<B2<<<B1<<<B0<<<     |
    2 |          F0>>>F1>>>F2>>>F3>>>B3<<<B2<<<B1<<<B0<<<          |
       0                                                    12 cost
    legend:  F3>> forward of micro-batch 3
             B3<< backward of micro-batch 3
             f b w: an action under half a character  blank: idle

A fused action (a forward and a backward issued together, DualPipeV's) is one box made of
its parts, the forward's half then the backward's, which opens with ``+`` as the text form
does (``1F1+1B0``). Device 1 here fuses two pairs (F=1, B=2, 52 columns)::

    hand: 2 devices, 3 micro-batches, makespan 12 cost, bubble 25.00%
    0 |F0>>F1>>F2>>        B0<<<<<<    B1<<<<<<B2<<<<<<|
    1 |    F0>>F1>>>>+B0<<<F2>>>>+B1<<<B2<<<<<<        |
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpipe.analysis.labels import KIND_NAMES, format_memory, format_time, kinds_in
from gpipe.schedule import BACKWARD, FORWARD, FUSED, WEIGHT, Action

if TYPE_CHECKING:
    from gpipe.analysis.timeline import Event, Timeline

__all__ = ["format_chart"]

# Without colour the fill character alone tells the kinds apart.
_FILL = {FORWARD: ">", BACKWARD: "<", WEIGHT: "="}
_BLOCK_COLOR = {FORWARD: "\x1b[97;44m", BACKWARD: "\x1b[30;42m", WEIGHT: "\x1b[30;43m"}
# An action under half a character: its kind's letter in lower case; a fused one, "+".
_MARK = {FORWARD: "f", BACKWARD: "b", WEIGHT: "w", FUSED: "+"}
_MARK_COLOR = {FORWARD: "\x1b[34m", BACKWARD: "\x1b[32m", WEIGHT: "\x1b[33m", FUSED: "\x1b[36m"}
_RESET = "\x1b[0m"
_MAX_WIDTH = 160  # wider charts stop being readable even on wide terminals
_MIN_COLUMNS = 8


def format_chart(timeline: Timeline, width: int | None = None, color: bool | None = None) -> str:
    """Draw ``timeline`` as a text Gantt chart: a row per device, time across.

    Each block shows its kind and micro-batch (``F3``) when it is wide enough, else the
    micro-batch number alone, else just its fill character: ``>`` forward, ``<`` backward,
    ``=`` weight gradient. An action narrower than half a character still shows, as the
    lower-case kind letter. Blank cells are idle time, the pipeline bubble.

    A fused action is one box: its forward's half (``F3>>``, forward colours) then its
    backward's (``+B1<<``, backward colours), and a last ``=`` cell for a W part when the
    box has room; one under half a character shows as ``+``.

    Args:
        timeline: a simulated or measured timeline.
        width: total characters per line; by default the terminal's width, capped at 160.
        color: ANSI colours on or off; by default on when stdout is a terminal and the
            ``NO_COLOR`` environment variable is unset.

    Returns:
        The chart: a header with schedule, makespan and bubble, a row per device, a time
        axis, and a legend, joined by newlines (no trailing newline).
    """
    if width is None:
        width = min(shutil.get_terminal_size((100, 24)).columns, _MAX_WIDTH)
    if color is None:
        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    label_width = len(str(max(timeline.devices - 1, 0)))
    columns = _snap(timeline, max(width - label_width - 3, _MIN_COLUMNS))
    lines = [_header(timeline)]
    origin, span = timeline.start, timeline.makespan
    for device, events in enumerate(timeline.events):
        cells = _render_row(events, origin, span, columns, color)
        lines.append(f"{device:>{label_width}} |{cells}|")
    end = f"{format_time(timeline.makespan, timeline.unit)}"
    lines.append(" " * (label_width + 2) + "0" + end.rjust(columns - 1))
    peaks = timeline.peak_memory
    if any(peaks):
        shown = ", ".join(format_memory(p, timeline.unit) for p in peaks)
        lines.append(f"peak memory per device: {shown}")
    lines.extend(_legend(timeline, color, width))
    return "\n".join(lines)


def _snap(timeline: Timeline, columns: int) -> int:
    """Shrink ``columns`` to a whole number of characters per time unit when that is exact.

    Simulated timelines with whole-number costs then draw every block of one cost the same
    width, instead of blocks one character wider or narrower from rounding.
    """
    span = timeline.makespan
    if span < 1 or columns < span:
        return columns
    origin = timeline.start
    times = [t - origin for device in timeline.events for e in device for t in (e.start, e.end)]
    if all(abs(t - round(t)) < 1e-9 for t in times) and abs(span - round(span)) < 1e-9:
        return columns // round(span) * round(span)
    return columns


def _header(timeline: Timeline) -> str:
    microbatches = 1 + max(
        (u.microbatch for device in timeline.events for e in device for u in e.action.units),
        default=-1,
    )
    name = timeline.schedule or "timeline"
    return (
        f"{name}: {_count(timeline.devices, 'device')}, "
        f"{_count(microbatches, 'micro-batch', 'micro-batches')}, "
        f"makespan {format_time(timeline.makespan, timeline.unit)}, "
        f"bubble {timeline.bubble:.2%}"
    )


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one}" if n == 1 else f"{n} {many or one + 's'}"


def _legend(timeline: Timeline, color: bool, width: int) -> list[str]:
    """The legend as (visible text, printed text) items packed into lines of ``width``."""
    items = []
    kinds = kinds_in(timeline)
    for kind in kinds:
        if kind == FUSED:
            sample = Action.fuse(Action(FORWARD, 0, 3), Action(BACKWARD, 0, 1))
            swatch, printed = _block(sample, 10, False), _block(sample, 10, color)
            text = (
                f" {KIND_NAMES[FORWARD]} of micro-batch 3 {KIND_NAMES[FUSED]} with "
                f"{KIND_NAMES[BACKWARD]} of 1"
            )
        else:
            swatch = f"{kind}3{_FILL[kind] * 2}"
            printed = _BLOCK_COLOR[kind] + swatch + _RESET if color else swatch
            text = f" {KIND_NAMES[kind]} of micro-batch 3"
        items.append((swatch + text, printed + text))
    marks = "f b w +" if FUSED in kinds else "f b w"
    items.append((f"{marks}: an action under half a character",) * 2)
    items.append(("blank: idle", "blank: idle"))
    lines: list[str] = []
    visible, printed = "legend:", "legend:"
    for item_visible, item_printed in items:
        # NOTE: lengths are measured without ANSI codes, which take no room on screen.
        if len(visible) + 2 + len(item_visible) > width and visible.strip():
            lines.append(printed)
            visible, printed = "       ", "       "
        visible += "  " + item_visible
        printed += "  " + item_printed
    lines.append(printed)
    return lines


def _render_row(
    events: Sequence[Event], origin: float, span: float, columns: int, color: bool
) -> str:
    """Lay one device's events onto ``columns`` character cells of equal time."""
    owner: list[int | None] = [None] * columns  # the event covering most of each cell
    share = [0.0] * columns  # how much of the cell that event covers
    busy = [0.0] * columns  # how much of the cell any event covers
    step = span / columns if span > 0 else 1.0
    floor, ceil, top = math.floor, math.ceil, columns - 1
    # NOTE: this loop runs once per event (262k for K=128, M=1024), so it inlines min/max as
    # comparisons and takes an event within one cell, the common case there, in one go.
    for number, event in enumerate(events):
        a = (event.start - origin) / step
        b = (event.end - origin) / step
        first = floor(a)
        first = 0 if first < 0 else top if first > top else first
        last = ceil(b) - 1
        last = first if last < first else top if last > top else last
        for cell in range(first, last + 1) if last > first else (first,):
            # NOTE: the 1e-9 floor keeps zero-length actions visible instead of dropping them.
            covered = (b if b < cell + 1 else cell + 1) - (a if a > cell else cell)
            if covered < 1e-9:
                covered = 1e-9
            busy[cell] += covered
            if covered > share[cell]:
                owner[cell], share[cell] = number, covered
    # A cell less than half busy is idle, unless it is the only place its action shows.
    shown = {owner[c] for c in range(columns) if busy[c] >= 0.5}
    kinds: list[str] = []  # per cell: "" idle, "X" block of kind X, "x" thin mark
    for cell in range(columns):
        index = owner[cell]
        if index is None or (busy[cell] < 0.5 and index in shown):
            kinds.append("")
        elif busy[cell] < 0.5:
            kinds.append(events[index].action.kind.lower())
        else:
            kinds.append(events[index].action.kind)
    out: list[str] = []
    cell = 0
    while cell < columns:
        end = cell + 1
        while end < columns and owner[end] == owner[cell] and kinds[end] == kinds[cell]:
            end += 1
        kind = kinds[cell]
        if not kind:
            out.append(" " * (end - cell))
        elif kind.islower():
            upper = kind.upper()
            mark = _MARK[upper] * (end - cell)
            out.append(_MARK_COLOR[upper] + mark + _RESET if color else mark)
        else:
            index = owner[cell]
            assert index is not None
            out.append(_block(events[index].action, end - cell, color))
        cell = end
    return "".join(out)


def _block(action: Action, width: int, color: bool) -> str:
    """The cells of one action's box, coloured when ``color``; a fused action's box is its
    forward's half, then its backward's (opening with "+"), then one cell for its W."""
    if not action.parts:
        return _painted(action.kind, _block_text(action, width, color), color)
    forward, backward, *weight = action.parts
    if width < 2:
        return _painted(FORWARD, "+" * width, color)
    thin = 1 if weight and width >= 5 else 0
    first = (width - thin + 1) // 2
    second = width - thin - first
    return (
        _painted(FORWARD, _block_text(forward, first, color), color)
        + _painted(BACKWARD, "+" + _block_text(backward, second - 1, color), color)
        + _painted(WEIGHT, _FILL[WEIGHT] * thin, color)
    )


def _painted(kind: str, text: str, color: bool) -> str:
    return _BLOCK_COLOR[kind] + text + _RESET if color and text else text


def _block_text(action: Action, width: int, color: bool) -> str:
    kind, microbatch = action.kind, str(action.microbatch)
    label = kind + microbatch
    # Without colour the kind must stay readable, so a bare number is shown only in colour.
    if width < len(label):
        label = microbatch if color and width >= len(microbatch) else ""
    return label + _FILL[kind] * (width - len(label))
