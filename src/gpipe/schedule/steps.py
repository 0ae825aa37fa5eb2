"""Lock-step execution: the unit-time steps a schedule takes, as the grid prints them, and
one order of every device's actions for a thread that runs several devices."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpipe.schedule.action import Action, dependencies, units

if TYPE_CHECKING:
    from gpipe.schedule.schedule import Schedule

__all__ = ["Steps", "in_one_order", "run_in_steps"]


@dataclass(frozen=True)
class Steps:
    """The result of running every device's list in lock step.

    Args:
        rows: ``rows[t][d]`` is the position in device ``d``'s list of the action it ran at
            step ``t``, or ``None`` when it was idle.
        next: per device, the position of the first action that never ran; equal to the
            list's length when the device finished. Short of that means a deadlock.
    """

    rows: list[list[int | None]]
    next: list[int]

    def finished(self, schedule: Schedule) -> bool:
        """Whether every device ran its whole list."""
        return all(n == len(acts) for n, acts in zip(self.next, schedule.actions))


def run_in_steps(schedule: Schedule) -> Steps:
    """Run the schedule in unit-time steps until every device finishes or none can move.

    At each step, every device runs its next action if all of that action's dependencies
    finished in earlier steps. Sends never block (they are queued), which is how the
    in-process transport behaves, so a device waits only for what it consumes.

    Args:
        schedule: any schedule, valid or not; stage and micro-batch ranges are not checked.

    Returns:
        The steps taken and where each device stopped.
    """
    return _lock_step(schedule.actions, schedule.stages, set(), schedule.wrap)


def in_one_order(
    actions: Sequence[Sequence[Action]], stages: int, wrap: int = 0
) -> list[tuple[int, Action]]:
    """Every device's actions in one order, for one thread that runs them all.

    The order is the lock-step one (:func:`run_in_steps`), step by step and, within a step,
    device by device. It keeps each device's own order and puts every action after what it
    needs, so threads that each run some devices' actions in this order (filtered to
    theirs) never wait on one another in a cycle. A dependency that is in no list counts as
    done: a backward-only run follows the forwards of an earlier one.

    Args:
        actions: ``actions[d]`` is device ``d``'s list, in the order it runs them.
        stages: the number of model stages (K·v).
        wrap: a decode's lanes (see :func:`~gpipe.schedule.dependencies`); 0 for training.

    Returns:
        ``(device, action)`` pairs, every action once.

    Raises:
        ValueError: no order exists: some device's next action waits, directly or not, on
            an action behind it in its own or another device's list.
    """
    listed = {unit for device in actions for unit in units(device)}
    elsewhere = {
        dep for action in listed for dep in dependencies(action, stages, wrap) if dep not in listed
    }
    steps = _lock_step(actions, stages, elsewhere, wrap)
    stuck = [str(acts[at]) for acts, at in zip(actions, steps.next) if at < len(acts)]
    if stuck:
        raise ValueError(
            f"no device can run its next action ({', '.join(stuck)}): each waits for one "
            "listed after it; check the schedule with gpipe.schedule.validate"
        )
    return [
        (device, actions[device][at])
        for row in steps.rows
        for device, at in enumerate(row)
        if at is not None
    ]


def _lock_step(
    actions: Sequence[Sequence[Action]], stages: int, done: set[Action], wrap: int = 0
) -> Steps:
    """Lock-step execution of ``actions``, counting the actions in ``done`` as finished."""
    done = set(done)
    position = [0] * len(actions)
    rows: list[list[int | None]] = []
    while True:
        row: list[int | None] = [None] * len(actions)
        ran: list[Action] = []
        for device, listed in enumerate(actions):
            at = position[device]
            if at == len(listed):
                continue
            action = listed[at]
            if all(dep in done for dep in dependencies(action, stages, wrap)):
                row[device] = at
                ran.append(action)
                position[device] = at + 1
        if not ran:
            return Steps(rows, position)
        # NOTE: results become visible only at the next step, so a chain of dependent
        # actions takes one step each even when they share a device.
        done.update(units(ran))
        rows.append(row)
