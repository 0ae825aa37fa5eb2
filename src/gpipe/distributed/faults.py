"""The fault channel: a rank that fails says so in the c10d store, and every rank hears it.

A rank whose stage raises (or is interrupted) publishes what failed: its rank, stage,
micro-batch, action and the error, then wakes every rank's watcher. Each rank's watcher (a
daemon thread) sits in one blocking ``store.wait`` on a wake-up key of its own, so an idle
pipe sends the store no requests; woken, it reads the record and wakes its own waiting
worker with a :class:`PipelineFailure` naming the failing rank. So one rank's error ends every
rank within a fraction of a second, whoever launched the processes (torchrun, mp.spawn,
SLURM, or by hand), and no rank waits for a message that will never come.

The store is torch.distributed's own (the one the process group was initialized with).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from gpipe.runtime.transport import Aborted

__all__ = ["Failure", "FaultChannel", "PipelineFailure", "brief", "wait_for"]

_REARM = datetime.timedelta(hours=1)
# gloo's "[path/file.cc:123] " before its message
_SOURCE_LINE = re.compile(r"^\[[^\]]*:\d+\] ")


def brief(error: BaseException) -> str:
    """A torch.distributed error in one short clause, for a failure's one line: its first
    sentence, without gloo's source line before it and its advice after."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return _SOURCE_LINE.sub("", text).split(". ")[0]


@dataclass(frozen=True)
class Failure:
    """What failed, where: enough for every rank to say it in one line."""

    rank: int
    error: str
    stage: int | None = None
    microbatch: int | None = None
    action: str | None = None

    def describe(self) -> str:
        if self.rank < 0:
            return self.error
        where = f"rank {self.rank}"
        if self.action is not None:
            where += f" (stage {self.stage}, micro-batch {self.microbatch}, action {self.action})"
        return f"{where} failed: {self.error}"


class PipelineFailure(Aborted, RuntimeError):
    """Raised on every rank of a distributed pipe when one rank fails or vanishes.

    It is an :class:`~gpipe.runtime.transport.Aborted`: a worker that meets it stops as it
    would for a failure of another worker in its own process.

    Attributes:
        failure: what failed, on which rank, stage, micro-batch and action.
    """

    def __init__(self, failure: Failure, seen_by: int) -> None:
        super().__init__(f"gpipe: {failure.describe()} [seen by rank {seen_by}]")
        self.failure = failure


