"""Running one step: each device's action list on its own worker, the first failure re-raised."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial

import torch

from gpipe.analysis import Timeline
from gpipe.runtime.context import CallerContext
from gpipe.runtime.stages import StageSet
from gpipe.runtime.state import StepState
from gpipe.runtime.threads import Job
from gpipe.runtime.transport import Aborted, Transport
from gpipe.runtime.worker import StageWorker
from gpipe.schedule import Action

__all__ = ["Step"]

_KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}


class Step:
    """One step of a pipe: its state, the transport, and a worker per device.

    The same class runs a local pipe (every device in this process, one thread each) and a
    rank of a distributed one (only this rank's device has actions; the others' lists are
    empty, so it runs on the calling thread alone).

    A step starts from the current values of the tied Parameters whose copies other
    devices read (see :mod:`gpipe.tied`), and each run ends by adding the copies'
    gradients into those Parameters'.

    Args:
        stages: the stage modules and their placement.
        transport: what carries messages between stages; reset for this step.
        state: the step's settings and shared state.
    """

    def __init__(self, stages: StageSet, transport: Transport, state: StepState) -> None:
        self.stages = stages
        self.transport = transport
        self.state = state
        transport.reset()
        if stages.tied is not None:
            stages.tied.refresh()
        self._workers = [
            StageWorker(stages, d, transport, state) for d in range(len(stages.devices))
        ]
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._gpus = sorted(
            {d for d in stages.devices if d.type == "cuda"}, key=lambda d: d.index or 0
        )
        if state.track_memory:
            # NOTE: the allocator's peak is the process's: counted from here, beside ours
            for gpu in self._gpus:
                torch.cuda.reset_peak_memory_stats(gpu)

    def run(self, actions: Sequence[Sequence[Action]]) -> None:
        """Run each device's action list concurrently; re-raise the first failure.

        The first device with actions runs on the calling thread and every other device on
        its own thread (kept by ``stages.threads`` from step to step), under the calling
        thread's state (autocast, modes, saved-tensor hooks: see
        :class:`~gpipe.runtime.context.CallerContext`), captured here for this run. NOTE:
        keeping one device on the caller means a one-stage pipe (and a rank of a distributed
        pipe) uses no other thread, and the caller's intra-op (OpenMP) thread team keeps
        doing the work: a second team in another thread competes with it for the cores and
        was measured 2x slower.

        Raises:
            Exception: the first exception any stage raised, its message naming the stage,
                micro-batch and action. The other workers are woken and end; none stays
                blocked.
        """
        devices = self.stages.devices
        context = CallerContext.capture(devices)
        self.state.context = context
        if self.state.forward_context is None:
            self.state.forward_context = context.autocast_only()
        busy = [d for d in range(len(actions)) if actions[d]]
        jobs: list[Job] = []
        try:
            for d in busy[1:]:
                jobs.append(
                    self.stages.threads.submit(d, partial(self._work, self._workers[d], actions[d]))
                )
            if busy:
                self._work(self._workers[busy[0]], actions[busy[0]])
            for job in jobs:
                job.wait()
        except BaseException as interrupted:  # Ctrl-C while waiting, no thread to start
            self.state.failed = True
            self.transport.abort(interrupted)
            for job in jobs:
                job.wait()
            raise
        finally:
            self.state.context = None  # NOTE: the step outlives the run: keep no user modes
            if self.state.track_memory:
                for gpu in self._gpus:
                    self.state.cuda_peaks[gpu] = torch.cuda.max_memory_allocated(gpu)
            if self.stages.tied is not None:  # a failed run's too: none left for the next
                self.stages.tied.collect_gradients()
        error, self._error = self._error, None
        if error is not None:
            self.state.saved.clear()
            # NOTE: dropping the local breaks the cycle frame -> error -> traceback -> frame,
            # so the pipe (and its threads) go as soon as the caller drops the exception.
            try:
                raise error
            finally:
                del error

    def _work(self, worker: StageWorker, actions: Sequence[Action]) -> None:
        try:
            worker.run(actions)
        except Aborted:
            pass
        except BaseException as exc:
            with self._error_lock:
                if self._error is None:
                    self._error = _annotate(exc)
            self.state.failed = True
            self.transport.abort(exc)

    def timeline(self, schedule: str) -> Timeline:
        """What ran so far, per device, in seconds from the step's start.

        Each device's worker appends its events as it runs them, so they are in start order;
        those run on a GPU get the times the GPU ran them (see :meth:`StepState.settle`).
        """
        self.state.settle()
        return Timeline([list(device) for device in self.state.events], "s", schedule)


_PLACE = "[gpipe: raised in "


def unplaced(message: str) -> str:
    """``message`` without the place :func:`_annotate` added to it (for a report that says
    the stage, micro-batch and action in its own words)."""
    return message.split(f" {_PLACE}", 1)[0]


def _annotate(exc: BaseException) -> BaseException:
    """Add the failing stage, micro-batch and action to the exception's message."""
    action = getattr(exc, "gpipe_action", None)
    if action is None:
        return exc
    where = (
        f"{_PLACE}stage {action.stage}, micro-batch {action.microbatch}, "
        f"during {_KIND_NAMES[action.kind]} ({action})]"
    )
    if exc.args and isinstance(exc.args[0], str) and type(exc).__str__ is BaseException.__str__:
        exc.args = (f"{exc.args[0]} {where}", *exc.args[1:])
    elif hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(where)
    return exc
