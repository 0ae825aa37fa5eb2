"""Larger layouts and failures under the data-parallel engines (test_data_parallel_scale.py):
pp x dp on 8 ranks against plain training, and a rank that raises inside an FSDP step."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gpipe.distributed as gd
from engine_scenarios import _grad_diff, _param_diff, mlp

WIDTH = 6


def layouts(engine: str, dp: int, schedules: list[str], batch: int = 13) -> dict[str, Any]:
    """Per schedule: a training step and an AdamW step under ``engine`` on pp x ``dp``
    (pp = world / dp), against plain training on the whole batch."""
    torch.manual_seed(1)
    x = torch.randn(batch, WIDTH, dtype=torch.float64)
    y = torch.randn(batch, WIDTH, dtype=torch.float64)
    loss_fn = nn.functional.mse_loss
    results: dict[str, Any] = {}
    for schedule in schedules:
        reference = mlp(8)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        pipe = gd.DistributedGPipe(
            mlp(8), chunks=3, schedule=schedule, dp_size=dp, data_parallel=engine, timeout=30
        )
        opt = pipe.make_optimizer(torch.optim.AdamW, lr=0.05)
        loss = pipe.train_step(x, y, loss_fn)
        grad, held = _grad_diff(pipe.user_view(), reference)
        opt.step()
        ref_opt.step()
        results[schedule] = {
            "loss": abs(float(loss) - float(ref_loss)),
            "grad": grad,
            "held": held,
            "param": _param_diff(pipe.user_view(), reference),
        }
        pipe.close()
    return results


class Raising(nn.Module):
    """Raises in its forward on rank ``rank`` at the given call."""

    def __init__(self, rank: int, at: int) -> None:
        super().__init__()
        self.rank, self.at, self.calls = rank, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if dist.get_rank() == self.rank and self.calls == self.at:
            raise RuntimeError(f"boom inside an fsdp step on rank {self.rank}")
        return x


def fails_inside(engine: str, rank: int) -> str:
    """A stage on ``rank`` raises in its second forward of the second step (its replica
    peer is then inside the engine's collectives): every rank must end, naming it."""
    model = mlp(4)
    layers = list(model)
    layers.insert(6, Raising(rank, 4))
    pipe = gd.DistributedGPipe(
        nn.Sequential(*layers), chunks=2, dp_size=2, data_parallel=engine, timeout=20
    )
    x = torch.randn(8, WIDTH, dtype=torch.float64)
    for _ in range(2):
        pipe.train_step(x, x, nn.functional.mse_loss)
    return "not raised"


def from_plan(engine: str) -> dict[str, Any]:
    """A plan of a 4-process job under ``engine``: its pp=2 x dp=2 layout built by
    ``DistributedGPipe.from_plan`` runs that engine and trains as plain training."""
    from gpipe.planning.planner import plan

    model = mlp(4)
    x = torch.randn(8, WIDTH, dtype=torch.float64)
    kwargs = dict(schedules=["1f1b"], checkpoints=["never"], chunks=[2], progress=False)
    report = plan(model, x, 8, ["cpu"] * 4, world_size=4, data_parallel=engine, repeats=1,
                  action_overhead=0.0, **kwargs)  # fmt: skip
    chosen = next(p for p in report.plans if (p.stages, p.dp) == (2, 2))
    reference = mlp(4)
    loss_fn = nn.functional.mse_loss
    ref_loss = loss_fn(reference(x), x)
    ref_loss.backward()
    pipe = gd.DistributedGPipe.from_plan(model, chosen, timeout=30)
    loss = pipe.train_step(x, x, loss_fn)
    grad, held = _grad_diff(pipe.user_view(), reference)
    result = {
        "engine": pipe._data_parallel.name,
        "described": chosen.describe(),
        "loss": abs(float(loss) - float(ref_loss)),
        "grad": grad,
        "held": held,
    }
    pipe.close()
    return result
