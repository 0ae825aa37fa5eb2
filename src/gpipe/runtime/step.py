"""One training step: the state its workers share, and running their action lists."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpipe.runtime.transport import Aborted, LocalTransport
from gpipe.runtime.worker import Stages, StageWorker, _Saved
from gpipe.schedule.action import Action
from gpipe.timeline import Event, Timeline

__all__ = ["Loss", "Step"]

_KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}


@dataclass
class Loss:
    """The loss computed on the last stage: ``fn(output, targets[i]) * weights[i]``."""

    fn: Callable[[Any, Any], torch.Tensor]
    targets: list[Any]
    weights: list[float]


class Step:
    """The state of one step: messages, what each micro-batch saved, losses, the timeline.

    Args:
        stages: the stage modules and their placement.
        microbatches: M, the number of micro-batches in this step.
        grad: whether the step builds autograd graphs (training) or only runs forward.
        checkpoint: the re-materialization mode.
        seed: the step's random seed (see :mod:`gpipe.randomness`).
        loss: the loss to compute on the last stage (train_step), or None.
        split_backward: run weight gradients as separate W actions (zero-bubble).
        track_memory: count the bytes each device holds for backward (see StageWorker).
    """

    def __init__(
        self,
        stages: Stages,
        microbatches: int,
        *,
        grad: bool,
        checkpoint: str,
        seed: int,
        loss: Loss | None = None,
        split_backward: bool = False,
        track_memory: bool = True,
    ) -> None:
        self.stages = stages
        self.microbatches = microbatches
        self.grad = grad
        self.checkpoint = checkpoint
        self.seed = seed
        self.loss = loss
        self.split_backward = split_backward
        self.track_memory = track_memory
        self.autocast = [
            (kind, torch.get_autocast_dtype(kind))
            for kind in sorted({d.type for d in stages.devices} | {"cpu"})
            if torch.is_autocast_enabled(kind)
        ]
        self.transport = LocalTransport(stages.placement, stages.devices)
        self.saved: dict[tuple[int, int], _Saved] = {}
        self.losses: list[torch.Tensor | None] = [None] * microbatches
        self.events: list[list[Event]] = [[] for _ in stages.devices]
        self.origin_ns = time.perf_counter_ns()
        self._workers = [StageWorker(self, d) for d in range(len(stages.devices))]
        self._error: BaseException | None = None
        self.failed = False  # set at the first failure: workers stop before their next action
        self._error_lock = threading.Lock()

    def run(self, actions: Sequence[Sequence[Action]]) -> None:
        """Run each device's action list concurrently; re-raise the first failure.

        Device 0 runs on the calling thread and every other device on a thread of its own.
        NOTE: keeping device 0 on the caller means a one-stage pipe starts no thread at all,
        and the caller's intra-op (OpenMP) thread team keeps doing the work: a second team
        in another thread competes with it for the cores and was measured 2x slower.

        Raises:
            Exception: the first exception any stage raised, its message naming the stage,
                micro-batch and action. The other workers are woken and end; none stays
                blocked.
        """
        threads = [
            threading.Thread(
                target=self._work,
                args=(self._workers[d], actions[d]),
                name=f"gpipe-device{d}",
                daemon=True,
            )
            for d in range(1, len(actions))
            if actions[d]
        ]
        for thread in threads:
            thread.start()
        try:
            if actions and actions[0]:
                self._work(self._workers[0], actions[0])
            for thread in threads:
                thread.join()
        except BaseException:  # e.g. Ctrl-C while waiting: stop every worker, then leave
            self.failed = True
            self.transport.abort()
            for thread in threads:
                thread.join()
            raise
        if self._error is not None:
            self.saved.clear()
            raise self._error

    def _work(self, worker: StageWorker, actions: Sequence[Action]) -> None:
        try:
            worker.run(actions)
        except Aborted:
            pass
        except BaseException as exc:
            with self._error_lock:
                if self._error is None:
                    self._error = _annotate(exc)
            self.failed = True
            self.transport.abort()

    def timeline(self, schedule: str) -> Timeline:
        """What ran so far, per device, in seconds from the step's start.

        Each device's worker appends its events as it runs them, so they are in start order.
        """
        return Timeline([list(device) for device in self.events], "s", schedule)


def _annotate(exc: BaseException) -> BaseException:
    """Add the failing stage, micro-batch and action to the exception's message."""
    action = getattr(exc, "gpipe_action", None)
    if action is None:
        return exc
    where = (
        f"[gpipe: raised in stage {action.stage}, micro-batch {action.microbatch}, "
        f"during {_KIND_NAMES[action.kind]} ({action})]"
    )
    if exc.args and isinstance(exc.args[0], str) and type(exc).__str__ is BaseException.__str__:
        exc.args = (f"{exc.args[0]} {where}", *exc.args[1:])
    else:
        exc.add_note(where)
    return exc
