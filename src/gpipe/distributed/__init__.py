"""The distributed runtime: one pipeline device per process, launched by torchrun.

    # torchrun --nproc-per-node 4 train.py
    import gpipe.distributed as gd
    gd.init()
    pipe = gd.DistributedGPipe(model, balance=[2, 2, 2, 2], chunks=8, schedule="1f1b")
    loss = pipe.train_step(x, target, loss_fn)

See docs/distributed.md.
"""

from gpipe.distributed.checkpoint import consolidate, newest_checkpoint
from gpipe.distributed.failure import PipelineFailure
from gpipe.distributed.launch import device, init, spawn
from gpipe.distributed.pipe import DistributedGPipe

__all__ = [
    "DistributedGPipe",
    "PipelineFailure",
    "consolidate",
    "device",
    "init",
    "newest_checkpoint",
    "spawn",
]
