"""Ranking: the plans that fit, fastest first, and every other with the reason it lost."""

from __future__ import annotations

from collections.abc import Sequence

from gpipe.planning.plan_report import Plan, PlanReport, Rejection
from gpipe.units import format_bytes

__all__ = ["rank"]


def rank(
    plans: list[Plan],
    budget: int | None,
    top: int,
    schedules: Sequence[str],
    modes: Sequence[str],
) -> PlanReport:
    """The ``top`` fastest plans within ``budget``; the others rejected, over-budget first.

    Raises:
        ValueError: no plan fits ``budget``; the message names the smallest predicted need.
    """

    def key(p: Plan) -> tuple[float, int, int, int, int]:
        # NOTE: equal simulated times are common (GPipe and 1F1B take as long); the tie goes
        # to the plan that holds less, then to the simpler one.
        return (
            p.predicted_step,
            max(p.needed_memory),
            p.stages,
            list(schedules).index(p.schedule),
            list(modes).index(p.checkpoint),
        )

    fits = sorted((p for p in plans if budget is None or max(p.needed_memory) <= budget), key=key)
    over = [p for p in plans if budget is not None and max(p.needed_memory) > budget]
    if not fits:
        smallest = min(plans, key=lambda p: max(p.needed_memory))
        assert budget is not None
        with_headroom = (
            f" (the predicted peak x headroom {smallest.headroom:.2f})"
            if smallest.headroom != 1.0
            else ""
        )
        raise ValueError(
            f"no plan fits in memory_per_device={format_bytes(budget)}: the smallest "
            f"predicted need is {format_bytes(max(smallest.needed_memory))} per device"
            f"{with_headroom} ({smallest.describe()}); raise the budget to at least "
            f"{max(smallest.needed_memory)} bytes, add devices, or use a smaller batch_size"
        )
    best = fits[0].predicted_step
    rejected = [
        Rejection(
            p,
            f"slower: +{(p.predicted_step / best - 1) * 100:.1f}% "
            f"({p.predicted_step * 1e3:.2f} ms)",
        )
        for p in fits[top:]
    ]
    for p in sorted(over, key=key):
        assert budget is not None
        needed = p.needed_memory
        device = max(range(len(needed)), key=lambda d: needed[d])
        excess = needed[device] - budget
        reason = f"over the memory budget by {format_bytes(excess)} on device {device}"
        if p.headroom != 1.0:
            reason += (
                f" (predicted {format_bytes(p.peak_memory[device])} x headroom {p.headroom:.2f})"
            )
        rejected.append(Rejection(p, reason))
    rejected.sort(key=lambda r: (not r.reason.startswith("over"), key(r.plan)))
    return PlanReport(fits[:top], rejected, budget)
