"""The schedules past zero bubble: interleaved zero bubble, looped BFS, V-Half and V-Min.

Each is valid for every size, runs under NCCL's rules as lowered, and its simulated step
time and peak memory are the closed forms of gpipe.analysis.formulas, exactly; "auto" finds
them (or better) under a memory limit. Torch-free: the runtime's parity runs them in
test_schedules_runtime.py, test_nccl_rules.py and test_distributed.py.
"""

from __future__ import annotations

import itertools

import pytest

from gpipe.analysis import Costs, bubble_formula, memory_formula, simulate
from gpipe.schedule import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    interleaved,
    interleaved_zb,
    looped_bfs,
    make_schedule,
    one_f_one_b,
    round_robin,
    v_half,
    v_min,
    v_shape,
    validate,
)
from gpipe.schedule.lowering import lower, replay

UNIT = Costs(forward=1, backward=1, weight=1)  # F = B = W = 1 per stage

# (name, virtual stages) of every schedule with a memory form, the new ones and the old.
NAMED = [
    ("gpipe", 1),
    ("gpipe", 3),
    ("1f1b", 1),
    ("interleaved", 2),
    ("interleaved", 3),
    ("zb-h1", 1),
    ("zb-h2", 1),
    ("zb-v", 2),
    ("interleaved-zb", 2),
    ("interleaved-zb", 3),
    ("looped-bfs", 1),
    ("looped-bfs", 2),
    ("looped-bfs", 3),
    ("v-half", 2),
    ("v-min", 2),
]
NAMED_IDS = [f"{name}-v{v}" for name, v in NAMED]
NEW = [("interleaved-zb", 2), ("interleaved-zb", 3), ("looped-bfs", 2), ("v-half", 2), ("v-min", 2)]
NEW_IDS = [f"{name}-v{v}" for name, v in NEW]


def sizes(most: int = 5) -> list[tuple[int, int]]:
    """(K, M) for K in 1..most and M in 1..3K."""
    return [(k, m) for k in range(1, most + 1) for m in range(1, 3 * k + 1)]


@pytest.mark.parametrize(("name", "v"), NEW, ids=NEW_IDS)
def test_new_schedules_are_valid_and_run_as_lowered_for_every_size(name: str, v: int) -> None:
    for k, m in sizes():
        schedule = make_schedule(name, k, m, virtual_stages=v)
        validate(schedule)
        assert replay(lower(schedule)) is None, (name, k, m)
        assert schedule.name == name
        assert (schedule.devices, schedule.stages, schedule.microbatches) == (k, k * v, m)
        assert schedule.split_backward == (name != "looped-bfs")


@pytest.mark.parametrize(("name", "v"), NAMED, ids=NAMED_IDS)
def test_simulated_peak_memory_is_the_memory_formula(name: str, v: int) -> None:
    for k, m in sizes():
        peak = max(simulate(make_schedule(name, k, m, virtual_stages=v), UNIT).peak_memory)
        assert peak == memory_formula(name, k, m, v), (name, v, k, m)


# the older schedules' bubbles are checked in test_simulate.py; GPipe with v stages per
# device runs looped BFS's order
@pytest.mark.parametrize(("name", "v"), [*NEW, ("gpipe", 3)], ids=[*NEW_IDS, "gpipe-v3"])
def test_simulated_bubble_is_the_bubble_formula_where_one_applies(name: str, v: int) -> None:
    checked = 0
    for k, m in sizes():
        expected = bubble_formula(name, k, m, v)
        if expected is None:
            continue
        schedule = make_schedule(name, k, m, virtual_stages=v)
        costs = UNIT if schedule.split_backward else Costs(forward=1, backward=1)
        assert simulate(schedule, costs).bubble == pytest.approx(expected, abs=1e-12)
        checked += 1
    assert checked >= 35  # every M >= K


@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_zb_takes_the_least_time_there_is_for_m_at_least_k(v: int) -> None:
    for k, m in sizes(6):
        if m >= k:
            timeline = simulate(interleaved_zb(k, m, virtual_stages=v), UNIT)
            assert timeline.makespan == 3 * v * m + k - 1, (k, m)


def test_interleaved_zb_holds_1f1b_memory_when_k_divides_m() -> None:
    for k, v in itertools.product(range(1, 6), (2, 3)):
        for m in (k, 2 * k, 3 * k):
            peaks = simulate(interleaved_zb(k, m, virtual_stages=v), UNIT).peak_memory
            assert max(peaks) == v * k  # K micro-batches, each v stages of a device


def test_interleaved_zb_defers_each_devices_weight_gradients_by_its_index() -> None:
    schedule = interleaved_zb(4, 8, virtual_stages=2)
    for d, actions in enumerate(schedule.actions):
        kinds = [a.kind for a in actions]
        assert kinds[: kinds.index(WEIGHT)].count(BACKWARD) == d + 1
    assert schedule.placement == round_robin(8, 4)


@pytest.mark.parametrize("v", [1, 2, 3])
def test_looped_bfs_takes_as_long_as_interleaved_1f1b(v: int) -> None:
    for k, m in sizes():
        for costs in (Costs(forward=1, backward=1), Costs(forward=1, backward=2)):
            bfs = simulate(looped_bfs(k, m, virtual_stages=v), costs)
            assert bfs.makespan == simulate(interleaved(k, m, virtual_stages=v), costs).makespan


