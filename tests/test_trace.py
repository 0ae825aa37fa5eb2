"""Drawing timelines: terminal chart, PNG Gantt chart, Chrome trace."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gpipe.analysis import Event, Timeline
from gpipe.analysis.chart import format_chart
from gpipe.analysis.perfetto import to_chrome_trace
from gpipe.analysis.plot import plot
from gpipe.schedule.action import Action

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def fill_drain(
    devices: int,
    microbatches: int,
    forward: float = 1.0,
    backward: float = 1.0,
    weight: float = 0.0,
    unit: str = "cost",
    start: float = 0.0,
) -> Timeline:
    """GPipe's timeline worked out by hand: all forwards, then backwards newest first.

    Memory counts the micro-batches whose activations a device holds.
    """
    events: list[list[Event]] = []
    for d in range(devices):
        row = [
            Event(
                Action("F", d, i),
                start + (d + i) * forward,
                start + (d + i + 1) * forward,
                memory=i + 1,
            )
            for i in range(microbatches)
        ]
        drain = (
            start + (microbatches + devices - 1) * forward + (devices - 1 - d) * (backward + weight)
        )
        for j, i in enumerate(reversed(range(microbatches))):
            t = drain + j * (backward + weight)
            row.append(Event(Action("B", d, i), t, t + backward, i + 1))
            if weight:
                row.append(Event(Action("W", d, i), t + backward, t + backward + weight, i))
        events.append(row)
    return Timeline(events, unit, "gpipe")


def chart_rows(chart: str, devices: int) -> list[str]:
    return chart.splitlines()[1 : devices + 1]


def test_chart_labels_every_action_on_its_device_row() -> None:
    timeline = fill_drain(3, 4, backward=2.0)
    chart = format_chart(timeline, width=100, color=False)
    rows = chart_rows(chart, 3)
    for device, row in enumerate(rows):
        assert row.startswith(f"{device} |") and row.endswith("|")
        labels = re.findall(r"[FBW]\d+", row)
        assert labels == [f"F{i}" for i in range(4)] + [f"B{i}" for i in (3, 2, 1, 0)]


def test_chart_header_names_schedule_makespan_and_bubble() -> None:
    timeline = fill_drain(4, 8)  # 1 - 16/22 busy: bubble 3/11
    header = format_chart(timeline, width=80, color=False).splitlines()[0]
    assert header == ("gpipe: 4 devices, 8 micro-batches, makespan 22 cost, bubble 27.27%")


def test_chart_draws_whole_number_costs_at_a_whole_number_of_characters() -> None:
    # 76 columns available for a makespan of 22: 3 characters per cost unit, 66 in all.
    rows = chart_rows(format_chart(fill_drain(4, 8), width=80, color=False), 4)
    assert (
        rows[0]
        == "0 |"
        + "".join(f"F{i}>" for i in range(8))
        + " " * 18
        + "".join(f"B{i}<" for i in reversed(range(8)))
        + "|"
    )
    assert rows[3].startswith("3 |" + " " * 9 + "F0>F1>")


def test_chart_without_color_has_no_ansi_codes_and_fits_width() -> None:
    chart = format_chart(fill_drain(4, 8, weight=1.0), width=72, color=False)
    assert "\x1b" not in chart
    assert all(len(line) <= 72 for line in chart.splitlines())
    assert "W3" in chart


def test_chart_with_color_paints_each_kind_and_keeps_the_same_text() -> None:
    timeline = fill_drain(2, 2, weight=1.0)
    colored = format_chart(timeline, width=60, color=True)
    assert "\x1b[97;44mF0" in colored  # forward blocks on blue
    assert "\x1b[30;42mB1" in colored  # backward on green
    assert "\x1b[30;43mW1" in colored  # weight gradient on yellow
    plain = format_chart(timeline, width=60, color=False)
    assert ANSI.sub("", colored).splitlines()[1:3] == plain.splitlines()[1:3]


def test_chart_color_defaults_off_when_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    # pytest captures stdout, so it is not a TTY here.
    assert "\x1b" not in format_chart(fill_drain(2, 2), width=60)


class _Terminal:
    def isatty(self) -> bool:
        return True


def test_chart_color_defaults_on_for_a_terminal_unless_no_color(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("sys.stdout", _Terminal())
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert "\x1b[" in format_chart(fill_drain(2, 2), width=60)
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\x1b" not in format_chart(fill_drain(2, 2), width=60)


def test_chart_shows_actions_narrower_than_a_character() -> None:
    # 16 x 64 of 1 ms actions in 40 columns: every cell holds several actions.
    timeline = fill_drain(16, 64, forward=1e-3, backward=1e-3, unit="s")
    rows = chart_rows(format_chart(timeline, width=45, color=False), 16)
    assert len(rows) == 16
    for row in rows:
        assert len(row) == 45
        cells = row.split("|")[1]
        assert len(cells) == 40
        assert ">" in cells and "<" in cells  # forwards and backwards both visible


def test_chart_marks_a_lone_sliver_as_lowercase_kind() -> None:
    events = [[Event(Action("F", 0, 0), 0.0, 10.0), Event(Action("B", 0, 0), 99.9, 100.0)]]
    # 20 columns of 5 units: F0 fills two cells, B0 covers 2% of the last one.
    row = chart_rows(format_chart(Timeline(events, "cost"), width=24, color=False), 1)[0]
    assert row == "0 |F0                 b|"


def test_chart_of_measured_timeline_reads_milliseconds_from_its_start() -> None:
    timeline = fill_drain(2, 2, forward=0.01, backward=0.01, unit="s", start=5.0)
    chart = format_chart(timeline, width=60, color=False)
    assert "makespan 60 ms" in chart.splitlines()[0]
    assert chart_rows(chart, 2)[0].startswith("0 |F0")


def test_timeline_str_is_the_uncolored_chart() -> None:
    timeline = fill_drain(2, 3)
    text = str(timeline)
    assert text.startswith("gpipe: 2 devices, 3 micro-batches")
    assert "\x1b" not in text


FORWARD_RGB, BACKWARD_RGB = (76, 114, 176), (85, 168, 104)  # #4c72b0, #55a868


def bars(path: Path, rgb: tuple[int, int, int]) -> list[tuple[int, int]]:
    """Per band of rows holding ``rgb`` (a device's row), top down: the first and last
    column of that colour in the band's middle row."""
    import matplotlib.image

    image = (matplotlib.image.imread(path)[..., :3] * 255).round()
    mask = (image == rgb).all(axis=-1)
    rows = [r for r in range(mask.shape[0]) if mask[r].any()]
    bands = [[rows[0]]]
    for r in rows[1:]:
        if r == bands[-1][-1] + 1:
            bands[-1].append(r)
        else:
            bands.append([r])
    found = []
    for band in bands:
        columns = mask[band[len(band) // 2]].nonzero()[0]
        if columns.max() - columns.min() > 40:  # leaves out the legend's small swatch
            found.append((int(columns.min()), int(columns.max())))
    return found


def test_plot_draws_each_action_on_its_device_row_where_it_ran(tmp_path: Path) -> None:
    # device 0: F0 at [0, 1], idle, B0 at [3, 4]; device 1: F0 at [1, 2], B0 at [2, 3]
    events = [
        [Event(Action("F", 0, 0), 0, 1), Event(Action("B", 0, 0), 3, 4)],
        [Event(Action("F", 1, 0), 1, 2), Event(Action("B", 1, 0), 2, 3)],
    ]
    path = plot(Timeline(events, "cost", "gpipe"), tmp_path / "gantt.png")
    (f0, f1), (b1, b0) = bars(path, FORWARD_RGB), bars(path, BACKWARD_RGB)[::-1]
    # in time order F0 on device 0, F0 on device 1, B0 on 1, B0 on 0: one unit apart each,
    # so device 0 is idle for two units between its forward and its backward
    starts = [bar[0] for bar in (f0, f1, b1, b0)]
    unit = (starts[3] - starts[0]) / 3  # pixels per cost unit
    assert unit > 200
    assert all(abs(start - (starts[0] + i * unit)) <= 2 for i, start in enumerate(starts))
    widths = [bar[1] - bar[0] for bar in (f0, f1, b1, b0)]
    assert all(unit - 8 <= width <= unit for width in widths)  # minus the white edges


def test_plot_compare_and_memory_add_panels(tmp_path: Path) -> None:
    import matplotlib.image

    measured = fill_drain(4, 8, forward=0.011, backward=0.012, unit="s")
    predicted = fill_drain(4, 8, forward=0.01, backward=0.01)
    plain = matplotlib.image.imread(plot(predicted, tmp_path / "a.png"))
    both = matplotlib.image.imread(measured.plot(tmp_path / "b.png", compare=predicted))
    # b has a second Gantt panel and the memory panel (measured has memory > 0).
    assert both.shape[0] > plain.shape[0]
    assert both.shape[1] == plain.shape[1] == 1200
    assert len(bars(tmp_path / "a.png", FORWARD_RGB)) == 4  # a row per device
    assert len(bars(tmp_path / "b.png", FORWARD_RGB)) == 8  # measured and predicted


def test_plot_stacks_one_panel_per_timeline(tmp_path: Path) -> None:
    import matplotlib.image

    plain = fill_drain(4, 8, forward=0.01, backward=0.01)
    split = fill_drain(4, 8, forward=0.01, backward=0.01, weight=0.01)
    two = matplotlib.image.imread(plot(plain, tmp_path / "two.png", compare=[split]))
    three = matplotlib.image.imread(
        plot(plain, tmp_path / "three.png", compare=[split, split], names=["a", "b", "c"])
    )
    assert three.shape[0] > two.shape[0]
    rgb = (two[..., :3] * 255).round()
    assert ((rgb == [221, 132, 82]).all(axis=-1)).sum() > 1000  # the second panel's W's
    with pytest.raises(ValueError, match="names lists 1 panels, but there are 2"):
        plot(plain, tmp_path / "bad.png", compare=[split], names=["a"])
    # The memory panel (of the first timeline) can be left out.
    bare = matplotlib.image.imread(
        plot(plain, tmp_path / "bare.png", compare=[split], memory=False)
    )
    assert bare.shape[0] < two.shape[0]


def test_plot_draws_a_row_for_every_device_of_a_large_pipeline(tmp_path: Path) -> None:
    out = plot(fill_drain(16, 64, weight=1.0), tmp_path / "nested" / "big.png", title="K=16")
    forward_rows = bars(out, FORWARD_RGB)
    assert len(forward_rows) == 16
    # each device starts one forward later than the one above it: rows step to the right
    starts = [first for first, _ in forward_rows]
    assert starts == sorted(starts) and len(set(starts)) == 16


def test_chrome_trace_has_one_complete_event_per_action(tmp_path: Path) -> None:
    timeline = fill_drain(3, 4, weight=1.0, unit="s", start=2.0)
    path = tmp_path / "trace.json"
    trace = to_chrome_trace(timeline, path)
    assert json.loads(path.read_text()) == trace
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 3 * 4 * 3
    by_key = {(e["tid"], e["name"]): e for e in complete}
    assert len(by_key) == len(complete)
    for device, events in enumerate(timeline.events):
        for event in events:
            action = event.action
            record = by_key[(device, f"{action.kind}{action.microbatch}")]
            assert record["pid"] == 0
            assert record["ts"] == pytest.approx((event.start - 2.0) * 1e6)
            assert record["dur"] == pytest.approx(event.duration * 1e6)
            assert record["args"] == {
                "stage": action.stage,
                "microbatch": action.microbatch,
                "memory": event.memory,
            }


def test_chrome_trace_counts_memory_and_names_threads() -> None:
    trace = fill_drain(2, 2).to_chrome_trace()
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert {c["name"] for c in counters} == {"memory device 0", "memory device 1"}
    # What each device holds (gpipe.analysis.held): up through the forwards, down through
    # the backwards, back to zero; device 1 starts its first forward at 1 ms.
    levels = [
        [(c["ts"], c["args"]["memory"]) for c in counters if c["name"] == name]
        for name in ("memory device 0", "memory device 1")
    ]
    assert levels == [
        [(0.0, 1), (1e3, 2), (5e3, 1), (6e3, 0)],
        [(0.0, 0), (1e3, 1), (2e3, 2), (4e3, 1), (5e3, 0)],
    ]
    threads = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert threads == ["device 0", "device 1"]


def test_chrome_trace_shows_a_cost_unit_as_one_millisecond() -> None:
    trace = to_chrome_trace(fill_drain(2, 2, forward=1.0, backward=2.5))
    durations = sorted({e["dur"] for e in trace["traceEvents"] if e["ph"] == "X"})
    assert durations == [1000.0, 2500.0]
    assert trace["otherData"]["unit"] == "cost"


def test_chrome_trace_rejects_unknown_units() -> None:
    with pytest.raises(ValueError, match="expected one of"):
        to_chrome_trace(Timeline([[Event(Action("F", 0, 0), 0, 1)]], unit="furlong"))


def test_chart_shows_measured_peak_memory_in_binary_units() -> None:
    events = [[Event(Action("F", d, 0), 0.0, 0.5, memory=(d + 1) * 3 * 2**20)] for d in range(2)]
    chart = format_chart(Timeline(events, "s"), width=40, color=False)
    assert "peak memory per device: 3.0 MiB, 6.0 MiB" in chart.splitlines()
