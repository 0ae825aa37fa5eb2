"""Device threads: one long-lived thread per pipeline device, handed each step's work."""

from __future__ import annotations

import contextvars
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["DeviceThreads", "Job"]


class Job:
    """One piece of work handed to a device thread; :meth:`wait` returns once it has run."""

    def __init__(self, work: Callable[[], None]) -> None:
        self._work: Callable[[], None] | None = work
        # NOTE: the work runs in the submitting thread's context: torch keeps a user's
        # config settings (torch._functorch.config.donated_buffer = False) per context, so
        # a device thread of its own would compile and run the layers without them.
        self._context: contextvars.Context | None = contextvars.copy_context()
        self._done = threading.Lock()
        self._done.acquire()

    def run(self) -> None:
        try:
            assert self._work is not None and self._context is not None
            self._context.run(self._work)
        finally:
            # NOTE: drop the step (and what it saved) as soon as it is over
            self._work = self._context = None
            self._done.release()

    def wait(self) -> None:
        """Block until the work has run (at once if it already has); safe to call again."""
        self._done.acquire()
        self._done.release()


def _serve(jobs: queue.SimpleQueue[Job | None]) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        job.run()
        del job  # NOTE: hold nothing of the last step while waiting for the next


def _stop(threads: dict[int, tuple[threading.Thread, queue.SimpleQueue[Job | None]]]) -> None:
    for _, jobs in threads.values():
        jobs.put(None)
    threads.clear()


class DeviceThreads:
    """A daemon thread per pipeline device, started at its first job and kept across steps.

    NOTE: kept, not started per step: a new thread costs its start, and builds its own
    intra-op (OpenMP) thread team at its first parallel op. These threads live as long as
    their pipe: they end at :meth:`close`, or once this object is garbage collected. A
    thread holds nothing of a step between jobs, and a step re-enters its own settings on
    each thread.
    """

    def __init__(self) -> None:
        self._threads: dict[int, tuple[threading.Thread, queue.SimpleQueue[Job | None]]] = {}
        self._lock = threading.Lock()
        # NOTE: the finalizer holds the dict, not self, so the pipe can be collected.
        weakref.finalize(self, _stop, self._threads)

    def submit(self, device: int, work: Callable[[], None]) -> Job:
        """Run ``work`` on ``device``'s thread (started if it is not running); the job."""
        job = Job(work)
        with self._lock:
            entry = self._threads.get(device)
            # NOTE: a thread may be gone: after os.fork() only the forking thread exists.
            if entry is None or not entry[0].is_alive():
                jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
                thread = threading.Thread(
                    target=_serve, args=(jobs,), name=f"gpipe-device{device}", daemon=True
                )
                thread.start()
                entry = self._threads[device] = (thread, jobs)
        entry[1].put(job)
        return job

    def close(self) -> None:
        """End every thread once its current job is done, and wait for it; a later
        :meth:`submit` starts a new one."""
        with self._lock:
            threads = [thread for thread, _ in self._threads.values()]
            _stop(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()

    def __reduce__(self) -> tuple[Any, ...]:
        """A copy (pickle, deepcopy) starts with no threads of its own."""
        return (DeviceThreads, ())
