"""Measuring on a shared machine: layer times robust to load, and a process's peak memory."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["PeakMemory", "layer_times", "peak_rss_during"]


def peak_rss_during(step: Callable[[], object]) -> int | None:
    """Bytes of resident memory ``step()`` added at its peak, above what the process held.

    Linux only (None elsewhere); see :class:`PeakMemory`. This is what the machine must
    provide for the step, allocator and all.
    """
    memory = PeakMemory()
    memory.start()
    step()
    return memory.peak()


class PeakMemory:
    """The resident memory a stretch of code adds at its peak (Linux; None elsewhere).

    ``start()`` hands memory the C allocator kept after frees back (``malloc_trim``),
    resets the kernel's high-water mark (``VmHWM``) to the current size and notes that
    size; ``peak()`` is the high-water mark since, less the size noted.
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
