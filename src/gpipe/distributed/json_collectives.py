"""Collectives of JSON values, sent as UTF-8 bytes in uint8 tensors: nothing is pickled.

``torch.distributed``'s ``*_object`` collectives pickle what they send and unpickle what
they receive, so a peer (or whatever speaks on its port) could run code in this process;
JSON cannot.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_json", "broadcast_json"]


def all_gather_json(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value`` (anything ``json.dumps`` takes), in the group's rank order.

    A collective: every rank of ``group`` calls it. Tuples come back as lists.
    """
    device = _device(group)
    data = _encode(value)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(n) for n in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(gathered, padded, group=group)
    return [_decode(t[:n]) for t, n in zip(gathered, lengths)]


def broadcast_json(value: Any, src: int = 0, group: Any = None) -> Any:
    """``value`` as the rank ``src`` (a global rank) holds it, on every rank of ``group``."""
    device = _device(group)
    mine = _encode(value) if dist.get_rank() == src else b""
    size = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    data = torch.zeros(int(size), dtype=torch.uint8, device=device)
    if mine:
        data[:] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    dist.broadcast(data, src, group=group)
    return _decode(data)


def _encode(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def _decode(data: torch.Tensor) -> Any:
    return json.loads(bytes(data.cpu().numpy()).decode())


def _device(group: Any) -> torch.device:
    """Where the group's collectives take their tensors: the current GPU under NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
