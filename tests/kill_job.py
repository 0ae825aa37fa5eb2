"""A job one of whose ranks is killed (or stopped) at a point drawn at random, run as plain
processes (tests/test_fail_safely.py).

``GPIPE_VICTIM`` is the rank, ``GPIPE_HOW`` "kill" (SIGKILL) or "stop" (SIGSTOP), and
``GPIPE_WHEN`` where: "step" (any moment of a step after the second, drawn over two steps'
time), or "build" (just before one of the torch.distributed calls of building a third
pipe, drawn among those the second one made: the first also made the groups every pipe
shares). ``GPIPE_SEED`` seeds the draw. As in
tests/stop_job.py, the victim says on stderr when it dies, and a survivor prints
``FAILED <unix time> <message>`` and exits with status 3 through the interpreter's own
teardown.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gpipe.distributed as gd

rank, world = gd.init(timeout=60)
victim, how = int(os.environ["GPIPE_VICTIM"]), os.environ["GPIPE_HOW"]
when = os.environ["GPIPE_WHEN"]
timeout = float(os.environ.get("GPIPE_TIMEOUT", "30"))
draw = random.Random(int(os.environ.get("GPIPE_SEED", "0")))


def die(note: str = "") -> None:
    """SIGKILL (or SIGSTOP) this process now, saying so on stderr."""
    print(f"STOPPING {time.time()!r} {note}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def die_after(seconds: float) -> None:
    """On the victim: die ``seconds`` from now."""

    def later() -> None:
        time.sleep(seconds)
        die()

    if rank == victim:
        threading.Thread(target=later, daemon=True).start()


def die_while_building_the_third_pipe() -> None:
    """On the victim: count the torch.distributed calls of building the second pipe, then
    die just before one of them, drawn at random, while building the third."""
    state = {"pipe": 0, "building": False, "calls": 0, "second": 0, "die_at": 0}

    def hooked(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if state["building"]:
                state["calls"] += 1
                if state["pipe"] == 3 and state["calls"] == state["die_at"]:
                    die(f"at call {state['calls']} of building")
            return real(*args, **kwargs)

        return call

    for name in ("new_group", "barrier", "broadcast", "all_gather", "all_reduce", "send", "recv"):
        setattr(dist, name, hooked(getattr(dist, name)))
    real_init = gd.DistributedGPipe.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        state.update(pipe=state["pipe"] + 1, building=True, calls=0)
        if state["pipe"] == 3:
            state["die_at"] = draw.randint(1, max(1, state["second"]))
        try:
            real_init(self, *args, **kwargs)
        finally:
            if state["pipe"] == 2:
                state["second"] = state["calls"]
            state["building"] = False

    gd.DistributedGPipe.__init__ = init  # type: ignore[method-assign]


def build() -> gd.DistributedGPipe:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(world)])
    return gd.DistributedGPipe(model, chunks=4, schedule="1f1b", timeout=timeout)


x, y = torch.randn(8, 8), torch.randn(8, 8)
try:
    if when == "build":
        if rank == victim:
            die_while_building_the_third_pipe()
        for _ in range(2):
            build().close()
        pipe = build()
        die_after(0.0)  # NOTE: in case the third pipe made fewer calls than the second
    else:
        pipe = build()
        for _ in range(2):
            began = time.monotonic()
            pipe.train_step(x, y, nn.functional.mse_loss)
        die_after(draw.uniform(0.0, 2 * (time.monotonic() - began)))
    for _ in range(100_000):  # NOTE: till the victim dies; no rank gets this far
        pipe.train_step(x, y, nn.functional.mse_loss)
except gd.PipelineFailure as error:
    print(f"FAILED {time.time()!r} {error}", file=sys.stderr, flush=True)
    sys.exit(3)
