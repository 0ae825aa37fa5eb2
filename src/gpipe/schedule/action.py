"""Actions: one unit of work (F, B or W of one micro-batch on one stage) and what it waits for."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["BACKWARD", "FORWARD", "KINDS", "WEIGHT", "Action", "dependencies"]

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
