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


def check_same_everywhere(
    settings: dict[str, Any], wait: Callable[[Any], None], group: Any = None
) -> None:
    """Compare this rank's ``settings`` (and versions) with every rank's.

    A collective over the whole job, of two numbers per rank: the lowest and highest hash
    of every rank's settings. Only when they differ do the ranks exchange the settings
    themselves (as JSON, never pickled), to name what differs. Ranks given different
    arguments (another balance, a different model, another torch) would exchange messages
    that do not fit and hang or compute nonsense; here they all stop at once instead.

    Args:
        settings: JSON-able values every rank must share.
        wait: waits for a collective's work, or raises if a rank failed meanwhile.
        group: every rank of the job (by default the default group).

    Raises:
        ValueError: on every rank, when any rank's settings differ from rank 0's.
    """
    mine = {**settings, "torch": torch.__version__, "gpipe": gpipe.__version__}
    text = json.dumps(mine, sort_keys=True, default=repr).encode()
    code = zlib.crc32(text)
    device = collective_device(group or dist.group.WORLD)
    low = torch.tensor([code], dtype=torch.int64, device=device)
    high = low.clone()
    wait(dist.all_reduce(low, dist.ReduceOp.MIN, group=group, async_op=True))
    wait(dist.all_reduce(high, dist.ReduceOp.MAX, group=group, async_op=True))
    if int(low) == int(high):
        return
    everyone = [json.loads(data) for data in _gathered(text, device, wait, group)]
    for rank, theirs in enumerate(everyone):
        differ = [key for key in everyone[0] if theirs.get(key) != everyone[0][key]]
        if differ:
            shown = ", ".join(
                _first_difference(key, everyone[0][key], theirs.get(key), rank) for key in differ
            )
            raise ValueError(
                f"the ranks built different pipes ({shown}): every rank must construct "
                "DistributedGPipe with the same model and arguments"
            )


def _first_difference(key: str, ours: Any, theirs: Any, rank: int) -> str:
    """Where rank 0's and rank ``rank``'s values of ``key`` differ: for two lists (a
    model's tensors), their first differing entry, not thousands of them."""
    if not (isinstance(ours, list) and isinstance(theirs, list)):
        return f"{key}: rank 0 has {ours!r}, rank {rank} has {theirs!r}"
    at = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs))
    )
    shown = f"{key}[{at}]: rank 0 has {_entry(ours, at)}, rank {rank} has {_entry(theirs, at)}"
    if len(ours) != len(theirs):
        shown += f" ({len(ours)} entries on rank 0, {len(theirs)} on rank {rank})"
    return shown


def _entry(values: list[Any], at: int) -> str:
    return repr(values[at]) if at < len(values) else "no such entry"


def _gathered(
    data: bytes, device: torch.device, wait: Callable[[Any], None], group: Any
) -> list[bytes]:
    """Every rank's ``data``, gathered as padded byte tensors."""
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    wait(dist.all_gather(sizes, size, group=group, async_op=True))
    longest = max(int(n) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    wait(dist.all_gather(gathered, padded, group=group, async_op=True))
    return [bytes(t.cpu()[: int(n)].tolist()) for t, n in zip(gathered, sizes)]
