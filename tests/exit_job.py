"""A job whose rank 1 raises in its second step, run as a plain script (tests/test_distributed.py).

Nothing here skips the interpreter's teardown: each rank must exit with status 1 on its own.
"""

from __future__ import annotations

import torch
from torch import nn

import gpipe.distributed as gd

rank, world = gd.init(timeout=30)


class Bomb(nn.Module):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Bomb.calls += 1
        if rank == 1 and Bomb.calls == 4:  # 2 micro-batches per step: the second step
            raise ValueError("boom on rank 1")
        return x


model = nn.Sequential(nn.Linear(4, 4), Bomb(), nn.Linear(4, 4), Bomb())
pipe = gd.DistributedGPipe(model, chunks=2, timeout=30)
x, y = torch.randn(4, 4), torch.randn(4, 4)
for _ in range(5):
    pipe.train_step(x, y, nn.functional.mse_loss)
