"""Two ways timed in turns, and a verdict only when their difference stands above the noise.

On a shared machine other work takes a changing share of the cores, so one run of A and one
of B says little. :func:`in_turns` runs them in alternation (AB, BA, AB, ...) so that a change
of load hits both; :func:`judge` then compares the middle halves of their times (first to
third quartile). Only when those do not overlap, and other processes did not keep the host
busy while it ran, does it say which is faster, and by how much. Otherwise it says that this
run cannot tell, and why, with the host's load measured before and after.

NOTE: the load average cannot tell whose work it counts: a demo that has just trained for a
minute finds the load above its core count and would judge its own quiet host busy. So where
the system says (Linux's ``/proc/stat``), :class:`LoadMeter` counts the CPU time every
process spent while the measurement ran, less this process's own: what *other* work took.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "CpuTimes",
    "Load",
    "LoadMeter",
    "Verdict",
    "host_load",
    "in_turns",
    "judge",
    "spread",
]


@dataclass(frozen=True)
class Load:
    """The host's 1-minute load average before and after a measurement, and its cores.

    Attributes:
        before, after: the load average.
        cores: the host's cores.
        others: the cores other processes kept busy on average while the measurement ran
            (see :class:`LoadMeter`); None where the system does not say.
    """

    before: float
    after: float
    cores: int
    others: float | None = None

    def __str__(self) -> str:
        said = f"load {self.before:.1f} → {self.after:.1f} on {self.cores} cores"
        if self.others is not None:
            said += f", other processes {self.others:.1f} cores"
        return said

    @property
    def busy(self) -> bool:
        """Other work took a large share of the cores: more than half of them while the
        measurement ran, where that is known; else a load above the core count before it."""
        if self.others is not None:
            return self.others > self.cores / 2
        return self.before > self.cores

    @property
    def why_busy(self) -> str:
        """What made the host busy, for a verdict's reason."""
        if self.others is not None:
            return (
                f"other processes kept {self.others:.1f} of the {self.cores} cores busy while "
                "it ran: they took a changing share of the cores"
            )
        return (
            f"the host was busy before the run began (load {self.before:.1f} on "
            f"{self.cores} cores): other work took a changing share of the cores"
        )


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds spent so far: by every process on the host, and by this one; and when.

    Attributes:
        host: busy CPU seconds of the whole host since boot (``/proc/stat``: everything but
            idle and I/O wait); None where the system does not say.
        own: CPU seconds of this process, all its threads (``time.process_time``).
        wall: ``time.perf_counter()`` when they were read.
    """

    host: float | None
    own: float
    wall: float

    @classmethod
    def now(cls) -> CpuTimes:
        return cls(_host_busy_seconds(), time.process_time(), time.perf_counter())

    def others_since(self, earlier: CpuTimes) -> float | None:
        """Cores other processes kept busy on average from ``earlier`` to this reading."""
        if self.host is None or earlier.host is None or self.wall <= earlier.wall:
            return None
        others = (self.host - earlier.host) - (self.own - earlier.own)
        return max(0.0, others / (self.wall - earlier.wall))


def _host_busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    fields = lines[0].split() if lines else []
    listed = sum(line[:3] == "cpu" and line[3:4].isdigit() for line in lines)
    # NOTE: a container limited to some of a larger host's CPUs sees the whole host here,
    # whose other work need not compete with ours: then the figure says nothing.
    if not fields or fields[0] != "cpu" or listed != os.cpu_count():
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user already)
    counts = [int(v) for v in fields[1:9]]
    return (sum(counts) - counts[3] - counts[4]) / ticks


class LoadMeter:
    """The host's :class:`Load` around a measurement: ``meter = LoadMeter()``, measure,
    ``meter.stop()``. Other processes' share is counted only for work in this process (its
    threads); a measurement that starts processes of its own counts them as others."""

    def __init__(self) -> None:
        self._before = host_load()
        self._times = CpuTimes.now()

    def stop(self) -> Load:
        others = CpuTimes.now().others_since(self._times)
        return Load(self._before, host_load(), os.cpu_count() or 1, others)


def host_load() -> float:
    """The 1-minute load average (``os.getloadavg``); nan where the system has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return math.nan


