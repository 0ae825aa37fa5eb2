"""Ranking: the plans that fit, fastest first, and every other with the reason it lost.

Predictions carry the host's noise (:attr:`Plan.predicted_range`). Plans whose ranges overlap
the fastest one's cannot be told apart by this profile, and the order among them would
follow the noise from run to run. So among those the simpler plan is listed first, by a
fixed preference (fewer devices, fewer micro-batches, no recomputation, less memory), and
the report says which plans were within noise and why the first one leads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpipe.planning.plan_report import Plan, PlanReport, Rejection
from gpipe.units import format_bytes

__all__ = ["PREFERENCE", "rank", "within_noise"]

#: Among plans within noise of each other, what the first listed has less of, in order.
PREFERENCE = (
    "fewer devices",
    "fewer micro-batches (fewer hand-offs: the cost a profile of single layers sees least)",
    "less recomputation",
    "less memory",
    "an earlier schedule in the list asked for",
)
_RECOMPUTE = {"never": 0, "except_last": 1, "always": 2}


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

    def simpler(p: Plan) -> tuple[int, int, int, int, int]:
        return (
            p.stages * p.dp,
            p.chunks,
            _RECOMPUTE[p.checkpoint],
            max(p.needed_memory),
            list(schedules).index(p.schedule),
        )

    fits = sorted((p for p in plans if budget is None or max(p.needed_memory) <= budget), key=key)
    verified = sorted((p for p in fits if p.measured_step is not None), key=_measured)
    unverified = [p for p in fits if p.measured_step is None]
    notes = []
    if verified:
        # NOTE: what ran is ranked by what it measured, ahead of what only was predicted
        tied = within_noise(verified, measured=True)
        verified = sorted(tied, key=simpler) + verified[len(tied) :]
        notes += _measured_notes(verified, tied, simpler)
        fits = verified + unverified
    else:
        tied = within_noise(fits)
        fits = sorted(tied, key=simpler) + fits[len(tied) :]
        if len(tied) > 1:
            notes.append(_tie_note(sorted(tied, key=simpler), simpler))
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
    best = fits[0]
    rejected = [Rejection(p, _slower(p, best)) for p in fits[top:]]
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
    return PlanReport(fits[:top], rejected, budget, notes=notes)


def within_noise(ranked: list[Plan], *, measured: bool = False) -> list[Plan]:
    """The plans of ``ranked`` (fastest first) whose range overlaps the fastest one's: ones
    this profile (or, with ``measured``, these real steps) cannot tell from it."""
    if not ranked:
        return []
    if measured:
        _, high = _quartiles(ranked[0])
        return [p for p in ranked if _quartiles(p)[0] <= high]
    _, high = ranked[0].predicted_range
    return [p for p in ranked if p.predicted_step <= high]


def _measured(p: Plan) -> float:
    assert p.measured_step is not None
    return p.measured_step


def _quartiles(p: Plan) -> tuple[float, float]:
    if p.measured_range is not None:
        return p.measured_range
    return _measured(p), _measured(p)


def _slower(p: Plan, best: Plan) -> str:
    """Why ``p`` lost to ``best``: by how much, measured where both ran, else predicted."""
    if p.measured_step is not None and best.measured_step is not None:
        ratio, said = p.measured_step / best.measured_step, "measured"
        seconds = p.measured_step
    else:
        ratio, said = p.predicted_step / best.predicted_step, "predicted"
        seconds = p.predicted_step
    return f"slower: +{(ratio - 1) * 100:.1f}% ({said} {seconds * 1e3:.2f} ms)"


def _measured_notes(
    verified: list[Plan], tied: list[Plan], simpler: Callable[[Plan], tuple[int, ...]]
) -> list[str]:
    """What the real steps said: a reordering of the predictions, and plans within noise."""
    notes = []
    by_prediction = sorted(verified, key=lambda p: p.predicted_step)
    if by_prediction[0] is not verified[0]:
        fastest, predicted = verified[0], by_prediction[0]
        notes.append(
            f"re-ranked by measured time: {fastest.describe()} measured "
            f"{_measured(fastest) * 1e3:.2f} ms against {_measured(predicted) * 1e3:.2f} ms "
            f"for {predicted.describe()}, which the calibrated profile predicted faster"
        )
    if len(tied) > 1:
        first, second = sorted(tied, key=simpler)[:2]
        why = next(
            (r for r, a, b in zip(PREFERENCE, simpler(first), simpler(second)) if a < b),
            "the same on every preference",
        )
        named = ", ".join(
            f"{p.describe()} ({_range(_quartiles(p))})" for p in sorted(tied, key=simpler)[:4]
        )
        notes.append(
            f"measured within noise: {named}: the middle halves of their steps overlap; "
            f"{first.describe()} is listed first: {why}"
        )
    return notes


def _tie_note(tied: list[Plan], simpler: Callable[[Plan], tuple[int, ...]]) -> str:
    """Which plans were within noise, and why the first is listed first."""
    first, second = tied[0], tied[1]
    why = next(
        (reason for reason, a, b in zip(PREFERENCE, simpler(first), simpler(second)) if a < b),
        "the same on every preference",
    )
    named = ", ".join(f"{p.describe()} ({_range(p.predicted_range)})" for p in tied[:4])
    more = f" and {len(tied) - 4} more" if len(tied) > 4 else ""
    return (
        f"within noise: {named}{more}: their predicted ranges (from each layer's fastest run "
        f"to its first quartile) overlap, so this profile cannot tell them apart; "
        f"{first.describe()} is listed first: {why}"
    )


def _range(span: tuple[float, float]) -> str:
    low, high = span
    return f"{low * 1e3:.2f}–{high * 1e3:.2f} ms"