def test_looped_bfs_runs_each_local_stage_in_one_stretch_per_direction() -> None:
    schedule = looped_bfs(3, 5, virtual_stages=3)
    for d, actions in enumerate(schedule.actions):
        forwards = [a.stage for a in actions if a.kind == FORWARD]
        backwards = [a.stage for a in actions if a.kind == BACKWARD]
        assert [s for s, _ in itertools.groupby(forwards)] == [d, d + 3, d + 6]
        assert [s for s, _ in itertools.groupby(backwards)] == [d + 6, d + 3, d]
    assert schedule.placement == round_robin(9, 3)


@pytest.mark.parametrize(
    ("generator", "shares"), [(v_half, lambda k: (k + 2) // 2), (v_min, lambda k: (k + 4) // 3)]
)
def test_v_schedules_hold_the_papers_share_of_1f1b_memory(generator, shares) -> None:
    for k in range(1, 13):
        m = 2 * k
        schedule = generator(k, m)
        assert schedule.placement == v_shape(k)
        peak = max(simulate(schedule, UNIT).peak_memory)
        # a device's share of a micro-batch is its two stages: 1F1B holds K shares
        assert peak == 2 * shares(k)


def test_v_half_and_v_min_trade_half_and_a_third_of_1f1bs_memory_for_its_bubble() -> None:
    k, m = 24, 48
    # 1F1B on the same devices: each of its stages is two of the V's
    one_f_one_b_run = simulate(one_f_one_b(k, m), Costs(forward=2, backward=2, weight=2))
    idle_1f1b = one_f_one_b_run.makespan - 6 * m
    memory_1f1b = 2 * max(one_f_one_b_run.peak_memory)
    half, least = simulate(v_half(k, m), UNIT), simulate(v_min(k, m), UNIT)
    assert max(half.peak_memory) / memory_1f1b == pytest.approx(1 / 2, abs=0.05)
    assert max(least.peak_memory) / memory_1f1b == pytest.approx(1 / 3, abs=0.05)
    assert (half.makespan - 6 * m) / idle_1f1b == pytest.approx(1 / 2, abs=0.05)
    assert (least.makespan - 6 * m) / idle_1f1b == pytest.approx(2 / 3, abs=0.05)


@pytest.mark.parametrize(("generator", "name"), [(v_half, "v-half"), (v_min, "v-min")])
def test_auto_under_the_v_schedules_memory_is_at_least_as_fast(generator, name) -> None:
    k, m = 4, 8
    limit = memory_formula(name, k, m, 2)
    assert limit is not None and limit < 2 * k  # below 1F1B's (and zb-v's) 2K stages
    auto = make_schedule("auto", k, m, virtual_stages=2, costs=UNIT, memory_limit=limit)
    timeline = simulate(auto, UNIT)
    assert max(timeline.peak_memory) <= limit
    assert timeline.makespan <= simulate(generator(k, m), UNIT).makespan
    assert auto.placement == v_shape(k)


def test_interleaved_zb_asks_for_two_stages_per_device() -> None:
    with pytest.raises(ValueError, match="virtual_stages=2"):
        interleaved_zb(2, 4, virtual_stages=1)
    with pytest.raises(ValueError, match="virtual_stages=2"):
        make_schedule("interleaved-zb", 2, 4)
    assert make_schedule("interleaved-zb", 2, 4, virtual_stages=3).stages == 6


def test_v_schedules_ask_for_two_stages_per_device() -> None:
    for name in ("v-half", "v-min"):
        with pytest.raises(ValueError, match="virtual_stages=2"):
            make_schedule(name, 3, 4)
        assert make_schedule(name, 3, 4, virtual_stages=2).placement == v_shape(3)


@pytest.mark.parametrize("generator", [interleaved_zb, looped_bfs, v_half, v_min])
def test_new_generators_refuse_no_stages_or_microbatches(generator) -> None:
    with pytest.raises(ValueError, match="stages must be >= 1"):
        generator(0, 4)
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        generator(2, 0)


def test_looped_bfs_refuses_no_virtual_stages() -> None:
    with pytest.raises(ValueError, match="virtual_stages must be >= 1"):
        looped_bfs(2, 4, virtual_stages=0)


def test_memory_formula_knows_dualpipev_only_once_m_fills_it() -> None:
    assert memory_formula("dualpipev", 4, 8, 2) == 9
    assert memory_formula("dualpipev", 4, 7, 2) is None
    assert memory_formula("auto", 4, 8, 2) is None


def test_dualpipev_bubble_and_memory_are_their_formulas_once_m_fills_it() -> None:
    # F = B = W per stage, pairs at their parts' sum: an idle 2(K-1) over 6M of work, and
    # the published 2K+1 stage-micro-batches on every device, for every M >= 2K.
    checked = 0
    for k in range(1, 7):
        for m in range(2 * k, 4 * k + 2):
            timeline = simulate(make_schedule("dualpipev", k, m, virtual_stages=2), UNIT)
            assert timeline.bubble == pytest.approx(bubble_formula("dualpipev", k, m, 2), abs=1e-12)
            assert timeline.bubble == pytest.approx((k - 1) / (3 * m + k - 1), abs=1e-12)
            assert timeline.peak_memory == [memory_formula("dualpipev", k, m, 2)] * k
            checked += 1
    assert checked == sum(2 * k + 2 for k in range(1, 7))
    assert bubble_formula("dualpipev", 4, 7, 2) is None  # it needs M >= 2K
