"""`gpipe report --quick`: every section measures, draws and tabulates what it promises."""

from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path

import pytest

from gpipe.bench.progress import progress
from gpipe.bench.turns import CpuTimes, Load, in_turns, judge
from gpipe.cli import main

HAS_DISTRIBUTED = importlib.util.find_spec("gpipe.distributed") is not None


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """One quick report for the tests that read it (about a minute on 2 busy cores, so they
    run in the slow tier; ``test_report_sections_run_alone`` runs a section in make test)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("report")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["report", "--quick", "--out", str(out)]) == 0
    line = next(x for x in printed.getvalue().splitlines() if x.startswith("RESULT "))
    return out, dict(item.split("=", 1) for item in line.split()[1:])


@pytest.mark.slow
def test_quick_report_writes_every_picture_and_section(report: tuple[Path, dict[str, str]]) -> None:
    out, _ = report
    text = (out / "report.md").read_text()
    for number, title in enumerate(
        [
            "Partitioning",
            "Micro-batching and the bubble",
            "Schedules side by side",
            "Gradient accumulation = full batch",
            "Re-materialization",
            "Pipeline vs data parallel",
            "Efficiency at scale",
            "The paper, reproduced",
        ],
        start=1,
    ):
        assert f"## {number}. {title}" in text
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    expected = {
        "partitioning.png",
        "bubble.png",
        "schedules.png",
        "accumulation.png",
        "rematerialization.png",
        "scale.png",
        "paper.png",
    }
    expected |= {"parallelism.png"} if HAS_DISTRIBUTED else set()
    assert set(pictures) == expected
    for name in pictures:
        assert (out / name).read_bytes()[:4] == b"\x89PNG", name
    assert text.count("\n| ---") >= 7  # a table per section and the summary
    if not HAS_DISTRIBUTED:
        assert "**Pending:**" in text


@pytest.mark.slow
def test_quick_report_measures_sensible_values(report: tuple[Path, dict[str, str]]) -> None:
    _, result = report
    assert float(result["grad_max_diff"]) < 1e-12  # float64: pipelined = whole batch
    assert float(result["loss_max_diff"]) < 1e-12
    assert abs(float(result["bubble_k4m8"]) - 3 / 11) < 0.15  # near (K-1)/(M+K-1)
    # Zero-bubble fills the bubble GPipe leaves (same stages, same costs).
    assert float(result["bubble_zbh1"]) < float(result["bubble_gpipe"])
    assert float(result["remat_saving_k1"]) > 3  # checkpointing holds far less
    assert 0 < float(result["efficiency_k8m16"]) < 1
    # 128 devices of 16 GiB hold a Transformer-L hundreds of times larger than one plain
    assert float(result["largest_k128_params"]) > 100 * float(result["naive_params"])
    assert 1 < float(result["speedup_k8m32"]) < 8


@pytest.mark.slow
def test_the_schedule_table_sets_every_schedule_beside_its_formulas(
    report: tuple[Path, dict[str, str]],
) -> None:
    out, result = report
    from gpipe.schedule import SCHEDULES

    names = [name for name in SCHEDULES if name != "auto"]
    assert {f"bubble_{name.replace('-', '')}" for name in names} <= set(result)
    text = (out / "report.md").read_text()
    section = text.split("## 3. ")[1].split("\n## ")[0]
    rows = {
        cells[0]: cells[3:5] + cells[6:8]
        for line in section.splitlines()
        if line.startswith("| ") and (cells := [c.strip() for c in line.split("|")[1:-1]])
    }
    # simulated bubble, its formula, simulated stage inputs held, its formula (K=4, M=8)
    assert rows["gpipe"] == ["0.273", "0.273", "8", "8"]
    assert rows["zb-v (v=2)"] == ["0.059", "0.059", "8", "8"]
    assert rows["v-min (v=2)"] == ["0.186", "0.186", "4", "4"]
    assert rows["dualpipev (v=2)"] == ["0.111", "0.111", "9", "9"]  # (K-1)/(3M+K-1), 2K+1
    shown = {row.split(" (v=")[0] for row in rows} - {"schedule", "---"}  # less the header
    assert shown == set(names)


def test_report_refuses_an_unknown_section(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--sections", "2,9"]) == 2
    assert "no section 9: choose from 1-8, e.g. --sections 2,3" in capsys.readouterr().err


def test_report_sections_run_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--quick", "--sections", "4", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "## 4. Gradient accumulation = full batch" in text and "## 2." not in text
    assert (tmp_path / "accumulation.png").exists()
    assert "grad_max_diff=" in capsys.readouterr().out


QUIET = Load(before=0.5, after=0.8, cores=8)


def test_a_difference_above_the_spread_gets_a_verdict() -> None:
    never = [0.100, 0.102, 0.101, 0.103, 0.099]
    always = [0.131, 0.133, 0.130, 0.135, 0.132]
    verdict = judge("never", never, "always", always, QUIET)
    assert verdict.told == "slower"
    assert verdict.ratio == pytest.approx(0.132 / 0.101)
    assert str(verdict).startswith("always costs 1.31x never's time: the middle halves")
    assert verdict.short == "1.31x"
    faster = judge("always", always, "never", never, QUIET)
    assert faster.told == "faster" and str(faster).startswith("never is 1.31x faster than always")


def test_overlapping_times_cannot_tell_and_say_why() -> None:
    # a burst of other work made one "always" run look 3.5x faster: the quartiles overlap
    never = [0.100, 0.140, 0.105, 0.180, 0.102]
    always = [0.030, 0.131, 0.160, 0.133, 0.150]
    verdict = judge("never", never, "always", always, QUIET)
    assert verdict.told is None
    assert str(verdict).startswith("this run cannot tell never from always (median ratio 1.27)")
    assert "the middle halves of their times overlap (never 102.0–140.0 ms" in str(verdict)
    assert str(verdict).endswith("medians of 5 turns, load 0.5 → 0.8 on 8 cores")
    assert verdict.short == "1.27x?"


def test_a_host_busy_before_the_run_gets_no_verdict_however_clear_the_times() -> None:
    busy = Load(before=12.2, after=13.0, cores=2)
    verdict = judge("PP", [0.2, 0.2, 0.2], "DP", [0.5, 0.5, 0.5], busy, unit="steps")
    assert verdict.told is None
    assert "the host was busy before the run began (load 12.2 on 2 cores)" in str(verdict)
    assert str(verdict).endswith("medians of 3 steps, load 12.2 → 13.0 on 2 cores")


def test_a_load_of_our_own_making_does_not_stop_a_verdict() -> None:
    # the demo trained a minute before its turns: the load average counts that training,
    # but during the turns other processes took a tenth of a core
    own = Load(before=3.1, after=2.4, cores=2, others=0.1)
    verdict = judge("plain", [0.10, 0.10, 0.11], "pipe", [0.20, 0.21, 0.20], own)
    assert verdict.told == "slower"
    assert str(verdict).endswith("load 3.1 → 2.4 on 2 cores, other processes 0.1 cores")
    crowded = Load(before=0.2, after=0.3, cores=2, others=1.4)
    verdict = judge("plain", [0.10, 0.10, 0.11], "pipe", [0.20, 0.21, 0.20], crowded)
    assert verdict.told is None
    assert "other processes kept 1.4 of the 2 cores busy while it ran" in verdict.reason


def test_other_processes_cpu_is_the_hosts_less_our_own_over_the_wall_time() -> None:
    # over 2 s the host's CPUs were busy 3.0 s in all, 2.6 s of them this process's threads
    before = CpuTimes(host=1000.0, own=50.0, wall=10.0)
    after = CpuTimes(host=1003.0, own=52.6, wall=12.0)
    assert after.others_since(before) == pytest.approx(0.2)
    # tick rounding can leave our own time above the host's: never below no one
    assert CpuTimes(1001.0, 52.0, 12.0).others_since(before) == 0.0
    assert CpuTimes(None, 52.0, 12.0).others_since(before) is None
    assert CpuTimes(1003.0, 52.0, 10.0).others_since(before) is None  # no time passed


def test_one_run_each_cannot_tell() -> None:
    verdict = judge("plain", [0.1], "pipe", [0.5], QUIET)
    assert verdict.told is None and "one run each" in verdict.reason
    with pytest.raises(ValueError, match="no times to compare"):
        judge("plain", [], "pipe", [0.5], QUIET)


def test_turns_alternate_and_swap_the_order_each_round() -> None:
    ran: list[str] = []
    a_times, b_times, load = in_turns(lambda: ran.append("a"), lambda: ran.append("b"), 3)
    assert ran == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then AB, BA, AB
    assert len(a_times) == len(b_times) == 3 and load.cores >= 1


def test_a_silent_phase_shows_what_runs_and_for_how_long() -> None:
    import io

    stream = io.StringIO()
    with progress("profiling each layer", quiet=0.05, every=0.1, stream=stream):
        time.sleep(0.28)
    lines = stream.getvalue().splitlines()
    assert 2 <= len(lines) <= 3
    assert all(re.fullmatch(r"   profiling each layer \.\.\. \d+ s", line) for line in lines)
    quiet = io.StringIO()
    with progress("a short phase", quiet=5, stream=quiet):
        pass
    assert quiet.getvalue() == ""


@pytest.mark.slow
def test_quick_report_counts_recomputation_in_flops_and_judges_every_timing(
    report: tuple[Path, dict[str, str]],
) -> None:
    out, result = report
    # one more forward on top of forward + backward (2 forwards' work): 4/3, on any host
    assert float(result["remat_flops_ratio"]) == pytest.approx(4 / 3, abs=0.02)
    text = (out / "report.md").read_text()
    verdicts = re.findall(
        r"(cannot tell|costs [\d.]+x|[\d.]+x faster than)[^;]*; "
        r"medians of \d+ (?:turns|steps), load [\d.]+ → [\d.]+ on \d+ cores",
        text,
    )
    assert len(verdicts) >= 3  # partitioning, re-materialization, PP against DP
