"""The "auto" schedule: the fastest schedule under a memory limit, never worse than a named one."""

from __future__ import annotations

import inspect
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpipe.analysis import Costs, search, simulate
from gpipe.schedule import greedy, make_schedule, round_robin, v_shape, validate
from test_schedule import unit_time_picture

EQUAL = Costs(forward=1, backward=1, weight=1)


def fitting_named(k: int, m: int, v: int, costs: Costs, limit: float | list[float]) -> list[float]:
    """Makespans of the named schedules with auto's placement that fit ``limit``."""
    names = ["gpipe", "1f1b", "zb-h1", "zb-h2"] if v == 1 else ["zb-v"]
    limits = limit if isinstance(limit, list) else [limit] * k
    spans = []
    for name in names:
        timeline = simulate(make_schedule(name, k, m, virtual_stages=v), costs)
        if all(peak <= most + 1e-9 for peak, most in zip(timeline.peak_memory, limits)):
            spans.append(timeline.makespan)
    return spans


@pytest.mark.parametrize(
    "costs",
    [
        EQUAL,
        Costs(forward=1, backward=2, weight=0.5),
        Costs(forward=2, backward=1, weight=1),
        Costs(forward=1, backward=1, weight=0),
        Costs(forward=[1, 2, 1, 3], backward=[2, 2, 1, 1], weight=[1, 0.5, 1, 1]),
        Costs(forward=1, backward=1, weight=1, transfer=0.5),
    ],
    ids=["equal", "b-heavy", "f-heavy", "no-w", "uneven-stages", "transfer"],
)
@pytest.mark.parametrize("limit", [2, 4, 7])
def test_auto_is_never_slower_than_the_best_named_schedule_that_fits(costs, limit):
    for m in (2, 4, 8, 11):
        schedule = search(4, m, costs=costs, memory_limit=limit)
        validate(schedule)
        timeline = simulate(schedule, costs)
        assert max(timeline.peak_memory) <= limit
        named = fitting_named(4, m, 1, costs, limit)
        assert timeline.makespan <= min(named, default=float("inf")) + 1e-9, (m, named)


@st.composite
def cases(draw: st.DrawFn) -> tuple[int, int, int, Costs, list[float]]:
    """A pipeline shape, per-stage costs and activation sizes, and a per-device limit."""
    v = draw(st.sampled_from([1, 2]))
    k, m = draw(st.integers(1, 4)), draw(st.integers(1, 9))
    count = k * v
    times = st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]), min_size=count, max_size=count)
    costs = Costs(
        forward=draw(times),
        backward=draw(times),
        weight=draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=count, max_size=count)),
        transfer=draw(st.sampled_from([0.0, 0.25, 1.0])),
        activation_bytes=draw(st.lists(st.integers(1, 3), min_size=count, max_size=count)),
    )
    limits = draw(st.lists(st.integers(2, 8 * k), min_size=k, max_size=k))
    return k, m, v, costs, [float(limit) for limit in limits]


@settings(max_examples=60, deadline=None)
@given(cases())
def test_auto_under_random_costs_and_limits_fits_and_beats_every_named_schedule_that_fits(
    case: tuple[int, int, int, Costs, list[float]],
) -> None:
    k, m, v, costs, limits = case
    named = fitting_named(k, m, v, costs, limits)
    try:
        schedule = search(k, m, virtual_stages=v, costs=costs, memory_limit=limits)
    except ValueError as error:
        assert not named, (named, error)  # refused only when no named schedule fits either
        assert "no schedule fits" in str(error)
        return
    validate(schedule)
    timeline = simulate(schedule, costs)
    assert all(peak <= most + 1e-9 for peak, most in zip(timeline.peak_memory, limits))
    assert timeline.makespan <= min(named, default=float("inf")) + 1e-9


@pytest.mark.parametrize("k", [2, 3, 4, 6])
def test_auto_with_1f1b_memory_is_zero_bubble_h1_or_better(k):
    for m in (k, 2 * k, 3 * k + 1):
        schedule = make_schedule("auto", k, m, memory_limit=k)
        timeline = simulate(schedule, EQUAL)
        assert schedule.name == "auto"
        assert max(timeline.peak_memory) <= k
        assert timeline.makespan <= simulate(make_schedule("zb-h1", k, m), EQUAL).makespan
        assert timeline.makespan == 3 * m + k - 1


