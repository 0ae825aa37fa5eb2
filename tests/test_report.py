"""`gpipe report --quick`: every section measures, draws and tabulates what it promises."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from gpipe.cli import main

HAS_DISTRIBUTED = importlib.util.find_spec("gpipe.distributed") is not None


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """One quick report for every test here (about a minute on 2 busy cores)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("report")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["report", "--quick", "--out", str(out)]) == 0
    line = next(x for x in printed.getvalue().splitlines() if x.startswith("RESULT "))
    return out, dict(item.split("=", 1) for item in line.split()[1:])


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
    }
    expected |= {"parallelism.png"} if HAS_DISTRIBUTED else set()
    assert set(pictures) == expected
    for name in pictures:
        assert (out / name).read_bytes()[:4] == b"\x89PNG", name
    assert text.count("\n| ---") >= 7  # a table per section and the summary
    if not HAS_DISTRIBUTED:
        assert "**Pending:**" in text


def test_quick_report_measures_sensible_values(report: tuple[Path, dict[str, str]]) -> None:
    _, result = report
    assert float(result["grad_max_diff"]) < 1e-12  # float64: pipelined = whole batch
    assert float(result["loss_max_diff"]) < 1e-12
    assert abs(float(result["bubble_k4m8"]) - 3 / 11) < 0.15  # near (K-1)/(M+K-1)
    # Zero-bubble fills the bubble GPipe leaves (same stages, same costs).
    assert float(result["bubble_zbh1"]) < float(result["bubble_gpipe"])
    assert float(result["remat_saving_k1"]) > 3  # checkpointing holds far less
    assert 0 < float(result["efficiency_k8m16"]) < 1


def test_report_refuses_an_unknown_section(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--sections", "2,9"]) == 2
    assert "no section 9: choose from 1-7, e.g. --sections 2,3" in capsys.readouterr().err


def test_report_sections_run_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--quick", "--sections", "4", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "## 4. Gradient accumulation = full batch" in text and "## 2." not in text
    assert (tmp_path / "accumulation.png").exists()
    assert "grad_max_diff=" in capsys.readouterr().out
