"""Before the first step: every rank must have built the same pipe, or none runs."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import gpipe
from gpipe.distributed.mesh import collective_device

__all__ = ["check_same_everywhere"]


def check_same_everywhere(settings: dict[str, Any], wait: Callable[[Any], None]) -> None:
    """Compare this rank's ``settings`` (and versions) with every rank's.

    A collective over the whole job, of two numbers per rank: the lowest and highest hash
    of every rank's settings. Only when they differ do the ranks exchange the settings
    themselves (as JSON, never pickled), to name what differs. Ranks given different
    arguments (another balance, a different model, another torch) would exchange messages
    that do not fit and hang or compute nonsense; here they all stop at once instead.

    Args:
        settings: JSON-able values every rank must share.
        wait: waits for a collective's work, or raises if a rank failed meanwhile.

    Raises:
        ValueError: on every rank, when any rank's settings differ from rank 0's.
    """
    mine = {**settings, "torch": torch.__version__, "gpipe": gpipe.__version__}
    text = json.dumps(mine, sort_keys=True, default=repr).encode()
    code = zlib.crc32(text)
    device = collective_device(dist.group.WORLD)
    low = torch.tensor([code], dtype=torch.int64, device=device)
    high = low.clone()
    wait(dist.all_reduce(low, dist.ReduceOp.MIN, async_op=True))
    wait(dist.all_reduce(high, dist.ReduceOp.MAX, async_op=True))
    if int(low) == int(high):
        return
    everyone = [json.loads(data) for data in _gathered(text, device, wait)]
    for rank, theirs in enumerate(everyone):
        differ = [key for key in everyone[0] if theirs.get(key) != everyone[0][key]]
        if differ:
            shown = ", ".join(
                f"{key}: rank 0 has {everyone[0][key]!r}, rank {rank} has {theirs.get(key)!r}"
                for key in differ
            )
            raise ValueError(
                f"the ranks built different pipes ({shown}): every rank must construct "
                "DistributedGPipe with the same model and arguments"
            )


def _gathered(data: bytes, device: torch.device, wait: Callable[[Any], None]) -> list[bytes]:
    """Every rank's ``data``, gathered as padded byte tensors."""
    world = dist.get_world_size()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    wait(dist.all_gather(sizes, size, async_op=True))
    longest = max(int(n) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    wait(dist.all_gather(gathered, padded, async_op=True))
    return [bytes(t.cpu()[: int(n)].tolist()) for t, n in zip(gathered, sizes)]
