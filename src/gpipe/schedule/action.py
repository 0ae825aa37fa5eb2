"""Actions and schedules: a pipeline schedule is data, one ordered action list per device."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

__all__ = ["BACKWARD", "FORWARD", "KINDS", "WEIGHT", "Action", "Schedule", "dependencies"]

FORWARD = "F"  # forward of one micro-batch on one stage
BACKWARD = "B"  # input gradient; also the weight gradient unless the schedule has W actions
WEIGHT = "W"  # weight gradient only (zero-bubble schedules split it off B)
KINDS = (FORWARD, BACKWARD, WEIGHT)

_TEXT = re.compile(r"^\s*(\d+)([FBW])(\d+)\s*$")


@dataclass(frozen=True, order=True, slots=True)
class Action:
    """One unit of work: ``kind`` of micro-batch ``microbatch`` on model stage ``stage``.

    ``stage`` indexes the pieces the model is cut into. With virtual stages (interleaved
    schedules) a device holds several of them; :attr:`Schedule.placement` says which.
    The text form is compact: ``Action("F", 2, 0)`` is ``"2F0"``.
    """

    kind: str
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"action kind must be one of {KINDS}, got {self.kind!r}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(
                f"stage and microbatch must be >= 0, got {self.stage}, {self.microbatch}"
            )

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the compact text form, e.g. ``"2F0"`` or ``"0W3"``."""
        match = _TEXT.match(text)
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><F|B|W><microbatch>, e.g. '2F0'"
            )
        stage, kind, microbatch = match.groups()
        return cls(kind, int(stage), int(microbatch))


def dependencies(action: Action, stages: int) -> tuple[Action, ...]:
    """The actions that must finish before ``action`` can start.

    F(s, i) needs F(s-1, i); B(s, i) needs F(s, i) and B(s+1, i), except on the last stage,
    which computes the loss and so needs only its own forward; W(s, i) needs B(s, i).

    Args:
        action: the action to start.
        stages: the number of model stages (K·v), so the last stage is ``stages - 1``.

    Returns:
        The prerequisite actions, at most two.
    """
    kind, stage, microbatch = action.kind, action.stage, action.microbatch
    if kind == FORWARD:
        return (Action(FORWARD, stage - 1, microbatch),) if stage > 0 else ()
    if kind == BACKWARD:
        own = Action(FORWARD, stage, microbatch)
        if stage + 1 < stages:
            return (own, Action(BACKWARD, stage + 1, microbatch))
        return (own,)
    return (Action(BACKWARD, stage, microbatch),)


def _round_robin(stages: int, devices: int) -> tuple[int, ...]:
    return tuple(stage % devices for stage in range(stages))


@dataclass(frozen=True)
class Schedule:
    """Per device, the ordered actions it runs in one training step.

    Args:
        name: the generator's name ("gpipe", "1f1b", ...).
        actions: ``actions[d]`` is device ``d``'s action list, in execution order.
        microbatches: M, the number of micro-batches in the step.
        stages: the number of model stages (K·v with v virtual stages per device).
        placement: ``placement[s]`` is the device holding stage ``s``; by default stage
            ``s`` lives on device ``s % devices`` (Megatron's interleaved layout).
    """

    name: str
    actions: tuple[tuple[Action, ...], ...]
    microbatches: int
    stages: int = -1
    placement: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        actions = tuple(tuple(device_actions) for device_actions in self.actions)
        object.__setattr__(self, "actions", actions)
        if self.stages < 0:
            object.__setattr__(self, "stages", len(actions))
        if not self.placement:
            object.__setattr__(self, "placement", _round_robin(self.stages, len(actions)))
        if len(self.placement) != self.stages:
            raise ValueError(
                f"placement lists {len(self.placement)} stages but the schedule has {self.stages}"
            )

    @property
    def devices(self) -> int:
        """K, the number of devices (pipeline ranks)."""
        return len(self.actions)

    @property
    def virtual_stages(self) -> int:
        """v, the model stages held by each device."""
        return self.stages // max(self.devices, 1)

    @property
    def split_backward(self) -> bool:
        """Whether weight gradients run as separate W actions (zero-bubble)."""
        return any(action.kind == WEIGHT for device in self.actions for action in device)

    def stages_of(self, device: int) -> list[int]:
        """The model stages held by ``device``, in increasing order."""
        return [stage for stage, owner in enumerate(self.placement) if owner == device]

    def __iter__(self) -> Iterator[tuple[int, Action]]:
        """Yield ``(device, action)`` for every action, device by device."""
        for device, device_actions in enumerate(self.actions):
            for action in device_actions:
                yield device, action

    def __len__(self) -> int:
        return sum(len(device_actions) for device_actions in self.actions)

    def __str__(self) -> str:
        """The step × device grid (see :func:`gpipe.schedule.format_grid`)."""
        from gpipe.schedule.text import format_grid  # NOTE: lazy, text.py imports this module

        return format_grid(self)

    def to_csv(self) -> str:
        """The schedule as CSV text, one row per device (see :func:`gpipe.schedule.to_csv`)."""
        from gpipe.schedule.text import to_csv

        return to_csv(self)

    @classmethod
    def from_csv(cls, text: str, name: str | None = None) -> Schedule:
        """Read a schedule from CSV text (see :func:`gpipe.schedule.from_csv`)."""
        from gpipe.schedule.text import from_csv

        return from_csv(text, name=name)

    def validate(self) -> None:
        """Raise :class:`~gpipe.schedule.ScheduleError` unless the schedule can run.

        See :func:`gpipe.schedule.validate`.
        """
        from gpipe.schedule.validate import validate

        validate(self)

    def only(self, kinds: Sequence[str]) -> Schedule:
        """The same schedule keeping only actions of the given kinds (order preserved)."""
        return Schedule(
            self.name,
            tuple(tuple(a for a in device if a.kind in kinds) for device in self.actions),
            self.microbatches,
            self.stages,
            self.placement,
        )
