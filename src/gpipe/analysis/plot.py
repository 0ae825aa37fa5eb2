"""The PNG Gantt chart of a timeline (matplotlib), with measured and predicted panels."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpipe.analysis.held import held_memory
from gpipe.analysis.labels import KIND_NAMES, action_label, format_memory, format_time, kinds_in
from gpipe.schedule import BACKWARD, FORWARD, FUSED, WEIGHT

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from gpipe.analysis.timeline import Timeline
    from gpipe.schedule import Action

__all__ = ["plot"]

# One colour per kind; later virtual stages of a device are drawn lighter.
_PLOT_COLOR = {FORWARD: "#4c72b0", BACKWARD: "#55a868", WEIGHT: "#dd8452"}
_FUSED_EDGE = "0.15"  # the outline that holds a fused action's halves together as one bar
_FUSED_LABEL = "F+B (fused)"
_THIN = 0.2  # the share of a fused bar its W part takes
_FIG_WIDTH = 12.0  # inches
_MOST_ARROWS = 3000  # beyond that, message lines hide the bars
_DPI = 100


def plot(
    timeline: Timeline,
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    compare: Timeline | Sequence[Timeline] | None = None,
    names: Sequence[str] | None = None,
    memory: bool | None = None,
) -> Path:
    """Save ``timeline`` as a PNG Gantt chart: a row per device, bars coloured by kind.

    Bars carry their micro-batch label when it fits. Later virtual stages of a device (the
    chunks of interleaved schedules) are drawn in a lighter shade of their kind's colour.
    A fused action (a forward and a backward issued together) is one outlined bar split
    in two halves, coloured as its F and its B (and a thin W slice at its end when it has
    one), labelled like ``F3+B1``; the legend then names "F+B (fused)".
    The figure is drawn with matplotlib's Agg canvas directly, so the caller's pyplot
    backend is left alone.

    Args:
        timeline: the timeline to draw, e.g. a measured one.
        path: where to write the PNG; missing parent folders are created.
        title: the figure's title; by default the schedule's name.
        compare: a second timeline, e.g. the simulator's prediction for the same schedule,
            drawn as a panel underneath on the same time axis ("measured vs predicted");
            or several, one panel each (e.g. every schedule on the same model).
        names: each panel's name, ``timeline``'s first; by default "measured" or
            "simulated" by unit, and "predicted" for a single ``compare``.
        memory: add a panel of what each device holds for backward over time (``timeline``'s,
            see :func:`~gpipe.analysis.held.held_memory`); by default when it recorded any.

    Returns:
        The path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    others = [] if compare is None else [compare] if not isinstance(compare, Sequence) else compare
    panels = [timeline, *others]
    memory = any(timeline.peak_memory) if memory is None else memory
    heights = [max(1.6, 0.32 * p.devices + 0.9) for p in panels] + ([2.0] if memory else [])
    figure = Figure(figsize=(_FIG_WIDTH, sum(heights) + 0.6), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(heights), 1, sharex=True, height_ratios=heights, squeeze=False)
    span = max(p.makespan for p in panels) or 1.0
    if names is None:
        names = [_panel_name(timeline), *(["predicted"] if len(others) == 1 else [])]
        names += [p.schedule or _panel_name(p) for p in others[len(names) - 1 :]]
    if len(names) != len(panels):
        raise ValueError(f"names lists {len(names)} panels, but there are {len(panels)}")
    for ax, panel, name in zip(axes[:, 0], panels, names):
        _draw_gantt(ax, panel, span, name, legend=panels if ax is axes[0, 0] else None)
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


