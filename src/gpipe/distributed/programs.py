"""Each rank's programs: its part of a schedule lowered to communication
(:mod:`gpipe.schedule.lowering`), made and checked under NCCL's rules once per schedule.

What every rank agrees on before a step (the header) is in :mod:`gpipe.distributed.header`.
"""

from __future__ import annotations

import os
from typing import Any

from gpipe.runtime.routes import Routes
from gpipe.schedule import Schedule
from gpipe.schedule.lowering import Batch, Flow, lower
from gpipe.schedule.validate import check_lowered

__all__ = ["RECEIVES", "Programs"]

# Where a pipe posts its receives (see gpipe.schedule.lowering.lower): "early" (the default)
# or "late", for benchmarks/handoff.py to measure what posting early saves.
RECEIVES = "GPIPE_RECEIVES"


class Programs:
    """One rank's lowered programs, made (and checked under NCCL's rules) once per schedule.

    Args:
        routes: a dataflow's routes (which stages pass values to which); None for a chain.
        device: this rank's pipeline device.
    """

    def __init__(self, routes: Routes | None, device: int) -> None:
        self._flow = None if routes is None else _flow(routes)
        self._device = device
        self._known: dict[Any, tuple[Schedule, list[Batch]]] = {}
        self._receives = os.environ.get(RECEIVES, "early")

    def of(self, schedule: Schedule) -> list[Batch]:
        """This rank's batches of ``schedule``.

        Raises:
            ScheduleError: the lowered schedule could hang under NCCL's rules.
        """
        key = (schedule.microbatches, schedule.split_backward, len(schedule))
        known = self._known.get(key)
        if known is None or known[0].actions != schedule.actions:
            lowered = lower(schedule, self._flow, receives=self._receives)
            check_lowered(lowered)
            known = self._known[key] = (schedule, lowered.batches(self._device))
        return known[1]


def _flow(routes: Routes) -> Flow:
    count = routes.count
    return Flow(
        tuple(tuple(source for source, _ in routes.sources[s]) for s in range(count)),
        tuple(tuple(reader for reader, _ in routes.readers[s]) for s in range(count)),
    )
