"""The schedules by name: what ``GPipe(schedule=...)`` and the command line accept."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from gpipe.schedule.controllable import v_half, v_min
from gpipe.schedule.dualpipe import dualpipev
from gpipe.schedule.generate import gpipe, interleaved, one_f_one_b
from gpipe.schedule.looped import interleaved_zb, looped_bfs
from gpipe.schedule.schedule import Schedule
from gpipe.schedule.validate import validate
from gpipe.schedule.zero_bubble import zb_h1, zb_h2, zb_v

__all__ = [
    "SCHEDULES",
    "check_virtual_stages",
    "default_virtual_stages",
    "make_schedule",
    "schedule_for",
]

Generator = Callable[..., Schedule]

# NOTE: "auto" (gpipe.analysis.search) registers itself here when gpipe.analysis loads, which
# importing anything from gpipe does: the search needs the simulator, which sits above
# this package, so this package cannot import it.
SCHEDULES: dict[str, Generator] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zb-v": zb_v,
    "interleaved-zb": interleaved_zb,
    "looped-bfs": looped_bfs,
    "v-half": v_half,
    "v-min": v_min,
    "dualpipev": dualpipev,
}


def make_schedule(
    name: str, stages: int, microbatches: int, *, virtual_stages: int = 1, **options: Any
) -> Schedule:
    """Build the named schedule for ``stages`` devices and ``microbatches`` micro-batches.

    Args:
        name: one of :data:`SCHEDULES` ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2",
            "zb-v", "interleaved-zb", "looped-bfs", "v-half", "v-min", "dualpipev",
            "auto").
        stages: K, the number of devices.
        microbatches: M.
        virtual_stages: model stages per device: any for "interleaved", "looped-bfs" and
            "gpipe", 2 or more for "interleaved-zb", 2 for "zb-v", "v-half", "v-min" and
            "dualpipev", 1 or 2 for "auto", else 1.
        options: what the generator takes beyond these, e.g. "auto"'s ``costs`` and
            ``memory_limit`` (see :func:`gpipe.analysis.search`).

    Raises:
        ValueError: an unknown name, ``virtual_stages`` the schedule does not support, or an
            option it does not take.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    generator = SCHEDULES[name]
    takes = inspect.signature(generator).parameters
    unknown = sorted(set(options) - set(takes))
    if unknown:
        known = sorted(set(takes) - {"stages", "microbatches", "virtual_stages"})
        raise ValueError(
            f"schedule {name!r} takes no option {', '.join(map(repr, unknown))}"
            + (f"; it takes {', '.join(map(repr, known))}" if known else "")
            + " (only 'auto' takes costs and memory_limit)"
        )
    check_virtual_stages(name, virtual_stages)
    fixed = getattr(generator, "virtual_stages", None)
    if fixed is not None:
        return generator(stages, microbatches, **options)
    if getattr(generator, "virtual", False):
        return generator(stages, microbatches, virtual_stages=virtual_stages, **options)
    if virtual_stages != 1:
        raise ValueError(
            f"schedule {name!r} runs one stage per device; use schedule='interleaved' or "
            f"'zb-v' for virtual_stages={virtual_stages}"
        )
    return generator(stages, microbatches, **options)


def default_virtual_stages(name: str) -> int:
    """The model stages per device schedule ``name`` runs unless told otherwise: its fixed
    count (zb-v, dualpipev, v-half, v-min: 2), 2 for the looped ones (interleaved,
    interleaved-zb, looped-bfs), else 1 ("gpipe" and "auto" take any, one by default).

    Raises:
        ValueError: an unknown name.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    generator = SCHEDULES[name]
    fixed = getattr(generator, "virtual_stages", None)
    if fixed is not None:
        return int(fixed)
    return 2 if getattr(generator, "virtual", False) and name not in ("gpipe", "auto") else 1


def check_schedule_type(schedule: Any) -> None:
    """Refuse a ``schedule`` that is neither a name nor a :class:`Schedule`.

    Raises:
        TypeError: anything else.
    """
    if not isinstance(schedule, (str, Schedule)):
        raise TypeError(
            f"schedule must be a name such as '1f1b' or a gpipe.schedule.Schedule, "
            f"got {type(schedule).__name__}"
        )


def check_virtual_stages(schedule: str | Schedule, virtual_stages: int) -> None:
    """Refuse ``virtual_stages`` other than the named schedule's own (zb-v: 2), or fewer
    than it needs (interleaved-zb: 2).

    NOTE: a pipe calls it before checking balance against devices, whose message would
    otherwise ask for more devices when the fix is ``virtual_stages=2``.

    Raises:
        ValueError: the schedule holds a fixed number of stages per device, and not this.
    """
    generator = SCHEDULES.get(schedule) if isinstance(schedule, str) else None
    fixed = getattr(generator, "virtual_stages", None)
    if fixed is not None and virtual_stages != fixed:
        raise ValueError(
            f"schedule {schedule!r} holds {fixed} stages per device: pass "
            f"virtual_stages={fixed} (and {fixed} balance entries per device)"
        )
    least = getattr(generator, "least_virtual_stages", 1)
    if virtual_stages < least:
        raise ValueError(
            f"schedule {schedule!r} holds at least {least} stages per device: pass "
            f"virtual_stages={least} (and {least} balance entries per device)"
        )


def schedule_for(
    given: str | Schedule,
    devices: int,
    microbatches: int,
    *,
    virtual_stages: int = 1,
    placement: tuple[int, ...] | None = None,
) -> Schedule:
    """What a pipe of ``devices`` devices runs for a batch of ``microbatches`` micro-batches.

    A name is built for that count; a :class:`Schedule` is taken as given, and must fit it.
    Either way it is checked against the pipe (devices, stages, and the ``placement`` the
    pipe already holds its stages in) and validated, so none can hang a step.

    Raises:
        ValueError: a schedule that does not fit the pipe or the batch.
        ScheduleError: a schedule that cannot run (see :func:`validate`).
    """
    if isinstance(given, Schedule):
        if given.wrap:
            raise ValueError(
                f"schedule {given.name!r} is a decode (wrap={given.wrap}): it generates, "
                "forwards only; pass a training schedule such as '1f1b'"
            )
        if microbatches != given.microbatches:
            raise ValueError(
                f"the schedule {given.name!r} was built for {given.microbatches} "
                f"micro-batches, but this batch splits into {microbatches}: pass a "
                "batch of at least chunks samples, or a schedule name, which is "
                "built for any micro-batch count"
            )
        schedule = given
    else:
        schedule = make_schedule(given, devices, microbatches, virtual_stages=virtual_stages)
    stages = devices * virtual_stages
    if schedule.devices != devices or schedule.stages != stages:
        raise ValueError(
            f"schedule {schedule.name!r} has {schedule.devices} devices x "
            f"{schedule.stages} stages, but the pipe has {devices} devices x "
            f"{stages} stages; give virtual_stages={schedule.virtual_stages} and one "
            "balance entry per stage"
        )
    if placement is not None and schedule.placement != placement:
        raise ValueError(
            f"schedule {schedule.name!r} for {microbatches} micro-batches places "
            f"the stages on devices {schedule.placement}, but the pipe holds them "
            f"on {placement}: build a new GPipe(..., schedule={schedule.name!r}) to place "
            "them so"
        )
    validate(schedule)
    return schedule
