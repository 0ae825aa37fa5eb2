"""The validator: a schedule runs iff every action is present once, in place, and reachable."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpipe.schedule.action import BACKWARD, FORWARD, KINDS, WEIGHT, Action, dependencies
from gpipe.schedule.grid import format_grid
from gpipe.schedule.lowering import Lowered, lower, replay
from gpipe.schedule.steps import run_in_steps

if TYPE_CHECKING:
    from gpipe.schedule.schedule import Schedule

__all__ = ["ScheduleError", "check_lowered", "validate"]

_SHOWN = 5  # problems listed per error; the rest are counted


class ScheduleError(ValueError):
    """A schedule that cannot run; the message names the problem and shows the grid."""


def validate(schedule: Schedule) -> None:
    """Check that ``schedule`` can run to completion, and raise if it cannot.

    The checks, in order:

    1. every action's stage and micro-batch are in range, and its device holds its stage
       (``schedule.placement``);
    2. every (kind, stage, micro-batch) appears exactly once, where the kinds are F and B,
       plus W if the schedule has any W (then every B must have its W), or F alone in a
       decode (``wrap`` > 0, :func:`~gpipe.schedule.decode`);
    3. no deadlock: running each device's list in order, a device moving on only when its
       next action's dependencies have finished, every device reaches its end. Sends are
       taken not to block: the in-process transport queues them, and the distributed one
       sends in the background, so a device waits only for what it consumes;
    4. its messages can be posted so that no run hangs, even under NCCL's rules:
       :func:`~gpipe.schedule.lowering.lower` places each device's sends and receives,
       posting every receive in the step its message is made, and
       :func:`~gpipe.schedule.lowering.replay` runs the programs (one stream per device,
       each pair's messages matched in posting order). Any order that passes 3 passes
       this too, so any order torch generates runs as it is; the check stays because the
       runtimes rely on it.

    A fused action (``0F3+5B1``) counts as its parts for checks 1 and 2, and starts only
    once every part could (3).

    Args:
        schedule: the schedule to check.

    Raises:
        ScheduleError: the first failing check, naming the offending actions, with the
            step × device grid in which they are marked ``>like this<``.
    """
    marks, problems = _check_ranges(schedule)
    if not problems:
        marks, problems = _check_coverage(schedule)
    if not problems:
        marks, problems = _check_deadlock(schedule)
    if not problems:
        marks, problems = _check_lowered(schedule)
    if problems:
        shown = problems[:_SHOWN]
        if len(problems) > _SHOWN:
            shown.append(f"... and {len(problems) - _SHOWN} more")
        body = "\n".join(f"  - {p}" for p in shown)
        grid = format_grid(schedule, mark=marks)
        raise ScheduleError(
            f"invalid schedule {schedule.name!r} ({schedule.devices} devices, "
            f"{schedule.stages} stages, {schedule.microbatches} micro-batches):\n"
            f"{body}\n{grid}"
        )


Cells = list[tuple[int, int]]


def _check_ranges(schedule: Schedule) -> tuple[Cells, list[str]]:
    marks: Cells = []
    problems: list[str] = []
    for device, actions in enumerate(schedule.actions):
        for position, listed in enumerate(actions):
            for action in listed.units:
                problem = _out_of_range(schedule, device, action)
                if problem is not None:
                    marks.append((device, position))
                    problems.append(f"{action} on device {device} (position {position}) {problem}")
                    break
    return marks, problems


def _out_of_range(schedule: Schedule, device: int, action: Action) -> str | None:
    """What is wrong with where ``action`` runs, or None."""
    if action.stage >= schedule.stages:
        return f"has stage {action.stage}, but stages run 0..{schedule.stages - 1}"
    if action.microbatch >= schedule.microbatches:
        return (
            f"has micro-batch {action.microbatch}, but micro-batches run "
            f"0..{schedule.microbatches - 1}"
        )
    if schedule.placement[action.stage] != device:
        return (
            f"is on the wrong device: stage {action.stage} lives on device "
            f"{schedule.placement[action.stage]}"
        )
    return None


def _check_coverage(schedule: Schedule) -> tuple[Cells, list[str]]:
    if schedule.wrap:  # a decode: forwards alone
        kinds: tuple[str, ...] = (FORWARD,)
    else:
        kinds = KINDS if schedule.split_backward else (FORWARD, BACKWARD)
    first: dict[Action, int] = {}
    marks: Cells = []
    problems: list[str] = []
    for device, actions in enumerate(schedule.actions):
        for position, listed in enumerate(actions):
            for action in listed.units:
                if action not in first:
                    first[action] = position
                    continue
                marks.append((device, position))
                problems.append(
                    f"{action} appears twice on device {device}: positions "
                    f"{first[action]} and {position}"
                )
    for kind in kinds:
        for stage in range(schedule.stages):
            for microbatch in range(schedule.microbatches):
                action = Action(kind, stage, microbatch)
                if action not in first:
                    why = " (the schedule has W actions, so every B needs one)"
                    problems.append(
                        f"{action} is missing: device {schedule.placement[stage]} never runs it"
                        + (why if kind == WEIGHT else "")
                    )
    return marks, problems


def _check_deadlock(schedule: Schedule) -> tuple[Cells, list[str]]:
    steps = run_in_steps(schedule)
    if steps.finished(schedule):
        return [], []
    where = {
        unit: (d, p)
        for d, actions in enumerate(schedule.actions)
        for p, action in enumerate(actions)
        for unit in action.units
    }
    stuck = [d for d, p in enumerate(steps.next) if p < len(schedule.actions[d])]
    marks: Cells = [(d, steps.next[d]) for d in stuck]
    problems = [_wait_chain(schedule, steps.next, where, stuck[0])]
    return marks, problems


def _wait_chain(
    schedule: Schedule,
    next_position: list[int],
    where: dict[Action, tuple[int, int]],
    device: int,
) -> str:
    """Follow who waits for whom from ``device`` until the chain closes, and describe it."""
    links: list[str] = []
    visited: set[int] = set()
    while device not in visited:
        visited.add(device)
        action = schedule.actions[device][next_position[device]]
        waited = [
            dep
            for dep in dependencies(action, schedule.stages, schedule.wrap)
            if where[dep][1] >= next_position[where[dep][0]]
        ]
        dep = waited[0]
        owner, position = where[dep]
        if owner == device:
            links.append(
                f"{action} on device {device} waits for {dep}, which device {device} runs "
                f"only later (position {position}), so it never runs"
            )
            break
        blocker = schedule.actions[owner][next_position[owner]]
        stuck_at = "at it" if blocker == dep else f"before it, at {blocker}"
        links.append(
            f"{action} on device {device} waits for {dep}, which never runs: device {owner} "
            f"is stuck {stuck_at}"
        )
        device = owner
    return "deadlock: " + "; ".join(links)


def _check_lowered(schedule: Schedule) -> tuple[Cells, list[str]]:
    """The lowered program replays to its end under NCCL's rules (see :func:`check_lowered`)."""
    stuck = replay(lower(schedule))
    if stuck is None:
        return [], []
    return [(d, p) for d, p in enumerate(stuck.actions) if p is not None], stuck.problems


def check_lowered(lowered: Lowered) -> None:
    """Raise unless ``lowered`` runs to its end under NCCL's rules (see
    :func:`gpipe.schedule.lowering.replay`): no distributed run of it can hang.

    Raises:
        ScheduleError: naming the batch each stuck device waits in and what for, with the
            step × device grid in which the action each one never reached is marked.
    """
    stuck = replay(lowered)
    if stuck is None:
        return
    schedule = lowered.schedule
    marks = [(d, p) for d, p in enumerate(stuck.actions) if p is not None]
    body = "\n".join(f"  - {p}" for p in stuck.problems[:_SHOWN])
    raise ScheduleError(
        f"schedule {schedule.name!r} ({schedule.devices} devices, {schedule.microbatches} "
        f"micro-batches) would hang when its messages are posted as lowered:\n{body}\n"
        f"{format_grid(schedule, mark=marks)}"
    )
