"""A job one of whose ranks stops answering, run as plain processes (tests/test_fail_safely.py).

``GPIPE_VICTIM`` is the rank; ``GPIPE_HOW`` is what happens to it in its second step:
"stop" (SIGSTOP: a hung process), "kill" (SIGKILL) or "hook" (a forward that never returns).
The victim says on stderr when it stops; a survivor prints ``FAILED <unix time> <message>``
and exits with status 3 through the interpreter's own teardown (no os._exit), so the test
sees its real exit.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
from torch import nn

import gpipe.distributed as gd

rank, world = gd.init(timeout=60)
victim, how = int(os.environ["GPIPE_VICTIM"]), os.environ["GPIPE_HOW"]
timeout = float(os.environ.get("GPIPE_TIMEOUT", "5"))


class Trap(nn.Module):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Trap.calls += 1
        if rank == victim and Trap.calls == 2 * 2 + 1:  # 2 micro-batches a step: step 2
            print(f"STOPPING {time.time()!r}", file=sys.stderr, flush=True)
            if how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                threading.Event().wait()  # a deadlocked hook
        return x


model = nn.Sequential(*[layer for _ in range(world) for layer in (nn.Linear(4, 4), Trap())])
pipe = gd.DistributedGPipe(model, chunks=2, timeout=timeout)
x, y = torch.randn(4, 4), torch.randn(4, 4)
try:
    for _ in range(5):
        pipe.train_step(x, y, nn.functional.mse_loss)
except gd.PipelineFailure as error:
    print(f"FAILED {time.time()!r} {error}", file=sys.stderr, flush=True)
    sys.exit(3)