def _chunks(timeline: Timeline) -> int:
    """Stages per device, as drawn: chunk ``stage // K`` (round-robin and V alike)."""
    devices = max(timeline.devices, 1)
    stages = (u.stage for d in timeline.events for e in d for u in e.action.units)
    return 1 + max((stage // devices for stage in stages), default=0)


def _draw_gantt(
    ax: Axes, timeline: Timeline, span: float, name: str, *, legend: list[Timeline] | None
) -> None:
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    devices = timeline.devices
    chunks = _chunks(timeline)
    # Label when the text fits the bar: about 0.6 em per character at 7 pt.
    points_per_unit = _FIG_WIDTH * 72 * 0.9 / span
    char_points = 7 * 0.62
    origin = timeline.start
    shortest = min((e.duration for d in timeline.events for e in d), default=0.0)
    # White edges separate bars, but would drown bars only a few points wide.
    edge = 0.4 if shortest * points_per_unit > 4 else 0.0
    for device, events in enumerate(timeline.events):
        bars: dict[tuple[str, int], list[tuple[float, float]]] = {}
        fused: list[tuple[float, float]] = []
        for e in events:
            at = e.start - origin
            for unit, (offset, length) in zip(e.action.units, _slices(e.action, e.duration)):
                chunk = unit.stage // max(devices, 1)
                bars.setdefault((unit.kind, chunk), []).append((at + offset, length))
            if e.action.parts:
                fused.append((at, e.duration))
            label = action_label(e.action)
            if e.duration * points_per_unit < char_points * len(label) + 2:
                label = "+".join(str(unit.microbatch) for unit in e.action.units[:2])
            if e.duration * points_per_unit >= char_points * len(label) + 2:
                dark = any(unit.stage >= max(devices, 1) for unit in e.action.units)
                ax.text(
                    at + e.duration / 2,
                    device,
                    label,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if dark else "white",
                )
        for (kind, chunk), spans in bars.items():
            rgb = to_rgb(_PLOT_COLOR[kind])
            light = 0.55 * chunk / max(chunks - 1, 1)
            shade = tuple(c + (1 - c) * light for c in rgb)
            ax.broken_barh(
                spans, (device - 0.4, 0.8), facecolors=shade, edgecolors="white", linewidths=edge
            )
        if fused:  # over the halves, so they read as one bar
            ax.broken_barh(
                fused,
                (device - 0.4, 0.8),
                facecolors="none",
                edgecolors=_FUSED_EDGE,
                linewidths=0.8,
                gid="fused",
            )
    if 0 < len(timeline.transfers) <= _MOST_ARROWS:
        # A message: from its sender's row when handed over to its receiver's on arrival.
        for t in timeline.transfers:
            ax.plot(
                [t.start - origin, t.end - origin],
                [t.source, t.target],
                color="0.35",
                linewidth=0.6,
                alpha=0.7,
            )
    ax.set_ylim(max(devices, 1) - 0.5, -0.5)  # device 0 on top, as in the terminal chart
    label = "rank" if timeline.processes else "dev"
    ax.set_yticks(range(devices), [f"{label} {d}" for d in range(devices)], fontsize=8)
    ax.set_title(
        f"{name}: makespan {format_time(timeline.makespan, timeline.unit)}, "
        f"bubble {timeline.bubble:.1%}",
        loc="left",
        fontsize=10,
    )
    ax.grid(axis="x", alpha=0.3)
    if legend is not None:
        from matplotlib.legend_handler import HandlerTuple

        present = {kind for panel in legend for kind in kinds_in(panel)}
        # A colour is named when any bar shows it, a fused bar's halves too.
        colored = {u.kind for p in legend for d in p.events for e in d for u in e.action.units}
        kinds = [kind for kind in (FORWARD, BACKWARD, WEIGHT) if kind in colored]
        handles: list[Any] = [Patch(color=_PLOT_COLOR[k]) for k in kinds]
        labels = [KIND_NAMES[k] for k in kinds]
        if FUSED in present:
            halves = (FORWARD, BACKWARD)
            handles.append(tuple(Patch(fc=_PLOT_COLOR[k], ec=_FUSED_EDGE) for k in halves))
            labels.append(_FUSED_LABEL)
        if max(_chunks(panel) for panel in legend) > 1:
            handles.append(Patch(color="#d0d0d0"))
            labels.append("lighter: later virtual stage")
        ax.legend(
            handles,
            labels,
            handler_map={tuple: HandlerTuple(ndivide=None, pad=0)},
            loc="lower right",
            bbox_to_anchor=(1.0, 1.0),
            ncols=3,
            fontsize=8,
            frameon=False,
        )


def _slices(action: Action, duration: float) -> list[tuple[float, float]]:
    """(offset, length) of each of ``action``'s units within its bar: all of it for a plain
    action; halves for a fused one's F and B, after a thin W slice is taken off the end."""
    if not action.parts:
        return [(0.0, duration)]
    thin = _THIN * duration if len(action.parts) > 2 else 0.0
    half = (duration - thin) / 2
    return [(0.0, half), (half, half), (2 * half, thin)][: len(action.parts)]


def _draw_memory(ax: Axes, timeline: Timeline) -> None:
    from matplotlib import colormaps
    from matplotlib.ticker import FuncFormatter

    # Past ten devices the default colour cycle repeats; a gradient keeps them in order.
    palette = colormaps["viridis"] if timeline.devices > 10 else colormaps["tab10"]
    for device, (times, held, kept) in enumerate(held_memory(timeline)):
        if len(times) < 3:  # an idle device holds nothing
            continue
        shade = device / max(timeline.devices - 1, 1) if timeline.devices > 10 else device
        color = palette(shade)
        top = max(range(len(held)), key=held.__getitem__)
        ax.step(times, held, where="post", linewidth=0.6, alpha=0.45, color=color)
        ax.step(times, kept, where="post", linewidth=1.4, color=color)
        ax.plot(
            times[top],
            held[top],
            "o",
            markersize=3,
            color=color,
            label=f"dev {device}, peak {format_memory(held[top], timeline.unit)}",
        )
    ax.set_ylim(bottom=0)
    ax.set_ylabel("memory", fontsize=8)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_memory(v, timeline.unit)))
    decoding = all(e.action.kind == "F" for device in timeline.events for e in device)
    ax.set_title(
        "KV cache held, per device (dot: peak)"
        if decoding and timeline.schedule == "decode"
        else "held for backward, per device (faint: with a running backward's work; dot: peak)",
        loc="left",
        fontsize=10,
    )
    ax.legend(
        fontsize=6,
        ncols=min(timeline.devices, 8),
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        frameon=False,
    )
    ax.grid(alpha=0.3)
