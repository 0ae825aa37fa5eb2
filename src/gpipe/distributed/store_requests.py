"""Requests to the c10d store that are answered within a bound, on clients of their own.

A TCPStore client waits for a stopped server forever, whatever its timeout (a wait that
times out cancels itself with one more request, which the stopped server never answers).
So a rank that asks the store while its host is stopped (SIGSTOP, a hung node) would hang:
here one thread per set of requests runs them in order, and the caller waits for each
answer ``within`` seconds at most. A store that does not answer is itself the clue
(:class:`StoreSilent`), and is asked nothing more.

The clients are the process's own, not the job's shared one: a TCPStore client serves one
request at a time, so a request blocked on it would stall every other use of it. They are
reused from pipe to pipe, so a job that builds pipe after pipe opens no new connection to
the store's host each time.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from typing import Any

import torch.distributed as dist

__all__ = ["StoreRequests", "StoreSilent", "borrow_client", "return_client"]


class StoreSilent(RuntimeError):
    """The store did not answer within its bound (its host is stopped or gone)."""


# idle clients of each store the pipes were given (the job's own store object, which torch
# keeps while the default group lives); they go with it
_IDLE: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
_IDLE_LOCK = threading.Lock()


def _server(store: Any) -> Any:
    """The TCPStore under ``store``'s prefixes, or None (an in-process store)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


def borrow_client(store: Any) -> Any:
    """A client of ``store``'s server that no one else uses until it is returned: an idle
    one, or a new one (keys are then the server's own, under no prefix). An in-process store
    serves many requests at once: it is ``store`` itself."""
    server = _server(store)
    if server is None:
        return store
    with _IDLE_LOCK:
        idle = _IDLE.get(store)
        if idle:
            return idle.pop()
    return dist.TCPStore(
        server.host,
        server.port,
        is_master=False,
        timeout=server.timeout,
        wait_for_workers=False,
    )


def return_client(store: Any, client: Any) -> None:
    """Keep ``client`` (from :func:`borrow_client`) for the next borrower. Only a client with
    no request in flight, whose requests all succeeded, may be returned."""
    if client is store:
        return
    with _IDLE_LOCK, contextlib.suppress(TypeError):  # a store that takes no weak reference
        _IDLE.setdefault(store, []).append(client)


class StoreRequests:
    """Requests to ``store`` on a client of their own, each answered within ``within`` s.

    Args:
        store: the c10d store every rank shares.
        within: seconds a request may take before the store counts as silent.
        name: the requests thread's name.
    """

    def __init__(self, store: Any, within: float, name: str) -> None:
        self.within = within
        self.silent = False  # the store did not answer once: ask it nothing more
        self._store = store
        self._client: Any = borrow_client(store)
        self._clean = True  # every request succeeded: the client may serve another pipe
        self._jobs: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        self._answered = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def __call__(self, method: str, *args: Any, within: float | None = None) -> Any:
        """``client.method(*args)``, or StoreSilent if no answer comes within ``within`` s
        (this object's bound unless given; the time queued behind other requests counts).

        Raises:
            StoreSilent: no answer in time, now or for an earlier request.
        """
        if self.silent or self._closed:
            raise StoreSilent("the store did not answer before, or the channel is closed")
        job: list[Any] = [method, args, None]  # the answer: (ok, value) once done
        self._jobs.put(job)
        bound = self.within if within is None else within
        with self._answered:
            if not self._answered.wait_for(lambda: job[2] is not None or self.silent, bound):
                self.silent = True
                self._answered.notify_all()  # the other waiters need not wait their bound out
            if job[2] is None:
                raise StoreSilent(f"the store did not answer within {bound:g} s")
        ok, value = job[2]
        if not ok:
            raise value
        return value

    def close(self, deadline: float) -> bool:
        """Let the requests thread end (by ``deadline``, a ``time.monotonic()``), and return
        the client once it is idle. Whether the thread ended (a silent store's never does)."""
        self._closed = True
        self._jobs.put(None)
        if not self.silent and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        ended = not self._thread.is_alive()
        if ended and self._clean and not self.silent:
            return_client(self._store, self._client)
        self._client = None
        return ended

    def _run(self) -> None:
        client = self._client
        while (job := self._jobs.get()) is not None:
            method, args, _ = job
            try:
                answer = (True, getattr(client, method)(*args))
            except BaseException as error:
                answer = (False, error)
                self._clean = False
            with self._answered:
                job[2] = answer
                self._answered.notify_all()
            del job, answer
