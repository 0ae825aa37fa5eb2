"""The validator accepts every generated schedule and explains, on the grid, what it rejects."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpipe.analysis import simulate
from gpipe.schedule import (
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    communication,
    gpipe,
    interleaved,
    make_schedule,
    one_f_one_b,
    run_in_steps,
    v_shape,
    validate,
    zb_h1,
)
from gpipe.schedule.communication import keeps_pair_order
from gpipe.schedule.lowering import lower, replay


def schedule_of(*devices: str, microbatches: int, **kwargs) -> Schedule:
    """A hand-written schedule: one string of action texts per device."""
    actions = [[Action.parse(text) for text in device.split()] for device in devices]
    return Schedule("hand", actions, microbatches, **kwargs)


def rejection(schedule: Schedule) -> str:
    with pytest.raises(ScheduleError) as error:
        validate(schedule)
    return str(error.value)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
def test_accepts_every_one_stage_per_device_schedule(name):
    for stages in range(1, 9):
        for microbatches in range(1, 17):
            validate(make_schedule(name, stages, microbatches))


def test_accepts_interleaved_for_every_microbatch_count_and_virtual_stage_count():
    for stages in range(1, 9):
        for microbatches in range(1, 17):
            for virtual_stages in range(1, 4):
                validate(interleaved(stages, microbatches, virtual_stages=virtual_stages))


def test_generated_schedules_finish_in_lock_step_with_every_action_run_once():
    schedule = zb_h1(4, 6)
    steps = run_in_steps(schedule)
    assert steps.finished(schedule)
    ran = [(d, p) for row in steps.rows for d, p in enumerate(row) if p is not None]
    assert len(ran) == len(set(ran)) == len(schedule) == 4 * 6 * 3


def test_rejects_a_missing_backward_naming_the_device_that_should_run_it():
    schedule = schedule_of("0F0 0F1 0B0 0B1", "1F0 1B0 1F1", microbatches=2)
    message = rejection(schedule)
    assert "1B1 is missing: device 1 never runs it" in message
    assert "step   0     1" in message


def test_rejects_a_duplicate_and_marks_its_second_occurrence():
    schedule = schedule_of("0F0 0F0 0B0", "1F0 1B0", microbatches=1)
    message = rejection(schedule)
    assert "0F0 appears twice on device 0: positions 0 and 1" in message
    assert ">0F0<" in message


def test_rejects_an_action_on_a_device_that_does_not_hold_its_stage():
    schedule = schedule_of("0F0 1F0 1B0 0B0", "", microbatches=1)
    message = rejection(schedule)
    assert "1F0 on device 0 (position 1) is on the wrong device: stage 1 lives on device 1" in (
        message
    )
    assert ">1F0<" in message


def test_rejects_microbatches_and_stages_out_of_range():
    message = rejection(schedule_of("0F0 0F5 0B0", microbatches=1))
    assert "0F5 on device 0 (position 1) has micro-batch 5, but micro-batches run 0..0" in message
    message = rejection(schedule_of("0F0 3F0 0B0", microbatches=1))
    assert "has stage 3, but stages run 0..0" in message


def test_rejects_a_split_schedule_missing_a_weight_gradient():
    schedule = schedule_of("0F0 0F1 0B0 0W0 0B1", microbatches=2)
    message = rejection(schedule)
    assert "0W1 is missing" in message
    assert "every B needs one" in message


def test_rejects_a_deadlock_showing_who_waits_for_whom_on_the_grid():
    # Device 1 runs 1B1 before 1F1, so 1B1 can never start, and device 0 waits for it.
    schedule = schedule_of("0F0 0F1 0B1 0B0", "1F0 1B0 1B1 1F1", microbatches=2)
    message = rejection(schedule)
    assert (
        "deadlock: 0B1 on device 0 waits for 1B1, which never runs: device 1 is stuck at it; "
        "1B1 on device 1 waits for 1F1, which device 1 runs only later (position 3)"
    ) in message
    assert message.endswith(
        "\n".join(
            [
                " step   0      1",
                "    0   0F0",
                "    1   0F1    1F0",
                "    2          1B0",
                "stuck  >0B1<  >1B1<",
            ]
        )
    )


def test_rejects_a_cross_device_deadlock_cycle():
    # Device 0 waits for device 1's backward before sending the forward device 1 waits for.
    schedule = schedule_of("0F0 0B0 2F0 2B0", "1F0 3F0 3B0 1B0", microbatches=1, stages=4)
    message = rejection(schedule)
    assert (
        "deadlock: 0B0 on device 0 waits for 1B0, which never runs: device 1 is stuck before "
        "it, at 3F0; 3F0 on device 1 waits for 2F0, which never runs: device 0 is stuck "
        "before it, at 0B0"
    ) in message
    assert "stuck  >0B0<  >3F0<" in message


def test_simulating_an_invalid_schedule_raises_the_validators_error():
    schedule = schedule_of("0F0 0F1 0B1 0B0", "1F0 1B0 1B1 1F1", microbatches=2)
    with pytest.raises(ScheduleError, match="deadlock: 0B1 on device 0 waits for 1B1"):
        simulate(schedule)


def test_schedule_validate_method_delegates_to_the_validator():
    one_f_one_b(3, 3).validate()
    with pytest.raises(ScheduleError, match="is missing"):
        schedule_of("0F0", microbatches=1).validate()


@st.composite
def shuffled_schedules(draw: st.DrawFn) -> Schedule:
    """A generated schedule with one device's list reordered: valid or deadlocked."""
    name = draw(st.sampled_from(["gpipe", "1f1b", "zb-h1"]))
    schedule = make_schedule(name, draw(st.integers(1, 5)), draw(st.integers(1, 6)))
    device = draw(st.integers(0, schedule.devices - 1))
    actions = [list(d) for d in schedule.actions]
    actions[device] = draw(st.permutations(actions[device]))
    return Schedule(schedule.name, actions, schedule.microbatches)


