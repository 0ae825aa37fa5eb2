"""Matplotlib figures drawn off-screen (the Agg canvas), so no display is ever needed."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["COLORS", "new_figure", "save"]

# One colour per series, the same ones the timeline pictures use first.
COLORS = ["#4c72b0", "#55a868", "#dd8452", "#c44e52", "#8172b3", "#937860", "#da8bc3"]


def new_figure(width: float, height: float, **subplots: Any) -> tuple[Figure, Any]:
    """A figure of ``width`` x ``height`` inches and its axes (``figure.subplots(**subplots)``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.subplots(**subplots)


def save(figure: Figure, folder: Path, name: str) -> str:
    """Write ``figure`` as ``folder/name``; returns ``name`` for linking from the report."""
    folder.mkdir(parents=True, exist_ok=True)
    figure.savefig(folder / name, format="png")
    return name
