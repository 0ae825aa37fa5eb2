"""Drawing timelines: a terminal chart, a PNG Gantt chart, and a Chrome/Perfetto trace.

Every function takes a :class:`~gpipe.timeline.Timeline`, whether the simulator predicted it
(unit ``"cost"``) or the runtime measured it (unit ``"s"``), and draws it the same way, so a
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
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpipe.schedule.action import BACKWARD, FORWARD, WEIGHT
from gpipe.units import format_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from gpipe.timeline import Event, Timeline

__all__ = ["format_chart", "plot", "to_chrome_trace"]

_NAMES = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "weight gradient"}

# Terminal chart: without colour the fill character alone tells the kinds apart.
_FILL = {FORWARD: ">", BACKWARD: "<", WEIGHT: "="}
_BLOCK_COLOR = {FORWARD: "\x1b[97;44m", BACKWARD: "\x1b[30;42m", WEIGHT: "\x1b[30;43m"}
_MARK_COLOR = {FORWARD: "\x1b[34m", BACKWARD: "\x1b[32m", WEIGHT: "\x1b[33m"}
_RESET = "\x1b[0m"
_MAX_WIDTH = 160  # wider charts stop being readable even on wide terminals
_MIN_COLUMNS = 8

# PNG: one colour per kind; later virtual stages of a device are drawn lighter.
_PLOT_COLOR = {FORWARD: "#4c72b0", BACKWARD: "#55a868", WEIGHT: "#dd8452"}
_FIG_WIDTH = 12.0  # inches
_DPI = 100

# Chrome traces count microseconds; a simulated cost unit is shown as one millisecond.
_MICROSECONDS = {"s": 1e6, "cost": 1e3}


def format_chart(timeline: Timeline, width: int | None = None, color: bool | None = None) -> str:
    """Draw ``timeline`` as a text Gantt chart: a row per device, time across.

    Each block shows its kind and micro-batch (``F3``) when it is wide enough, else the
    micro-batch number alone, else just its fill character: ``>`` forward, ``<`` backward,
    ``=`` weight gradient. An action narrower than half a character still shows, as the
    lower-case kind letter. Blank cells are idle time, the pipeline bubble.

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
    end = f"{_format_time(timeline.makespan, timeline.unit)}"
    lines.append(" " * (label_width + 2) + "0" + end.rjust(columns - 1))
    peaks = timeline.peak_memory
    if any(peaks):
        shown = ", ".join(_format_memory(p, timeline.unit) for p in peaks)
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
        (e.action.microbatch for device in timeline.events for e in device), default=-1
    )
    name = timeline.schedule or "timeline"
    return (
        f"{name}: {_count(timeline.devices, 'device')}, "
        f"{_count(microbatches, 'micro-batch', 'micro-batches')}, "
        f"makespan {_format_time(timeline.makespan, timeline.unit)}, "
        f"bubble {timeline.bubble:.2%}"
    )


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one}" if n == 1 else f"{n} {many or one + 's'}"


