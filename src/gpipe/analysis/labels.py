"""What the drawings share: names and labels of the action kinds, and times and sizes for
people."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpipe.schedule import BACKWARD, FORWARD, FUSED, WEIGHT
from gpipe.units import format_bytes

if TYPE_CHECKING:
    from gpipe.analysis.timeline import Timeline
    from gpipe.schedule import Action

__all__ = ["KIND_NAMES", "action_label", "format_memory", "format_time", "kinds_in"]

KIND_NAMES = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "weight gradient", FUSED: "fused"}


def action_label(action: Action) -> str:
    """What a drawing writes on an action: kind and micro-batch, ``"F3"``; a fused action's
    parts joined, ``"F3+B1"`` (stages are told by the row and the shade)."""
    return "+".join(f"{unit.kind}{unit.microbatch}" for unit in action.units)


def format_time(value: float, unit: str) -> str:
    """A duration: milliseconds or seconds if measured, else the cost model's units."""
    if unit == "s":
        return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"
    return f"{value:.6g} {unit}"


def format_memory(value: float, unit: str) -> str:
    """Bytes for a measured timeline; plain numbers for a simulated one's memory units."""
    if unit == "s":  # measured timelines count bytes
        return format_bytes(value)
    return f"{value:.0f}" if value == int(value) else f"{value:.4g}"


def kinds_in(timeline: Timeline) -> list[str]:
    """The action kinds present in ``timeline``, in F, B, W, F+B (fused) order."""
    present = {e.action.kind for device in timeline.events for e in device}
    return [kind for kind in (FORWARD, BACKWARD, WEIGHT, FUSED) if kind in present]
