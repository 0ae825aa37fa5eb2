"""A fused action (a forward and a backward issued together, DualPipeV's) is drawn as one
action made of its parts, and every reader of a timeline takes it as such.

The hand schedule: device 0 runs stage 0 plainly; device 1 fuses 1F1 with 1B0 and 1F2 with
1B1. With F = 1 and B = 2 its actions run 1F0 [1, 2], 1F1+1B0 [2, 5], 1F2+1B1 [5, 8] and
1B2 [8, 10].
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from gpipe.analysis import Costs, Event, Timeline, costs_from_timeline, simulate
from gpipe.analysis.chart import format_chart
from gpipe.analysis.held import held_after, held_memory
from gpipe.schedule import FUSED, Action, Schedule, make_schedule

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FORWARD_COLOR, BACKWARD_COLOR, WEIGHT_COLOR = "#4c72b0", "#55a868", "#dd8452"
FORWARD_BLOCK, BACKWARD_BLOCK, WEIGHT_BLOCK = "\x1b[97;44m", "\x1b[30;42m", "\x1b[30;43m"
RESET = "\x1b[0m"


def hand(weight: bool = False) -> Schedule:
    """The module docstring's schedule; with ``weight``, W split off B, each fused pair
    carrying its backward's W."""
    if weight:
        first = "0F0 0F1 0F2 0B0 0W0 0B1 0W1 0B2 0W2"
        second = "1F0 1F1+1B0+1W0 1F2+1B1+1W1 1B2 1W2"
    else:
        first, second = "0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1+1B0 1F2+1B1 1B2"
    rows = [[Action.parse(text) for text in row.split()] for row in (first, second)]
    return Schedule("hand", rows, 3)


def dualpipev() -> Schedule:
    return make_schedule("dualpipev", 4, 8, virtual_stages=2)


def fused_count(timeline: Timeline) -> int:
    return sum(e.kind == FUSED for device in timeline.events for e in device)


def test_chart_draws_a_fused_action_as_one_box_of_its_forward_then_its_backward() -> None:
    chart = format_chart(simulate(hand(), Costs(forward=1, backward=2)), width=52, color=False)
    rows = chart.splitlines()
    assert rows[1] == "0 |F0>>F1>>F2>>        B0<<<<<<    B1<<<<<<B2<<<<<<|"
    assert rows[2] == "1 |    F0>>F1>>>>+B0<<<F2>>>>+B1<<<B2<<<<<<        |"
    assert "F3>>>+B1<< forward of micro-batch 3 fused with backward of 1" in chart
    assert "f b w +: an action under half a character" in chart


def test_colored_chart_paints_each_half_of_a_fused_box_in_its_parts_colour() -> None:
    chart = format_chart(simulate(hand(), Costs(forward=1, backward=2)), width=52, color=True)
    device_1 = chart.splitlines()[2]
    assert f"{FORWARD_BLOCK}F1>>>>{RESET}{BACKWARD_BLOCK}+B0<<<{RESET}" in device_1
    assert f"{FORWARD_BLOCK}F2>>>>{RESET}{BACKWARD_BLOCK}+B1<<<{RESET}" in device_1


def test_chart_gives_a_fused_w_part_the_box_s_last_cell() -> None:
    timeline = simulate(hand(weight=True), Costs(forward=1, backward=1, weight=1))
    plain = format_chart(timeline, width=40, color=False)
    assert plain.splitlines()[2] == "1 |   F0>F1>>+B0<=F2>>+B1<=B2<W2=      |"
    colored = format_chart(timeline, width=40, color=True)
    assert f"{BACKWARD_BLOCK}+B0<{RESET}{WEIGHT_BLOCK}={RESET}" in colored


