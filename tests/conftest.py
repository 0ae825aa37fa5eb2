"""Shared fixtures: small float64 models and the plain-PyTorch reference they must match."""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import strategies as st
from torch import nn

from gpipe.schedule import Action, Schedule, make_schedule
from gpipe.schedule.action import BACKWARD, FORWARD, WEIGHT, dependencies

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


def valid_reorder(base: Schedule, pick: Callable[[int], int]) -> Schedule:
    """``base`` with each device's actions in a random order the validator accepts.

    One run of the pipeline in which, turn after turn, some device runs one of its actions
    whose dependencies have finished (so no order deadlocks): any F or B, in any order of
    the micro-batches, W's any time after their B. With one stage per device these are
    exactly the orders the validator accepts: the lowering posts every message in the step
    it is made, so no pair of devices needs its messages taken in the order sent.

    Args:
        base: a schedule with one stage per device; only its shape and kinds are kept.
        pick: ``pick(n)`` chooses one of ``n`` choices, ``0 <= pick(n) < n``.
    """
    assert base.placement == tuple(range(base.devices)), "one stage per device only"
    kinds = (FORWARD, BACKWARD, WEIGHT) if base.split_backward else (FORWARD, BACKWARD)
    left = {
        Action(kind, s, i)
        for kind in kinds
        for s in range(base.stages)
        for i in range(base.microbatches)
    }
    done: set[Action] = set()
    rows: list[list[Action]] = [[] for _ in range(base.devices)]
    while left:
        ready = sorted(a for a in left if all(dep in done for dep in dependencies(a, base.stages)))
        action = ready[pick(len(ready))]
        rows[action.stage].append(action)
        done.add(action)
        left.remove(action)
    return dataclasses.replace(base, actions=rows)


@st.composite
def valid_reorders(draw: st.DrawFn) -> Schedule:
    """A built-in schedule (2-4 devices, 1-5 micro-batches, with or without W) whose
    devices run their actions in a random order the validator accepts."""
    devices, microbatches = draw(st.integers(2, 4)), draw(st.integers(1, 5))
    base = make_schedule(draw(st.sampled_from(["gpipe", "1f1b", "zb-h1"])), devices, microbatches)
    return valid_reorder(base, lambda n: draw(st.integers(0, n - 1)))


def assert_new_pipe_trained_as_plain(results: list[dict[str, Any]], world: int) -> None:
    """Check what ``dist_scenarios:new_pipe_after_failure`` returned on every rank: each saw
    the first pipe's step fail, and the new pipe's loss and every gradient its rank holds
    equal plain training's."""
    assert len(results) == world, results
    for rank, result in enumerate(results):
        assert "boom" in result["failed"], (rank, result)
        assert result["loss"] < 1e-12 and result["grad"] < 1e-12, (rank, result)
        assert result["checked"] > 0, (rank, result)  # the rank held gradients to compare


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
