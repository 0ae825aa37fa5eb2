"""Run a function in N processes that form one torch.distributed job, as a test needs it.

Plain subprocesses with the variables torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1, MASTER_PORT on a port picked free), so no launcher can rescue a hung
rank: the test sees exactly what a user launching by hand would. Every process is ended by
the time :func:`launch` returns, and a run past its deadline is killed.

A target is ``"module:function"`` importable from the tests folder; it runs after
``gpipe.distributed.init()`` with the keyword arguments given, and what it returns (tensors,
numbers, strings, lists and dicts of them) comes back through a file read with
``weights_only=True``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TESTS = Path(__file__).parent


@dataclass
class Rank:
    """What one process did."""

    rank: int
    returncode: int | None  # None: still running at the deadline (then killed)
    result: Any
    error: str  # the traceback, if the target raised
    stderr: str
    seconds: float  # from the launch to the end of the target (its return or its raise)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_all(commands: list[tuple[list[str], dict[str, str]]], timeout: float) -> list[Any]:
    """Run each (command, environment) at once and wait for them all; every process is
    killed before this returns. Each one's ``(returncode, stderr)``."""
    procs = [
        subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for command, env in commands
    ]
    try:
        errors = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, error) for p, error in zip(procs, errors)]


def run_script(script: str, world: int, timeout: float) -> list[Any]:
    """Run the Python file ``script`` as ``world`` plain processes with torchrun's variables
    (nothing to end the others if one fails); each one's ``(returncode, stderr)``."""
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
        PYTHONFAULTHANDLER="1",  # a rank that aborts prints every thread's stack
    )
    return run_all(
        [
            ([sys.executable, script], dict(env, RANK=str(r), LOCAL_RANK=str(r)))
            for r in range(world)
        ],
        timeout,
    )


def launch(
    target: str,
    world: int,
    *,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
    may_hang: tuple[int, ...] = (),
    **kwargs: Any,
) -> list[Rank]:
    """Run ``target(**kwargs)`` on ``world`` ranks; return each rank's outcome.

    Args:
        may_hang: ranks a test stops on purpose: once every other rank has ended they are
            killed, and their ``returncode`` is None.

    Raises:
        AssertionError: a rank was still running after ``timeout`` seconds (all are killed).
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gpipe-ranks-") as tmp:
        folder = Path(tmp)
        (folder / "kwargs.json").write_text(json.dumps(kwargs))
        base = dict(os.environ, **(env or {}))
        base.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(world),
            GPIPE_TEST_TARGET=target,
            GPIPE_TEST_DIR=tmp,
            PYTHONPATH=os.pathsep.join([str(TESTS), base.get("PYTHONPATH", "")]),
            OMP_NUM_THREADS="1",
        )
        began, began_wall = time.monotonic(), time.time()
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", "import ranks; ranks._child()"],
                env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            for r in range(world)
        ]
        ended: dict[int, float] = {}
        try:
            others = world - len(may_hang)
            while (
                len(ended) < world
                and len([r for r in ended if r not in may_hang]) < others
                and time.monotonic() - began < timeout
            ):
                for r, proc in enumerate(procs):
                    if r not in ended and proc.poll() is not None:
                        ended[r] = time.monotonic() - began
                time.sleep(0.02)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            stderrs = [proc.communicate()[1] for proc in procs]
        outcomes = []
        for r, proc in enumerate(procs):
            out, err = folder / f"rank{r}.pt", folder / f"rank{r}.err"
            stamp = folder / f"rank{r}.time"
            seconds = float(stamp.read_text()) - began_wall if stamp.exists() else timeout
            outcomes.append(
                Rank(
                    r,
                    proc.returncode if r in ended else None,
                    torch.load(out, weights_only=True) if out.exists() else None,
                    err.read_text() if err.exists() else "",
                    stderrs[r],
                    seconds,
                )
            )
    hung = [o.rank for o in outcomes if o.returncode is None and o.rank not in may_hang]
    assert not hung, f"ranks {hung} still running after {timeout} s:\n" + "\n".join(
        o.stderr[-2000:] for o in outcomes
    )
    return outcomes


def check(outcomes: list[Rank]) -> list[Any]:
    """Every rank's result, after asserting that every rank succeeded."""
    failed = [o for o in outcomes if o.returncode != 0]
    assert not failed, "\n".join(
        f"rank {o.rank} exited {o.returncode}:\n{o.error or o.stderr[-3000:]}" for o in failed
    )
    return [o.result for o in outcomes]


def _child() -> None:
    import importlib

    import gpipe.distributed as gd

    folder = Path(os.environ["GPIPE_TEST_DIR"])
    rank = int(os.environ["RANK"])
    module, _, name = os.environ["GPIPE_TEST_TARGET"].partition(":")
    kwargs = json.loads((folder / "kwargs.json").read_text())
    code = 0
    try:
        gd.init(timeout=60)
        result = getattr(importlib.import_module(module), name)(**kwargs)
        torch.save(result, folder / f"rank{rank}.pt")
    except BaseException:
        (folder / f"rank{rank}.err").write_text(traceback.format_exc())
        sys.stderr.write(traceback.format_exc())
        code = 1
    (folder / f"rank{rank}.time").write_text(repr(time.time()))
    _leave_together()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # NOTE: skip interpreter teardown: a peer's pending receive must not hold us


def _leave_together(grace: float = 5.0) -> None:
    """Wait (a little) for every rank to finish before leaving.

    NOTE: started by hand, rank 0's process hosts the c10d store; torchrun's agent would
    keep it alive for the slower ranks, so the harness does the same. A store whose host a
    test stopped (SIGSTOP) answers nothing: the wait runs in a thread, given up after
    ``grace`` s.
    """
    import threading

    import torch.distributed as dist

    if not dist.is_initialized():
        return

    def wait() -> None:
        try:
            store = dist.distributed_c10d._get_default_store()
            count = store.add("harness/done", 1)
            deadline = time.monotonic() + grace
            while count < dist.get_world_size() and time.monotonic() < deadline:
                time.sleep(0.05)
                count = store.add("harness/done", 0)
        except Exception:
            return

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(grace + 1.0)
