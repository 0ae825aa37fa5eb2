"""A healthy job with a ZeroRedundancyOptimizer over 2 replicas of a 2-stage pipe, run as a
plain script (tests/test_distributed.py): every rank must exit with status 0 on its own.
"""

from __future__ import annotations

import torch
from torch import nn

import gpipe.distributed as gd

rank, world = gd.init(timeout=30)
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(8)])
pipe = gd.DistributedGPipe(
    model, balance=[4, 4], chunks=8, schedule="1f1b", dp_size=2, zero=True, timeout=30
)
optimizer = pipe.make_optimizer(torch.optim.AdamW, lr=3e-4)
pipe.train_step(torch.randn(64, 512), torch.randn(64, 512), nn.functional.mse_loss)
optimizer.step()
print(f"rank {rank} done", flush=True)