def spread(times: Sequence[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of ``times``; all three equal for one time."""
    if len(times) == 1:
        return times[0], times[0], times[0]
    q1, median, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return q1, median, q3


@dataclass(frozen=True)
class Verdict:
    """What comparing B's times with A's can say.

    Attributes:
        a, b: the two ways' names.
        ratio: B's median time over A's.
        told: "slower" (B takes longer), "faster" (B takes less) or None: cannot tell.
        reason: why it cannot tell, or the spreads that let it tell.
        load: the host's load around the measurement.
        turns: how many times each ran.
        unit: what one of those times is ("turns", or "steps" pooled from launches).
    """

    a: str
    b: str
    ratio: float
    told: str | None
    reason: str
    load: Load
    turns: int
    unit: str = "turns"

    def __str__(self) -> str:
        if self.told == "slower":
            said = f"{self.b} costs {self.ratio:.2f}x {self.a}'s time"
        elif self.told == "faster":
            said = f"{self.b} is {1 / self.ratio:.2f}x faster than {self.a}"
        else:
            said = f"this run cannot tell {self.a} from {self.b} (median ratio {self.ratio:.2f})"
        return f"{said}: {self.reason}; medians of {self.turns} {self.unit}, {self.load}"

    @property
    def short(self) -> str:
        """The ratio, with a question mark when this run cannot tell: ``1.31x``, ``0.95x?``."""
        return f"{self.ratio:.2f}x" + ("" if self.told else "?")


def judge(
    a: str,
    a_times: Sequence[float],
    b: str,
    b_times: Sequence[float],
    load: Load,
    *,
    unit: str = "turns",
) -> Verdict:
    """Compare B's times with A's; a verdict only when the difference exceeds the spread.

    Args:
        a, b: names for the two ways, as the verdict prints them.
        a_times, b_times: seconds per run of each, from turns or launches in alternation.
        load: the host's load before and after.
        unit: what one time is, as the verdict names it.

    Returns:
        The verdict: "slower" or "faster" when the quartile ranges of the two do not overlap
        and other work did not keep the host busy (:attr:`Load.busy`), else None with the
        reason.

    Raises:
        ValueError: on an empty list of times.
    """
    if not a_times or not b_times:
        raise ValueError(f"no times to compare: {len(a_times)} for {a}, {len(b_times)} for {b}")
    (a_low, a_median, a_high), (b_low, b_median, b_high) = spread(a_times), spread(b_times)
    ratio = b_median / a_median
    turns = min(len(a_times), len(b_times))
    ranges = (
        f"{a} {a_low * 1e3:.1f}–{a_high * 1e3:.1f} ms, {b} {b_low * 1e3:.1f}–{b_high * 1e3:.1f} ms"
    )
    told: str | None = None
    if turns < 2:
        reason = "one run each leaves no spread to judge the difference by"
    elif load.busy:
        reason = load.why_busy
    elif b_low > a_high:
        told, reason = "slower", f"the middle halves of their times do not overlap ({ranges})"
    elif b_high < a_low:
        told, reason = "faster", f"the middle halves of their times do not overlap ({ranges})"
    else:
        reason = f"the middle halves of their times overlap ({ranges})"
    return Verdict(a, b, ratio, told, reason, load, turns, unit)


def in_turns(
    a: Callable[[], object], b: Callable[[], object], turns: int, *, warmup: int = 1
) -> tuple[list[float], list[float], Load]:
    """Run ``a`` and ``b`` in alternation, ``turns`` times each after ``warmup`` of each.

    The order swaps every round (AB, BA, AB, ...), so neither always runs first after a pause.

    Returns:
        (a's seconds per run, b's seconds per run, the host's load around them).
    """
    for _ in range(warmup):
        a()
        b()
    meter = LoadMeter()
    times: tuple[list[float], list[float]] = ([], [])
    for turn in range(turns):
        order = ((0, a), (1, b)) if turn % 2 == 0 else ((1, b), (0, a))
        for which, run in order:
            began = time.perf_counter()
            run()
            times[which].append(time.perf_counter() - began)
    return times[0], times[1], meter.stop()