@pytest.mark.parametrize("k", [2, 3, 4, 6])
def test_auto_with_2k_minus_1_memory_idles_nowhere_back_to_back_like_zb_h2(k):
    for m in (2 * k - 1, 3 * k):
        timeline = simulate(make_schedule("auto", k, m, memory_limit=2 * k - 1), EQUAL)
        assert max(timeline.peak_memory) <= 2 * k - 1
        assert timeline.makespan == 3 * m + k - 1
        assert max(timeline.spans) == 3 * m  # the paper's zero bubble, as ZB-H2
        assert timeline.steady_bubble == 0


def test_auto_with_two_stages_per_device_lays_them_out_in_a_v_and_matches_zb_v():
    for k, m in [(2, 4), (4, 8), (3, 7)]:
        schedule = make_schedule("auto", k, m, virtual_stages=2)
        assert schedule.placement == v_shape(k)
        timeline = simulate(schedule, EQUAL)
        assert max(timeline.peak_memory) <= 2 * k  # default: 1F1B's memory
        assert timeline.makespan <= min(fitting_named(k, m, 2, EQUAL, 2 * k))


def test_auto_trades_memory_for_time_below_1f1b_memory():
    k, m = 4, 8
    times = {}
    for limit in (1, 2, 3, 4):
        timeline = simulate(search(k, m, memory_limit=limit), EQUAL)
        assert max(timeline.peak_memory) <= limit
        times[limit] = timeline.makespan
    # Holding one micro-batch, device 0 sends each down and back alone: F, B, W in turn.
    assert times[1] == m * (2 * k + 1)
    assert times[1] > times[2] > times[3] > times[4]
    # No named schedule fits under 1F1B's K, yet 3/4 of it already runs as fast as 1F1B.
    assert fitting_named(k, m, 1, EQUAL, 3) == []
    assert times[3] <= simulate(make_schedule("1f1b", k, m), EQUAL).makespan


def test_docstring_picture_is_the_search_below_1f1b_memory():
    schedule = search(3, 4, memory_limit=2)
    assert simulate(schedule, EQUAL).peak_memory == [2, 2, 2]
    picture = textwrap.indent(unit_time_picture(schedule), "    ")
    assert picture in textwrap.dedent(inspect.getdoc(search) or "")


def test_auto_defaults_to_unit_costs_and_1f1b_memory():
    default = search(3, 6)
    assert default.actions == search(3, 6, costs=EQUAL, memory_limit=3).actions
    assert search(3, 6, costs={"forward": 1, "backward": 1, "weight": 1}).actions == (
        default.actions
    )


def test_auto_takes_one_limit_per_device():
    schedule = search(3, 6, memory_limit=[5, 3, 1])
    assert [p <= limit for p, limit in zip(simulate(schedule, EQUAL).peak_memory, [5, 3, 1])] == [
        True
    ] * 3


def test_auto_rejects_a_limit_nothing_fits_naming_the_least_need():
    with pytest.raises(ValueError, match=r"no schedule fits memory_limit=0.5: the least"):
        search(3, 4, memory_limit=0.5)
    with pytest.raises(ValueError, match=r"memory_limit must be > 0"):
        search(3, 4, memory_limit=0)
    with pytest.raises(ValueError, match=r"memory_limit lists 2 entries, expected 3"):
        search(3, 4, memory_limit=[1, 2])


def test_auto_rejects_more_than_two_stages_per_device():
    with pytest.raises(ValueError, match="schedule='interleaved'"):
        make_schedule("auto", 2, 4, virtual_stages=3)


def test_greedy_builder_reports_a_limit_too_small_to_run_a_backward():
    # Two stages per device need both a micro-batch's stages held to start its backward.
    assert greedy("g", v_shape(2), 2, limit=1, lead=2) is None
    assert greedy("g", round_robin(2, 2), 2, limit=1) is not None


def test_greedy_builder_checks_its_rules():
    with pytest.raises(ValueError, match="order must rank F, B and W once each"):
        greedy("g", round_robin(2, 2), 2, limit=2, order="BFF")
    with pytest.raises(ValueError, match="two stages per device need a lead"):
        greedy("g", v_shape(2), 2, limit=4)
    with pytest.raises(ValueError, match="one or two stages per device"):
        greedy("g", (0, 0, 0, 1), 2, limit=4, lead=1)
