"""The host: what running on this machine adds to the layers' profiled times.

Two things a profile of each layer alone cannot show: the runtime's own cost per action
(hand-offs, bookkeeping, Python), and "cpu" stages slowing each other down when together
they want more cores than the host has.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from gpipe.balance import Profile

__all__ = ["action_overhead", "host_share"]


def action_overhead(device: str, microbatches: int = 8, steps: int = 5) -> float:
    """Seconds the runtime adds to every action on this host, measured, not assumed.

    Two stages of a one-weight layer on ``device`` run a few steps: with nothing to compute,
    a step is hand-offs, bookkeeping and Python, along a critical path of M + K - 1
    forwards and as many backwards. A schedule with more actions (more micro-batches,
    zero-bubble's separate W, interleaving) pays this more often, which the profile of the
    layers alone cannot show.
    """
    from gpipe.pipe import GPipe  # the planner sits above the pipe, like the command line

    pipe = GPipe(
        nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)),
        [1, 1],
        devices=[device, device],
        chunks=microbatches,
        checkpoint="never",
        track_memory=False,
    )
    x = torch.zeros(microbatches, 1, device=device)
    seconds = []
    for run in range(steps + 2):
        began = time.perf_counter()
        pipe.train_step(x, x.to(pipe.devices[-1]), nn.functional.mse_loss)
        if run >= 2:
            seconds.append(time.perf_counter() - began)
    return statistics.median(seconds) / (2 * (microbatches + 1))


def host_share(
    measured: Profile,
    spans: list[tuple[int, int]],
    devices: list[str],
    placement: Sequence[int] | None = None,
) -> float:
    """How much slower each stage runs when "cpu" stages share this host's cores.

    The profile timed each layer alone and noted how much of that time its thread spent
    computing: near all of it for a layer that computes on the CPU (with every intra-op
    thread busy alongside), near none for one that waits on an accelerator (or sleeps).
    While the pipeline is full every stage runs at once, so when the CPU stages together
    want more cores than the host has, each runs ``wanted / cores`` times slower. Stages on
    accelerators compete for nothing.
    """
    if not measured.cpu:
        return 1.0
    cores = os.cpu_count() or 1
    threads = min(torch.get_num_threads(), cores)
    cpu = [0.0] * len(devices)
    busy = [0.0] * len(devices)
    for stage, (a, b) in enumerate(spans):
        device = placement[stage] if placement is not None else stage % len(devices)
        cpu[device] += sum(measured.cpu[a:b])
        busy[device] += sum(measured.forward[a:b]) + sum(measured.backward[a:b])
    wanted = 0.0
    for c, t, name in zip(cpu, busy, devices):
        if name.startswith("cpu") and t > 0:
            # r = the share of the time its thread computed. A stage that computes throughout
            # (r = 1) keeps every intra-op thread busy; one that mostly waits spends its
            # little CPU time in Python, on one core: interpolate between the two.
            r = min(1.0, c / t)
            wanted += r * (1 + (threads - 1) * r)
    return max(1.0, wanted / cores)
