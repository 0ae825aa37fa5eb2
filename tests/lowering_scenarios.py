"""Distributed runs of lowered programs, for test_nccl_rules.py (run by tests/ranks.py)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gpipe.distributed as gd
import gpipe.distributed.programs as protocol
from dist_scenarios import WIDTH, _diff, mlp
from gpipe.distributed.posting import POSTER
from gpipe.planning.candidates import stages_per_device
from gpipe.schedule import Action, Schedule
from gpipe.schedule.lowering import RECV, SEND, Batch, Lowered, Op, lower


class Scale(nn.Module):
    """x * w elementwise: a layer whose activations are as large as its weight, cheaply."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.weight)


def _step_against_plain(
    pipe: gd.DistributedGPipe, model: nn.Module, plain: nn.Module, x: Any, y: torch.Tensor
) -> float:
    """One train_step, compared with plain training of ``plain`` on the same batch: the
    largest difference of the loss and of this rank's gradients."""
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    expected = nn.functional.mse_loss(plain(x), y)
    expected.backward()
    worst = _diff(loss, expected)
    grads = dict(plain.named_parameters())
    for name, param in model.named_parameters():
        if param.device.type != "meta":
            assert param.grad is not None, name
            worst = max(worst, _diff(param.grad, grads[name].grad))
    model.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    return worst


def steps(schedules: list[str], poster: str) -> dict[str, list[float]]:
    """Every schedule, 5 steps per pipe: 3 of one batch shape, one of another, the first
    again; each step's loss and gradients against plain training."""
    os.environ[POSTER] = poster
    results = {}
    for schedule in schedules:
        v = stages_per_device(schedule)
        # dualpipev needs 2K micro-batches: more ranks take more (and larger batches)
        chunks = max(4, 2 * dist.get_world_size()) if schedule == "dualpipev" else 4
        model, plain = mlp(), mlp()
        pipe = gd.DistributedGPipe(
            model, chunks=chunks, schedule=schedule, virtual_stages=v, timeout=30
        )
        worst = []
        for step, batch in enumerate([2 * chunks, 2 * chunks, 2 * chunks, chunks + 1, 2 * chunks]):
            torch.manual_seed(step)
            x = torch.randn(batch, WIDTH, dtype=torch.float64)
            y = torch.randn(batch, WIDTH, dtype=torch.float64)
            worst.append(_step_against_plain(pipe, model, plain, x, y))
        pipe.close()
        results[schedule] = worst
    return results


def large(schedule: str, poster: str, mib: int) -> list[float]:
    """Messages of ``mib`` MiB each (float32 activations), 3 steps, against plain training."""
    os.environ[POSTER] = poster
    width = mib * 2**20 // 4 // 2  # a micro-batch of 2 samples
    world = dist.get_world_size()

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[Scale(width) for _ in range(world)])

    model, plain = build(), build()
    pipe = gd.DistributedGPipe(model, chunks=2, schedule=schedule, timeout=60)
    worst = []
    for step in range(3):
        torch.manual_seed(step)
        x, y = torch.randn(4, width), torch.randn(4, width)
        worst.append(_step_against_plain(pipe, model, plain, x, y))
    pipe.close()
    return worst


def naive(schedule: Schedule, flow: Any = None, receives: str = "early") -> Lowered:
    """Each action's receives right before it and its sends right after, one batch each:
    how a transport unaware of NCCL's streams would post (hangs interleaved GPipe)."""
    full = lower(schedule, flow)
    ops = [op for device in range(schedule.devices) for b in full.batches(device) for op in b.ops]
    programs = []
    for device, actions in enumerate(schedule.actions):
        mine = [op for b in full.batches(device) for op in b.ops]
        program: list[Any] = []
        for position, action in enumerate(actions):
            program += [Batch((op,), position) for op in mine if _needs(op, action)]
            program.append(action)
            program += [Batch((op,), position + 1) for op in mine if _makes(op, action)]
        programs.append(tuple(program))
    assert ops
    return Lowered(schedule, tuple(programs))


def _needs(op: Op, action: Action) -> bool:
    kind = "F" if op.tag[0] == "act" else "B"
    return op.direction == RECV and Action(kind, op.tag[1], op.tag[2]) == action


def _makes(op: Op, action: Action) -> bool:
    kind, stage, mb = op.tag[0], op.tag[1], op.tag[2]
    maker = Action("F", stage - 1, mb) if kind == "act" else Action("B", stage + 1, mb)
    return op.direction == SEND and maker == action


def naive_program(poster: str) -> dict[str, Any]:
    """GPipe with 2 virtual stages per rank, posted the naive way, bypassing the check."""
    os.environ[POSTER] = poster
    protocol.lower = naive  # type: ignore[assignment]
    protocol.check_lowered = lambda lowered: None  # type: ignore[assignment]
    model, plain = mlp(), mlp()
    pipe = gd.DistributedGPipe(model, chunks=4, schedule="gpipe", virtual_stages=2, timeout=8)
    torch.manual_seed(0)
    x = torch.randn(8, WIDTH, dtype=torch.float64)
    y = torch.randn(8, WIDTH, dtype=torch.float64)
    return {"worst": _step_against_plain(pipe, model, plain, x, y)}


def init_fn_raises(rank: int) -> None:
    """Rank ``rank``'s init_fn raises while the pipe is built on meta; the others build."""
    with torch.device("meta"):
        model = mlp()

    def init_fn(module: nn.Module) -> None:
        if dist.get_rank() == rank:
            raise RuntimeError("out of memory (a test's init_fn)")
        if isinstance(module, nn.Linear):
            module.reset_parameters()

    gd.DistributedGPipe(model, chunks=2, init_fn=init_fn, timeout=300)


def custom(csvs: list[str]) -> list[float]:
    """Each custom schedule (CSV text) for 5 steps on this job's ranks, against plain."""
    worst = []
    for text in csvs:
        model, plain = mlp(), mlp()
        pipe = gd.DistributedGPipe(model, chunks=4, schedule=Schedule.from_csv(text), timeout=30)
        for step in range(3):
            torch.manual_seed(step)
            x = torch.randn(8, WIDTH, dtype=torch.float64)
            y = torch.randn(8, WIDTH, dtype=torch.float64)
            worst.append(_step_against_plain(pipe, model, plain, x, y))
        pipe.close()
    return worst
