"""The memory panel draws what each device holds over the step (gpipe.analysis.held).

Between actions it stands at what the last one left held (``Event.left``, recorded by the
runtime and the simulator): it rises at each forward, falls at each backward (or W, in
zero-bubble schedules) and ends where it began. While an action runs it stands at what the
runtime counted for it, so its top is the timeline's peak. The Perfetto trace's memory
counter follows the same line.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from conftest import make_mlp
from gpipe import GPipe
from gpipe.analysis import Costs, Event, Timeline, simulate
from gpipe.analysis.held import held_after, held_memory
from gpipe.runtime.worker import StageWorker
from gpipe.schedule import Action, make_schedule

# One device, 1F1B's order for 2 micro-batches: a forward keeps 10 bytes; a backward also
# holds 3 bytes of gradients while it runs. (action, start, end, memory, left)
ONE_DEVICE = [
    (Action("F", 0, 0), 1.0, 2.0, 10, 10),
    (Action("F", 0, 1), 2.0, 3.0, 20, 20),
    (Action("B", 0, 0), 4.0, 6.0, 23, 10),
    (Action("B", 0, 1), 7.0, 9.0, 13, 0),
]


@pytest.mark.parametrize("recorded", [True, False], ids=["left", "walked"])
def test_held_memory_is_each_actions_count_while_it_runs_and_what_it_left_between(
    recorded: bool,
) -> None:
    # Without ``left`` (a timeline built by hand or saved before it was recorded), a
    # schedule without W is walked: the same line.
    events = [Event(a, s, e, m, left if recorded else None) for a, s, e, m, left in ONE_DEVICE]
    idle = [Event(Action("F", 1, 0), 0.0, 1.0, 0, 0 if recorded else None)]
    [(times, held, kept), _] = held_memory(Timeline([events, idle], "s"))
    assert times == [0.0, 1.0, 2.0, 2.0, 3.0, 4.0, 6.0, 7.0, 9.0, 9.0]
    assert held == [0.0, 10, 10, 20, 20, 23, 10, 13, 0, 0]
    # Without the backward's gradients: each micro-batch kept until its backward ends.
    assert kept == [0.0, 10, 10, 20, 20, 20, 10, 10, 0, 0]


def test_held_memory_is_what_each_action_left_not_a_walk_of_the_peaks() -> None:
    # A step that retained its graph: the backwards freed nothing, as ``left`` says.
    events = [Event(a, s, e, m, 20 if a.kind == "B" else left) for a, s, e, m, left in ONE_DEVICE]
    assert held_after(events) == [10, 20, 20, 20]


def test_zero_bubble_held_memory_without_left_shows_only_the_peaks() -> None:
    # What B keeps for W shows in no peak: each action is taken to leave its peak held.
    events = [
        Event(Action("F", 0, 0), 0.0, 1.0, 10),
        Event(Action("B", 0, 0), 1.0, 2.0, 16),
        Event(Action("W", 0, 0), 2.0, 3.0, 14),
    ]
    assert held_after(events) == [10, 16, 14]


def microbatches_in_flight(events: Sequence[Event]) -> list[int]:
    """Per action, the micro-batches whose forward has run and whose backward has not."""
    count, out = 0, []
    for e in events:
        count += 1 if e.kind == "F" else -1
        out.append(count)
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_held_memory_falls_back_to_zero_and_tops_out_at_the_peak(schedule: str, k: int) -> None:
    m = 6
    # 100 bytes a micro-batch; a backward also holds 7 bytes of gradients while it runs.
    costs = Costs(activation_bytes=100, gradient_bytes=7)
    timeline = simulate(make_schedule(schedule, k, m), costs)
    for device, (times, held, kept) in enumerate(held_memory(timeline)):
        events = timeline.events[device]
        assert held_after(events) == [100 * n for n in microbatches_in_flight(events)]
        assert held[0] == held[-1] == kept[-1] == 0
        assert max(held) == timeline.peak_memory[device]
        # GPipe keeps every micro-batch until its backwards; 1F1B stage d keeps min(K-d, M).
        assert max(kept) == 100 * (m if schedule == "gpipe" else min(k - device, m))
        assert times == sorted(times)


def walked(events: Sequence[Event], full: list[int], deferred: list[int]) -> list[int]:
    """What the device holds after each action by the simulator's sizes: F keeps ``full``,
    B keeps ``deferred`` more for its W, W frees both."""
    level, out = 0, []
    for e in events:
        s = e.action.stage
        level += {"F": full[s], "B": deferred[s], "W": -full[s] - deferred[s]}[e.kind]
        out.append(level)
    return out


@pytest.mark.parametrize(("schedule", "v"), [("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2)])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_zero_bubble_held_memory_keeps_what_b_leaves_for_w_until_w(
    schedule: str, v: int, k: int
) -> None:
    rng = random.Random(k)
    stages = k * v
    full = [rng.randint(100, 999) for _ in range(stages)]
    deferred = [rng.randint(0, 99) for _ in range(stages)]
    costs = Costs(
        weight=0.5,
        activation_bytes=full,
        gradient_bytes=[rng.randint(0, 50) for _ in range(stages)],
        deferred_bytes=deferred,
    )
    timeline = simulate(make_schedule(schedule, k, 7, virtual_stages=v), costs)
    for device, (_, held, _) in enumerate(held_memory(timeline)):
        events = timeline.events[device]
        assert held_after(events) == pytest.approx(walked(events, full, deferred), abs=1e-6)
        assert held[-1] == pytest.approx(0, abs=1e-6)
        assert max(held) == timeline.peak_memory[device]


@pytest.mark.parametrize(
    ("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2)]
)
@pytest.mark.parametrize("k", [2, 3, 4])
def test_simulated_left_ends_at_zero_and_the_held_line_tops_out_at_the_peak(
    schedule: str, v: int, k: int
) -> None:
    stages = k * v
    costs = Costs(
        weight=0.5,
        activation_bytes=[100 + 10 * s for s in range(stages)],
        gradient_bytes=[7 + s for s in range(stages)],
        deferred_bytes=[30 + s for s in range(stages)],
    )
    timeline = simulate(make_schedule(schedule, k, 6, virtual_stages=v), costs)
    for device, (_, held, _) in enumerate(held_memory(timeline)):
        events = timeline.events[device]
        assert all(e.left is not None for e in events)
        assert events[-1].left == 0
        assert max(held) == timeline.peak_memory[device]


def test_chrome_trace_memory_counter_follows_the_held_line() -> None:
    events = [Event(*row) for row in ONE_DEVICE]
    trace = Timeline([events], "s").to_chrome_trace()
    counter = [(c["ts"], c["args"]["memory"]) for c in trace["traceEvents"] if c["ph"] == "C"]
    # From the timeline's start, in microseconds: up at each action's start to its count,
    # down at its end to what it left, back to zero.
    assert counter == [(0.0, 10), (1e6, 20), (3e6, 23), (5e6, 10), (6e6, 13), (8e6, 0)]
    sliced = [c["args"] for c in trace["traceEvents"] if c["ph"] == "X"]
    assert [a["left"] for a in sliced] == [10, 20, 10, 0]


@pytest.mark.parametrize(
    ("schedule", "checkpoint"),
    [("gpipe", "except_last"), ("1f1b", "always"), ("zb-h1", "never"), ("zb-h1", "except_last")],
)
def test_held_memory_between_actions_is_what_the_runtime_held(
    monkeypatch: pytest.MonkeyPatch, schedule: str, checkpoint: str
) -> None:
    # The runtime's own count after each action, read as the action is recorded.
    counted: dict[int, list[int]] = {}
    record = StageWorker._record

    def counting(worker: StageWorker, *args: Any, **kwargs: Any) -> None:
        record(worker, *args, **kwargs)
        counted.setdefault(worker.device, []).append(worker.held)

    monkeypatch.setattr(StageWorker, "_record", counting)
    k, m = 3, 4
    pipe = GPipe(
        make_mlp(6, width=8),
        [4] * k,
        devices=["cpu"] * k,
        chunks=m,
        checkpoint=checkpoint,
        schedule=schedule,
    )
    x = torch.randn(4 * m, 8, dtype=torch.float64)
    pipe.train_step(x, torch.randn(4 * m, 8, dtype=torch.float64), F.mse_loss)
    timeline = pipe.timeline
    assert min(counted[0]) >= 0 and max(counted[0]) > 0
    for device, (_, held, _) in enumerate(held_memory(timeline)):
        assert [e.left for e in timeline.events[device]] == counted[device]
        assert held_after(timeline.events[device]) == counted[device]
        assert held[-1] == 0
        assert max(held) == timeline.peak_memory[device]
