"""What ``gpipe plan`` prints beside the report: why the pick won, and its RESULT fields."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpipe.planning.plan_report import Plan, PlanReport
    from gpipe.planning.verify import Calibration

__all__ = [
    "calibration_argument",
    "cut_fields",
    "measured_fields",
    "why_this_plan",
    "why_this_schedule",
]


def measured_fields(report: PlanReport) -> str:
    """The RESULT fields of a verified plan: its measured step, and what was fitted."""
    best, calibration = report.best, report.calibration
    if best.measured_step is None or calibration is None:
        return ""
    return (
        f" measured_ms={best.measured_step * 1e3:.3f} verified={calibration.plans} "
        f"calibration={calibration_argument(calibration)}"
    )


def calibration_argument(calibration: Calibration) -> str:
    """``--calibration`` 's value for what a verification fitted."""
    return (
        f"{calibration.action_overhead * 1e3:.4f},{calibration.time_scale:.4f},"
        f"{calibration.headroom:.4f}"
    )


def cut_fields(best: Plan) -> str:
    """The RESULT fields that say where a model that is not an nn.Sequential is cut."""
    if best.split_points is not None:
        return f" split_points={','.join(best.split_points) or 'none'}"
    if best.pieces is not None:
        return f" pieces={','.join(map(str, best.pieces))}"
    return ""


def why_this_plan(report: PlanReport) -> list[str]:
    """Lines that say why the best plan's micro-batch count won, from the other candidates.

    For the best plan's schedule and checkpoint mode, each micro-batch count M tried: its
    predicted step (the simulator on the profiled costs), or that it was over the budget.
    When M=1 wins, it says why: it leaves the largest bubble, so cutting the batch must
    cost more than the bubble it fills.
    """
    best = report.best
    same = (best.schedule, best.checkpoint, best.virtual_stages, best.stages, best.dp, best.zero)
    over = {id(r.plan) for r in report.rejected if r.reason.startswith("over")}
    by_chunks: dict[int, Plan | None] = {}
    for candidate in [*report.plans, *(r.plan for r in report.rejected)]:
        key = (
            candidate.schedule,
            candidate.checkpoint,
            candidate.virtual_stages,
            candidate.stages,
            candidate.dp,
            candidate.zero,
        )
        if key != same:
            continue
        fits = id(candidate) not in over
        known = by_chunks.get(candidate.chunks)
        if fits and (known is None or candidate.predicted_step < known.predicted_step):
            by_chunks[candidate.chunks] = candidate
        elif not fits:
            by_chunks.setdefault(candidate.chunks, None)
    tried = [f"M={m} " + _said(p) for m, p in sorted(by_chunks.items())]
    lines = [
        f"why M={best.chunks}: {best.schedule}, checkpoint {best.checkpoint}, predicted "
        f"step at " + ", ".join(tried)
    ]
    if best.measured_step is not None:
        lines.append(
            f"  measured: M={best.chunks} took {best.measured_step * 1e3:.2f} ms a step (the "
            "median of the real steps --verify ran); the plans are ranked by what was measured"
        )
        return lines
    _, high = best.predicted_range
    close = [p for p in by_chunks.values() if p is not None and p is not best]
    close = [p for p in close if p.predicted_step <= high]
    if close:
        names = ", ".join(f"M={p.chunks}" for p in sorted(close, key=lambda p: p.chunks))
        lines.append(
            f"  M={best.chunks} is within this host's noise of {names}: their predicted ranges "
            "overlap, and the plan with fewer micro-batches is listed first (fewer hand-offs, "
            "the cost a profile sees least); --verify runs them and ranks by measured time"
        )
        return lines
    larger = [p for m, p in sorted(by_chunks.items()) if m > 1 and p is not None]
    if best.chunks == 1 and larger:
        other = larger[0]
        lines.append(
            f"  M=1 leaves the largest bubble ({best.bubble:.0%} of the devices' time idle), "
            f"yet M={other.chunks} is predicted slower ({other.predicted_step * 1e3:.2f} ms "
            f"against {best.predicted_step * 1e3:.2f}, bubble {other.bubble:.0%}): on these "
            "profiled costs its micro-batches together take longer than the whole batch at "
            "once (small layers pay a fixed cost per call, and cpu stages share this host's "
            "cores), more than the bubble they fill. A larger --batch-size or model "
            "lets micro-batches pay off; --chunks picks them by hand."
        )
    elif best.chunks == 1:
        lines.append("  M=1: no larger micro-batch count fits the memory budget")
    return lines


def why_this_schedule(report: PlanReport) -> list[str]:
    """A line that says why the best plan's schedule won: every schedule weighed at the
    same stages, micro-batches, checkpoint mode and replicas, with its predicted step and
    the most memory a device holds, or that it went over the budget."""
    best = report.best
    same = (best.stages, best.chunks, best.checkpoint, best.dp, best.zero)
    over = {id(r.plan) for r in report.rejected if r.reason.startswith("over")}
    by_schedule: dict[str, tuple[Plan, bool]] = {}
    for candidate in [*report.plans, *(r.plan for r in report.rejected)]:
        key = (candidate.stages, candidate.chunks, candidate.checkpoint, candidate.dp)
        if (*key, candidate.zero) != same or candidate is best:
            continue
        fits = id(candidate) not in over
        known = by_schedule.get(candidate.schedule)
        better = known is None or (fits, -candidate.predicted_step) > (
            known[1],
            -known[0].predicted_step,
        )
        if better:
            by_schedule[candidate.schedule] = (candidate, fits)
    if not by_schedule:
        return []
    said = [f"{best.schedule} {_step_and_memory(best)}"]
    for name, (plan, fits) in sorted(by_schedule.items(), key=lambda kv: kv[1][0].predicted_step):
        said.append(f"{name} " + (_step_and_memory(plan) if fits else "over the budget"))
    return [
        f"why {best.schedule}: at K={best.stages} M={best.chunks} checkpoint {best.checkpoint}, "
        "predicted step and most memory a device holds: " + ", ".join(said)
    ]


def _step_and_memory(plan: Plan) -> str:
    return f"{plan.predicted_step * 1e3:.2f} ms {max(plan.peak_memory) / 2**20:.1f} MiB"


def _said(plan: Plan | None) -> str:
    """One candidate in the why line: over the budget, its predicted range, what it measured."""
    if plan is None:
        return "over the budget"
    low, high = (f"{t * 1e3:.2f}" for t in plan.predicted_range)
    said = f"{low} ms" if low == high else f"{low}–{high} ms"
    if plan.measured_step is not None:
        said += f" (measured {plan.measured_step * 1e3:.2f})"
    return said
