"""The validator: a schedule runs iff every action is present once, in place, and reachable."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpipe.schedule.action import BACKWARD, FORWARD, KINDS, WEIGHT, Action, dependencies
from gpipe.schedule.communication import RECV, SEND, Message, communication, keeps_pair_order
from gpipe.schedule.grid import format_grid
from gpipe.schedule.lowering import Lowered, replay
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
       plus W if the schedule has any W (then every B must have its W);
    3. no deadlock: running each device's list in order, a device moving on only when its
       next action's dependencies have finished, every device reaches its end. Sends are
       taken not to block: the in-process transport queues them, and the distributed one
       sends in the background, so a device waits only for what it consumes;
    4. messages keep their order between each pair of devices: what one device sends to
       another (activations of its F's, gradients of its B's, for stage boundaries that
       cross devices) goes in the order the receiver's actions take it. Point-to-point
       libraries (NCCL) match a pair's messages in posting order, with no tags, so a
       transport that posts its receives in action order relies on this
       (:func:`~gpipe.schedule.communication` lists each device's messages).

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
        marks, problems = _check_pair_order(schedule)
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
        for position, action in enumerate(actions):
            if action.stage >= schedule.stages:
                problem = f"has stage {action.stage}, but stages run 0..{schedule.stages - 1}"
            elif action.microbatch >= schedule.microbatches:
                problem = (
                    f"has micro-batch {action.microbatch}, but micro-batches run "
                    f"0..{schedule.microbatches - 1}"
                )
            elif schedule.placement[action.stage] != device:
                problem = (
                    f"is on the wrong device: stage {action.stage} lives on device "
                    f"{schedule.placement[action.stage]}"
                )
            else:
                continue
            marks.append((device, position))
            problems.append(f"{action} on device {device} (position {position}) {problem}")
    return marks, problems


def _check_coverage(schedule: Schedule) -> tuple[Cells, list[str]]:
    kinds = KINDS if schedule.split_backward else (FORWARD, BACKWARD)
    first: dict[Action, int] = {}
    marks: Cells = []
    problems: list[str] = []
    for device, actions in enumerate(schedule.actions):
        for position, action in enumerate(actions):
            if action in first:
                marks.append((device, position))
                problems.append(
                    f"{action} appears twice on device {device}: positions "
                    f"{first[action]} and {position}"
                )
            else:
                first[action] = position
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
    where = {a: (d, p) for d, actions in enumerate(schedule.actions) for p, a in enumerate(actions)}
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
            for dep in dependencies(action, schedule.stages)
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


def _check_pair_order(schedule: Schedule) -> tuple[Cells, list[str]]:
    """Between each ordered pair of devices, messages are received in the order sent."""
    if keeps_pair_order(schedule):
        return [], []
    where = {(d, a): p for d, actions in enumerate(schedule.actions) for p, a in enumerate(actions)}
    channels: dict[tuple[int, int, str], list[tuple[int, Message]]] = {}
    for device, messages in enumerate(communication(schedule)):
        for message in messages:
            src, dst = (
                (device, message.peer) if message.direction == SEND else (message.peer, device)
            )
            channels.setdefault((src, dst, message.direction), []).append((device, message))
    marks: Cells = []
    problems: list[str] = []
    for (src, dst, direction), sent in sorted(channels.items()):
        if direction != SEND:
            continue
        taken = channels.get((src, dst, RECV), [])
        for (_, out), (_, into) in zip(sent, taken):
            if out.tag == into.tag:
                continue
            # The receiver takes ``into`` first, but the sender sends ``out`` before it.
            late = next(m for _, m in sent if m.tag == into.tag)
            early = next(m for _, m in taken if m.tag == out.tag)
            marks += [
                (src, where[src, out.action]),
                (src, where[src, late.action]),
                (dst, where[dst, into.action]),
                (dst, where[dst, early.action]),
            ]
            problems.append(
                f"device {src} sends device {dst} the {out} (from {out.action}) before the "
                f"{into} (from {late.action}), but device {dst} takes them the other way round "
                f"({into.action} before {early.action}); point-to-point messages between "
                "two devices are matched in order, so the receiver would get the wrong "
                "one: reorder either device's actions"
            )
            break
    return marks, problems


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