class FaultChannel:
    """Publish this rank's failure; hear any rank's.

    Args:
        store: the c10d store every rank shares.
        prefix: keys are ``prefix + "/failure"`` and ``prefix + "/wake/<rank>"``: one set per
            pipe, so pipes never mix.
        rank: this rank.
        on_failure: called (in the watcher thread) with the first failure any rank reports.
        world: how many ranks watch (a failure wakes each).
    """

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        on_failure: Callable[[Failure], None],
        world: int,
    ) -> None:
        # NOTE: clients of their own: a TCPStore client serves one request at a time, so a
        # watcher blocked in wait on the job's shared client would stall every other use of
        # it (process groups made meanwhile waited the whole wait out)
        self._store = _own_client(store)
        self._waiter = _own_client(store)
        self._prefix = prefix
        self._key = f"{prefix}/failure"
        self._rank = rank
        self._world = world
        self._on_failure = on_failure
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.failure: Failure | None = None
        self._thread = threading.Thread(
            target=self._watch, name=f"gpipe-faults-rank{rank}", daemon=True
        )
        self._thread.start()

    def publish(self, failure: Failure) -> Failure:
        """Report ``failure`` unless another rank already reported one; return the first.

        NOTE: compare_set makes the first report win, so every rank names the same cause
        even when a failure on one rank makes its neighbours fail too.
        """
        payload = json.dumps(asdict(failure)).encode()
        try:
            first = self._store.compare_set(self._key, b"", payload)
            winner = _load(first) if first else failure
            if not first or first == payload:  # this report won: wake every watcher
                for rank in range(self._world):
                    self._store.set(self._wake(rank), b"failure")
        except Exception:  # the store itself is gone (its host died): keep our own account
            winner = failure
        self._heard(winner)
        return winner

    def check(self) -> Failure | None:
        """The failure reported so far, if any (asks the store once).

        NOTE: a store that cannot be reached is not a failure by itself: launched by hand,
        rank 0 hosts it and may simply have finished first. If rank 0 died instead, the
        ranks it talks to see their links to it break, and report that.
        """
        if self.failure is None:
            try:
                if self._store.check([self._key]):
                    self._heard(_load(self._store.get(self._key)))
            except Exception:
                self._stop.set()
        return self.failure

    def acknowledge(self, ranks: int, grace: float = 2.0) -> None:
        """Say this rank heard the failure; wait (``grace`` s at most) until all ``ranks`` did.

        NOTE: launched by hand, the store lives in rank 0's process; a rank still blocked in
        a collective when the failing rank exits can only learn the cause from the store, so
        no rank leaves before every rank has heard (or the grace runs out: a dead rank never
        acknowledges).
        """
        key = f"{self._key}/heard"
        deadline = time.monotonic() + grace
        try:
            count = self._store.add(key, 1)
            while count < ranks and time.monotonic() < deadline:
                time.sleep(0.02)
                count = self._store.add(key, 0)
        except Exception:
            return

    def close(self) -> None:
        """Stop watching: wake this rank's watcher, and wait (a second at most) for it.

        NOTE: a watcher still asking the store while the interpreter exits can abort the
        process (the store goes away under a thread in C++); pipes close at exit for that.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        with contextlib.suppress(Exception):  # the store is gone: the watcher has ended
            self._store.set(self._wake(self._rank), b"closed")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def _wake(self, rank: int) -> str:
        return f"{self._prefix}/wake/{rank}"

    def _watch(self) -> None:
        """Block on this rank's wake-up key (re-armed each hour) until a failure or close."""
        while not self._stop.is_set():
            try:
                self._waiter.wait([self._wake(self._rank)], _REARM)
            except Exception as error:
                if "timeout" in str(error).lower():
                    continue
                # NOTE: the waiting client broke (the store's host may be gone): look
                # with the other client now and then, until closed or a failure is heard
                while not self._stop.wait(0.5):
                    if self.check() is not None:
                        return
                return
            if self._stop.is_set() or self.check() is not None:
                return

    def _heard(self, failure: Failure) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = failure
        self._on_failure(failure)


def _own_client(store: Any) -> Any:
    """A new client of ``store``'s server when it is a TCPStore (under any prefixes: keys are
    then the server's own), else ``store`` itself (an in-process store serves many at once)."""
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if not isinstance(base, dist.TCPStore):
        return store
    return dist.TCPStore(
        base.host,
        base.port,
        is_master=False,
        timeout=base.timeout,  # type: ignore[attr-defined]
        wait_for_workers=False,
    )


def _load(payload: bytes) -> Failure:
    return Failure(**json.loads(payload.decode()))


def wait_for(
    work: Any, faults: FaultChannel, failed: Callable[[], Failure | None], rank: int
) -> None:
    """Wait for a torch.distributed ``work``, or for a failure anywhere, whichever comes first.

    NOTE: a gloo wait cannot be interrupted, and a timed-out one breaks the link, so a
    thread waits for the work while this one watches for a failure (``failed()``, which the
    fault channel sets): a rank that fails while the others sit in a collective still ends
    them all at once.

    Raises:
        PipelineFailure: a rank reported a failure, or a link broke (its cause named if
            the failing rank reported one within a second).
    """
    if work.is_completed():  # NOTE: often so (a loss sent long ago): no thread to start
        try:
            work.wait()
        except Exception as error:
            raise PipelineFailure(_cause(error, faults, failed), rank) from error
        return
    done = threading.Event()
    broke: list[BaseException] = []

    def wait() -> None:
        try:
            work.wait()
        except BaseException as error:
            broke.append(error)
        finally:
            done.set()

    threading.Thread(target=wait, name="gpipe-collective", daemon=True).start()
    while not done.wait(0.05):
        failure = failed()
        if failure is not None:
            raise PipelineFailure(failure, rank)
    if broke:
        raise PipelineFailure(_cause(broke[0], faults, failed), rank) from broke[0]


def _cause(
    error: BaseException, faults: FaultChannel, failed: Callable[[], Failure | None]
) -> Failure:
    """Why a link broke: the failure some rank reported, if it comes within a second."""
    for _ in range(10):
        failure = failed() or faults.check()
        if failure is not None:
            return failure
        time.sleep(0.1)
    return Failure(-1, f"a rank left the job without reporting why ({brief(error)})")
