"""What this host's timer does: how far ``time.sleep`` overshoots what it was asked for.

Latency benchmarks sleep to stand in for kernels, so every sleep costs its request plus this
overshoot (timer slack and wake-up latency, which vary with the kernel and the machine's
load). Benchmarks print it beside their figures, because it moves absolute numbers from
day to day while ratios measured in the same run hold.
"""

from __future__ import annotations

import statistics
import time


def sleep_overshoot_us(seconds: float = 0.5e-3, repeats: int = 200) -> float:
    """The median microseconds ``time.sleep(seconds)`` takes beyond ``seconds``."""
    extra = []
    for _ in range(repeats):
        began = time.perf_counter()
        time.sleep(seconds)
        extra.append(time.perf_counter() - began - seconds)
    return statistics.median(extra) * 1e6
