"""The GPU check never replaces the saved GPU report from a host without CUDA.

``benchmarks/runs/gpu_check.txt`` is an H200's report and the README cites its figures: a
run without CUDA writes only where ``--out`` says, and the benchmarks page never reruns it.
The parts of its fused-pair row that a CPU can run are checked here too.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without CUDA")


def _copy_of_the_check(tmp_path: Path) -> Path:
    """benchmarks/gpu_check.py in a folder of its own, beside a runs/ holding a saved report."""
    (tmp_path / "benchmarks" / "runs").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "gpu_check.py", tmp_path / "benchmarks")
    saved = tmp_path / "benchmarks" / "runs" / "gpu_check.txt"
    saved.write_text("CARD NVIDIA_H200\nRESULT card=NVIDIA_H200\n")
    return saved


def _check(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", *arguments],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _the_check() -> ModuleType:
    """benchmarks/gpu_check.py as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    return check


def test_the_split_dualpipev_runs_each_pairs_parts_in_order_and_validates() -> None:
    from gpipe.schedule import FUSED, make_schedule, validate

    check = _the_check()
    fused = make_schedule("dualpipev", 2, 4, virtual_stages=2)
    split = check._split_pairs(fused)
    validate(split)
    assert split.name == "dualpipev-split" and split.placement == fused.placement
    assert not any(a.kind == FUSED for device in split.actions for a in device)
    for ours, theirs in zip(split.actions, fused.actions):
        assert list(ours) == [unit for action in theirs for unit in action.units]
    assert len(split) > len(fused)  # there were pairs to split


def test_the_check_gives_dualpipev_the_2k_micro_batches_it_needs() -> None:
    check = _the_check()
    assert check._chunks("dualpipev", 4, 4) == 8
    assert check._chunks("dualpipev", 2, 4) == 4
    assert check._chunks("zb-v", 4, 4) == 4
    assert [check._virtual(name) for name in ("1f1b", "interleaved", "v-min", "dualpipev")] == [
        1,
        2,
        2,
        2,
    ]
    assert check._balance(15, 8) == [2, 2, 2, 2, 2, 2, 2, 1]


def test_the_fused_pair_benchmark_times_a_pair_and_its_parts_on_a_cpu() -> None:
    check = _the_check()
    torch.manual_seed(0)
    stage = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    pair, apart = check._fused_pair(stage, torch.randn(4, 8), 2)
    assert 0 < pair < 1 and 0 < apart < 1
    assert all(p.grad is not None for p in stage.parameters())  # the backward was a full one


@no_cuda
def test_the_check_without_cuda_says_so_and_leaves_the_saved_report_alone(
    tmp_path: Path,
) -> None:
    saved = _copy_of_the_check(tmp_path)
    before = saved.read_bytes()
    done = _check(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device: nothing is written" in done.stdout
    assert saved.read_bytes() == before
    assert sorted(p.name for p in saved.parent.iterdir()) == ["gpu_check.txt"]


@no_cuda
def test_the_check_without_cuda_writes_its_report_where_out_says(tmp_path: Path) -> None:
    saved = _copy_of_the_check(tmp_path)
    before = saved.read_bytes()
    out = tmp_path / "cpu_check.txt"
    done = _check(tmp_path, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_text().splitlines()[-1].startswith("RESULT card=none ran=0 ")
    assert saved.read_bytes() == before


def _benchmarks_page(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> tuple[ModuleType, list[str]]:
    """tools/benchmarks_page.py with its runs and page in tmp_path and its runs recorded."""
    spec = importlib.util.spec_from_file_location(
        "benchmarks_page", ROOT / "tools" / "benchmarks_page.py"
    )
    assert spec is not None and spec.loader is not None
    page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page)
    ran: list[str] = []

    def record(command: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        ran.append(Path(command[1]).stem)
        return subprocess.CompletedProcess(command, 0, stdout="RESULT ok=1\n", stderr="")

    monkeypatch.setattr(page.subprocess, "run", record)
    monkeypatch.setattr(page, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(page, "PAGE", tmp_path / "benchmarks.md")
    return page, ran


def test_the_benchmarks_page_reruns_every_benchmark_but_the_gpu_check(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    page, ran = _benchmarks_page(monkeypatch, tmp_path)
    (tmp_path / "runs").mkdir()
    shutil.copy(ROOT / "benchmarks" / "runs" / "gpu_check.txt", tmp_path / "runs")
    monkeypatch.setattr(sys, "argv", ["benchmarks_page.py", "--run"])
    page.main()
    assert "gpu_check" not in ran
    assert {"latency", "overhead", "schedules"} <= set(ran)
    shown = (tmp_path / "benchmarks.md").read_text()
    assert "## gpu_check.py\n" in shown and "CARD NVIDIA_H200" in shown  # from the saved run


def test_the_benchmarks_page_refuses_to_rerun_the_gpu_check_by_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    page, ran = _benchmarks_page(monkeypatch, tmp_path)
    monkeypatch.setattr(sys, "argv", ["benchmarks_page.py", "--run", "gpu_check"])
    with pytest.raises(SystemExit):
        page.main()
    assert ran == []
