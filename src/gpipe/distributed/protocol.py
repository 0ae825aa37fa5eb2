"""The step protocol: what every rank agrees on before a step, and the program it runs.

Before each step the first stage's rank broadcasts a header: the micro-batch count, the
batch size, a code of the input's shapes (what every message's shapes follow from), the
step's seed and a code of the settings every rank must share. Each rank then runs its part
of the schedule lowered to communication (:mod:`gpipe.schedule.lowering`), made and checked
once per schedule.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import torch

from gpipe.runtime.routes import Routes
from gpipe.schedule import Schedule
from gpipe.schedule.lowering import Batch, Flow, lower
from gpipe.schedule.validate import check_lowered
from gpipe.structure import leaves

__all__ = ["Programs", "settings_code", "shapes_code"]


def shapes_code(microbatches: list[Any]) -> int:
    """A number standing for the micro-batches' structure, shapes and dtypes: what the
    shapes of every message of a step follow from."""
    described = [
        (tuple(leaf.shape), str(leaf.dtype), leaf.requires_grad)
        if isinstance(leaf, torch.Tensor)
        else repr(leaf)
        for leaf in leaves(microbatches)
    ]
    return zlib.crc32(repr(described).encode())


def settings_code(schedule: str | Schedule, checkpoint: str, chunks: int) -> int:
    """A number standing for the settings every rank's step must share."""
    named = schedule if isinstance(schedule, str) else _described(schedule)
    return zlib.crc32(f"{named}|{checkpoint}|{chunks}".encode())


@functools.lru_cache(maxsize=4)
def _described(schedule: Schedule) -> str:
    """A custom schedule as text (long: made once per schedule, not per step)."""
    return repr(schedule.actions)


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

    def of(self, schedule: Schedule) -> list[Batch]:
        """This rank's batches of ``schedule``.

        Raises:
            ScheduleError: the lowered schedule could hang under NCCL's rules.
        """
        key = (schedule.microbatches, schedule.split_backward, len(schedule))
        known = self._known.get(key)
        if known is None or known[0].actions != schedule.actions:
            lowered = lower(schedule, self._flow)
            check_lowered(lowered)
            known = self._known[key] = (schedule, lowered.batches(self._device))
        return known[1]


def _flow(routes: Routes) -> Flow:
    count = routes.count
    return Flow(
        tuple(tuple(source for source, _ in routes.sources[s]) for s in range(count)),
        tuple(tuple(reader for reader, _ in routes.readers[s]) for s in range(count)),
    )
