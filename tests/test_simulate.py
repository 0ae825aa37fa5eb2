"""The simulator reproduces the schedules' formulas: bubble, memory, transfer time."""

from __future__ import annotations

import time

import pytest

from gpipe.analysis import (
    Costs,
    Event,
    Timeline,
    bubble_formula,
    costs_from_timeline,
    paper_bubble,
    simulate,
)
from gpipe.schedule import (
    Action,
    Schedule,
    ScheduleError,
    gpipe,
    interleaved,
    make_schedule,
    one_f_one_b,
    zb_h1,
    zb_h2,
    zb_v,
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


def test_zb_h2_takes_as_long_as_zb_h1_alone_and_idles_nowhere_back_to_back():
    # One step alone cannot beat 3M+K-1: the last device waits K-1 forwards for its input.
    for k in range(1, 9):
        for m in range(k, 3 * k + 1):
            timeline = simulate(zb_h2(k, m), EQUAL)
            assert timeline.makespan == 3 * m + k - 1
            assert timeline.bubble == pytest.approx(bubble_formula("zb-h2", k, m, 1), abs=1e-12)
            if m >= 2 * k - 1:  # steady state reached: every device busy from start to end
                assert timeline.spans == [3 * m] * k
                assert timeline.steady_bubble == 0


def test_zb_h2_holds_2k_minus_1_microbatches_on_every_device():
    for k in range(1, 9):
        for m in range(1, 3 * k):
            assert simulate(zb_h2(k, m), EQUAL).peak_memory == [min(2 * k - 1, m)] * k


def test_zb_v_takes_the_least_time_one_step_can_take():
    # Units: one action on one of the 2K stages, half a device's share. The last device
    # waits K-1 for its first input, then works 6M: (K-1)/(6M+K-1), half of ZB-H1's.
    for k in range(1, 9):
        for m in range(k, 3 * k + 1):
            timeline = simulate(zb_v(k, m), EQUAL)
            assert timeline.makespan == 6 * m + k - 1
            assert timeline.bubble == pytest.approx((k - 1) / (6 * m + k - 1), abs=1e-12)
            assert timeline.bubble == pytest.approx(bubble_formula("zb-v", k, m, 2), abs=1e-12)
            # Back to back: with M >= 2K-1 the paper's order idles nowhere; the greedy
            # one for fewer has device d idle K-1-d (it keeps each pair's messages in order)
            if m >= 2 * k - 1:
                assert timeline.spans == [6 * m] * k
            else:
                assert timeline.spans == [6 * m + k - 1 - d for d in range(k)]


def test_zb_v_holds_1f1b_memory_on_every_device():
    # 2K stage-micro-batches of half a device's share each: 1F1B's K micro-batches.
    for k in range(1, 9):
        for m in range(1, 3 * k):
            assert simulate(zb_v(k, m), EQUAL).peak_memory == [min(2 * k, 2 * m)] * k


def test_zb_v_is_faster_than_1f1b_and_zb_h1_on_the_same_model():
    # The same model: a 1F1B stage is two zb-v stages, so F = B = W = 2 there, 1 in zb-v.
    whole = Costs(forward=2, backward=2, weight=2)
    for k, m in [(4, 8), (4, 16), (8, 16)]:
        v = simulate(zb_v(k, m), EQUAL).makespan
        assert v == 6 * m + k - 1
        assert simulate(zb_h1(k, m), whole).makespan == 2 * (3 * m + k - 1) > v
        assert simulate(one_f_one_b(k, m), whole).makespan == 6 * (m + k - 1) > v


@pytest.mark.parametrize(
    ("f", "b", "w"), [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 0.5), (2, 3, 1), (3, 1, 0.5)]
)
def test_idle_time_back_to_back_is_the_zero_bubble_papers_formula(f, b, w):
    # Qi et al. 2024, table 2: 1F1B (p-1)(F+B+W), ZB-H1 (p-1)(F+B-W), ZB-H2 (p-1)(F+B-2W).
    costs = Costs(forward=f, backward=b, weight=w)
    for k in range(1, 7):
        for m in range(2 * k - 1, 3 * k + 1):
            for name in ("1f1b", "zb-h1", "zb-h2"):
                timeline = simulate(make_schedule(name, k, m), costs)
                idle = max(timeline.spans) - m * (f + b + w)
                assert idle == pytest.approx(paper_bubble(name, k, m, f, b, w)), (name, k, m)


def test_zero_bubble_papers_headline_figures():
    # Qi et al. 2024 with T_F = T_B = T_W, steps back to back: bubble rate (bubble over
    # work) 1F1B (p-1)/m, ZB-H1 (p-1)/3m, ZB-H2 0; activation memory against 1F1B: 1x,
    # 1x, (2p-1)/p ("2x"); ZB-V 1x at zero bubble with 2 chunks of half a stage each
    # (the paper's ZB-V idles nowhere steps back to back; ours keeps each pair's message
    # order and so idles K-1-d on device d, though one step alone takes no longer).
    k, m = 4, 12
    work = 3 * m
    timelines = {name: simulate(make_schedule(name, k, m), EQUAL) for name in ("1f1b", "zb-h1")}
    timelines["zb-h2"] = simulate(zb_h2(k, m), EQUAL)
    rate = {n: (max(t.spans) - work) / work for n, t in timelines.items()}
    assert rate == {"1f1b": (k - 1) / m, "zb-h1": (k - 1) / (3 * m), "zb-h2": 0}
    peak = {n: max(t.peak_memory) for n, t in timelines.items()}
    assert peak == {"1f1b": k, "zb-h1": k, "zb-h2": 2 * k - 1}
    v = simulate(zb_v(k, m), EQUAL)
    assert max(v.peak_memory) / 2 == k  # in whole-stage units
    assert v.makespan == 2 * work + k - 1


def test_steady_bubble_measures_each_device_from_its_own_start():
    timeline = simulate(zb_h1(3, 4), EQUAL)
    assert timeline.spans == [14, 13, 12]
    assert timeline.steady_bubble == pytest.approx(1 - 36 / (3 * 14))
    assert Timeline([[], []]).steady_bubble == 0.0


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


def test_large_pipeline_simulates_without_blowing_up():
    # K=128, M=1024: 262,144 actions, 0.1-0.15 s of CPU each. The bound only catches a
    # hang or a cost that grows faster than the actions (over 60x the usual time); the
    # speed target is benchmarks/simulate.py's.
    for schedule in (gpipe(128, 1024), one_f_one_b(128, 1024)):
        started = time.process_time()
        timeline = simulate(schedule)
        elapsed = time.process_time() - started
        assert elapsed < 10.0
        assert timeline.makespan == 2 * (1024 + 127)


def test_empty_device_lists_are_an_invalid_schedule_not_a_hang():
    with pytest.raises(ScheduleError, match="0F0 is missing"):
        simulate(Schedule("empty", [[], []], 1))
