"""Speedup against K and M: measured on sleeping stages, simulated, and by formula.

A model whose whole forward and backward sleep a known time per micro-batch is cut into K
stages of a K-th each. One device would take M times the whole model's time; a pipe takes
what its schedule, its runtime and its hand-offs make of it. GPipe's schedule alone gives
K / (1 + (K - 1)/M).
"""

from __future__ import annotations

import statistics

from gpipe.analysis import Costs, simulate
from gpipe.report.latency import sleep_pipeline
from gpipe.schedule import make_schedule

__all__ = ["formula", "measure_speedups", "simulated_speedup"]


def formula(stages: int, microbatches: int) -> float:
    """GPipe's speedup over one device with equal stages and free hand-offs."""
    return stages / (1 + (stages - 1) / microbatches)


def measure_speedups(
    stages: tuple[int, ...],
    counts: tuple[int, ...],
    forward_ms: float,
    backward_ms: float,
    *,
    steps: int = 2,
) -> tuple[dict[tuple[int, int], float], float]:
    """Speedups of K sleeping stages over one device doing the whole model, and the
    runtime's cost per action fitted from them (ms).

    The whole model sleeps ``forward_ms`` forward and ``backward_ms`` backward per
    micro-batch; K stages sleep a K-th of it each. One device would take M times the
    whole model's time; the speedup is that over the step's median time.
    """
    speedups, overheads = {}, []
    for k in stages:
        f, b = forward_ms / k, backward_ms / k
        for m in counts:
            step = sleep_pipeline(k, m, f, b, steps=steps)
            speedups[(k, m)] = m * (forward_ms + backward_ms) / 1e3 / step.seconds
            # what the step took beyond the schedule, per action on its critical path
            scheduled = (m + k - 1) * (f + b) / 1e3
            overheads.append(max(0.0, step.seconds - scheduled) / (2 * (m + k - 1)) * 1e3)
    return speedups, statistics.median(overheads)


def simulated_speedup(
    stages: int,
    microbatches: int,
    forward_ms: float,
    backward_ms: float,
    *,
    overhead_ms: float = 0.0,
    transfer_ms: float = 0.0,
) -> float:
    """The simulator's speedup for the same model: K equal stages, each action paying
    ``overhead_ms``, each hand-off between devices ``transfer_ms``."""
    costs = Costs(
        forward=forward_ms / stages + overhead_ms,
        backward=backward_ms / stages + overhead_ms,
        transfer=transfer_ms,
    )
    timeline = simulate(make_schedule("gpipe", stages, microbatches), costs)
    return microbatches * (forward_ms + backward_ms) / timeline.makespan
