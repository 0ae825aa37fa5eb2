"""The Chrome/Perfetto trace of a timeline: open it at https://ui.perfetto.dev."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpipe.analysis.labels import KIND_NAMES

if TYPE_CHECKING:
    from gpipe.analysis.timeline import Timeline

__all__ = ["to_chrome_trace"]

# Chrome traces count microseconds; a simulated cost unit is shown as one millisecond.
_MICROSECONDS = {"s": 1e6, "cost": 1e3}


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
                    "cat": KIND_NAMES[action.kind],
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
