"""Planning a DistributedGPipe job: every (pipeline depth, replicas) of its processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from gpipe.cli import main
from gpipe.planning.planner import plan


def model(width: int = 8, blocks: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(blocks)])


def quick(**kwargs: Any) -> Any:
    kwargs.setdefault("schedules", ("1f1b",))
    kwargs.setdefault("checkpoints", ("never",))
    return plan(
        model(),
        torch.randn(4, 8),
        kwargs.pop("batch_size", 8),
        kwargs.pop("devices", ["cpu"] * 4),
        top=100,
        repeats=1,
        action_overhead=0.0,
        progress=False,
        **kwargs,
    )


def every(report: Any) -> list[Any]:
    return [*report.plans, *(r.plan for r in report.rejected)]


def test_a_job_is_laid_out_every_way_its_processes_divide() -> None:
    report = quick(world_size=4, optimizer="adam", zero=True)
    layouts = {(p.stages, p.dp) for p in every(report)}
    assert layouts == {(1, 4), (2, 2), (4, 1)}
    for p in every(report):
        assert p.world_size == 4 and p.stages * p.dp == 4
        assert p.chunks <= 8 // p.dp  # micro-batches of one replica's share
        assert f"dp={p.dp} zero of 4 processes" in p.describe()
    # ZeRO: more replicas, a smaller share of the optimizer state on each device
    one_stage = {p.dp: max(p.peak_memory) for p in every(report) if p.chunks == 1}
    assert one_stage[4] < quick(optimizer="adam", chunks=[1]).plans[0].peak_memory[0]


def test_a_batch_the_replicas_cannot_share_leaves_those_layouts_out() -> None:
    # 6 samples: 4 replicas cannot share them, 2 can
    report = quick(world_size=4, batch_size=6)
    assert {(p.stages, p.dp) for p in every(report)} == {(2, 2), (4, 1)}


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"world_size": 4, "dp": 2}, "not both"),
        ({"world_size": 4, "verify": True}, "verify runs plans in this process"),
        ({"world_size": 0}, "world_size must be >= 1"),
        ({"world_size": 8, "batch_size": 3, "devices": ["cpu"]}, "no layout of world_size=8"),
    ],
)
def test_bad_job_sizes_name_the_fix(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        quick(**changes)


def test_cli_plans_a_job(capsys: pytest.CaptureFixture[str]) -> None:
    job = ["plan", "--stages", "2", "--world-size", "2", "--batch-size", "4", "--chunks", "1,2"]
    code = main([*job, "--schedules", "1f1b", "--checkpoints", "never", "--repeats", "1"])
    assert code == 0
    result = capsys.readouterr().out.splitlines()[-1]
    assert result.startswith("RESULT ") and result.endswith("world_size=2")
