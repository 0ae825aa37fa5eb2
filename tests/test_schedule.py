"""Schedule generators, their pictures, and the grid and CSV text forms."""

from __future__ import annotations

import inspect
import textwrap

import pytest

from gpipe.analysis import Costs, simulate
from gpipe.schedule import (
    SCHEDULES,
    Action,
    Schedule,
    dependencies,
    dualpipev,
    format_grid,
    from_csv,
    gpipe,
    interleaved,
    interleaved_zb,
    looped_bfs,
    make_schedule,
    one_f_one_b,
    to_csv,
    v_half,
    v_min,
    v_shape,
    validate,
    zb_h1,
    zb_h2,
    zb_v,
)
from gpipe.schedule.generate import round_sizes


def lists(schedule: Schedule) -> list[str]:
    """Each device's actions as one space-separated line of action texts."""
    return [" ".join(str(a) for a in device) for device in schedule.actions]


def unit_time_picture(schedule: Schedule) -> str:
    """The schedule as the generators' docstrings draw it: one column per unit of time."""
    weight = 1.0 if schedule.split_backward else 0.0
    timeline = simulate(schedule, Costs(forward=1, backward=1, weight=weight))
    width = max(len(str(a)) for _, a in schedule)
    lines = []
    for device, events in enumerate(timeline.events):
        cells = [""] * int(timeline.makespan)
        for event in events:
            cells[int(event.start)] = str(event.action)
        lines.append(f"{device}: " + " ".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(lines)


def test_gpipe_runs_every_forward_then_backwards_newest_first():
    assert lists(gpipe(2, 3)) == [
        "0F0 0F1 0F2 0B2 0B1 0B0",
        "1F0 1F1 1F2 1B2 1B1 1B0",
    ]


def test_1f1b_warms_up_k_minus_stage_minus_one_forwards_then_alternates():
    assert lists(one_f_one_b(3, 4)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]


def test_1f1b_with_fewer_microbatches_than_stages_warms_up_with_at_most_all_of_them():
    assert lists(one_f_one_b(4, 2)) == [
        "0F0 0F1 0B0 0B1",
        "1F0 1F1 1B0 1B1",
        "2F0 2F1 2B0 2B1",
        "3F0 3B0 3F1 3B1",
    ]


def test_interleaved_places_stage_s_on_device_s_mod_k():
    schedule = interleaved(2, 4, virtual_stages=2)
    assert schedule.stages == 4
    assert schedule.placement == (0, 1, 0, 1)
    assert lists(schedule) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


def test_interleaved_first_group_takes_the_microbatches_k_does_not_divide():
    # M = 3 on 2 devices: groups {0, 1, 2}; device 0 warms up 2·1 + 1·3 = 5 forwards.
    assert lists(interleaved(2, 3, virtual_stages=2)) == [
        "0F0 0F1 0F2 2F0 2F1 2F2 2B0 2B1 2B2 0B0 0B1 0B2",
        "1F0 1F1 1F2 3F0 3B0 3F1 3B1 3F2 3B2 1B0 1B1 1B2",
    ]


def test_interleaved_with_one_virtual_stage_is_1f1b():
    schedule = interleaved(3, 5, virtual_stages=1)
    assert schedule.actions == one_f_one_b(3, 5).actions
    assert schedule.name == "interleaved"


def test_zb_h1_defers_each_devices_weight_gradients_by_its_index():
    assert lists(zb_h1(3, 4)) == [
        "0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3",
        "1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3",
    ]


def test_zb_h2_warms_up_with_2k_minus_2k_minus_1_forwards_then_runs_without_a_gap():
    assert lists(zb_h2(3, 5)) == [
        "0F0 0F1 0F2 0F3 0F4 0B0 0W0 0B1 0W1 0B2 0W2 0B3 0W3 0B4 0W4",
        "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1W0 1B3 1W1 1B4 1W2 1W3 1W4",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2F4 2B4 2W0 2W1 2W2 2W3 2W4",
    ]


def test_zb_v_places_stage_d_and_2k_minus_1_minus_d_on_device_d():
    schedule = zb_v(3, 3)
    assert schedule.stages == 6
    assert schedule.placement == v_shape(3) == (0, 1, 2, 2, 1, 0)
    assert lists(schedule) == [
        "0F0 0F1 0F2 5F0 5B0 5F1 5B1 5F2 5B2 0B0 5W0 0B1 5W1 0B2 5W2 0W0 0W1 0W2",
        "1F0 1F1 1F2 4F0 4F1 4B0 4F2 4B1 1B0 4B2 1B1 4W0 1B2 4W1 1W0 4W2 1W1 1W2",
        "2F0 3F0 2F1 3F1 2F2 3F2 3B0 2B0 3B1 2B1 3B2 2B2 3W0 2W0 3W1 2W1 3W2 2W2",
    ]


def test_dualpipev_pairs_a_forward_with_a_full_backward_of_the_other_stage():
    assert lists(dualpipev(2, 4)) == [
        "0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3+3B1+3W1 3F2+0B0+0W0 3B2 3W2 3F3+0B1+0W1 3B3 3W3 "
        "0B2 0W2 0B3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 2W0 2F2+1B0+1W0 1F3+2B1+2W1 2F3+1B1+1W1 2B2 2W2 1B2 1W2 "
        "2B3 1B3 2W3 1W3",
    ]
    assert dualpipev(2, 4).placement == v_shape(2)
    with pytest.raises(ValueError, match=r"at least 2K = 4 micro-batches on 2 devices"):
        dualpipev(2, 3)


def test_dualpipev_docstring_picture_is_its_step_grid():
    # A fused action takes three units, too wide for a unit-time picture.
    docstring = textwrap.dedent(inspect.getdoc(dualpipev) or "")
    assert textwrap.indent(format_grid(dualpipev(2, 4)), "    ") in docstring


def test_gpipe_fill_drain_follows_any_placement():
    # What pipe(x) runs on a zb-v pipe: each device's stages in order, forwards then back.
    assert lists(gpipe(2, 2, virtual_stages=2, placement=v_shape(2))) == [
        "0F0 0F1 3F0 3F1 3B1 3B0 0B1 0B0",
        "1F0 1F1 2F0 2F1 2B1 2B0 1B1 1B0",
    ]
    with pytest.raises(ValueError, match=r"must give each of the 2 devices 2 of the 4 stages"):
        gpipe(2, 2, virtual_stages=2, placement=(0, 0, 0, 1))


def test_interleaved_cuts_uneven_micro_batches_into_even_rounds_the_larger_first():
    # As torch's ScheduleInterleaved1F1B: M // K rounds of sizes differing by at most one.
    assert round_sizes(4, 10) == [5, 5]
    assert round_sizes(4, 11) == [6, 5]
    assert round_sizes(2, 5) == [3, 2]
    assert round_sizes(4, 3) == [3]
    schedule = interleaved(2, 5, virtual_stages=2)
    assert lists(schedule)[0].split()[:6] == ["0F0", "0F1", "0F2", "2F0", "2F1", "2F2"]
    validate(schedule)
    # even rounds hold least: 12 on 4
    # devices for M = 10 (a first group of 6 held 13), 25 on 8 for M = 20 (27)
    assert max(simulate(interleaved(4, 10, virtual_stages=2)).peak_memory) == 12
    assert max(simulate(interleaved(8, 20, virtual_stages=2)).peak_memory) == 25


@pytest.mark.parametrize(
    ("generator", "schedule"),
    [
        (gpipe, gpipe(3, 4)),
        (one_f_one_b, one_f_one_b(3, 4)),
        (interleaved, interleaved(2, 4, virtual_stages=2)),
        (zb_h1, zb_h1(3, 4)),
        (zb_h2, zb_h2(3, 5)),
        (zb_v, zb_v(3, 3)),
        (interleaved_zb, interleaved_zb(3, 3, virtual_stages=2)),
        (looped_bfs, looped_bfs(2, 4, virtual_stages=2)),
        (v_half, v_half(2, 3)),
        (v_min, v_min(2, 3)),
    ],
    ids=[
        *("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v"),
        *("interleaved-zb", "looped-bfs", "v-half", "v-min"),
    ],
)
def test_docstring_picture_is_the_unit_time_simulation(generator, schedule):
    docstring = textwrap.dedent(inspect.getdoc(generator) or "")
    picture = textwrap.indent(unit_time_picture(schedule), "    ")
    assert picture in docstring


def test_make_schedule_knows_every_generator_by_name():
    assert sorted(SCHEDULES) == [
        "1f1b",
        "auto",
        "dualpipev",
        "gpipe",
        "interleaved",
        "interleaved-zb",
        "looped-bfs",
        "v-half",
        "v-min",
        "zb-h1",
        "zb-h2",
        "zb-v",
    ]
    for name in SCHEDULES:
        v = 2 if name in ("zb-v", "interleaved-zb", "v-half", "v-min", "dualpipev") else 1
        m = 4 if name == "dualpipev" else 3  # dualpipev needs M >= 2K
        assert make_schedule(name, 2, m, virtual_stages=v).name == name
    assert make_schedule("interleaved", 2, 4, virtual_stages=3).stages == 6


def test_make_schedule_tells_zb_v_to_take_two_stages_per_device():
    with pytest.raises(ValueError, match="virtual_stages=2"):
        make_schedule("zb-v", 2, 4)
    assert make_schedule("zb-v", 2, 4, virtual_stages=2).placement == (0, 1, 1, 0)


def test_make_schedule_passes_options_only_to_generators_that_take_them():
    with pytest.raises(ValueError, match=r"'zb-h1' takes no option 'memory_limit'"):
        make_schedule("zb-h1", 2, 4, memory_limit=3)
    assert make_schedule("auto", 2, 4, memory_limit=3).name == "auto"


def test_make_schedule_rejects_virtual_stages_for_one_stage_per_device_schedules():
    with pytest.raises(ValueError, match="schedule='interleaved'"):
        make_schedule("1f1b", 2, 4, virtual_stages=2)


def test_generators_reject_no_stages_or_microbatches():
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        zb_h1(2, 0)
    with pytest.raises(ValueError, match="virtual_stages must be >= 1"):
        interleaved(2, 2, virtual_stages=0)


def test_dependencies_follow_the_data_flow():
    assert dependencies(Action.parse("0F0"), 3) == ()
    assert dependencies(Action.parse("2F1"), 3) == (Action.parse("1F1"),)
    assert dependencies(Action.parse("1B0"), 3) == (Action.parse("1F0"), Action.parse("2B0"))
    assert dependencies(Action.parse("2B0"), 3) == (Action.parse("2F0"),)
    assert dependencies(Action.parse("1W4"), 3) == (Action.parse("1B4"),)


def test_grid_has_one_row_per_step_and_one_column_per_device():
    assert format_grid(one_f_one_b(2, 2)) == "\n".join(
        [
            "step   0     1",
            "   0   0F0",
            "   1   0F1   1F0",
            "   2         1B0",
            "   3   0B0   1F1",
            "   4         1B1",
            "   5   0B1",
        ]
    )


def test_schedule_prints_as_its_grid():
    schedule = zb_h1(2, 2)
    assert str(schedule) == format_grid(schedule)
    assert str(schedule).splitlines()[0] == "step   0     1"


def test_grid_marks_requested_cells_and_shows_where_devices_are_stuck():
    actions = [["0F0", "0B0"], ["1B0", "1F0"]]
    stuck = Schedule("stuck", [[Action.parse(a) for a in d] for d in actions], 1)
    assert format_grid(stuck, mark=[(1, 0)]) == "\n".join(
        [
            " step   0     1",
            "    0   0F0",
            "stuck   0B0  >1B0<",
        ]
    )


def test_csv_round_trip_is_exact_for_every_schedule():
    for schedule in [
        gpipe(3, 2),
        one_f_one_b(4, 6),
        interleaved(3, 7, virtual_stages=3),
        zb_h1(4, 5),
        zb_v(3, 4),
        dualpipev(3, 7),
    ]:
        text = to_csv(schedule)
        assert from_csv(text) == schedule
        assert Schedule.from_csv(schedule.to_csv()) == schedule


def test_csv_writes_metadata_comments_then_one_row_per_device():
    assert to_csv(one_f_one_b(2, 2)) == (
        "# name: 1f1b\n"
        "# microbatches: 2\n"
        "# stages: 2\n"
        "# placement: 0 1\n"
        "0F0,0F1,0B0,0B1\n"
        "1F0,1B0,1F1,1B1\n"
    )


def test_csv_without_metadata_infers_sizes_and_placement():
    schedule = from_csv("0F0,2F0,2B0,0B0\n1F0,3F0,3B0,1B0,\n", name="hand")
    assert schedule.name == "hand"
    assert schedule.microbatches == 1
    assert schedule.stages == 4
    assert schedule.placement == (0, 1, 0, 1)
    assert schedule.actions[1][-1] == Action.parse("1B0")


def test_csv_name_argument_overrides_the_name_line():
    assert from_csv(to_csv(gpipe(1, 1)), name="mine").name == "mine"


def test_csv_rejects_a_stage_no_row_runs_without_a_placement_line():
    with pytest.raises(ValueError, match="stage 1: no row run it"):
        from_csv("# stages: 2\n0F0,0B0\n")


def test_csv_rejects_unparsable_cells():
    with pytest.raises(ValueError, match="cannot parse action 'XF0'"):
        from_csv("0F0,XF0\n")