def _format_time(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"
    return f"{value:.6g} {unit}"


def _format_memory(value: float, unit: str) -> str:
    if unit == "s":  # measured timelines count bytes
        return format_bytes(value)
    return f"{value:.0f}" if value == int(value) else f"{value:.4g}"


def _legend(timeline: Timeline, color: bool, width: int) -> list[str]:
    """The legend as (visible text, printed text) items packed into lines of ``width``."""
    items = []
    for kind in _kinds(timeline):
        swatch = f"{kind}3{_FILL[kind] * 2}"
        printed = _BLOCK_COLOR[kind] + swatch + _RESET if color else swatch
        text = f" {_NAMES[kind]} of micro-batch 3"
        items.append((swatch + text, printed + text))
    items.append(
        ("f b w: an action under half a character", "f b w: an action under half a character")
    )
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


def _kinds(timeline: Timeline) -> list[str]:
    present = {e.action.kind for device in timeline.events for e in device}
    return [kind for kind in (FORWARD, BACKWARD, WEIGHT) if kind in present]


def _render_row(
    events: Sequence[Event], origin: float, span: float, columns: int, color: bool
) -> str:
    """Lay one device's events onto ``columns`` character cells of equal time."""
    owner: list[int | None] = [None] * columns  # the event covering most of each cell
    share = [0.0] * columns  # how much of the cell that event covers
    busy = [0.0] * columns  # how much of the cell any event covers
    step = span / columns if span > 0 else 1.0
    for index, event in enumerate(events):
        a = (event.start - origin) / step
        b = (event.end - origin) / step
        first = min(max(math.floor(a), 0), columns - 1)
        last = min(max(math.ceil(b) - 1, first), columns - 1)
        for cell in range(first, last + 1):
            # NOTE: the 1e-9 floor keeps zero-length actions visible instead of dropping them.
            covered = max(min(b, cell + 1) - max(a, cell), 1e-9)
            busy[cell] += covered
            if covered > share[cell]:
                owner[cell], share[cell] = index, covered
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
            mark = kind * (end - cell)
            out.append(_MARK_COLOR[kind.upper()] + mark + _RESET if color else mark)
        else:
            index = owner[cell]
            assert index is not None
            block = _block_text(events[index], end - cell, color)
            out.append(_BLOCK_COLOR[kind] + block + _RESET if color else block)
        cell = end
    return "".join(out)


def _block_text(event: Event, width: int, color: bool) -> str:
    kind, microbatch = event.action.kind, str(event.action.microbatch)
    label = kind + microbatch
    # Without colour the kind must stay readable, so a bare number is shown only in colour.
    if width < len(label):
        label = microbatch if color and width >= len(microbatch) else ""
    return label + _FILL[kind] * (width - len(label))


def plot(
    timeline: Timeline,
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    compare: Timeline | None = None,
) -> Path:
    """Save ``timeline`` as a PNG Gantt chart: a row per device, bars coloured by kind.

    Bars carry their micro-batch label when it fits. Later virtual stages of a device (the
    chunks of interleaved schedules) are drawn in a lighter shade of their kind's colour.
    The figure is drawn with matplotlib's Agg canvas directly, so the caller's pyplot
    backend is left alone.

    Args:
        timeline: the timeline to draw, e.g. a measured one.
        path: where to write the PNG; missing parent folders are created.
        title: the figure's title; by default the schedule's name.
        compare: a second timeline, e.g. the simulator's prediction for the same schedule,
            drawn as a panel underneath on the same time axis ("measured vs predicted").

    Returns:
        The path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [timeline] if compare is None else [timeline, compare]
    memory = any(timeline.peak_memory)
    heights = [max(1.6, 0.32 * p.devices + 0.9) for p in panels] + ([2.0] if memory else [])
    figure = Figure(figsize=(_FIG_WIDTH, sum(heights) + 0.6), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(heights), 1, sharex=True, height_ratios=heights, squeeze=False)
    span = max(p.makespan for p in panels) or 1.0
    names = [_panel_name(timeline), "predicted"]
    for ax, panel, name in zip(axes[:, 0], panels, names):
        _draw_gantt(ax, panel, span, name, first=ax is axes[0, 0])
    if memory:
        _draw_memory(axes[-1, 0], timeline)
    axes[-1, 0].set_xlabel("time (s)" if timeline.unit == "s" else f"time ({timeline.unit})")
    axes[-1, 0].set_xlim(0, span * 1.01)
    figure.suptitle(title or timeline.schedule or "timeline", fontsize=12)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png")
    return out


def _panel_name(timeline: Timeline) -> str:
    return "measured" if timeline.unit == "s" else "simulated"


def _draw_gantt(ax: Axes, timeline: Timeline, span: float, name: str, *, first: bool) -> None:
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    devices = timeline.devices
    chunks = 1 + max(
        (e.action.stage // max(devices, 1) for d in timeline.events for e in d), default=0
    )
    # Label when the text fits the bar: about 0.6 em per character at 7 pt.
    points_per_unit = _FIG_WIDTH * 72 * 0.9 / span
    char_points = 7 * 0.62
    origin = timeline.start
    shortest = min((e.duration for d in timeline.events for e in d), default=0.0)
    # White edges separate bars, but would drown bars only a few points wide.
    edge = 0.4 if shortest * points_per_unit > 4 else 0.0
    for device, events in enumerate(timeline.events):
        bars: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for e in events:
            chunk = e.action.stage // max(devices, 1)
            bars.setdefault((e.action.kind, chunk), []).append((e.start - origin, e.duration))
            label = f"{e.action.kind}{e.action.microbatch}"
            if e.duration * points_per_unit < char_points * len(label) + 2:
                label = str(e.action.microbatch)
            if e.duration * points_per_unit >= char_points * len(label) + 2:
                ax.text(
                    e.start - origin + e.duration / 2,
                    device,
                    label,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if chunk == 0 else "black",
                )
        for (kind, chunk), spans in bars.items():
            rgb = to_rgb(_PLOT_COLOR[kind])
            light = 0.55 * chunk / max(chunks - 1, 1)
            shade = tuple(c + (1 - c) * light for c in rgb)
            ax.broken_barh(
                spans, (device - 0.4, 0.8), facecolors=shade, edgecolors="white", linewidths=edge
            )
    ax.set_ylim(max(devices, 1) - 0.5, -0.5)  # device 0 on top, as in the terminal chart
    ax.set_yticks(range(devices), [f"dev {d}" for d in range(devices)], fontsize=8)
    ax.set_title(
        f"{name}: makespan {_format_time(timeline.makespan, timeline.unit)}, "
        f"bubble {timeline.bubble:.1%}",
        loc="left",
        fontsize=10,
    )
    ax.grid(axis="x", alpha=0.3)
    if first:
        handles = [Patch(color=_PLOT_COLOR[k], label=_NAMES[k]) for k in _kinds(timeline)]
        if chunks > 1:
            handles.append(Patch(color="#d0d0d0", label="lighter: later virtual stage"))
        ax.legend(
            handles=handles,
            loc="lower right",
            bbox_to_anchor=(1.0, 1.0),
            ncols=3,
            fontsize=8,
            frameon=False,
        )


def _draw_memory(ax: Axes, timeline: Timeline) -> None:
    from matplotlib import colormaps
    from matplotlib.ticker import FuncFormatter

    origin = timeline.start
    # Past ten devices the default colour cycle repeats; a gradient keeps them in order.
    palette = colormaps["viridis"] if timeline.devices > 10 else colormaps["tab10"]
    for device, events in enumerate(timeline.events):
        if not events:
            continue
        # What an action holds stays held until the next action changes it.
        xs = [e.start - origin for e in events] + [events[-1].end - origin]
        ys = [e.memory for e in events] + [events[-1].memory]
        shade = device / max(timeline.devices - 1, 1) if timeline.devices > 10 else device
        ax.step(xs, ys, where="post", linewidth=1.0, label=f"dev {device}", color=palette(shade))
    ax.set_ylim(bottom=0)
    ax.set_ylabel("memory", fontsize=8)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _format_memory(v, timeline.unit)))
    ax.set_title("held for backward, per device", loc="left", fontsize=10)
    ax.legend(
        fontsize=6,
        ncols=min(timeline.devices, 8),
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        frameon=False,
    )
    ax.grid(alpha=0.3)


def to_chrome_trace(
    timeline: Timeline, path: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """Convert ``timeline`` to the Chrome trace event format (Perfetto, chrome://tracing).

    Each action is one complete event (``"ph": "X"``) named like ``"F3"`` on thread ``tid``
    = device, with times in microseconds from the timeline's start and ``args`` holding
    stage, micro-batch and memory. When any memory is recorded, a counter track
    (``"ph": "C"``) per device follows it. A measured timeline keeps its real time; a
    simulated one (unit ``"cost"``) is shown with one cost unit as one millisecond.

    Args:
        timeline: a simulated or measured timeline.
        path: if given, the trace is also written there as JSON.

    Returns:
        The trace: ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``.

    Raises:
        ValueError: the timeline's unit is neither ``"s"`` nor ``"cost"``.
    """
    if timeline.unit not in _MICROSECONDS:
        raise ValueError(
            f"cannot place unit {timeline.unit!r} on a trace clock; "
            f"expected one of {sorted(_MICROSECONDS)}"
        )
    scale = _MICROSECONDS[timeline.unit]
    origin = timeline.start
    name = timeline.schedule or "timeline"
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"gpipe {name}"}}
    ]
    for device in range(timeline.devices):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 0,
                "tid": device,
                "args": {"name": f"device {device}"},
            }
        )
    with_memory = any(timeline.peak_memory)
    for device, device_events in enumerate(timeline.events):
        for e in device_events:
            action = e.action
            events.append(
                {
                    "name": f"{action.kind}{action.microbatch}",
                    "cat": _NAMES[action.kind],
                    "ph": "X",
                    "pid": 0,
                    "tid": device,
                    "ts": (e.start - origin) * scale,
                    "dur": e.duration * scale,
                    "args": {
                        "stage": action.stage,
                        "microbatch": action.microbatch,
                        "memory": e.memory,
                    },
                }
            )
            if with_memory:
                events.append(
                    {
                        "name": f"memory device {device}",
                        "ph": "C",
                        "pid": 0,
                        "ts": (e.start - origin) * scale,
                        "args": {"memory": e.memory},
                    }
                )
    trace: dict[str, Any] = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": name,
            "unit": timeline.unit,
            "makespan": timeline.makespan,
            "bubble": timeline.bubble,
        },
    }
    if path is not None:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(trace))
    return trace
