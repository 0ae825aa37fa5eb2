"""The settings a pipe's steps read, settable between steps: chunks, checkpoint, schedule.

:class:`~gpipe.GPipe` and :class:`~gpipe.distributed.DistributedGPipe` share them: each is
checked when set, and a new schedule replaces the ones built from the old, so a step never
runs a stale one.
"""

from __future__ import annotations

from gpipe.arguments import check_chunks
from gpipe.recompute import check_checkpoint
from gpipe.schedule import Schedule, check_schedule_type, check_virtual_stages, schedule_for

__all__ = ["StepSettings"]


class StepSettings:
    """``chunks``, ``checkpoint`` and ``schedule`` as checked properties, and the schedules
    built from them (one per micro-batch count).

    A pipe sets ``_schedules`` to an empty dict once its stages are known (until then a
    schedule is only stored) and says how many pipeline devices it has.
    """

    virtual_stages: int
    _chunks: int
    _checkpoint: str
    _schedule: str | Schedule
    _schedules: dict[int, Schedule]

    def _pipeline_devices(self) -> int:
        """How many pipeline devices the schedules are built for (0: an empty pipe)."""
        raise NotImplementedError

    @property
    def chunks(self) -> int:
        """M, micro-batches per mini-batch (of each replica); settable (an int, or ``8.0``)."""
        return self._chunks

    @chunks.setter
    def chunks(self, value: int) -> None:
        self._chunks = check_chunks(value)

    @property
    def checkpoint(self) -> str:
        """Which micro-batches re-materialize: "always", "except_last" or "never"; settable
        between steps (a distributed pipe's on every rank alike)."""
        return self._checkpoint

    @checkpoint.setter
    def checkpoint(self, value: str) -> None:
        # NOTE: str() as torchgpipe does, so a str-like mode object works; then validated.
        self._checkpoint = check_checkpoint(str(value))

    @property
    def schedule(self) -> str | Schedule:
        """The schedule ``train_step`` runs (a name or a Schedule); settable between steps
        (a distributed pipe's on every rank alike).

        Raises:
            TypeError: neither a name nor a :class:`~gpipe.schedule.Schedule`.
            ValueError: a schedule that does not fit the pipe (checked when set).
        """
        return self._schedule

    @schedule.setter
    def schedule(self, value: str | Schedule) -> None:
        check_schedule_type(value)
        built = self.__dict__.get("_schedules")
        if built is None:  # __init__: checked once the stages are known
            self._schedule = value
            return
        # NOTE: the schedules built so far follow the old value; a stale one would keep
        # running silently, so they go, and the new value is checked now, not at a step.
        check_virtual_stages(value, self.virtual_stages)
        fresh = {}
        if self._pipeline_devices():  # NOTE: an empty pipe (no layers) runs no schedule
            fresh[self.chunks] = self._build(value, self.chunks, built)
        self._schedule, self._schedules = value, fresh

    def _schedule_for(self, microbatches: int) -> Schedule:
        """The pipe's schedule for ``microbatches``, built and validated once per count."""
        if microbatches not in self._schedules:
            self._schedules[microbatches] = self._build(
                self.schedule, microbatches, self._schedules
            )
        return self._schedules[microbatches]

    def _build(
        self, schedule: str | Schedule, microbatches: int, built: dict[int, Schedule]
    ) -> Schedule:
        """``schedule`` for ``microbatches``, placing the stages where ``built`` did."""
        held = next(iter(built.values())).placement if built else None
        return schedule_for(
            schedule,
            self._pipeline_devices(),
            microbatches,
            virtual_stages=self.virtual_stages,
            placement=held,
        )
