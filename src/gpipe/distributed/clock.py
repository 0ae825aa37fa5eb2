"""One clock for every rank: each rank's offset from rank 0's, measured by ping-pong."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["offsets_to_rank0"]


def offsets_to_rank0(ranks: list[int], group: Any, rounds: int = 8) -> int:
    """This rank's ``perf_counter_ns`` minus rank ``ranks[0]``'s, in nanoseconds.

    NTP's way: the first rank sends its time, the other answers with its own, and of several
    rounds the one with the shortest round trip bounds the offset best (by half of it).
    Every rank of ``ranks`` must call this; it is a few milliseconds of messages.
    """
    me = dist.get_rank()
    first = ranks[0]
    offset = 0
    if me == first:
        for peer in ranks[1:]:
            best = None
            for _ in range(rounds):
                sent = time.perf_counter_ns()
                dist.send(torch.tensor([sent], dtype=torch.int64), peer, group=group)
                theirs = torch.empty(1, dtype=torch.int64)
                dist.recv(theirs, peer, group=group)
                back = time.perf_counter_ns()
                trip = back - sent
                estimate = int(theirs.item()) - (sent + back) // 2
                if best is None or trip < best[0]:
                    best = (trip, estimate)
            assert best is not None
            dist.send(torch.tensor([best[1]], dtype=torch.int64), peer, group=group)
    elif me in ranks:
        for _ in range(rounds):
            dist.recv(torch.empty(1, dtype=torch.int64), first, group=group)
            dist.send(torch.tensor([time.perf_counter_ns()], dtype=torch.int64), first, group=group)
        result = torch.empty(1, dtype=torch.int64)
        dist.recv(result, first, group=group)
        offset = int(result.item())
    return offset
