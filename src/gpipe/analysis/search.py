"""The "auto" schedule: the fastest schedule that fits a memory limit, found by simulation.

Like the zero-bubble paper's automatic scheduler (Qi et al. 2024, section 3), it builds
schedules greedily under the memory limit (:func:`gpipe.schedule.greedy`: a forward while
memory allows, a backward as soon as its gradient is there, weight gradients in the time
left), here over a sweep of its rules: how much each device may hold (the warm-up), which
kind goes first on a tie, and with two stages per device how far forwards run ahead of
backwards. Every named schedule with the same placement joins the candidates, so the
result is never slower than the best of them that fits. Each candidate is timed by
:func:`simulate` under the given costs; the fastest that fits wins, and among equally fast
ones the one with the shorter span per device (faster when steps run back to back), then
the one that holds less. A greedy candidate that cannot beat the best so far is stopped as
soon as that is sure, usually early in building it.

    schedule = search(4, 8, costs=Costs(forward=1, backward=1, weight=1), memory_limit=4)
    pipe = GPipe(model, balance, devices=devices, chunks=8, schedule=schedule)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from gpipe.analysis.simulator import Costs, simulate
from gpipe.analysis.timeline import Timeline
from gpipe.schedule import (
    SCHEDULES,
    Schedule,
    gpipe,
    greedy,
    one_f_one_b,
    round_robin,
    v_half,
    v_min,
    v_shape,
    zb_h1,
    zb_h2,
    zb_v,
)

__all__ = ["search"]

_ORDERS = ("BFW", "FBW")


def _per(value: float | Sequence[float], count: int, what: str) -> list[float]:
    if isinstance(value, int | float):
        return [float(value)] * count
    values = [float(v) for v in value]
    if len(values) != count:
        raise ValueError(f"{what} lists {len(values)} entries, expected {count}")
    return values


def search(
    stages: int,
    microbatches: int,
    *,
    virtual_stages: int = 1,
    costs: Costs | Mapping[str, Any] | None = None,
    memory_limit: float | Sequence[float] | None = None,
) -> Schedule:
    """The schedule with the shortest simulated step that fits ``memory_limit`` ("auto").

    With one stage per device the candidates are gpipe, 1f1b, zb-h1, zb-h2 and the greedy
    builder's schedules; with two, the stages are laid out in a V (as zb-v) and the
    candidates are zb-v, GPipe's fill-drain, v-half, v-min (half and a third of 1F1B's
    memory) and the greedy builder's V schedules. The looped schedules (interleaved,
    interleaved-zb, looped-bfs) place stages round-robin, not in the V, so they are not
    candidates: a pipe keeps one placement for every batch size.

    Memory is counted as the simulator does: a micro-batch's forward on a stage holds the
    stage's ``costs.activation_bytes`` (1 by default: one unit per micro-batch per stage)
    until its W (its B, in a schedule without W actions).

    Below 1F1B's memory, where no named schedule fits, it still finds one. For 3 stages,
    4 micro-batches, F = B = W = 1 and at most 2 micro-batches per device (1F1B holds 3 on
    device 0), laid out in time::

        0: 0F0 0F1             0B0 0W0 0B1 0F2 0W1 0F3         0B2 0W2 0B3 0W3
        1:     1F0 1F1     1B0 1W0 1B1 1W1     1F2     1F3 1B2 1W2 1B3 1W3
        2:         2F0 2B0 2F1 2B1 2W0 2W1         2F2 2B2 2F3 2B3 2W2 2W3

    Args:
        stages: K, the number of devices.
        microbatches: M.
        virtual_stages: stages per device, 1 or 2 (then in a V).
        costs: per-stage F, B, W times (and transfer time, activation sizes), as for
            :func:`simulate`; F = B = W = 1 by default. ``weight`` is what a zero-bubble
            schedule runs as W; the others run it inside B.
        memory_limit: the most each device may hold (one number, or one per device), in
            the units of ``costs.activation_bytes``; by default what 1F1B holds (zb-v with
            two stages per device): K with the default costs (2K with two stages).

    Returns:
        The schedule, named "auto".

    Raises:
        ValueError: a count below 1, ``virtual_stages`` other than 1 or 2, a cost or limit
            list of the wrong length, or a limit no candidate fits in (the message says the
            least any candidate needs).
    """
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages and microbatches must be >= 1, got {stages}, {microbatches}")
    if virtual_stages not in (1, 2):
        raise ValueError(
            f"schedule 'auto' searches one or two stages per device (two in a V, as zb-v), "
            f"got virtual_stages={virtual_stages}; use schedule='interleaved' for more"
        )
    if isinstance(costs, Mapping):
        costs = Costs(**costs)
    costs = costs if costs is not None else Costs(forward=1.0, backward=1.0, weight=1.0)
    count = stages * virtual_stages
    activation = _per(costs.activation_bytes, count, "Costs.activation_bytes")
    named = _named(stages, microbatches, virtual_stages)
    # 1F1B's memory is the default limit (zb-v holds as much with two stages per device);
    # they are the first candidates, so their timeline serves twice.
    first = simulate(named[0], costs)
    if memory_limit is None:
        limits = [max(first.peak_memory)] * stages
    else:
        limits = _per(memory_limit, stages, "memory_limit")
    if any(not limit > 0 for limit in limits):
        raise ValueError(f"memory_limit must be > 0 on every device, got {memory_limit!r}")

    best: tuple[tuple[float, float, float], Schedule] | None = None
    smallest: tuple[float, str] | None = None

    def judge(schedule: Schedule, timeline: Timeline) -> None:
        nonlocal best, smallest
        peaks = timeline.peak_memory
        need = max(peak - limit for peak, limit in zip(peaks, limits))
        if need > 1e-9:
            if smallest is None or max(peaks) < smallest[0]:
                smallest = (max(peaks), schedule.name)
            return
        key = (timeline.makespan, max(timeline.spans), max(peaks))
        if best is None or key < best[0]:
            best = (key, schedule)

    for index, schedule in enumerate(named):
        judge(schedule, first if index == 0 else simulate(schedule, costs))
    # NOTE: the greedy builder times each schedule as it builds it, never slower than
    # simulate does (the same costs, and transfers no dearer), so it stops a candidate as
    # soon as a device cannot finish by the best step so far: it could never win.
    negative = _any_negative(costs)
    for build in _builders(stages, microbatches, virtual_stages, costs, limits):
        deadline = None if best is None or negative else best[0][0]
        built = build(deadline=deadline)
        if built is not None:
            judge(built, simulate(built, costs))
    if best is None:
        assert smallest is not None
        least = min(activation) if virtual_stages == 1 else 2 * min(activation)
        raise ValueError(
            f"no schedule fits memory_limit={memory_limit!r}: the least any candidate holds "
            f"is {smallest[0]:g} ({smallest[1]}); a device needs at least {least:g} to run "
            "a backward at all. Raise memory_limit, or checkpoint to shrink activations"
        )
    return dataclasses.replace(best[1], name="auto")


def _any_negative(costs: Costs) -> bool:
    """Whether some time is negative, which voids the builder's deadline (a device's clock
    plus its work left is the soonest it can finish only when no work takes less than 0)."""
    times = [costs.forward, costs.backward, costs.weight]
    values = [v for t in times for v in ([t] if isinstance(t, int | float) else list(t))]
    return min([*values, costs.transfer, costs.latency]) < 0


def _named(stages: int, microbatches: int, virtual_stages: int) -> list[Schedule]:
    """The named schedules with the placement the search uses."""
    if virtual_stages == 2:
        return [
            zb_v(stages, microbatches),
            gpipe(stages, microbatches, virtual_stages=2, placement=v_shape(stages)),
            v_half(stages, microbatches),
            v_min(stages, microbatches),
        ]
    return [
        one_f_one_b(stages, microbatches),
        gpipe(stages, microbatches),
        zb_h1(stages, microbatches),
        zb_h2(stages, microbatches),
    ]


def _builders(
    stages: int, microbatches: int, virtual_stages: int, costs: Costs, limits: list[float]
) -> Iterator[Callable[..., Schedule | None]]:
    """The greedy builder over the sweep of its rules, one call per candidate, each given
    the deadline it must meet (None: no deadline)."""
    count = stages * virtual_stages
    forward = _per(costs.forward, count, "Costs.forward")
    backward = _per(costs.backward, count, "Costs.backward")
    weight = _per(costs.weight, count, "Costs.weight")
    activation = _per(costs.activation_bytes, count, "Costs.activation_bytes")
    # The warm-up: how much each device may hold, in whole micro-batches up to 2K of them
    # (ZB-H1 holds K, ZB-H2 2K-1), and the limit itself.
    unit = max(activation) or 1.0
    caps: list[list[float]] = []
    for held in [*range(virtual_stages, 2 * stages * virtual_stages + 1), None]:
        cap = [limit if held is None else min(held * unit, limit) for limit in limits]
        if cap not in caps:
            caps.append(cap)
    leads: list[int | None] = [None]
    placement = round_robin(stages, stages)
    if virtual_stages == 2:
        placement = v_shape(stages)
        leads = [*sorted({max(1, stages // 2), max(1, stages - 1), stages, stages + 1, 2 * stages})]
    for cap in caps:
        for order in _ORDERS:
            for lead in leads:
                yield functools.partial(
                    greedy,
                    "greedy",
                    placement,
                    microbatches,
                    limit=cap,
                    order=order,
                    lead=lead,
                    forward=forward,
                    backward=backward,
                    weight=weight,
                    transfer=costs.transfer,
                    activation=activation,
                )


search.virtual = True  # type: ignore[attr-defined]
SCHEDULES["auto"] = search
