"""The critical path of a timeline: which actions and waits set a step's length."""

from __future__ import annotations

import pytest

from gpipe.analysis import Costs, Event, Timeline, Transfer, critical_path, simulate
from gpipe.schedule import Action, gpipe, interleaved, one_f_one_b, zb_h1


def _event(text: str, start: float, end: float) -> Event:
    kind_at = next(i for i, c in enumerate(text) if c.isalpha())
    return Event(Action(text[kind_at], int(text[:kind_at]), int(text[kind_at + 1 :])), start, end)


@pytest.mark.parametrize(
    ("name", "schedule"),
    [
        ("gpipe", gpipe(4, 8)),
        ("1f1b", one_f_one_b(4, 8)),
        ("interleaved", interleaved(4, 8, virtual_stages=2)),
        ("zb-h1", zb_h1(4, 8)),
    ],
)
def test_the_path_of_a_simulated_step_is_the_step_itself(name: str, schedule: object) -> None:
    weight = 1.0 if name == "zb-h1" else 0.0
    timeline = simulate(schedule, Costs(forward=1.0, backward=2.0, weight=weight, transfer=0.1))
    path = timeline.critical_path()
    assert path.length == pytest.approx(timeline.makespan)
    assert path.compute + path.device_wait + path.message_wait == pytest.approx(path.length)
    assert path.links[0].after == "start" and path.links[0].event.action == Action("F", 0, 0)
    assert path.links[-1].event.end == pytest.approx(timeline.start + timeline.makespan)
    # every hand-off on the path waited exactly the simulated transfer
    assert path.waits("message") == pytest.approx([0.1] * len(path.waits("message")))


def test_1f1b_puts_more_hand_offs_on_the_path_than_gpipe() -> None:
    """GPipe's path crosses the pipeline twice (2(K - 1) hand-offs), whatever M is; 1F1B's
    zig-zags between its stages, so each micro-batch adds hand-offs: why it is the schedule
    a slow link hurts most."""
    costs = Costs(forward=1.0, backward=2.0, transfer=0.1)
    fill_drain = simulate(gpipe(4, 8), costs).critical_path()
    one_one = simulate(one_f_one_b(4, 8), costs).critical_path()
    assert len(fill_drain.waits("message")) == 6
    assert len(one_one.waits("message")) == 16
    assert one_one.message_wait == pytest.approx(1.6)
    assert one_one.length == pytest.approx(33.0 + 1.6)


def test_a_measured_step_splits_into_actions_device_waits_and_hand_offs() -> None:
    """Two stages on two devices, M = 2, read back from the last action: 0B1 waited for its
    own device (0B0 ended after 1B1), 0B0 for 1B0's gradient, and so on to 0F0."""
    timeline = Timeline(
        [
            [_event("0F0", 0.0, 1.0), _event("0F1", 1.1, 2.1), _event("0B0", 5.0, 7.0),
             _event("0B1", 7.2, 9.2)],
            [_event("1F0", 1.5, 2.5), _event("1F1", 2.6, 3.6), _event("1B0", 3.6, 4.6),
             _event("1B1", 4.7, 6.7)],
        ]
    )  # fmt: skip
    path = critical_path(timeline)
    assert [str(link.event.action) for link in path.links] == [
        "0F0", "1F0", "1F1", "1B0", "0B0", "0B1"
    ]  # fmt: skip
    assert [link.after for link in path.links] == [
        "start", "message", "device", "device", "message", "device"
    ]  # fmt: skip
    assert [link.device for link in path.links] == [0, 1, 1, 1, 0, 0]
    assert [link.source for link in path.links[1:]] == [0, 1, 1, 1, 0]
    assert [link.wait for link in path.links] == pytest.approx([0.0, 0.5, 0.1, 0.0, 0.4, 0.2])
    assert path.device_wait == pytest.approx(0.3)
    assert path.message_wait == pytest.approx(0.9)
    assert path.compute == pytest.approx(8.0)
    assert path.length == pytest.approx(9.2)
    text = str(path)
    assert "6 actions, 9.2 s long" in text
    assert "(2, 0.45 s each)" in text and "(3, 0.1 s each)" in text


def test_a_stage_reading_past_its_neighbour_waits_for_the_stage_that_sent() -> None:
    """In a dataflow a stage may read a stage further back (a skip), as its transfers say:
    that sender, not the neighbour, is what the forward waited for when it ended last."""
    events = [
        [_event("0F0", 0.0, 3.0)],
        [_event("1F0", 0.5, 1.0)],
        [_event("2F0", 3.4, 4.0)],
    ]
    skip = Transfer("F", 2, 0, source=0, target=2, start=3.0, end=3.3, sender=0)
    path = Timeline(events, transfers=[skip]).critical_path()
    assert [str(link.event.action) for link in path.links] == ["0F0", "2F0"]
    assert path.links[1].after == "message" and path.links[1].source == 0
    assert path.message_wait == pytest.approx(0.4)
    without = Timeline(events).critical_path()  # no transfer recorded: the chain only
    assert [str(link.event.action) for link in without.links] == ["0F0", "1F0", "2F0"]


def test_an_empty_timeline_has_an_empty_path() -> None:
    path = Timeline([[], []]).critical_path()
    assert path.links == [] and path.length == 0.0 and path.compute == 0.0
    assert "0 actions" in str(path)


def test_a_measured_local_step_adds_up_to_its_makespan() -> None:
    import torch
    from torch import nn

    from gpipe import GPipe

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh())
    pipe = GPipe(model, balance=[2, 2], chunks=4, schedule="1f1b")
    pipe.train_step(torch.randn(8, 8), torch.randn(8, 8), nn.functional.mse_loss)
    timeline = pipe.timeline
    path = timeline.critical_path()
    assert path.length == pytest.approx(timeline.makespan)
    assert path.compute + path.device_wait + path.message_wait == pytest.approx(path.length)
    assert {str(link.event.action) for link in path.links} >= {"0F0", "0B3"}
    assert all(link.wait >= 0 for link in path.links)
