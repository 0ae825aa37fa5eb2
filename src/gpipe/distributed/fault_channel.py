"""The fault channel: a rank that fails says so in the c10d store, and every rank hears it.

A rank whose stage raises (or is interrupted) publishes what failed: its rank, stage,
micro-batch, action and the error, then wakes every rank's watcher. Each rank's watcher (a
daemon thread) sits in one blocking ``store.wait`` on a wake-up key of its own, so an idle
pipe sends the store no requests; woken, it reads the record and wakes its own waiting
worker with a :class:`~gpipe.distributed.failure.PipelineFailure` naming the failing rank.
So one rank's error ends every rank within a fraction of a second, whoever launched the
processes (torchrun, mp.spawn, SLURM, or by hand), and no rank waits for a message that will
never come. A rank that stops answering reports nothing: its beats name it instead (see
:mod:`gpipe.distributed.heartbeat`).

Every request to the store is bounded (see :mod:`gpipe.distributed.store_requests`). Failure
records and beats carry a MAC under a token only the ranks know, bound to their key, so
another client of the store cannot stop the job by writing one, nor forge a beat (what it
can do is said in docs/distributed.md, "When something fails"). Keys name the launcher's
restart attempt (torchrun's ``TORCHELASTIC_RESTART_COUNT``): a restarted job never reads
what an earlier attempt wrote (its failure record, its beats, its acknowledgements). The
store is torch.distributed's own (the one the process group was initialized with).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from gpipe.distributed.failure import Failure, signed, verified
from gpipe.distributed.heartbeat import BEAT, Heartbeat
from gpipe.distributed.restarts import attempt as restart_attempt
from gpipe.distributed.store_requests import (
    StoreRequests,
    StoreSilent,
    borrow_client,
    return_client,
)

__all__ = ["ASK", "FaultChannel"]

_REARM = datetime.timedelta(hours=1)
ASK = 3.0  # seconds a store request may take before the store counts as silent


class FaultChannel:
    """Publish this rank's failure; hear any rank's; beat while busy; name who stopped.

    Once :meth:`close` returns, the channel holds no thread, and its store clients are idle
    and kept for the next channel (unless the store fell silent or broke).

    Args:
        store: the c10d store every rank shares.
        prefix: keys are ``<prefix>/attempt-<attempt>/`` followed by ``failure``,
            ``wake/<rank>`` and ``alive/<rank>``: one set per pipe and attempt, so pipes
            and restarts never mix.
        rank: this rank.
        on_failure: called (in the watcher thread) with the first failure any rank reports.
        world: how many ranks watch (a failure wakes each).
        token: a secret only the ranks share; failure records without its MAC are ignored.
        beat: seconds between beats while busy.
        ask: seconds a store request may take before the store counts as silent.
        attempt: the launcher's restart attempt (default: torchrun's, see
            :func:`gpipe.distributed.restarts.attempt`).
    """

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        on_failure: Callable[[Failure], None],
        world: int,
        *,
        token: bytes = b"",
        beat: float = BEAT,
        ask: float = ASK,
        attempt: int | None = None,
    ) -> None:
        if attempt is None:
            attempt = restart_attempt()
        self._ask = StoreRequests(store, ask, f"gpipe-store-rank{rank}")
        self._store = store
        self._waiter: Any = borrow_client(store)  # NOTE: blocked in wait: a client of its own
        self._waiter_clean = True
        # NOTE: torchrun hands every attempt the same store, and the clients borrowed here
        # see its keys under no prefix (see borrow_client): the attempt is in the keys
        self._prefix = prefix = f"{prefix}/attempt-{attempt}"
        self._key = f"{prefix}/failure"
        self._rank = rank
        self._world = world
        self._token = token
        self._on_failure = on_failure
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._failed = threading.Event()  # set with self.failure
        self._listeners: set[threading.Event] = set()  # also set then (see waiting.wait_for)
        self.failure: Failure | None = None
        self._heartbeat = Heartbeat(
            self._ask, prefix, rank, world, beat, f"gpipe-beats-rank{rank}", token
        )
        self._thread = threading.Thread(
            target=self._watch, name=f"gpipe-faults-rank{rank}", daemon=True
        )
        self._thread.start()

    @property
    def progress(self) -> Callable[[], dict[str, Any]]:
        """What this rank is doing, for its beats (set by the pipe)."""
        return self._heartbeat.progress

    @progress.setter
    def progress(self, progress: Callable[[], dict[str, Any]]) -> None:
        self._heartbeat.progress = progress

    def busy(self) -> contextlib.AbstractContextManager[None]:
        """Beat while inside (see :meth:`Heartbeat.busy`)."""
        return self._heartbeat.busy()

    def culprit(
        self,
        suspect: int,
        what: str,
        ranks: Sequence[int] | None = None,
        fallback: Failure | None = None,
    ) -> Failure:
        """Whom to name when this rank's wait for ``suspect`` failed (see
        :meth:`Heartbeat.culprit`): a failure reported meanwhile wins."""
        return self._heartbeat.culprit(suspect, what, ranks, self._reported, fallback)

    def publish(self, failure: Failure) -> Failure:
        """Report ``failure`` unless another rank already reported one; return the first.

        NOTE: compare_set makes the first report win, so every rank names the same cause
        even when a failure on one rank makes its neighbours fail too. A record that is not
        ours (no valid MAC: written by another client of the store) is overwritten.
        """
        payload = signed(failure, self._key, self._token)
        try:
            first = self._ask("compare_set", self._key, b"", payload)
            winner = verified(first, self._key, self._token) if first else failure
            if winner is None:  # a forged record sits there: ours replaces it
                self._ask("set", self._key, payload)
                winner, first = failure, payload
            if not first or first == payload:  # this report won: wake every watcher
                for rank in range(self._world):
                    self._ask("set", self._wake(rank), b"failure")
        except Exception:  # the store is gone or silent: keep our own account
            winner = failure
        self._heard(winner)
        return winner

    def check(self) -> Failure | None:
        """The failure reported so far, if any (asks the store once).

        NOTE: a store that cannot be reached is not a failure by itself: launched by hand,
        rank 0 hosts it and may simply have finished first.
        """
        if self.failure is None:
            try:
                if self._ask("check", [self._key]):
                    found = verified(self._ask("get", self._key), self._key, self._token)
                    if found is not None:
                        self._heard(found)
            except StoreSilent:
                pass
            except Exception:
                self._stop.set()
        return self.failure

    def acknowledge(self, ranks: int, grace: float | None = None) -> None:
        """Say this rank heard the failure; wait (``grace`` s at most) until all ``ranks`` did.

        NOTE: launched by hand, the store lives in rank 0's process: no rank leaves before
        every rank has heard the cause (a dead rank never acknowledges: hence the grace).
        By default the grace outlasts a culprit's watch of the beats (three beats), so a
        rank still watching when the others leave does not find the store gone and name
        its host (seen in 1 of 20 kills at 4 ranks with a grace of 2 s).
        """
        if grace is None:
            grace = 3 * self._heartbeat.beat + 2.0
        heard = f"{self._key}/heard"
        try:
            if self._ask("add", heard, 1) >= ranks:
                self._ask("set", f"{heard}/all", b"1")
            else:
                limit = datetime.timedelta(seconds=grace)
                self._ask("wait", [f"{heard}/all"], limit, within=grace + self._ask.within)
        except Exception:
            return

    def close(self) -> None:
        """Stop watching and beating: wake this rank's watcher, and wait until it, the beats
        and every store request in flight have ended (``ask`` s and one more at most).

        NOTE: a thread that returns from torch once the interpreter is finalizing aborts the
        process, so close (also run at exit) leaves none behind, except on a silent store,
        whose requests never return.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        beats = self._heartbeat.stop()
        with contextlib.suppress(Exception):  # the store is gone: the watcher has ended
            self._ask("set", self._wake(self._rank), b"closed")
        deadline = time.monotonic() + self._ask.within + 1.0
        for thread in (self._thread, beats):
            if thread is not threading.current_thread() and not self._ask.silent:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if not self._thread.is_alive() and self._waiter_clean and not self._ask.silent:
            return_client(self._store, self._waiter)
            # NOTE: a store keeps every key ever set: only this rank's watcher reads its
            # wake-up key, which has ended, so it goes (a job builds pipe after pipe)
            with contextlib.suppress(Exception):
                self._ask("delete_key", self._wake(self._rank))
        self._waiter = None
        self._ask.close(deadline)  # NOTE: last: the threads above ask through it
        # NOTE: let go of the pipe's callbacks, so a pipe that holds this channel is freed
        # with its last reference, not by the collector (with the process groups it holds)
        self._on_failure = _ignore
        self._heartbeat.progress = dict

    @contextlib.contextmanager
    def wakes(self, event: threading.Event) -> Iterator[None]:
        """Set ``event`` when a failure is heard, while inside (at once if one was)."""
        with self._lock:
            self._listeners.add(event)
            if self._failed.is_set():
                event.set()
        try:
            yield
        finally:
            with self._lock:
                self._listeners.discard(event)

    def _wake(self, rank: int) -> str:
        return f"{self._prefix}/wake/{rank}"

    def _reported(self, seconds: float) -> Failure | None:
        """The failure reported within ``seconds`` (the watcher hears it), if any."""
        self._failed.wait(seconds)
        return self.failure

    def _watch(self) -> None:
        """Block on this rank's wake-up key (re-armed each hour) until a failure or close."""
        waiter = self._waiter
        while not self._stop.is_set():
            try:
                waiter.wait([self._wake(self._rank)], _REARM)
            except Exception as error:
                if "timeout" in str(error).lower():
                    continue
                self._waiter_clean = False
                # NOTE: the waiting client broke and no other blocks for a failure: look with
                # the other client now and then, until closed or a failure is heard
                while not self._stop.wait(0.5):
                    if self.check() is not None:
                        return
                return
            if self._stop.is_set() or self.check() is not None:
                return
            # NOTE: woken with no valid record (a forged one, or none): wait again
            with contextlib.suppress(Exception):
                self._ask("delete_key", self._wake(self._rank))

    def _heard(self, failure: Failure) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = failure
        self._heartbeat.stop()  # NOTE: nobody waits for this rank any more
        self._on_failure(failure)
        self._failed.set()  # NOTE: after on_failure, so a waiter woken finds it everywhere
        with self._lock:
            for event in self._listeners:
                event.set()


def _ignore(failure: Failure) -> None:
    """What a closed channel does with a failure heard late: nothing."""
