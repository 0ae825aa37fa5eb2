"""Running one step: each device's action list on its own worker, the first failure re-raised."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial

import torch

from gpipe.analysis import Timeline
from gpipe.runtime.context import CallerContext
from gpipe.runtime.stage_set import StageSet
from gpipe.runtime.state import StepState
from gpipe.runtime.threads import Job
from gpipe.runtime.transport import Aborted, Transport
from gpipe.runtime.worker import StageWorker
from gpipe.schedule import Action, in_one_order

__all__ = ["Step"]

_KIND_NAMES = {
    "F": "forward",
    "B": "backward",
    "W": "weight gradient",
    "F+B": "fused forward and backward",
}


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

        Each lane (a device, or every device on one GPU: see
        :func:`~gpipe.runtime.stage_set.lanes_of`) runs on a thread: the first with actions on
        the calling thread, every other on its own (kept by ``stages.threads`` from step to
        step), all under the calling thread's state (autocast, modes, saved-tensor hooks:
        see :class:`~gpipe.runtime.context.CallerContext`), captured here for this run. NOTE:
        keeping one lane on the caller means a one-stage pipe (and a rank of a distributed
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
        lanes = [[d for d in lane if actions[d]] for lane in self.stages.lanes]
        lanes = [lane for lane in lanes if lane]
        jobs: list[Job] = []
        try:
            for lane in lanes[1:]:
                work = partial(self._work, self._lane(lane, actions))
                jobs.append(self.stages.threads.submit(lane[0], work))
            if lanes:
                self._work(self._lane(lanes[0], actions))
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

    def _lane(self, lane: list[int], actions: Sequence[Sequence[Action]]) -> Callable[[], None]:
        """What one thread runs: one device's actions, or several devices' in one order."""
        workers = [self._workers[d] for d in lane]
        if len(lane) == 1:
            return partial(_run_lane, workers, [(lane[0], action) for action in actions[lane[0]]])
        cached = self.stages.orders.get(id(actions))
        if cached is None or cached[0] is not actions:
            if len(self.stages.orders) > 16:  # NOTE: one entry per list the pipe runs
                self.stages.orders.clear()
            cached = self.stages.orders[id(actions)] = (
                actions,
                in_one_order(actions, self.stages.count),
            )
        order = [(d, action) for d, action in cached[1] if d in lane]
        return partial(_run_lane, workers, order)

    def _work(self, run: Callable[[], None]) -> None:
        try:
            run()
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


def _run_lane(workers: list[StageWorker], order: list[tuple[int, Action]]) -> None:
    """Run one or several devices' actions on this thread, in ``order`` (device, action),
    under the caller's state; stop before the next action once the step failed.

    NOTE: several workers share the thread, so one hands the next what the default random
    generators looked like after the last forward (``_watched``), as one worker holding
    every stage would keep it; a forward on another worker in between would otherwise make
    the next look drawn from and be redone.
    """
    by_device = {worker.device: worker for worker in workers}
    state = workers[0].state
    with workers[0].entered():
        for worker in workers:
            worker.prepare()
        last = workers[0]
        for d, action in order:
            if state.failed:
                raise Aborted
            worker = by_device[d]
            if worker is not last:
                worker._watched, last = last._watched, worker
            worker.perform(action)


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
