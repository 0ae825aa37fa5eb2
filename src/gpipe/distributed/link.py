"""The link between two ranks, measured: latency per message and bandwidth in bytes/s."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["measure_link"]


def measure_link(
    ranks: list[int],
    group: Any,
    device: torch.device | None = None,
    *,
    small: int = 8,
    large: int = 1 << 20,
    rounds: int = 5,
) -> tuple[float, float]:
    """Latency (s) and bandwidth (bytes/s) between the first two ``ranks``, on every rank.

    A ping-pong of ``small`` bytes gives the latency (half the median round trip); one of
    ``large`` bytes gives the bandwidth from what it takes beyond that. Every rank of the
    group must call it; the others only receive the answer. One rank alone: (0, inf).

    The messages travel as the pipe's do: over ``group`` (the pipeline's, NCCL on GPUs),
    from ``device``. NOTE: NCCL's send and receive return once queued on the GPU, so on a
    GPU each round trip ends with a wait for the device: the clock then times the link,
    not the queueing. One round first, untimed, sets the pair's connection up.
    """
    device = device or torch.device("cpu")

    def settled() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    me = dist.get_rank()
    answer = torch.tensor([0.0, float("inf")], dtype=torch.float64, device=device)
    if len(ranks) > 1 and me in ranks[:2]:
        peer = ranks[1] if me == ranks[0] else ranks[0]
        times = {}
        for size in (small, large):
            data = torch.zeros(size // 4, dtype=torch.float32, device=device)
            trips = []
            for _ in range(rounds + 1):
                settled()
                began = time.perf_counter()
                if me == ranks[0]:
                    dist.send(data, peer, group=group)
                    dist.recv(data, peer, group=group)
                else:
                    dist.recv(data, peer, group=group)
                    dist.send(data, peer, group=group)
                settled()
                trips.append(time.perf_counter() - began)
            times[size] = statistics.median(trips[1:]) / 2
        latency = times[small]
        extra = max(times[large] - latency, 1e-9)
        answer = torch.tensor(
            [latency, (large - small) / extra], dtype=torch.float64, device=device
        )
    if len(ranks) > 1:
        dist.broadcast(answer, ranks[0], group=group)
    return float(answer[0]), float(answer[1])
