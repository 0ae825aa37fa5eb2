"""A training script as users write it, for `torchrun --nproc-per-node N torchrun_job.py OUT`.

Three AdamW steps of a DistributedGPipe beside the same three steps of the plain model; each
rank saves its largest differences to OUT/rank<r>.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

import gpipe.distributed as gd
from dist_scenarios import mlp


def main(out: Path) -> None:
    rank, world = gd.init()
    model, plain = mlp(), mlp()
    dp = int(os.environ.get("GPIPE_TEST_DP", "1"))
    pipe = gd.DistributedGPipe(model, chunks=4, schedule="1f1b", dp_size=dp)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    reference = torch.optim.AdamW(plain.parameters(), lr=0.01)
    torch.manual_seed(5)
    worst = {"loss": 0.0, "weight": 0.0}
    for _ in range(3):
        x = torch.randn(8, 6, dtype=torch.float64)
        y = torch.randn(8, 6, dtype=torch.float64)
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
        optimizer.step()
        optimizer.zero_grad()
        expected = nn.functional.mse_loss(plain(x), y)
        expected.backward()
        reference.step()
        reference.zero_grad()
        worst["loss"] = max(worst["loss"], abs(loss.item() - expected.item()))
    for p, q in zip(model.parameters(), plain.parameters()):
        if p.device.type != "meta":
            worst["weight"] = max(worst["weight"], float((p - q).detach().abs().max()))
    torch.save({"world": world, **worst}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
