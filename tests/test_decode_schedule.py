"""Generation as schedule data: the decode schedule's wrap-around through the validator, the
lowering and the simulator (issue 41's schedule part; the runtime comes later)."""

from __future__ import annotations

import inspect
import textwrap

import pytest

from gpipe.analysis import Costs, simulate
from gpipe.schedule import (
    Action,
    Schedule,
    ScheduleError,
    decode,
    dependencies,
    format_grid,
    v_shape,
    validate,
)
from gpipe.schedule.lowering import lower, replay

FORWARDS = Costs(forward=1, backward=0, activation_bytes=0)  # one unit a forward, no memory


def test_the_docstring_grid_is_the_schedules_own() -> None:
    docstring = textwrap.dedent(inspect.getdoc(decode) or "")
    assert textwrap.indent(format_grid(decode(2, 2, 3)), "    ") in docstring


def test_a_lanes_next_token_waits_for_the_last_stage_to_sample_its_previous_one() -> None:
    assert dependencies(Action.parse("0F5"), 4, wrap=3) == (Action.parse("3F2"),)
    assert dependencies(Action.parse("0F2"), 4, wrap=3) == ()  # a first token
    assert dependencies(Action.parse("0F5"), 4) == ()  # training: no wrap
    timeline = simulate(decode(3, 2, 4), FORWARDS)
    end = {e.action: e.end for device in timeline.events for e in device}
    for device in timeline.events:
        for event in device:
            action = event.action
            if action.stage == 0 and action.microbatch >= 2:
                assert event.start >= end[Action("F", 2, action.microbatch - 2)]


@pytest.mark.parametrize("virtual", [1, 2])
def test_every_decode_validates_and_replays_under_nccls_rules(virtual: int) -> None:
    for k in range(1, 5):
        for lanes in range(1, 2 * k * virtual + 2):
            for tokens in (1, 2, 4):
                layouts = [None] if virtual == 1 else [None, v_shape(k)]
                for placement in layouts:
                    schedule = decode(k, lanes, tokens, virtual_stages=virtual, placement=placement)
                    validate(schedule)
                    assert schedule.forward_only and schedule.wrap == lanes
                    assert replay(lower(schedule)) is None, (k, lanes, tokens, placement)


def test_lanes_keep_the_pipe_full_where_one_lane_keeps_one_stage_busy() -> None:
    # T tokens for L lanes on K stages, one unit a forward: T·max(L, K) + min(L, K) - 1,
    # so each device is busy T·L of it: 1/K with one lane, all of the steady state from L = K.
    for k in (2, 4, 8):
        for lanes in (1, 2, k, 2 * k):
            tokens = 8
            timeline = simulate(decode(k, lanes, tokens), FORWARDS)
            assert timeline.makespan == tokens * max(lanes, k) + min(lanes, k) - 1
            assert 1 - timeline.bubble == pytest.approx(tokens * lanes / timeline.makespan)
    assert 1 - simulate(decode(4, 1, 8), FORWARDS).bubble == pytest.approx(1 / 4)


def test_the_token_goes_back_from_the_last_device_to_the_first_as_a_message() -> None:
    schedule = decode(3, 3, 2)
    lowered = lower(schedule)
    last = [str(op) for batch in lowered.batches(2) for op in batch.ops]
    first = [str(op) for batch in lowered.batches(0) for op in batch.ops]
    for i in range(3):  # each lane's first token, sampled on device 2, read by 0F(i + 3)
        assert f"send act 0<-2:{i + 3} to 0" in last
        assert f"recv act 0<-2:{i + 3} from 2" in first
    timeline = simulate(schedule, Costs(forward=1, backward=0, transfer=0.5))
    tokens = [t for t in timeline.transfers if t.stage == 0]
    assert [(t.source, t.target, t.nbytes) for t in tokens] == [(2, 0, 0)] * 3


def test_the_csv_form_keeps_the_wrap() -> None:
    schedule = decode(2, 3, 2)
    text = schedule.to_csv()
    assert "# wrap: 3" in text
    assert Schedule.from_csv(text) == schedule


def test_an_order_that_reads_a_token_before_it_is_sampled_deadlocks_and_says_where() -> None:
    # One device: 0F1 (lane 0's second token) before 0F0 has gone through stage 1.
    actions = [[Action.parse(t) for t in ["0F0", "0F1", "1F0", "1F1"]]]
    with pytest.raises(ScheduleError, match="0F1 on device 0 waits for 1F0"):
        validate(Schedule("hand", actions, 2, 2, (0, 0), wrap=1))
    validate(Schedule("hand", [[actions[0][i] for i in (0, 2, 1, 3)]], 2, 2, (0, 0), wrap=1))


def test_bad_decode_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="lanes must be >= 1, got 0"):
        decode(2, 0, 4)
    with pytest.raises(ValueError, match="tokens must be >= 1, got 0"):
        decode(2, 1, 0)
    with pytest.raises(ValueError, match="must give each of the 2 devices 2"):
        decode(2, 1, 1, virtual_stages=2, placement=(0, 0, 0, 1))
    with pytest.raises(ValueError, match="wrap must be >= 0"):
        Schedule("hand", [[Action.parse("0F0")]], 1, wrap=-1)


def test_a_pipe_refuses_a_decode_schedule_for_training() -> None:
    from torch import nn

    from gpipe import GPipe

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"is a decode \(wrap=2\).*training schedule"):
        GPipe(model, [1, 1], devices=["cpu"] * 2, chunks=4, schedule=decode(2, 2, 2))
