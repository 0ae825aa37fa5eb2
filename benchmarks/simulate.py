"""How long planning takes at scale: simulate and the "auto" search against the reference.

The reference is the simulator and search as they were before issue 31, kept unchanged in
tests/reference_simulator.py; both run here, in the same process, on the same inputs, and
must give the same answer (checked). Times are CPU seconds of this process (a shared
machine's other work does not count), the median of several runs.

    python benchmarks/simulate.py                 # the goals' sizes
    python benchmarks/simulate.py --runs 3 --reference-runs 1

- simulate at K=128, M=1024 (gpipe and 1f1b: 262,144 actions), with a transfer time and
  gradient sizes, so memory and every transfer are recorded; interleaved (K=64, v=2) and
  zb-v (K=64) at the same number of actions and more;
- search at K=32, M=128 and K=64, M=256 with F = B = W = 1 (the reference's K=64 search
  takes minutes: it runs ``--reference-runs`` times, at most once).

Goals (issue 31): simulate <= 0.15 s each; search <= 1.5 s at K=32 and <= 10 s at K=64.

Last line: ``RESULT simulate_gpipe_s=... simulate_1f1b_s=... search_32_s=... search_64_s=...
... goals_met=<yes|no>`` with the reference's figures and the speed-ups beside them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import reference_simulator as reference
from gpipe.analysis import Costs, search, simulate
from gpipe.schedule import Schedule, gpipe, interleaved, one_f_one_b, zb_v

SIMULATE_GOAL, SEARCH_GOALS = 0.15, {32: 1.5, 64: 10.0}


def cpu_seconds(work: Callable[[], Any], runs: int) -> tuple[float, Any]:
    """The median CPU seconds of ``runs`` calls, and what the last one returned."""
    times, result = [], None
    for _ in range(runs):
        began = time.process_time()
        result = work()
        times.append(time.process_time() - began)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of the new code per figure")
    parser.add_argument("--reference-runs", type=int, default=3, help="runs of the reference")
    args = parser.parse_args()
    results: dict[str, str] = {}
    met = True

    costs = Costs(forward=1, backward=2, weight=1, transfer=0.1, gradient_bytes=1)
    cases: list[tuple[str, Schedule, bool]] = [
        ("gpipe", gpipe(128, 1024), True),
        ("1f1b", one_f_one_b(128, 1024), True),
        ("interleaved", interleaved(64, 1024, virtual_stages=2), False),
        ("zb-v", zb_v(64, 1024), False),
    ]
    print(f"{'simulate':<30}{'actions':>9}{'reference s':>13}{'new s':>9}{'speed-up':>10}")
    for name, schedule, goal in cases:
        new, timeline = cpu_seconds(lambda s=schedule: simulate(s, costs), args.runs)
        old, expected = cpu_seconds(
            lambda s=schedule: reference.simulate(s, costs), args.reference_runs
        )
        # the same answer: every event (start, end, memory), and every transfer
        assert timeline.makespan == expected.makespan
        assert timeline.peak_memory == expected.peak_memory
        assert timeline.events == expected.events
        assert sorted(map(repr, timeline.transfers)) == sorted(map(repr, expected.transfers))
        label = f"{name} K={schedule.devices} v={schedule.virtual_stages} M={schedule.microbatches}"
        print(f"{label:<30}{len(schedule):>9}{old:>13.3f}{new:>9.3f}{old / new:>9.1f}x")
        key = name.replace("-", "")
        results[f"simulate_{key}_s"] = f"{new:.3f}"
        results[f"reference_simulate_{key}_s"] = f"{old:.3f}"
        met &= not goal or new <= SIMULATE_GOAL

    equal = Costs(forward=1, backward=1, weight=1)
    print(f"\n{'search (auto)':<30}{'runs':>9}{'reference s':>13}{'new s':>9}{'speed-up':>10}")
    for stages, microbatches in [(32, 128), (64, 256)]:
        new, chosen = cpu_seconds(
            lambda k=stages, m=microbatches: search(k, m, costs=equal), args.runs
        )
        runs = args.reference_runs if stages < 64 else min(args.reference_runs, 1)
        old, expected = cpu_seconds(
            lambda k=stages, m=microbatches: reference.search(k, m, costs=equal), runs
        )
        assert chosen == expected, "the search chose another schedule than the reference"
        label = f"K={stages} M={microbatches}"
        print(f"{label:<30}{f'{args.runs}/{runs}':>9}{old:>13.3f}{new:>9.3f}{old / new:>9.1f}x")
        results[f"search_{stages}_s"] = f"{new:.3f}"
        results[f"reference_search_{stages}_s"] = f"{old:.3f}"
        met &= new <= SEARCH_GOALS[stages]

    print(
        f"\ngoals: simulate gpipe and 1f1b <= {SIMULATE_GOAL} s each; search <= "
        f"{SEARCH_GOALS[32]} s at K=32, <= {SEARCH_GOALS[64]} s at K=64 (CPU seconds, medians)"
    )
    fields = " ".join(f"{k}={v}" for k, v in results.items())
    print(f"RESULT {fields} same_answers=yes goals_met={'yes' if met else 'no'}")


if __name__ == "__main__":
    main()
