"""Shared fixtures: small float64 models and the plain-PyTorch reference they must match."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

# NOTE: every distributed test posts under NCCL's rules (one stream per rank, sends that wait
# for their receiver; see gpipe.distributed.posting), which gloo alone would forgive: so a
# program that could hang on NCCL hangs here. Tests of plain gloo's poster set their own.
os.environ.setdefault("GPIPE_POSTER", "nccl-rules")


def make_mlp(
    layers: int = 8, width: int = 6, *, dropout: float = 0.0, seed: int = 0
) -> nn.Sequential:
    """An MLP of ``layers`` blocks (Linear, Tanh[, Dropout]) in float64, seeded."""
    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.Tanh()]
        if dropout:
            blocks.append(nn.Dropout(dropout))
    return nn.Sequential(*blocks).double()


def reference_step(
    model: nn.Sequential, x: torch.Tensor, target: torch.Tensor, loss_fn: Callable
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    """Plain PyTorch: output, loss, every parameter's grad and the input's grad."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    output = model(x)
    loss = loss_fn(output, target)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return output.detach(), loss.detach(), grads, x.grad


def custom_schedules(devices: int, count: int, seed: int) -> list[str]:
    """Built-in schedules with each device's list shuffled by swaps, kept if valid."""
    import dataclasses
    import random

    from gpipe.schedule import ScheduleError, make_schedule

    rng = random.Random(seed)
    found: list[str] = []
    while len(found) < count:
        base = make_schedule(rng.choice(["gpipe", "1f1b", "zb-h1"]), devices, 4)
        rows = []
        for actions in base.actions:
            order = list(actions)
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(len(order) - 1)
                order[i], order[i + 1] = order[i + 1], order[i]
            rows.append(order)
        schedule = dataclasses.replace(base, name="custom", actions=rows)
        try:
            schedule.validate()
        except ScheduleError:
            continue
        if schedule.actions != base.actions:
            found.append(schedule.to_csv())
    return found


def fresh_python(code: str, timeout: float = 60) -> str:
    """What ``code`` prints, run in a new interpreter: for what a process loads, or does,
    the first time (imports, one-time costs), which this test process has long done."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=True
    )
    return done.stdout


@pytest.fixture
def mlp() -> Callable[..., nn.Sequential]:
    return make_mlp


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Every test ends with no gpipe worker thread left: a pipe's threads end with the pipe.

    The test's pipes are gone once it returns (a pipe in a reference cycle, such as a failed
    step's traceback, once collected), so a thread still running outlived its pipe.
    """
    yield
    leftover = [t for t in threading.enumerate() if t.name.startswith("gpipe-")]
    deadline = time.monotonic() + 0.5
    for thread in leftover:  # a dropped pipe's threads end at once
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in leftover):
        gc.collect()
        for thread in leftover:
            thread.join(timeout=5)
    assert not [t for t in leftover if t.is_alive()], "a gpipe worker thread outlived its pipe"
