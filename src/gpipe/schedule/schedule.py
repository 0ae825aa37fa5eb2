"""A schedule: per device, the ordered actions it runs in one training step.

The schedule is data. Generators build it, the validator checks it, the simulator times it,
the runtime runs it and the drawing code draws it; nothing else describes a pipeline.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from gpipe.schedule.action import FORWARD, WEIGHT, Action, units
from gpipe.schedule.grid import format_grid
from gpipe.schedule.placement import round_robin
from gpipe.schedule.text import parse_csv, to_csv
from gpipe.schedule.validate import validate

__all__ = ["Schedule", "from_csv"]


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
        wrap: for a decode (:func:`gpipe.schedule.decode`), its lanes: micro-batch ``i``'s
            forward on stage 0 waits for the last stage's forward of ``i - wrap``; 0 (the
            default) for training.
    """

    name: str
    actions: Sequence[Sequence[Action]]  # stored as tuples of tuples
    microbatches: int
    stages: int = -1
    placement: tuple[int, ...] = field(default=())
    wrap: int = 0

    def __post_init__(self) -> None:
        actions = tuple(tuple(device_actions) for device_actions in self.actions)
        object.__setattr__(self, "actions", actions)
        if self.stages < 0:
            object.__setattr__(self, "stages", len(actions))
        if not self.placement:
            object.__setattr__(self, "placement", round_robin(self.stages, max(len(actions), 1)))
        if len(self.placement) != self.stages:
            raise ValueError(
                f"placement lists {len(self.placement)} stages but the schedule has {self.stages}"
            )
        if self.wrap < 0:
            raise ValueError(f"wrap must be >= 0 (a decode's lanes), got {self.wrap}")

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
        return any(unit.kind == WEIGHT for device in self.actions for unit in units(device))

    @property
    def forward_only(self) -> bool:
        """Whether the schedule runs forwards alone (an evaluation, a decode)."""
        return all(unit.kind == FORWARD for device in self.actions for unit in units(device))

    @property
    def fused(self) -> bool:
        """Whether some action issues a forward and a backward together (DualPipeV)."""
        return any(action.parts for device in self.actions for action in device)

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
        return format_grid(self)

    def to_csv(self) -> str:
        """The schedule as CSV text, one row per device (see :func:`gpipe.schedule.to_csv`)."""
        return to_csv(self)

    @classmethod
    def from_csv(cls, text: str, name: str | None = None) -> Schedule:
        """Read a schedule from CSV text (see :func:`gpipe.schedule.from_csv`)."""
        rows, meta = parse_csv(text)
        return cls(
            name or meta.name, rows, meta.microbatches, meta.stages, meta.placement, meta.wrap
        )

    def validate(self) -> None:
        """Raise :class:`~gpipe.schedule.ScheduleError` unless the schedule can run.

        See :func:`gpipe.schedule.validate`.
        """
        validate(self)

    def only(self, kinds: Sequence[str]) -> Schedule:
        """The same schedule keeping only actions of the given kinds (order preserved); a
        fused action counts as its parts."""
        return Schedule(
            self.name,
            tuple(tuple(a for a in units(device) if a.kind in kinds) for device in self.actions),
            self.microbatches,
            self.stages,
            self.placement,
            self.wrap,
        )


def from_csv(text: str, name: str | None = None) -> Schedule:
    """Read the CSV form described in :mod:`gpipe.schedule.text`.

    Args:
        text: the CSV text, with or without ``#`` metadata lines.
        name: the schedule's name; overrides a ``# name:`` line.

    Returns:
        The schedule. It is not validated; call :func:`~gpipe.schedule.validate` for that.

    Raises:
        ValueError: an unparsable action or metadata line, or a stage whose device cannot
            be inferred (no placement line and no row or several rows run it).
    """
    return Schedule.from_csv(text, name)
