"""Property: the fast simulator, memory walk, greedy builder and search answer exactly as the
reference (today's code, frozen in reference_simulator.py) does, to the last bit."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference_simulator as reference
from gpipe.analysis import Costs, Timeline, search, simulate
from gpipe.analysis.memory import memory_per_action
from gpipe.schedule import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    Schedule,
    ScheduleError,
    dependencies,
    gpipe,
    greedy,
    interleaved,
    one_f_one_b,
    round_robin,
    v_shape,
    zb_h1,
    zb_h2,
    zb_v,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Times that add up with rounding (0.1 + 0.2 != 0.3), so a sum in another order would show.
TIMES = st.sampled_from([0, 0.1, 0.2, 0.3, 0.7, 1, 1.5, 2, 1 / 3, 2.25])


def _random_order(stages: int, microbatches: int, devices: int, split: bool, seed: int) -> Schedule:
    """A valid schedule of any shape: a random topological order of every action, each on
    its stage's device (round-robin), so the device lists interleave in ways no generator
    writes."""
    kinds = (FORWARD, BACKWARD, WEIGHT) if split else (FORWARD, BACKWARD)
    todo = {Action(k, s, i) for k in kinds for s in range(stages) for i in range(microbatches)}
    done: set[Action] = set()
    placement = round_robin(stages, devices)
    lists: list[list[Action]] = [[] for _ in range(devices)]
    rng = random.Random(seed)
    while todo:
        ready = sorted(
            a
            for a in todo
            if all(d in done for d in dependencies(a, stages))
            and (a.kind != WEIGHT or Action(BACKWARD, a.stage, a.microbatch) in done)
        )
        action = rng.choice(ready)
        todo.remove(action)
        done.add(action)
        lists[placement[action.stage]].append(action)
    return Schedule("random", lists, microbatches, stages, placement)


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    devices = draw(st.integers(1, 4))
    m = draw(st.integers(1, 6))
    name = draw(
        st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "random"])
    )
    if name == "gpipe":
        return gpipe(devices, m)
    if name == "1f1b":
        return one_f_one_b(devices, m)
    if name == "interleaved":
        return interleaved(devices, m * devices, virtual_stages=draw(st.integers(2, 3)))
    if name == "zb-h1":
        return zb_h1(devices, m)
    if name == "zb-h2":
        return zb_h2(devices, m)
    if name == "zb-v":
        return zb_v(devices, m)
    stages = devices * draw(st.integers(1, 2))
    return _random_order(stages, m, devices, draw(st.booleans()), draw(st.integers(0, 2**16)))


def _per_stage(draw: st.DrawFn, values: st.SearchStrategy, stages: int) -> object:
    if draw(st.booleans()):
        return draw(values)
    return draw(st.lists(values, min_size=stages, max_size=stages))


@st.composite
def costs(draw: st.DrawFn, stages: int) -> Costs:
    sizes = st.one_of(st.integers(0, 5), st.sampled_from([0.5, 1.25, 0.1, 3.0]))
    return Costs(
        forward=_per_stage(draw, TIMES, stages),
        backward=_per_stage(draw, TIMES, stages),
        weight=_per_stage(draw, TIMES, stages),
        transfer=draw(TIMES),
        activation_bytes=_per_stage(draw, sizes, stages),
        gradient_bytes=_per_stage(draw, sizes, stages),
        deferred_bytes=_per_stage(draw, sizes, stages),
        latency=draw(st.sampled_from([0.0, 0.05, 0.25])),
        bandwidth=draw(st.sampled_from([float("inf"), 4.0, 10.0])),
    )


@st.composite
def skips(draw: st.DrawFn, stages: int) -> list[tuple[int, int, float]]:
    if stages < 3:
        return []
    pairs = st.tuples(st.integers(0, stages - 3), st.integers(2, stages - 1))
    drawn = draw(st.lists(pairs, max_size=3))
    sizes = st.sampled_from([0.0, 1.0, 2.5, 7.0])
    return [(s, r, draw(sizes)) for s, r in drawn if s < r - 1]


def _transfer(t: object) -> tuple:
    return dataclasses.astuple(t)  # type: ignore[call-overload]


def _assert_same(new: Timeline, old: Timeline, schedule: Schedule) -> None:
    # the figures a search reads come from the columns, before any event is made
    assert new.makespan == old.makespan
    assert new.spans == old.spans
    assert new.busy == old.busy
    assert new.peak_memory == old.peak_memory
    assert new.bubble == old.bubble
    assert new.steady_bubble == old.steady_bubble
    # every action's start, end and memory; the reference predates ``Event.left``
    made = [[dataclasses.replace(e, left=None) for e in row] for row in new.events]
    assert made == old.events
    assert (new.unit, new.schedule) == (old.unit, old.schedule)
    assert sorted(map(_transfer, new.transfers)) == sorted(map(_transfer, old.transfers))
    # listed device by device, in the order the receiving actions run
    place = {(d, a): j for d, row in enumerate(schedule.actions) for j, a in enumerate(row)}
    order = [
        (t.target, place[t.target, Action(t.kind, t.stage, t.microbatch)]) for t in new.transfers
    ]
    assert order == sorted(order)


@FAST
@given(st.data())
def test_simulate_gives_the_references_events_memory_and_transfers(data: st.DataObject) -> None:
    schedule = data.draw(schedules())
    drawn = data.draw(costs(schedule.stages))
    skipped = data.draw(skips(schedule.stages))
    _assert_same(
        simulate(schedule, drawn, skipped), reference.simulate(schedule, drawn, skipped), schedule
    )


@FAST
@given(st.data())
def test_simulate_refuses_what_the_reference_refuses_in_its_words(data: st.DataObject) -> None:
    schedule = data.draw(schedules())
    rows = [list(row) for row in schedule.actions]
    device = data.draw(st.integers(0, len(rows) - 1))
    how = data.draw(st.sampled_from(["drop", "repeat", "swap", "stage", "microbatch", "move"]))
    row = rows[device]
    if how == "drop" and row:
        row.pop(data.draw(st.integers(0, len(row) - 1)))
    elif how == "repeat" and row:
        row.append(row[data.draw(st.integers(0, len(row) - 1))])
    elif how == "swap" and len(row) > 1:
        j = data.draw(st.integers(0, len(row) - 2))
        row[j], row[j + 1] = row[j + 1], row[j]
    elif how in ("stage", "microbatch"):
        big = schedule.stages if how == "stage" else schedule.microbatches
        row.append(Action(FORWARD, big, 0) if how == "stage" else Action(FORWARD, 0, big))
    elif how == "move" and len(rows) > 1 and row:
        rows[(device + 1) % len(rows)].append(row.pop())
    broken = Schedule(
        schedule.name, rows, schedule.microbatches, schedule.stages, schedule.placement
    )
    try:
        expected = reference.simulate(broken)
    except ScheduleError as error:
        with pytest.raises(ScheduleError) as raised:
            simulate(broken)
        assert str(raised.value) == str(error)
    else:
        _assert_same(simulate(broken), expected, broken)


@FAST
@given(st.data())
def test_the_memory_walk_gives_the_references_figures_in_every_checkpoint_mode(
    data: st.DataObject,
) -> None:
    schedule = data.draw(schedules())
    stages = schedule.stages
    sizes = st.one_of(st.integers(0, 9), st.sampled_from([0.1, 0.2, 2.5]))
    full = data.draw(st.lists(sizes, min_size=stages, max_size=stages))
    kept = data.draw(st.lists(sizes, min_size=stages, max_size=stages))
    gradient = data.draw(st.none() | st.lists(sizes, min_size=stages, max_size=stages))
    deferred = data.draw(st.none() | st.lists(sizes, min_size=stages, max_size=stages))
    mode = data.draw(st.sampled_from(["never", "always", "except_last"]))
    args = (schedule, full, kept, mode)
    kwargs = {"gradient": gradient, "deferred": deferred}
    assert memory_per_action(*args, **kwargs) == reference.memory_per_action(*args, **kwargs)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_greedy_builds_the_references_schedule_and_gives_up_only_past_its_deadline(
    data: st.DataObject,
) -> None:
    devices = data.draw(st.integers(1, 4))
    virtual = data.draw(st.integers(1, 2))
    placement = v_shape(devices) if virtual == 2 else round_robin(devices, devices)
    stages, m = devices * virtual, data.draw(st.integers(1, 6))
    times = st.lists(st.sampled_from([0.1, 0.2, 0.3, 1.0, 1.5]), min_size=stages, max_size=stages)
    kwargs = dict(
        limit=data.draw(st.integers(1, 2 * stages + 1)),
        order=data.draw(st.sampled_from(["BFW", "FBW", "WBF"])),
        lead=data.draw(st.integers(1, 2 * devices)) if virtual == 2 else None,
        forward=data.draw(times),
        backward=data.draw(times),
        weight=data.draw(times),
        transfer=data.draw(st.sampled_from([0.0, 0.1, 0.5])),
    )
    built = greedy("g", placement, m, **kwargs)
    assert built == reference.greedy("g", placement, m, **kwargs)
    if built is None:
        return
    makespan = simulate(
        built,
        {
            "forward": kwargs["forward"],
            "backward": kwargs["backward"],
            "weight": kwargs["weight"],
            "transfer": kwargs["transfer"],
        },
    ).makespan
    assert greedy("g", placement, m, deadline=makespan, **kwargs) == built
    assert greedy("g", placement, m, deadline=makespan - 0.05, **kwargs) is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_search_picks_the_references_schedule_or_refuses_in_its_words(
    data: st.DataObject,
) -> None:
    devices = data.draw(st.integers(1, 4))
    virtual = data.draw(st.integers(1, 2))
    m = data.draw(st.integers(1, 8))
    drawn = data.draw(costs(devices * virtual))
    limit = data.draw(st.none() | st.sampled_from([1, 2, 3, 4.5, 8]))
    kwargs = dict(virtual_stages=virtual, costs=drawn, memory_limit=limit)
    try:
        expected = reference.search(devices, m, **kwargs)
    except ValueError as error:
        with pytest.raises(ValueError) as raised:
            search(devices, m, **kwargs)
        assert str(raised.value) == str(error)
    else:
        assert search(devices, m, **kwargs) == expected


@pytest.mark.parametrize(("stages", "microbatches"), [(8, 32), (12, 24)])
def test_search_at_a_larger_size_picks_the_references_schedule(
    stages: int, microbatches: int
) -> None:
    equal = Costs(forward=1, backward=1, weight=1)
    uneven = Costs(forward=[1.0 + 0.1 * (s % 3) for s in range(stages)], backward=2, weight=0.7)
    for drawn in (equal, uneven):
        expected = reference.search(stages, microbatches, costs=drawn)
        assert search(stages, microbatches, costs=drawn) == expected


def test_the_reports_and_the_demos_figures_are_the_references(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpipe.report import bubble, partitioning
    from gpipe.schedule import make_schedule

    # the partitioning section: a GPipe step over three cuts of measured-like layer times
    rng = random.Random(0)
    forward = [rng.uniform(1e-4, 3e-3) for _ in range(12)]
    backward = [2 * f + rng.uniform(0, 1e-3) for f in forward]
    cuts = [[3, 3, 3, 3], [2, 4, 4, 2], [1, 5, 5, 1]]
    steps = [partitioning._simulated_step(cut, forward, backward) for cut in cuts]
    with monkeypatch.context() as patched:
        patched.setattr(partitioning, "simulate", reference.simulate)
        assert [partitioning._simulated_step(cut, forward, backward) for cut in cuts] == steps
    # the bubble section: GPipe's simulated bubble at every K and M it draws
    for k in bubble.STAGES:
        for m in (1, 2, 4, 8, 16, 32):
            schedule, costs = make_schedule("gpipe", k, m), Costs(forward=4.0, backward=8.0)
            assert simulate(schedule, costs).bubble == reference.simulate(schedule, costs).bubble
    # the demo's prediction: each schedule it runs, on per-stage measured-like costs
    for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)]:
        schedule = make_schedule(name, 4, 8, virtual_stages=v)
        costs = Costs(forward=forward[: 4 * v], backward=backward[: 4 * v])
        _assert_same(simulate(schedule, costs), reference.simulate(schedule, costs), schedule)