def test_chart_marks_a_fused_action_under_half_a_character_with_a_plus() -> None:
    fused = Action.parse("0F1+0B0")
    events = [
        [Event(Action("F", 0, 0), 0, 4), Event(fused, 5.0, 5.1), Event(Action("B", 0, 1), 6, 10)]
    ]
    row = format_chart(Timeline(events, "cost"), width=14, color=False).splitlines()[1]
    assert row == "0 |F0>> +B1<<|"


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Figure]:
    """Every figure saved while the test runs, to read its artists rather than pixels."""
    from matplotlib.figure import Figure

    saved: list[Figure] = []
    original = Figure.savefig

    def keep(figure: Figure, *args: Any, **kwargs: Any) -> None:
        saved.append(figure)
        original(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def legend_texts(figure: Figure) -> list[str]:
    legend = figure.axes[0].get_legend()
    assert legend is not None
    return [text.get_text() for text in legend.get_texts()]


def row_slices(figure: Figure, device: int) -> dict[tuple[float, float], str]:
    """(start, end) -> colour of each filled slice on ``device``'s Gantt row."""
    from matplotlib.colors import to_hex

    found = {}
    for collection in figure.axes[0].collections:
        if collection.get_gid() == "fused":
            continue
        red, green, blue, _ = np.asarray(collection.get_facecolor())[0].tolist()
        color = to_hex((red, green, blue))
        for path in collection.get_paths():
            box = path.get_extents()
            if box.y0 == pytest.approx(device - 0.4):
                found[(round(box.x0, 9), round(box.x1, 9))] = color
    return found


def test_plot_draws_a_fused_action_as_one_bar_in_halves_with_its_legend(
    tmp_path: Path, figures: list[Figure]
) -> None:
    out = simulate(hand(), Costs(forward=1, backward=2)).plot(tmp_path / "hand.png")
    assert out.stat().st_size > 0
    [figure] = figures
    assert legend_texts(figure) == ["forward", "backward", "F+B (fused)"]
    gantt = figure.axes[0]
    assert {"F1+B0", "F2+B1"} <= {text.get_text() for text in gantt.texts}
    # One outline per fused action, around the whole pair, on device 1's row.
    [outline] = [c for c in gantt.collections if c.get_gid() == "fused"]
    boxes = [path.get_extents() for path in outline.get_paths()]
    assert [(b.x0, b.x1, b.y0, b.y1) for b in boxes] == [(2, 5, 0.6, 1.4), (5, 8, 0.6, 1.4)]
    # Under it, halves: F from the pair's start, B to its end, each 1.5 long.
    slices = row_slices(figure, 1)
    assert slices[(2, 3.5)] == slices[(5, 6.5)] == FORWARD_COLOR
    assert slices[(3.5, 5)] == slices[(6.5, 8)] == BACKWARD_COLOR


def test_plot_draws_a_fused_w_part_as_a_thin_slice_at_the_end(
    tmp_path: Path, figures: list[Figure]
) -> None:
    simulate(hand(weight=True), Costs(forward=1, backward=2, weight=1)).plot(tmp_path / "w.png")
    [figure] = figures
    # 1F1+1B0+1W0 runs [2, 6]: F and B halves of 1.6, the W the last 0.8.
    slices = row_slices(figure, 1)
    assert slices[(2, 3.6)] == FORWARD_COLOR
    assert slices[(3.6, 5.2)] == BACKWARD_COLOR
    assert slices[(5.2, 6)] == WEIGHT_COLOR
    assert legend_texts(figure) == ["forward", "backward", "weight gradient", "F+B (fused)"]


def test_perfetto_holds_one_slice_per_fused_action_listing_its_parts() -> None:
    trace = simulate(hand(), Costs(forward=1, backward=2)).to_chrome_trace()
    fused = [e for e in trace["traceEvents"] if e.get("cat") == "fused"]
    assert [(e["name"], e["ts"], e["dur"], e["tid"]) for e in fused] == [
        ("F1+B0", 2000.0, 3000.0, 1),
        ("F2+B1", 5000.0, 3000.0, 1),
    ]
    assert [e["args"]["parts"] for e in fused] == [["1F1", "1B0"], ["1F2", "1B1"]]
    assert fused[0]["args"]["stage"] == 1 and fused[0]["args"]["microbatch"] == 1
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 6 + 4  # one per listed action: the parts are not slices of their own


@pytest.mark.parametrize("recorded", [True, False], ids=["left", "walked"])
def test_held_memory_rises_for_a_fused_forward_and_falls_for_its_backward(
    recorded: bool,
) -> None:
    timeline = simulate(hand(), Costs(forward=1, backward=2))
    if not recorded:  # a timeline saved without ``left`` is walked by the same rule
        timeline = Timeline(
            [[Event(e.action, e.start, e.end, e.memory) for e in d] for d in timeline.events],
            "cost",
        )
    device_1 = timeline.events[1]
    assert held_after(device_1) == [1, 1, 1, 0]
    times, held, kept = held_memory(timeline)[1]
    assert times == [0.0, 1.0, 2.0, 2.0, 5.0, 5.0, 8.0, 8.0, 10.0, 12.0]
    assert held == [0.0, 1, 1, 2, 1, 2, 1, 1, 0, 0]
    assert kept == [0.0, 1, 1, 2, 1, 2, 1, 1, 0, 0]


def test_per_kind_durations_count_a_fused_action_under_its_own_kind() -> None:
    timeline = simulate(hand(), Costs(forward=1, backward=2, fused=0.8))
    assert timeline.durations("F") == [[1.0, 1.0, 1.0], [1.0]]
    assert timeline.durations("B") == [[2.0, 2.0, 2.0], [2.0]]
    assert timeline.durations(FUSED) == [[], pytest.approx([2.4, 2.4])]


@pytest.mark.parametrize("weight", [False, True], ids=["F+B", "F+B+W"])
def test_costs_from_timeline_recover_the_fused_factor(weight: bool) -> None:
    costs = Costs(forward=1, backward=2, weight=1 if weight else 0, fused=0.8)
    recovered = costs_from_timeline(simulate(hand(weight), costs))
    assert recovered.fused == pytest.approx(0.8, abs=1e-9)
    assert recovered.forward == [1.0, 1.0]
    assert recovered.backward == [2.0, 2.0]  # the fused pairs are left out of the medians
    assert recovered.weight == ([1.0, 1.0] if weight else [0.0, 0.0])
    again = simulate(hand(weight), recovered)
    assert again.makespan == pytest.approx(simulate(hand(weight), costs).makespan)


def test_costs_from_timeline_clamp_the_fused_factor_and_default_it() -> None:
    slow = [
        [Event(Action("F", 0, 0), 0, 1), Event(Action("B", 0, 1), 1, 3)],
        [Event(Action.parse("0F1+0B0"), 3, 30)],
    ]
    assert costs_from_timeline(Timeline(slow, "s")).fused == 2.0
    alone = [[Event(Action.parse("0F1+0B0"), 0, 3)]]  # no plain F or B to compare it with
    assert costs_from_timeline(Timeline(alone, "s")).fused == 1.0


def test_critical_path_runs_through_a_fused_action_as_one_link() -> None:
    timeline = simulate(hand(), Costs(forward=1, backward=2, transfer=0.1))
    path = timeline.critical_path()
    assert path.length == pytest.approx(timeline.makespan)
    texts = [str(link.event.action) for link in path.links]
    assert "1F1+1B0" in texts or "1F2+1B1" in texts
    assert path.compute + path.device_wait + path.message_wait == pytest.approx(path.length)
    assert path.waits("message") == pytest.approx([0.1] * len(path.waits("message")))


def test_every_drawing_of_dualpipev_shows_its_fused_actions(
    tmp_path: Path, figures: list[Figure]
) -> None:
    schedule = dualpipev()
    listed = sum(a.kind == FUSED for row in schedule.actions for a in row)
    assert listed > 0
    timeline = simulate(schedule, Costs(forward=1, backward=2, fused=0.8))
    assert fused_count(timeline) == listed
    assert "+B" in format_chart(timeline, width=160, color=False)
    trace = timeline.to_chrome_trace(tmp_path / "dualpipev.json")
    assert sum(e.get("cat") == "fused" for e in trace["traceEvents"]) == listed
    timeline.plot(tmp_path / "dualpipev.png")
    assert "F+B (fused)" in legend_texts(figures[0])
    assert costs_from_timeline(timeline).fused == pytest.approx(0.8, abs=1e-9)
    assert timeline.critical_path().length == pytest.approx(timeline.makespan)
