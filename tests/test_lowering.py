"""The lowering: every schedule's sends and receives placed as data, checked under NCCL's rules."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from hypothesis import event, given, settings

from conftest import valid_reorder, valid_reorders
from gpipe.schedule import Schedule, ScheduleError, make_schedule, validate
from gpipe.schedule.lowering import RECV, SEND, Batch, Flow, Lowered, Op, lower, replay
from gpipe.schedule.validate import check_lowered
from lowering_scenarios import naive

BUILT_IN = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v"]


def test_one_f_one_b_on_two_devices_lowers_to_the_documented_program() -> None:
    lowered = lower(make_schedule("1f1b", 2, 2))
    assert str(lowered).splitlines() == [
        "device 0: 0F0 [send act 1:0 to 1] 0F1 [send act 1:1 to 1] [recv grad 0:0 from 1] 0B0 "
        "[recv grad 0:1 from 1] 0B1",
        "device 1: [recv act 1:0 from 0] 1F0 [recv act 1:1 from 0] 1B0 [send grad 0:0 to 0] 1F1 "
        "1B1 [send grad 0:1 to 0]",
    ]


def test_receives_posted_late_wait_for_the_step_their_reader_runs() -> None:
    # How gpipe posted before (kept for benchmarks/handoff.py): each message at both ends in
    # the step its reader runs, the send deferred until then too.
    lowered = lower(make_schedule("1f1b", 2, 2), receives="late")
    assert str(lowered).splitlines() == [
        "device 0: 0F0 [send act 1:0 to 1] 0F1 [send act 1:1 to 1, recv grad 0:0 from 1] 0B0 "
        "[recv grad 0:1 from 1] 0B1",
        "device 1: [recv act 1:0 from 0] 1F0 1B0 [send grad 0:0 to 0, recv act 1:1 from 0] 1F1 "
        "1B1 [send grad 0:1 to 0]",
    ]
    for name in ("interleaved", "zb-v", "dualpipev"):
        schedule = make_schedule(name, 4, 8, virtual_stages=2)
        assert replay(lower(schedule, receives="late")) is None
    with pytest.raises(ValueError, match="receives must be 'early' or 'late', got 'soon'"):
        lower(make_schedule("1f1b", 2, 2), receives="soon")


def test_each_pair_posts_its_messages_in_the_same_order_at_both_ends() -> None:
    lowered = lower(make_schedule("interleaved", 4, 8, virtual_stages=2))
    for a in range(4):
        for b in range(4):
            sent = [o.tag for x in lowered.batches(a) for o in x.ops if o == Op(SEND, b, o.tag)]
            taken = [o.tag for x in lowered.batches(b) for o in x.ops if o == Op(RECV, a, o.tag)]
            assert sent == taken, (a, b)


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_built_in_schedule_runs_to_its_end_under_nccls_rules(name: str) -> None:
    checked = 0
    for k in range(2, 9):
        for m in range(1, 3 * k + 1):
            for v in (1, 2):
                try:
                    schedule = make_schedule(name, k, m, virtual_stages=v)
                except ValueError:
                    continue  # this schedule takes no such v (or m)
                lowered = lower(schedule)
                assert replay(lowered) is None, (name, k, m, v)
                check_lowered(lowered)
                checked += 1
    assert checked >= 7 * 3  # every k, m of at least one v


def test_the_auto_schedule_runs_to_its_end_under_nccls_rules() -> None:
    for k, m, v in [(2, 4, 1), (3, 5, 1), (4, 8, 2), (4, 12, 1)]:
        assert replay(lower(make_schedule("auto", k, m, virtual_stages=v))) is None


def test_sends_right_after_each_action_hang_interleaved_gpipe_and_the_check_says_where() -> None:
    # Device 1 sends stage 2's input back to device 0, which is still busy sending stage
    # 1's inputs: both sends wait for a receive posted behind the other's.
    schedule = make_schedule("gpipe", 2, 4, virtual_stages=2)
    stuck = replay(naive(schedule))
    assert stuck is not None
    assert any("device 0 is stuck in batch [send act 1:" in p for p in stuck.problems)
    assert any("device 1 is stuck in batch [send act 2:0 to 0]" in p for p in stuck.problems)
    with pytest.raises(ScheduleError, match="would hang when its messages are posted") as error:
        check_lowered(naive(schedule))
    assert ">" in str(error.value)  # the grid, with the stuck actions marked
    assert replay(lower(schedule)) is None  # posted in rounds, it runs


def test_a_program_whose_ends_disagree_on_order_is_refused_naming_both_tags() -> None:
    lowered = lower(make_schedule("gpipe", 2, 2))
    program = list(lowered.programs[0])
    batches = [i for i, item in enumerate(program) if isinstance(item, Batch)]
    a, b = program[batches[0]], program[batches[1]]
    program[batches[0]] = dataclasses.replace(b, after=a.after)  # type: ignore[arg-type]
    program[batches[1]] = dataclasses.replace(a, after=b.after)  # type: ignore[arg-type]
    swapped = Lowered(lowered.schedule, (tuple(program), lowered.programs[1]))
    stuck = replay(swapped)
    assert stuck is not None
    assert any("disagree on the order" in p for p in stuck.problems)


def test_a_dataflows_skip_goes_straight_to_its_reader_in_the_same_rounds() -> None:
    # stage 0 feeds stages 1 and 2 (a skip over stage 1), on 3 devices
    flow = Flow(sources=((-1,), (0,), (0, 1)), readers=((1, 2), (2,), ()))
    schedule = make_schedule("1f1b", 3, 3)
    lowered = lower(schedule, flow)
    assert replay(lowered) is None
    ops = [op for batch in lowered.batches(0) for op in batch.ops]
    assert Op(SEND, 2, ("act", 2, 0, 0)) in ops
    assert Op(RECV, 2, ("grad", 0, 0, 2)) in ops
    sends = [op for batch in lowered.batches(2) for op in batch.ops if op.direction == SEND]
    assert [op.tag for op in sends if op.peer == 0] == [("grad", 0, m, 2) for m in range(3)]


def test_hand_offs_between_stages_on_one_device_are_no_operations() -> None:
    lowered = lower(make_schedule("zb-v", 2, 1, virtual_stages=2))
    for device, batches in enumerate(lowered.batches(d) for d in range(lowered.schedule.devices)):
        assert all(op.peer != device for batch in batches for op in batch.ops)


@settings(max_examples=60, deadline=None)
@given(valid_reorders())
def test_any_schedule_the_validator_accepts_lowers_to_a_program_that_cannot_hang(
    schedule: Schedule,
) -> None:
    validate(schedule)  # every draw is accepted, so every example checks the lowering
    built_in = make_schedule(schedule.name, schedule.devices, schedule.microbatches)
    event("reordered" if schedule.actions != built_in.actions else "the built-in order")
    assert replay(lower(schedule)) is None


@pytest.mark.parametrize(
    ("name", "devices", "microbatches"), [("1f1b", 2, 2), ("zb-h1", 2, 1), ("gpipe", 3, 1)]
)
def test_the_reorder_strategy_makes_every_order_the_validator_accepts_and_no_other(
    name: str, devices: int, microbatches: int
) -> None:
    base = make_schedule(name, devices, microbatches)
    accepted = set()
    for rows in itertools.product(*(itertools.permutations(row) for row in base.actions)):
        try:
            validate(dataclasses.replace(base, actions=[list(row) for row in rows]))
        except ScheduleError:
            continue
        accepted.add(rows)
    rng = random.Random(0)
    made = {tuple(map(tuple, valid_reorder(base, rng.randrange).actions)) for _ in range(4000)}
    assert made == accepted
