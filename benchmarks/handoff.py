"""Where a distributed step loses time between actions: ours, torch.distributed.pipelining, a floor.

The stages are sleep layers (F and B ms), one per process, as in latency_distributed.py, so
all that is not sleep is the runtime's. Three runtimes run the same stages, in turns, in the
same processes: ours (twice: **ours** posts each receive in the step its message is made,
as gpipe does, and **late** right before the action that reads it, as gpipe did before; see
:func:`gpipe.schedule.lowering.lower`), torch's, and a **floor**, the leanest loop gloo
allows: each rank runs its action list on its one thread with real autograd, every receive
of the step posted before its first action and waited for right where it is needed, every
send posted at once and waited for at the end, no header (the shapes are fixed), no failure
handling (a dead peer hangs it). It is what this machine's processes and links cost with
nothing else around them. Every sleep is noted on the machine's monotonic clock, which all processes
share, and three costs are read off the notes, the same way for every runtime:

- **overrun**: how much longer a sleep took than asked (the OS waking the thread late);
- **gap**: from the end of one sleep to the start of the next on the same rank, when the
  next action's message was already there: the runtime's own work around an action;
- **hop**: from the end of the sleep that made a message (on the neighbouring rank) to the
  start of the sleep that needed it, when that action had to wait for it: the hand-off.

On the critical path of a step each action costs its overrun, and each hand-off its gap or
its hop. The critical path itself (:meth:`gpipe.analysis.Timeline.critical_path`, on a
timeline made of the sleeps, the same for every runtime) says how many of each a step paid,
and what they cost there: 1F1B puts many more hand-offs on it than GPipe, whose receivers
are mostly busy. For ours, the timeline splits a hop into **sending** (the action's end to
its message posted by the sending thread), **flight** (posted to received by the receiving
thread) and **receiving** (received to the next action's start).

    python benchmarks/handoff.py                       # K=4, M=16, gpipe and 1f1b
    python benchmarks/handoff.py --stages 2 --microbatches 8 --schedules 1f1b
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

import gpipe.distributed as gd
from gpipe.analysis import Event, Timeline
from gpipe.distributed.programs import RECEIVES
from gpipe.models import sleep, sleep_stages
from gpipe.schedule import BACKWARD, FORWARD, Action, dependencies, make_schedule
from latency_distributed import SCHEDULES, torch_step

Sleep = tuple[float, int, int]  # (seconds asked, start ns, end ns)
# the critical path's RESULT keys, and the digits each is printed with
_PATH_KEYS = (("handoffs", 0), ("handoff_ms", 2), ("waits", 0), ("wait_ms", 2), ("overrun_ms", 2))
# each runtime's step figures in RESULT: (key, figure, digits)
_STEP_KEYS = (
    ("ms", "step", 1),
    ("hop_ms", "hop", 3),
    ("gap_ms", "gap", 3),
    ("overrun_ms", "overrun", 3),
)


class _NotingClock:
    """Stands in for the ``time`` module of gpipe.models.sleep: notes every sleep.

    NOTE: the sleep layers call ``time.sleep`` through their module's global ``time``, so
    replacing that global notes the sleeps of both runtimes alike, with no change to the
    layers or to either runtime.
    """

    def __init__(self) -> None:
        self.sleeps: list[Sleep] = []

    def sleep(self, seconds: float) -> None:
        start = time.perf_counter_ns()
        time.sleep(seconds)
        self.sleeps.append((seconds, start, time.perf_counter_ns()))


_CLOCK = _NotingClock()
sleep.time = _CLOCK  # type: ignore[attr-defined]


def _timed(step: Callable[[], None], steps: int, parts: Callable[[], Any]) -> list[Any]:
    """Per timed step (after a warm-up): (seconds, this rank's sleeps, ``parts()``)."""
    out = []
    for i in range(steps + 1):
        dist.barrier()
        _CLOCK.sleeps.clear()
        began = time.perf_counter()
        step()
        seconds = time.perf_counter() - began
        split = parts()  # NOTE: a collective for ours: every rank asks
        if i:
            out.append((seconds, list(_CLOCK.sleeps), split))
    return out


def _ours(
    k: int, f: float, b: float, m: int, schedule: str, steps: int, receives: str = "early"
) -> list[Any]:
    """Per timed step: (step seconds, this rank's sleeps, the timeline's hop parts)."""
    os.environ[RECEIVES] = receives  # NOTE: read once, as the pipe is made
    try:
        pipe = gd.DistributedGPipe(
            sleep_stages(k, f, b), [1] * k, chunks=m, schedule=schedule, checkpoint="never"
        )
    finally:
        del os.environ[RECEIVES]
    x, y = torch.randn(m, 4), torch.randn(m, 4)
    out = _timed(
        lambda: pipe.train_step(x, y, F.mse_loss), steps, lambda: _hop_parts(pipe.timeline)
    )
    pipe.close()
    return out


def _ours_late(k: int, f: float, b: float, m: int, schedule: str, steps: int) -> list[Any]:
    """:func:`_ours` with each receive posted right before its reader, as gpipe did before."""
    return _ours(k, f, b, m, schedule, steps, receives="late")


def _theirs(k: int, f: float, b: float, m: int, schedule: str, steps: int) -> list[Any]:
    """Per timed step: (step seconds, this rank's sleeps, None)."""
    return _timed(torch_step(k, f, b, m, schedule), steps, lambda: None)


def _floor(k: int, f: float, b: float, m: int, schedule: str, steps: int) -> list[Any]:
    """Per timed step: (step seconds, this rank's sleeps, None), of the floor loop."""
    rank = dist.get_rank()
    layer = sleep_stages(k, f, b)[rank]
    actions = make_schedule(schedule, k, m).actions[rank]
    x, y = torch.randn(m, 4), torch.randn(m, 4)

    def step() -> None:
        # every receive of the step, posted now: (kind, micro-batch) -> (buffer, work)
        posted = {}
        for action in actions:
            peer = rank - 1 if action.kind == FORWARD else rank + 1
            if 0 <= peer < k:
                buffer = torch.empty_like(x[:1])  # a micro-batch's message
                posted[action.kind, action.microbatch] = (buffer, dist.irecv(buffer, peer))
        sends, inputs, roots = [], {}, {}
        for action in actions:
            i, message = action.microbatch, posted.get((action.kind, action.microbatch))
            if message is not None:
                message[1].wait()
            if action.kind == FORWARD:
                given = x[i : i + 1] if message is None else message[0].requires_grad_()
                output = layer(given)
                inputs[i] = given
                if rank < k - 1:
                    sends.append(dist.isend(output.detach(), rank + 1))
                    roots[i] = output
                else:
                    roots[i] = F.mse_loss(output, y[i : i + 1])
            else:
                torch.autograd.backward(roots.pop(i), None if message is None else message[0])
                given = inputs.pop(i)
                if rank > 0:
                    sends.append(dist.isend(given.grad, rank - 1))
        for work in sends:
            work.wait()
        layer.zero_grad()

    return _timed(step, steps, lambda: None)


def _hop_parts(timeline: Timeline) -> list[tuple[float, float, float]]:
    """(sending, flight, receiving) in seconds of each message an action waited for."""
    ends = {
        (e.action.kind, e.action.stage, e.action.microbatch): e.end
        for device in timeline.events
        for e in device
    }
    parts = []
    for device, events in enumerate(timeline.events):
        arrivals = {
            (t.kind, t.stage, t.microbatch): t for t in timeline.transfers if t.target == device
        }
        for before, event in itertools.pairwise(events):
            action = event.action
            message = arrivals.get((action.kind, action.stage, action.microbatch))
            if message is None or message.end <= before.end:
                continue  # the message was there when the rank was free: no wait
            producer = action.stage - 1 if action.kind == FORWARD else action.stage + 1
            made = ends.get((action.kind, producer, action.microbatch))
            if made is None:
                continue
            parts.append(
                (message.start - made, message.end - message.start, event.start - message.end)
            )
    return parts


def _sleep_timeline(f_s: float, sleeps: list[list[Sleep]]) -> Timeline:
    """One step's sleeps as a timeline, the same for both runtimes: rank r's sleeps are
    stage r's actions, a forward's the ones of ``f_s`` seconds, and every rank runs each
    kind's micro-batches in order."""
    events = []
    for rank, notes in enumerate(sleeps):
        counts = {FORWARD: 0, BACKWARD: 0}
        mine = []
        for seconds, start, end in notes:
            kind = FORWARD if seconds == f_s else BACKWARD
            mine.append(Event(Action(kind, rank, counts[kind]), start / 1e9, end / 1e9))
            counts[kind] += 1
        events.append(mine)
    return Timeline(events)


def _costs(timeline: Timeline, asked: dict[str, float]) -> tuple[list[float], ...]:
    """Overruns, gaps and hops (seconds) of every action of one step's sleep timeline.

    An action's hop is from the end of what it needed from another rank (the schedule's
    dependencies on another stage) to its start.
    """
    ends = {e.action: e.end for device in timeline.events for e in device}
    stages = len(timeline.events)
    overruns, gaps, hops = [], [], []
    for events in timeline.events:
        free = None  # when this rank's last sleep ended
        for e in events:
            overruns.append(e.duration - asked[e.kind])
            needed = [a for a in dependencies(e.action, stages) if a.stage != e.stage]
            ready = max((ends[a] for a in needed if a in ends), default=None)
            if ready is not None and (free is None or ready > free):
                hops.append(e.start - ready)
            elif free is not None:
                gaps.append(e.start - free)
            free = e.end
    return overruns, gaps, hops


def _path(timeline: Timeline, asked: dict[str, float]) -> dict[str, float]:
    """The critical path of one step's sleep timeline: its hand-offs and device waits (how
    many, and milliseconds in all), and its sleeps' overruns (milliseconds in all)."""
    path = timeline.critical_path()
    return {
        "handoffs": len(path.waits("message")),
        "handoff_ms": path.message_wait * 1e3,
        "waits": len(path.waits("device")),
        "wait_ms": path.device_wait * 1e3,
        "overrun_ms": sum(link.event.duration - asked[link.event.kind] for link in path.links)
        * 1e3,
    }


# the runtimes measured, in the order they take turns
SIDES = {"ours": _ours, "late": _ours_late, "torch": _theirs, "floor": _floor}


def both(
    k: int, f: float, b: float, m: int, schedules: list[str], steps: int, rounds: int
) -> dict[str, Any]:
    """On every rank: each runtime in turns; rank 0 returns every rank's notes."""
    gd.init()
    runs: dict[str, list[Any]] = {}
    for _ in range(rounds):
        for schedule in schedules:
            for side, run in SIDES.items():
                mine = run(k, f, b, m, schedule, steps)
                gathered: list[Any] = [None] * k
                dist.all_gather_object(gathered, mine)
                runs.setdefault(f"{schedule}/{side}", []).extend(zip(*gathered))
    return runs if dist.get_rank() == 0 else {}


def _ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


def run(args: argparse.Namespace) -> None:
    """Measure, then a table and one RESULT line per schedule."""
    k, m, f, b = args.stages, args.microbatches, args.forward_ms, args.backward_ms
    if k < 2 or m < 1 or args.steps < 1 or args.rounds < 1:
        raise SystemExit(
            f"--stages {k} --microbatches {m} --steps {args.steps} --rounds {args.rounds}: "
            "give at least 2 stages (a hand-off needs two ranks) and at least 1 of the others"
        )
    runs = gd.spawn(both, k, k, f, b, m, args.schedules, args.steps, args.rounds, threads=1)[0]
    print(f"K={k} M={m} F={f:g} B={b:g} ms, in turns; medians over every step and rank")
    print(
        f"{'schedule':>8} {'side':>6} {'step ms':>8} {'overrun':>8} {'gap':>6} {'hop':>6} "
        f"{'hops/step':>9} {'sending':>8} {'flight':>7} {'receiving':>9}"
    )
    results = []
    for schedule in args.schedules:
        figures: dict[str, dict[str, float]] = {}
        for side in SIDES:
            steps = runs[f"{schedule}/{side}"]  # per step: every rank's (seconds, sleeps, parts)
            overruns, gaps, hops, parts, paths = [], [], [], [], []
            asked = {FORWARD: f / 1e3, BACKWARD: b / 1e3}
            for ranks in steps:
                timeline = _sleep_timeline(f / 1e3, [sleeps for _, sleeps, _ in ranks])
                paths.append(_path(timeline, asked))
                o, g, h = _costs(timeline, asked)
                overruns += o
                gaps += g
                hops += h
                if ranks[0][2] is not None:
                    parts += ranks[0][2]
            figures[side] = {
                "step": statistics.median(ranks[0][0] for ranks in steps) * 1e3,
                "overrun": _ms(overruns),
                "gap": _ms(gaps),
                "hop": _ms(hops),
                "hops": len(hops) / len(steps),
                **{
                    name: _ms([p[i] for p in parts])
                    for i, name in enumerate(("sending", "flight", "receiving"))
                },
                **{f"path_{name}": statistics.median(p[name] for p in paths) for name in paths[0]},
            }
            c = figures[side]
            split = (
                f"{c['sending']:8.3f} {c['flight']:7.3f} {c['receiving']:9.3f}"
                if parts
                else f"{'-':>8} {'-':>7} {'-':>9}"
            )
            print(
                f"{schedule:>8} {side:>6} {c['step']:8.1f} {c['overrun']:8.3f} {c['gap']:6.3f} "
                f"{c['hop']:6.3f} {c['hops']:9.1f} {split}"
            )
        results.append((schedule, figures))
    print("\non the critical path (median step): what it paid beyond its sleeps, in ms")
    print(
        f"{'schedule':>8} {'side':>6} {'overruns':>8} {'waits':>6} {'each':>6} "
        f"{'hand-offs':>9} {'each':>6} {'in all':>7}"
    )
    for schedule, figures in results:
        for side, c in figures.items():
            waits, handoffs = c["path_waits"], c["path_handoffs"]
            print(
                f"{schedule:>8} {side:>6} {c['path_overrun_ms']:8.2f} {waits:6.0f} "
                f"{c['path_wait_ms'] / max(waits, 1):6.3f} {handoffs:9.0f} "
                f"{c['path_handoff_ms'] / max(handoffs, 1):6.3f} "
                f"{c['path_overrun_ms'] + c['path_wait_ms'] + c['path_handoff_ms']:7.2f}"
            )
    ideal = (m + k - 1) * (f + b)
    for schedule, figures in results:
        ours = figures["ours"]
        print(
            f"RESULT schedule={schedule} stages={k} microbatches={m} ideal_ms={ideal:.1f} "
            + " ".join(
                f"{side}_{name}={c[key]:.{digits}f}"
                for side, c in figures.items()
                for name, key, digits in _STEP_KEYS
            )
            + f" ours_over_late={ours['step'] / figures['late']['step']:.3f}"
            + f" sending_ms={ours['sending']:.3f} flight_ms={ours['flight']:.3f} "
            f"receiving_ms={ours['receiving']:.3f} "
            + " ".join(
                f"{side}_path_{name}={c[f'path_{name}']:.{digits}f}"
                for side, c in figures.items()
                for name, digits in _PATH_KEYS
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--backward-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per turn")
    parser.add_argument("--rounds", type=int, default=2, help="turns of ours then torch's")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
