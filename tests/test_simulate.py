"""The simulator reproduces the schedules' formulas: bubble, memory, transfer time."""

from __future__ import annotations

import time

import pytest

from gpipe.analysis import Costs, Event, Timeline, costs_from_timeline, simulate
from gpipe.schedule import (
    Action,
    Schedule,
    ScheduleError,
    gpipe,
    interleaved,
    make_schedule,
    one_f_one_b,
    zb_h1,
)

EQUAL = Costs(forward=1, backward=1, weight=1)  # for split schedules: F = B = W


def test_gpipe_and_1f1b_bubble_is_k_minus_1_over_m_plus_k_minus_1():
    for name in ("gpipe", "1f1b"):
        for k in range(1, 9):
            for m in range(1, 17):
                timeline = simulate(make_schedule(name, k, m))
                assert timeline.makespan == 2 * (m + k - 1)
                assert timeline.bubble == pytest.approx((k - 1) / (m + k - 1), abs=1e-12)


def test_interleaved_bubble_shrinks_by_the_virtual_stage_count():
    for k in range(1, 7):
        for m in range(k, 3 * k + 2):
            for v in range(1, 4):
                timeline = simulate(interleaved(k, m, virtual_stages=v))
                assert timeline.makespan == 2 * (v * m + k - 1), (k, m, v)
                assert timeline.bubble == pytest.approx((k - 1) / (v * m + k - 1), abs=1e-12)


def test_zb_h1_bubble_is_a_third_of_1f1b_with_equal_f_b_w():
    for k in range(1, 9):
        for m in range(k, 17):
            timeline = simulate(zb_h1(k, m), EQUAL)
            assert timeline.makespan == 3 * m + k - 1
            assert timeline.bubble == pytest.approx((k - 1) / (3 * m + k - 1), abs=1e-12)


def test_zb_h1_with_fewer_microbatches_than_stages_still_beats_1f1b():
    # Below M = K the formula's makespan is shorter than one micro-batch's critical path
    # (M=1: F down, B back, one W = 2K+1 > 3+K-1); ZB-H1 takes 2(M+K)-1.
    for k in range(2, 9):
        for m in range(1, k):
            split = simulate(zb_h1(k, m), EQUAL).makespan
            assert split == 2 * (m + k) - 1
            assert split < simulate(one_f_one_b(k, m), EQUAL).makespan == 3 * (m + k - 1)


def test_1f1b_holds_at_most_k_minus_stage_microbatches_and_gpipe_all_of_them():
    for k in range(1, 9):
        for m in range(1, 17):
            assert simulate(one_f_one_b(k, m)).peak_memory == [min(k - s, m) for s in range(k)]
            assert simulate(gpipe(k, m)).peak_memory == [m] * k


def test_zb_h1_peak_memory_is_no_more_than_1f1b():
    for k in range(1, 9):
        for m in range(1, 17):
            split = simulate(zb_h1(k, m), EQUAL).peak_memory
            assert max(split) == max(simulate(one_f_one_b(k, m)).peak_memory) == min(k, m)
            assert all(peak <= min(k, m) for peak in split)


def test_transfer_time_is_paid_once_per_device_crossing():
    # Two devices, one micro-batch: F crosses once going down, B once coming back.
    for name in ("gpipe", "1f1b"):
        timeline = simulate(make_schedule(name, 2, 1), Costs(transfer=0.5))
        assert timeline.makespan == 4 + 2 * 0.5
    # Four devices: three crossings each way.
    assert simulate(gpipe(4, 1), Costs(transfer=0.25)).makespan == 8 + 6 * 0.25


def test_stages_on_the_same_device_hand_off_for_free():
    one_device = interleaved(1, 2, virtual_stages=3)
    assert simulate(one_device, Costs(transfer=10)).makespan == 12


def test_per_stage_costs_and_weight_folded_into_backward():
    costs = Costs(forward=[1, 2], backward=[1, 2], weight=[0.5, 0.5])
    timeline = simulate(gpipe(2, 2), costs)
    starts = [[(str(e.action), e.start, e.end) for e in device] for device in timeline.events]
    assert starts == [
        [("0F0", 0, 1), ("0F1", 1, 2), ("0B1", 7.5, 9.0), ("0B0", 10.0, 11.5)],
        [("1F0", 1, 3), ("1F1", 3, 5), ("1B1", 5, 7.5), ("1B0", 7.5, 10.0)],
    ]
    assert timeline.makespan == 11.5


def test_memory_counts_activation_bytes_until_backward_or_weight_gradient():
    timeline = simulate(one_f_one_b(2, 2), Costs(activation_bytes=[10, 3]))
    memory = [[(str(e.action), e.memory) for e in device] for device in timeline.events]
    assert memory == [
        [("0F0", 10), ("0F1", 20), ("0B0", 20), ("0B1", 10)],
        [("1F0", 3), ("1B0", 3), ("1F1", 3), ("1B1", 3)],
    ]
    # Split backward: B keeps the activations, W releases them.
    timeline = simulate(zb_h1(1, 2), EQUAL)
    memory = [(str(e.action), e.memory) for e in timeline.events[0]]
    assert memory == [("0F0", 1), ("0B0", 1), ("0W0", 1), ("0F1", 1), ("0B1", 1), ("0W1", 1)]


def test_timeline_is_in_cost_units_named_after_the_schedule():
    timeline = simulate(interleaved(2, 2))
    assert timeline.unit == "cost"
    assert timeline.schedule == "interleaved"
    assert [len(device) for device in timeline.events] == [8, 8]


def test_rejects_a_cost_list_of_the_wrong_length():
    with pytest.raises(ValueError, match=r"Costs\.forward lists 3 stages, the schedule has 2"):
        simulate(gpipe(2, 1), Costs(forward=[1, 1, 1]))


def test_costs_from_timeline_are_per_stage_medians():
    def event(text: str, start: float, end: float) -> Event:
        return Event(Action.parse(text), start, end)

    measured = Timeline(
        [
            [event("0F0", 0, 1), event("0F1", 1, 4), event("0F2", 4, 6), event("0B0", 6, 7)],
            [event("1F0", 1, 2), event("1B0", 2, 5), event("1W0", 5, 5.5)],
        ]
    )
    costs = costs_from_timeline(measured)
    assert costs == Costs(forward=[2, 1], backward=[1, 3], weight=[0.0, 0.5])
    assert Costs.from_timeline(measured, stages=3).forward == [2, 1, 0.0]


def test_simulating_with_measured_costs_predicts_the_same_timeline():
    costs = Costs(forward=[1, 3, 2], backward=[2, 5, 4], weight=[1, 1, 2])
    schedule = zb_h1(3, 5)
    first = simulate(schedule, costs)
    again = simulate(schedule, costs_from_timeline(first))
    assert again.events == first.events


def test_large_pipeline_simulates_in_under_a_second():
    # K=128, M=1024: 262,144 actions. CPU time, so a busy machine does not fail it.
    for schedule in (gpipe(128, 1024), one_f_one_b(128, 1024)):
        started = time.process_time()
        timeline = simulate(schedule)
        elapsed = time.process_time() - started
        assert elapsed < 1.0
        assert timeline.makespan == 2 * (1024 + 127)


def test_empty_device_lists_are_an_invalid_schedule_not_a_hang():
    with pytest.raises(ScheduleError, match="0F0 is missing"):
        simulate(Schedule("empty", [[], []], 1))
