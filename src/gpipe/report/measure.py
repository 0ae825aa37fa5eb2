"""Measuring on a shared machine: medians of repeated steps, and a process's peak memory."""

from __future__ import annotations

import ctypes
import ctypes.util
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["PeakMemory", "layer_times", "median_seconds", "peak_rss_during"]


def median_seconds(step: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """The median wall time of ``step()`` over ``repeats`` runs, after ``warmup`` untimed.

    The median, not the mean: on a machine shared with other work a few runs come out
    slow for reasons of their own, and the median ignores them.
    """
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def peak_rss_during(step: Callable[[], object]) -> int | None:
    """Bytes of resident memory ``step()`` added at its peak, above what the process held.

    Linux only (None elsewhere): memory the C allocator keeps after frees is handed back
    first (``malloc_trim``), then the kernel's high-water mark (``VmHWM``) is reset to the
    current size, the step runs, and the new high-water mark less the size before is its
    peak. This is what the machine must provide for the step, allocator and all.
    """
    if not sys.platform.startswith("linux"):
        step()
        return None
    _trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size
    except OSError:
        step()
        return None
    before = _status("VmRSS")
    step()
    return max(0, _status("VmHWM") - before)


class PeakMemory:
    """The resident memory a stretch of code adds at its peak (Linux; None elsewhere).

    ``start()`` hands freed memory back, resets the high-water mark and notes the size;
    ``peak()`` is the high-water mark since, less that size.
    """

    def __init__(self) -> None:
        self._before: int | None = None

    def start(self) -> None:
        if not sys.platform.startswith("linux"):
            return
        _trim()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return
        self._before = _status("VmRSS")

    def peak(self) -> int | None:
        if self._before is None:
            return None
        return max(0, _status("VmHWM") - self._before)


def _trim() -> None:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def layer_times(model: Any, sample: Any, runs: int = 3) -> tuple[list[float], list[float]]:
    """Each layer's forward and backward seconds: the least of ``runs`` profiles.

    :func:`gpipe.balance.profile` keeps the median of its repeats, which a burst of
    other work on a shared machine can still move; other work only ever adds time, so the
    least of a few profiles is the layer's own cost.
    """
    from gpipe.balance import profile

    profiles = [profile(model, sample, repeats=5) for _ in range(runs)]
    count = len(profiles[0].forward)
    forward = [min(p.forward[i] for p in profiles) for i in range(count)]
    backward = [min(p.backward[i] for p in profiles) for i in range(count)]
    return forward, backward
