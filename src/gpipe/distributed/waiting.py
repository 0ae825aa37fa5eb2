"""Waiting for a collective of the pipe's own, or for a failure anywhere, whichever comes
first: a rank that fails while the others sit in a collective still ends them all at once."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from gpipe.distributed.failure import Failure, PipelineFailure, brief
from gpipe.distributed.fault_channel import FaultChannel

__all__ = ["WaitHelpers", "wait_for"]


def wait_for(
    work: Any,
    faults: FaultChannel | None,
    failed: Callable[[], Failure | None],
    rank: int,
    ranks: Sequence[int] | None = None,
    helpers: WaitHelpers | None = None,
) -> None:
    """Wait for a torch.distributed ``work``, or for a failure anywhere, whichever comes first.

    A thread waits for the work, since a gloo wait cannot be interrupted and a timed-out one
    (``Work.wait(timeout)``) breaks the link; this one blocks until the work is done or
    ``faults`` hears a failure (``failed()`` then names it).

    Args:
        faults: the channel whose failures end the wait (None: only the work ends it).
        failed: the failure this rank knows of, if any.
        ranks: the collective's ranks, among which a silent one is looked for if a link
            breaks with no report (default: every rank).
        helpers: the threads to wait on (None: a new thread for this wait).

    Raises:
        PipelineFailure: a rank reported a failure, or a link broke (the rank that failed
            named, see :meth:`FaultChannel.culprit`).
    """
    if work.is_completed():  # NOTE: often so (a loss sent long ago): no thread to start
        try:
            work.wait()
        except Exception as error:
            raise PipelineFailure(_cause(error, faults, failed, ranks), rank) from error
        return
    woken = threading.Event()  # the work is done, or a failure was heard
    done = threading.Event()
    broke: list[BaseException] = []
    # NOTE: the helper lets go of the work before saying it is done, so the work is freed on
    # this thread, never on the helper: torch frees a work with the GIL released, and a
    # daemon thread taking the GIL back as the interpreter finalizes aborts the process.
    handed = [work]
    del work

    def wait() -> None:
        held = handed.pop()
        try:
            held.wait()
        except BaseException as error:
            broke.append(error)
        finally:
            del held
            done.set()
            woken.set()

    with _woken_by(faults, woken):
        if helpers is None:
            threading.Thread(target=wait, name="gpipe-collective", daemon=True).start()
        else:
            helpers.run(wait)
        woken.wait()
    if not done.is_set():  # woken by the channel, which heard a failure
        failure = failed() or (faults.failure if faults is not None else None)
        assert failure is not None
        raise PipelineFailure(failure, rank)
    if broke:
        raise PipelineFailure(_cause(broke[0], faults, failed, ranks), rank) from broke[0]


def _woken_by(
    faults: FaultChannel | None, event: threading.Event
) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if faults is None else faults.wakes(event)


def _cause(
    error: BaseException,
    faults: FaultChannel | None,
    failed: Callable[[], Failure | None],
    ranks: Sequence[int] | None,
) -> Failure:
    """Why a collective's link broke: a reported failure, else the rank that fell silent."""
    failure = failed()
    if failure is not None:
        return failure
    what = f"a link of a collective broke ({brief(error)})"
    if faults is None:
        return Failure(-1, what)
    return faults.culprit(-1, what, ranks)


class WaitHelpers:
    """The threads :func:`wait_for` waits on, kept from wait to wait, ended by :meth:`close`.

    NOTE: reused, not started per wait: each thread that waits on a c10d work and ends
    leaves native memory behind (torch's: benchmarks/soak_repro.py --mode broadcast), so a
    thread per wait grew a long run's RSS step after step. A helper whose wait never
    returns is never reused.
    """

    def __init__(self) -> None:
        self._idle: list[tuple[threading.Thread, queue.SimpleQueue[Any]]] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def run(self, job: Callable[[], None]) -> None:
        """Run ``job`` on an idle helper, or on a new one if none is idle."""
        with self._lock:
            while self._idle:
                thread, jobs = self._idle.pop()
                if thread.is_alive():  # NOTE: after os.fork() only the forking thread exists
                    jobs.put(job)
                    return
            jobs = queue.SimpleQueue()
            thread = threading.Thread(
                target=self._serve, args=(jobs,), name="gpipe-collective", daemon=True
            )
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        jobs.put(job)
        thread.start()

    def close(self, within: float = 1.0) -> None:
        """End the idle helpers now and the busy ones once their wait returns; wait
        ``within`` s at most for them to end."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            threads, self._threads = self._threads, []
        for _, jobs in idle:
            jobs.put(None)
        deadline = time.monotonic() + within
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _serve(self, jobs: queue.SimpleQueue[Any]) -> None:
        while (job := jobs.get()) is not None:
            job()
            del job
            with self._lock:
                if self._closed:
                    return
                self._idle.append((threading.current_thread(), jobs))
