"""The Chrome/Perfetto trace of a timeline: open it at https://ui.perfetto.dev."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpipe.analysis.held import held_memory
from gpipe.analysis.labels import KIND_NAMES, action_label

if TYPE_CHECKING:
    from gpipe.analysis.timeline import Timeline

__all__ = ["to_chrome_trace"]

# Chrome traces count microseconds; a simulated cost unit is shown as one millisecond.
_MICROSECONDS = {"s": 1e6, "cost": 1e3}


def to_chrome_trace(
    timeline: Timeline, path: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """Convert ``timeline`` to the Chrome trace event format (Perfetto, chrome://tracing).

    Each action is one complete event (``"ph": "X"``) named like ``"F3"`` on its device's
    track, with times in microseconds from the timeline's start and ``args`` holding stage,
    micro-batch, memory and, where recorded, what it left held. A fused action is one
    slice named by its parts, ``"F3+B1"``, in category "fused", whose ``args["parts"]``
    lists them in the text form (``["1F3", "1B1"]``); its stage and micro-batch are its
    forward's. A device is a thread of
    one process, or, for a timeline of several processes (``timeline.processes``), a
    process track of its own named "rank d". When any memory is recorded, a counter track
    (``"ph": "C"``) per device follows what it holds for backward
    (:func:`~gpipe.analysis.held.held_memory`): each action's count while it runs, what
    it left held after it. Messages between devices (``timeline.transfers``) are slices on the
    receiving device's "receives" track, from hand-over to arrival, with a flow arrow
    from the action that sent them. A measured timeline keeps its real time; a simulated
    one (unit ``"cost"``) is shown with one cost unit as one millisecond.

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
    tracks = _Tracks(timeline)
    events: list[dict[str, Any]] = tracks.names(name)
    for device, device_events in enumerate(timeline.events):
        pid, tid = tracks.compute(device)
        for e in device_events:
            action = e.action
            args: dict[str, Any] = {
                "stage": action.stage,
                "microbatch": action.microbatch,
                "memory": e.memory,
            }
            if e.left is not None:
                args["left"] = e.left
            if action.parts:
                args["parts"] = [str(part) for part in action.parts]
            events.append(
                {
                    "name": action_label(action),
                    "cat": KIND_NAMES[action.kind],
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "ts": (e.start - origin) * scale,
                    "dur": e.duration * scale,
                    "args": args,
                }
            )
    if any(timeline.peak_memory):
        events += _memory(timeline, tracks, scale)
    events += _transfers(timeline, tracks, origin, scale)
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


class _Tracks:
    """Where each device's actions and receives go: threads of one process, or processes."""

    def __init__(self, timeline: Timeline) -> None:
        self.processes = timeline.processes
        self.devices = timeline.devices
        self.receives = bool(timeline.transfers)

    def compute(self, device: int) -> tuple[int, int]:
        return (device, 0) if self.processes else (0, device)

    def received(self, device: int) -> tuple[int, int]:
        return (device, 1) if self.processes else (0, self.devices + device)

    def names(self, schedule: str) -> list[dict[str, Any]]:
        def meta(kind: str, pid: int, tid: int | None, label: str) -> dict[str, Any]:
            event: dict[str, Any] = {"name": kind, "ph": "M", "pid": pid, "args": {"name": label}}
            if tid is not None:
                event["tid"] = tid
            return event

        events = []
        if not self.processes:
            events.append(meta("process_name", 0, None, f"gpipe {schedule}"))
        for device in range(self.devices):
            pid, tid = self.compute(device)
            if self.processes:
                events.append(meta("process_name", pid, None, f"rank {device}"))
            events.append(meta("thread_name", pid, tid, f"device {device}"))
            if self.receives:
                pid, tid = self.received(device)
                events.append(meta("thread_name", pid, tid, f"device {device} receives"))
        return events


def _memory(timeline: Timeline, tracks: _Tracks, scale: float) -> list[dict[str, Any]]:
    """A counter per device of what it holds for backward (:func:`held_memory`): each
    action's count while it runs, what it left held between actions."""
    events: list[dict[str, Any]] = []
    for device, (times, held, _) in enumerate(held_memory(timeline)):
        pid, _ = tracks.compute(device)
        last = None
        for i, (at, value) in enumerate(zip(times, held)):
            if (i + 1 < len(times) and times[i + 1] == at) or value == last:
                continue  # replaced at the same moment (an instant action), or no change
            events.append(
                {
                    "name": f"memory device {device}",
                    "ph": "C",
                    "pid": pid,
                    "ts": at * scale,
                    "args": {"memory": value},
                }
            )
            last = value
    return events


def _transfers(
    timeline: Timeline, tracks: _Tracks, origin: float, scale: float
) -> list[dict[str, Any]]:
    """A slice per message on the receiver's track, and a flow arrow from its sender."""
    events: list[dict[str, Any]] = []
    # NOTE: a flow binds to the slice enclosing its timestamp, so each end sits a hair
    # inside: the sending action (which sends before it ends) and the receive slice.
    hair = 1e-3
    for number, t in enumerate(timeline.transfers):
        what = "activation" if t.kind == "F" else "gradient"
        start, end = (t.start - origin) * scale, (t.end - origin) * scale
        pid, tid = tracks.received(t.target)
        source_pid, source_tid = tracks.compute(t.source)
        label = f"{what} {t.stage}{t.kind}{t.microbatch} from device {t.source}"
        events += [
            {
                "name": label,
                "cat": "transfer",
                "ph": "X",
                "pid": pid,
                "tid": tid,
                "ts": start,
                "dur": max(end - start, hair),
                "args": {"bytes": t.nbytes, "stage": t.stage, "microbatch": t.microbatch},
            },
            {
                "name": what,
                "cat": "transfer",
                "ph": "s",
                "id": number,
                "pid": source_pid,
                "tid": source_tid,
                "ts": start - hair,
            },
            {
                "name": what,
                "cat": "transfer",
                "ph": "f",
                "bp": "e",
                "id": number,
                "pid": pid,
                "tid": tid,
                "ts": start + max(end - start, hair) / 2,
            },
        ]
    return events
