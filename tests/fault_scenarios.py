"""What the ranks of the fail-safely tests run (tests/test_fail_safely.py): each function runs
on every rank, under tests/ranks.py's launch."""

from __future__ import annotations

import datetime
import gc
import json
import os
import threading
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gpipe.distributed as gd
from dist_scenarios import WIDTH, _compare, _reference, mlp


def _usage() -> dict[str, int]:
    """This process's OS threads, open file descriptors and resident memory (KiB)."""
    lines = Path("/proc/self/status").read_text().splitlines()
    status = dict(line.split(":", 1) for line in lines if ":" in line)
    return {
        "threads": int(status["Threads"]),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_kib": int(status["VmRSS"].split()[0]),
        "python_threads": threading.active_count(),
    }


def retries(steps: int, measure_from: int, samples: int = 5) -> Any:
    """A new pipe each step; every second step fails on rank 1 (a layer raises), as a job
    that retries after a failure would. Usage after each failed step from ``measure_from``
    on: the lowest of the first ``samples`` and of the last ``samples``.

    NOTE: the lowest, not one reading: a pipe freed by the collector a step later holds a
    socket or two meanwhile, which is garbage, not a leak; a leak raises the floor too.
    """
    me = dist.get_rank()
    failing = {"on": False}

    class Bomb(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if failing["on"] and me == 1:
                raise ValueError("boom")
            return x

    x, y = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    readings: list[dict[str, int]] = []
    failures = 0
    for step in range(steps):
        failing["on"] = step % 2 == 1
        model = nn.Sequential(nn.Linear(WIDTH, WIDTH), Bomb(), nn.Linear(WIDTH, WIDTH), Bomb())
        pipe = gd.DistributedGPipe(model, chunks=2, timeout=60)
        try:
            pipe.train_step(x, y, nn.functional.mse_loss)
        except (gd.PipelineFailure, ValueError):
            failures += 1
        pipe.close()
        del pipe, model
        if step >= measure_from - 1 and step % 2 == 1:
            readings.append(_usage())
    assert len(readings) >= 2 * samples, "too few steps to compare"

    def lowest(part: list[dict[str, int]]) -> dict[str, int]:
        return {key: min(r[key] for r in part) for key in part[0]}

    return {
        "start": lowest(readings[:samples]),
        "end": lowest(readings[-samples:]),
        "failures": failures,
    }


def forged_records(steps: int = 4) -> Any:
    """After the first step, a client of the store that is not a rank writes a failure record
    and wakes every watcher, signed and unsigned; the job must train on, equal to plain."""
    me, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    y = torch.randn(4, WIDTH, dtype=torch.float64)
    model = mlp(world)
    pipe = gd.DistributedGPipe(model, chunks=2)
    pipe.train_step(x, y, nn.functional.mse_loss)
    dist.barrier()
    if me == 0:
        forger = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=10),
        )
        prefix = pipe._faults._prefix
        fake = {"rank": 1, "error": "forged", "stage": None, "microbatch": None, "action": None}
        forged = json.dumps({"failure": json.dumps(fake), "mac": "0" * 64})
        forger.set(f"{prefix}/failure", forged)
        forger.set(f"{prefix}/failure", json.dumps(fake))  # unsigned, as the old format
        for rank in range(world):
            forger.set(f"{prefix}/wake/{rank}", b"failure")
    dist.barrier()
    for param in model.parameters():
        param.grad = None
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    ref = _reference(partial(mlp, world), x, y, nn.functional.mse_loss)
    result = _compare(pipe, model, loss, ref)
    heard = pipe._faults.check()  # the forged record is not taken for a failure
    pipe.close()
    gc.collect()
    return {**result, "heard": None if heard is None else heard.error}
