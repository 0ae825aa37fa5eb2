"""Actions: one unit of work (F, B or W of one micro-batch on one stage) and what it waits for.

A fused action issues a forward and a backward (of other micro-batches, usually on the
device's other stage) together, so that they can overlap where the hardware allows:
DualPipeV's steady phase. It is one action made of parts, ``0F3+5B1``; its backward part
may carry its weight gradient too, ``0F3+5B1+5W1`` (a full backward inside a schedule
that otherwise splits W off).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["BACKWARD", "FORWARD", "FUSED", "KINDS", "WEIGHT", "Action", "dependencies", "units"]

FORWARD = "F"  # forward of one micro-batch on one stage
BACKWARD = "B"  # input gradient; also the weight gradient unless the schedule has W actions
WEIGHT = "W"  # weight gradient only (zero-bubble schedules split it off B)
KINDS = (FORWARD, BACKWARD, WEIGHT)
FUSED = "F+B"  # a forward and a backward issued together (see the module docstring)

_TEXT = re.compile(r"^\s*(\d+)([FBW])(\d+)\s*$")


@dataclass(frozen=True, order=True, slots=True, repr=False)
class Action:
    """One unit of work: ``kind`` of micro-batch ``microbatch`` on model stage ``stage``.

    ``stage`` indexes the pieces the model is cut into. With virtual stages (interleaved
    schedules) a device holds several of them; :attr:`Schedule.placement` says which.
    The text form is compact: ``Action("F", 2, 0)`` is ``"2F0"``.
    """

    kind: str
    stage: int
    microbatch: int
    parts: tuple[Action, ...] = ()  # a fused action's forward, backward (and W); else ()

    def __post_init__(self) -> None:
        if self.kind == FUSED:
            _check_parts(self)
            return
        if self.kind not in KINDS:
            raise ValueError(f"action kind must be one of {(*KINDS, FUSED)}, got {self.kind!r}")
        if self.parts:
            raise ValueError(f"only a fused action has parts, not a {self.kind!r} action")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(
                f"stage and microbatch must be >= 0, got {self.stage}, {self.microbatch}"
            )

    def __repr__(self) -> str:
        if self.parts:
            return f"Action.fuse({', '.join(map(repr, self.parts))})"
        return f"Action({self.kind!r}, {self.stage}, {self.microbatch})"

    def __str__(self) -> str:
        if self.parts:
            return "+".join(map(str, self.parts))
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def fuse(cls, forward: Action, backward: Action, weight: Action | None = None) -> Action:
        """The fused action that issues ``forward`` and ``backward`` together.

        Args:
            forward: an F.
            backward: a B of another micro-batch or stage.
            weight: the W of ``backward``'s stage and micro-batch, when the backward is a
                full one (input and weight gradients) in a schedule that has W actions.

        Raises:
            ValueError: parts of the wrong kinds, or a W that is not the backward's.
        """
        parts = (forward, backward) if weight is None else (forward, backward, weight)
        return cls(FUSED, forward.stage, forward.microbatch, parts)

    @property
    def units(self) -> tuple[Action, ...]:
        """The plain actions this one runs: a fused action's parts, else itself."""
        return self.parts or (self,)

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the compact text form, e.g. ``"2F0"``, ``"0W3"`` or fused ``"0F3+5B1"``."""
        if "+" in text:
            return cls.fuse(*(cls.parse(part) for part in text.split("+")))
        match = _TEXT.match(text)
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><F|B|W><microbatch>, e.g. '2F0'"
            )
        stage, kind, microbatch = match.groups()
        return cls(kind, int(stage), int(microbatch))


def _check_parts(action: Action) -> None:
    kinds = "".join(part.kind for part in action.parts)
    if kinds not in (FORWARD + BACKWARD, FORWARD + BACKWARD + WEIGHT):
        raise ValueError(
            "a fused action is a forward and a backward (and that backward's W), e.g. "
            f"'0F3+5B1' or '0F3+5B1+5W1'; got parts {'+'.join(map(str, action.parts))!r}"
        )
    forward, backward = action.parts[:2]
    if (action.stage, action.microbatch) != (forward.stage, forward.microbatch):
        raise ValueError(f"a fused action is named by its forward part, {forward}")
    if len(action.parts) == 3 and action.parts[2] != Action(
        WEIGHT, backward.stage, backward.microbatch
    ):
        raise ValueError(
            f"the W of fused {'+'.join(map(str, action.parts))} must be its backward's: "
            f"{backward.stage}W{backward.microbatch}"
        )
    if (forward.stage, forward.microbatch) == (backward.stage, backward.microbatch):
        raise ValueError(f"fused {forward}+{backward} would need its own forward to run first")


def units(actions: Iterable[Action]) -> list[Action]:
    """The plain actions of ``actions``, each fused action replaced by its parts in order."""
    return [unit for action in actions for unit in action.units]


def dependencies(action: Action, stages: int, wrap: int = 0) -> tuple[Action, ...]:
    """The actions that must finish before ``action`` can start.

    F(s, i) needs F(s-1, i); B(s, i) needs F(s, i) and B(s+1, i), except on the last stage,
    which computes the loss and so needs only its own forward; W(s, i) needs B(s, i). A
    fused action needs what its parts need, but for each other: it starts once every
    part could. In a decode (``wrap`` > 0, see :func:`gpipe.schedule.decode`), micro-batch
    ``i`` is token ``i // wrap`` of lane ``i % wrap``, and its F on stage 0 needs the last
    stage's F of micro-batch ``i - wrap``: the token that one sampled.

    Args:
        action: the action to start.
        stages: the number of model stages (K·v), so the last stage is ``stages - 1``.
        wrap: a decode's lanes; 0 for training.

    Returns:
        The prerequisite actions, at most two.
    """
    if action.parts:
        needed = [dep for part in action.parts for dep in dependencies(part, stages, wrap)]
        return tuple(dict.fromkeys(dep for dep in needed if dep not in action.parts))
    kind, stage, microbatch = action.kind, action.stage, action.microbatch
    if kind == FORWARD:
        if stage > 0:
            return (Action(FORWARD, stage - 1, microbatch),)
        if wrap and microbatch >= wrap:
            return (Action(FORWARD, stages - 1, microbatch - wrap),)
        return ()
    if kind == BACKWARD:
        own = Action(FORWARD, stage, microbatch)
        if stage + 1 < stages:
            return (own, Action(BACKWARD, stage + 1, microbatch))
        return (own,)
    return (Action(BACKWARD, stage, microbatch),)
