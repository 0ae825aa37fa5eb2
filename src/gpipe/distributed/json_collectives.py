"""Collectives of JSON values, sent as UTF-8 bytes in uint8 tensors: nothing is pickled.

``torch.distributed``'s ``*_object`` collectives pickle what they send and unpickle what
they receive, so a peer (or whatever speaks on its port) could run code in this process;
JSON cannot.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_json", "broadcast_json"]


Wait = Callable[[Any], None]


def all_gather_json(value: Any, group: Any = None, wait: Wait | None = None) -> list[Any]:
    """Every rank's ``value`` (anything ``json.dumps`` takes), in the group's rank order.

    A collective: every rank of ``group`` calls it. Tuples come back as lists. ``wait``
    waits for each collective's work (a pipe's guard, which wakes on a failure anywhere);
    None blocks in it.
    """
    device = _device(group)
    data = _encode(value)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    _run(dist.all_gather, wait, sizes, size, group=group)
    lengths = [int(n) for n in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty_like(padded) for _ in lengths]
    _run(dist.all_gather, wait, gathered, padded, group=group)
    return [_decode(t[:n]) for t, n in zip(gathered, lengths)]


def broadcast_json(value: Any, src: int = 0, group: Any = None, wait: Wait | None = None) -> Any:
    """``value`` as the rank ``src`` (a global rank) holds it, on every rank of ``group``;
    ``wait`` as :func:`all_gather_json`."""
    device = _device(group)
    mine = _encode(value) if dist.get_rank() == src else b""
    size = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    _run(dist.broadcast, wait, size, src, group=group)
    data = torch.zeros(int(size), dtype=torch.uint8, device=device)
    if mine:
        data[:] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    _run(dist.broadcast, wait, data, src, group=group)
    return _decode(data)


def _run(collective: Callable[..., Any], wait: Wait | None, *args: Any, group: Any) -> None:
    """Run ``collective``: blocking, or posted and handed to ``wait``."""
    if wait is None:
        collective(*args, group=group)
    else:
        wait(collective(*args, group=group, async_op=True))


def _encode(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def _decode(data: torch.Tensor) -> Any:
    return json.loads(bytes(data.cpu().numpy()).decode())


def _device(group: Any) -> torch.device:
    """Where the group's collectives take their tensors: the current GPU under NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
