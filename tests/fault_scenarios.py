"""What the ranks of the fail-safely tests run (tests/test_fail_safely.py): each function runs
on every rank, under tests/ranks.py's launch."""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import threading
import time
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


def _open_things() -> list[str]:
    """What each open file descriptor is (its ``/proc/self/fd`` link) and each OS thread's
    name, to name a leak."""
    links = []
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            links.append(f"fd {fd}: {os.readlink(f'/proc/self/fd/{fd}')}")
    for task in sorted(os.listdir("/proc/self/task"), key=int):
        with contextlib.suppress(OSError):  # a thread that just exited
            links.append(f"thread {task}: {Path(f'/proc/self/task/{task}/comm').read_text()}")
    return links


def _os_threads_settled(expected: int, within: float = 1.0) -> int:
    """This process's OS threads once those whose Python part ended have exited (``within``
    s at most): on Python < 3.13, ``Thread.join`` returns before the OS thread is gone."""
    deadline = time.monotonic() + within
    while (threads := _usage()["threads"]) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads


def retries(steps: int, measure_from: int) -> Any:
    """A new pipe each step; every second step fails on rank 1 (a layer raises), as a job
    that retries after a failure would. Usage as soon as each failed step's pipe is closed,
    from step ``measure_from`` on (``settled_threads``: OS threads once the threads joined
    have exited), with what was open at the first reading and at any that differs from it."""
    me = dist.get_rank()
    failing = {"on": False}

    class Bomb(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if failing["on"] and me == 1:
                raise ValueError("boom")
            return x

    x, y = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    readings: list[dict[str, int]] = []
    open_things: dict[int, list[str]] = {}
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
        if step >= measure_from - 1 and step % 2 == 1:
            if not readings:  # NOTE: the baseline, once every thread that ended has exited
                time.sleep(0.5)
            now = _usage()
            first = readings[0] if readings else now
            if any(now[k] != first[k] for k in ("threads", "fds", "python_threads")):
                open_things[step] = _open_things()
            now["settled_threads"] = _os_threads_settled(first["threads"])
            readings.append(now)
            if len(readings) == 1:
                open_things[step] = _open_things()
        del pipe, model
    return {"readings": readings, "open": open_things, "failures": failures}


def _channel_keys(pipe: Any, world: int) -> list[str]:
    """Every key the pipe's fault channel reads or waits on (see fault_channel.py)."""
    faults = pipe._guard.faults
    return [
        faults._key,  # the failure record
        f"{faults._key}/heard",  # acknowledgements: a counter
        f"{faults._key}/heard/all",  # ... and the key every rank waits on
        *(faults._wake(rank) for rank in range(world)),  # each watcher's wake-up key
        *(faults._heartbeat._alive(rank) for rank in range(world)),  # each rank's beats
    ]


def forged_records(steps: int = 4) -> Any:
    """After the first step, a client of the store that is not a rank keeps writing every
    key the fault channel reads, with values a rank never wrote: failure records signed
    under no token or with the old unsigned format, wake-ups for every watcher, beats that
    say a rank is stuck, acknowledgements. The job must train on, equal to plain, with no
    failure heard; ``writes`` says how many forged writes it took."""
    me, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    y = torch.randn(4, WIDTH, dtype=torch.float64)
    model = mlp(world)
    pipe = gd.DistributedGPipe(model, chunks=2)
    pipe.train_step(x, y, nn.functional.mse_loss)
    dist.barrier()
    stop, writes = threading.Event(), [0]
    errors: list[str] = []
    forging = None
    if me == 0:
        forger = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=10),
        )
        keys = _channel_keys(pipe, world)
        fake = {"rank": 1, "error": "forged", "stage": None, "microbatch": None, "action": None}
        stuck = {"beat": 10**9, "busy": True, "entered": 1, "done": 0, "waiting": False}
        values = [
            json.dumps({"failure": json.dumps(fake), "mac": "0" * 64}),  # no token's MAC
            json.dumps({"body": json.dumps(fake), "mac": "0" * 64}),
            json.dumps(fake),  # unsigned, as the old format
            json.dumps({"body": json.dumps(stuck), "mac": "0" * 64}),
            json.dumps(stuck),
            "failure",
        ]

        def forge() -> None:
            try:
                while not stop.is_set():
                    for key in keys:
                        for value in values:
                            forger.set(key, value)
                            writes[0] += 1
                    stop.wait(0.02)
            except Exception as error:  # the test fails on it: the forging stopped
                errors.append(repr(error))

        forging = threading.Thread(target=forge)
        forging.start()
        time.sleep(0.3)
    dist.barrier()
    try:
        for _ in range(steps - 1):
            for param in model.parameters():
                param.grad = None
            loss = pipe.train_step(x, y, nn.functional.mse_loss)
    finally:
        stop.set()
        if forging is not None:
            forging.join()
    ref = _reference(partial(mlp, world), x, y, nn.functional.mse_loss)
    result = _compare(pipe, model, loss, ref)
    heard = pipe._guard.faults.check()  # no forged record is taken for a failure
    pipe.close()
    gc.collect()
    return {
        **result,
        "heard": None if heard is None else heard.error,
        "writes": writes[0],
        "errors": errors,
    }