@settings(max_examples=150, deadline=None)
@given(shuffled_schedules())
def test_validator_and_simulator_agree_on_which_orders_can_run(schedule):
    finishes = run_in_steps(schedule).finished(schedule)
    try:
        validate(schedule)
    except ScheduleError as error:
        if finishes:  # it runs in one process, but a pair's messages would cross
            assert "matched in order" in str(error)
            simulate(schedule)
        else:
            with pytest.raises(ScheduleError):
                simulate(schedule)
    else:
        assert finishes
        timeline = simulate(schedule)
        assert sum(len(events) for events in timeline.events) == len(schedule)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(1, 24), st.integers(1, 4))
def test_accepts_interleaved_for_random_sizes(stages, microbatches, virtual_stages):
    validate(interleaved(stages, microbatches, virtual_stages=virtual_stages))


def test_gpipe_reversed_backward_still_valid_and_forward_first_required():
    validate(gpipe(2, 2))
    message = rejection(schedule_of("0B0 0F0", microbatches=1))
    assert "0B0 on device 0 waits for 0F0, which device 0 runs only later (position 1)" in message


# -- messages between each pair of devices keep their order --------------------------------


def test_communication_lists_each_devices_sends_and_receives_in_action_order():
    schedule = one_f_one_b(2, 2)  # 0F0 0F1 0B0 0B1 / 1F0 1B0 1F1 1B1
    messages = communication(schedule)
    got = [[(m.direction, m.peer, *m.tag, str(m.action)) for m in d] for d in messages]
    assert got == [
        [
            ("send", 1, "act", 1, 0, "0F0"),
            ("send", 1, "act", 1, 1, "0F1"),
            ("recv", 1, "grad", 0, 0, "0B0"),
            ("recv", 1, "grad", 0, 1, "0B1"),
        ],
        [
            ("recv", 0, "act", 1, 0, "1F0"),
            ("send", 0, "grad", 0, 0, "1B0"),
            ("recv", 0, "act", 1, 1, "1F1"),
            ("send", 0, "grad", 0, 1, "1B1"),
        ],
    ]
    assert str(communication(schedule)[0][0]) == "activation for stage 1, micro-batch 0"


def test_communication_leaves_out_hand_offs_on_one_device():
    # zb-v's stages 1 and 2 share device 1: 1F0's output goes to 2F0 with no message.
    messages = communication(make_schedule("zb-v", 2, 1, virtual_stages=2))
    assert [str(m.action) for m in messages[1]] == ["1F0", "2F0", "2B0", "1B0"]
    assert [m.direction for m in messages[1]] == ["recv", "send", "recv", "send"]


def test_accepts_a_pair_of_devices_taking_messages_out_of_send_order():
    # V placement: device 0 sends device 1 both 0F's outputs and 3B's gradients. It sends
    # 0F1's output before 3B0's gradient, but device 1 runs 2B0 before 1F1. A transport
    # posting receives in action order would mismatch them; the lowering posts each
    # receive in the step its message is made, so both ends agree (torch's zbv and
    # dualpipev orders do this for K >= 4).
    schedule = schedule_of(
        "0F0 0F1 3F0 3B0 3F1 3B1 0B0 0B1",
        "1F0 2F0 2B0 1F1 2F1 2B1 1B0 1B1",
        microbatches=2,
        stages=4,
        placement=(0, 1, 1, 0),
    )
    assert not keeps_pair_order(schedule)
    validate(schedule)
    lowered = lower(schedule)
    assert replay(lowered) is None
    # device 1 posts its receive of 0F1's output in the step 0F1 runs, before 2B0 reads
    # 3B0's gradient: the pair's messages are matched in the order device 0 sends them.
    assert [str(b) for b in lowered.batches(1)][:3] == [
        "[recv act 1:0 from 0]",
        "[recv act 1:1 from 0]",
        "[send act 3:0 to 0]",
    ]


def fixed_v(name: str, v: int) -> int:
    """The stages per device a named schedule takes: its fixed count, else 1 (or v >= 2)."""
    fixed = getattr(SCHEDULES[name], "virtual_stages", None)
    if fixed is not None:
        return int(fixed)
    return max(v, 2) if getattr(SCHEDULES[name], "virtual", False) else 1


@settings(max_examples=120, deadline=None)
@given(
    st.sampled_from(sorted(SCHEDULES)),
    st.integers(1, 8),
    st.integers(1, 20),
    st.integers(1, 4),
)
def test_every_generated_schedule_lowers_to_programs_that_replay_under_nccl_rules(name, k, m, v):
    v = {"interleaved": v, "gpipe": v, "auto": min(v, 2)}.get(name, fixed_v(name, v))
    try:
        schedule = make_schedule(name, k, m, virtual_stages=v)
    except ValueError as error:  # a schedule that needs more micro-batches says so
        assert "micro-batches" in str(error) or "microbatches" in str(error)
        return
    validate(schedule)
    assert replay(lower(schedule)) is None


def test_zb_v_and_interleaved_lower_to_programs_that_replay_exhaustively():
    for k in range(1, 7):
        for m in range(1, 3 * k + 2):
            for schedule in (
                make_schedule("zb-v", k, m, virtual_stages=2),
                interleaved(k, m, virtual_stages=2),
                interleaved(k, m, virtual_stages=3),
                gpipe(k, m, virtual_stages=2, placement=v_shape(k)),
            ):
                validate(schedule)
                assert replay(lower(schedule)) is None, (schedule.name, k, m)
