"""Schedule generators: one small pure function per schedule, and the registry by name."""

from __future__ import annotations

from collections.abc import Callable

from gpipe.schedule.action import BACKWARD, FORWARD, Action, Schedule

__all__ = ["SCHEDULES", "gpipe", "make_schedule"]


def _check(stages: int, microbatches: int) -> None:
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe fill-drain: every forward, then every backward in reverse micro-batch order.

    The backward runs the newest micro-batch first: its activations are the freshest, and
    with ``checkpoint="except_last"`` the one micro-batch that kept its activations needs no
    recomputation. For 3 stages and 4 micro-batches, laid out in time::

        0: 0F0 0F1 0F2 0F3                         0B3 0B2 0B1 0B0
        1:     1F0 1F1 1F2 1F3                 1B3 1B2 1B1 1B0
        2:         2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0

    Args:
        stages: K, one stage per device.
        microbatches: M.
    """
    _check(stages, microbatches)
    forward = [[Action(FORWARD, k, i) for i in range(microbatches)] for k in range(stages)]
    backward = [
        [Action(BACKWARD, k, i) for i in reversed(range(microbatches))] for k in range(stages)
    ]
    actions = tuple(tuple(f + b) for f, b in zip(forward, backward))
    return Schedule("gpipe", actions, microbatches)


Generator = Callable[..., Schedule]

SCHEDULES: dict[str, Generator] = {
    "gpipe": gpipe,
}


def make_schedule(
    name: str, stages: int, microbatches: int, *, virtual_stages: int = 1
) -> Schedule:
    """Build the named schedule for ``stages`` devices and ``microbatches`` micro-batches.

    Args:
        name: one of :data:`SCHEDULES` ("gpipe", "1f1b", "interleaved", "zb-h1").
        stages: K, the number of devices.
        microbatches: M.
        virtual_stages: model stages per device; only interleaved schedules take more than 1.

    Raises:
        ValueError: an unknown name, or ``virtual_stages`` the schedule does not support.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    generator = SCHEDULES[name]
    if getattr(generator, "virtual", False):
        return generator(stages, microbatches, virtual_stages=virtual_stages)
    if virtual_stages != 1:
        raise ValueError(
            f"schedule {name!r} runs one stage per device; use schedule='interleaved' for "
            f"virtual_stages={virtual_stages}"
        )
    return generator(stages, microbatches)
