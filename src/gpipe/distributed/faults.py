"""The fault channel: a rank that fails says so in the c10d store, and every rank hears it.

A rank whose stage raises (or is interrupted) publishes what failed: its rank, stage,
micro-batch, action and the error, then wakes every rank's watcher. Each rank's watcher (a
daemon thread) sits in one blocking ``store.wait`` on a wake-up key of its own, so an idle
pipe sends the store no requests; woken, it reads the record and wakes its own waiting
worker with a :class:`PipelineFailure` naming the failing rank. So one rank's error ends every
rank within a fraction of a second, whoever launched the processes (torchrun, mp.spawn,
SLURM, or by hand), and no rank waits for a message that will never come.

A rank that stops answering (stopped with SIGSTOP, a hung kernel, a deadlocked hook) reports
nothing, so while a rank is inside a step its channel also beats: every second it writes how
far it got. A rank whose wait for a peer fails asks :meth:`FaultChannel.culprit` whom to
name, and the answer comes from those beats: the rank that fell silent, or the one stuck in
an action, rather than the neighbour whose link happened to break first.

Every request to the store is bounded: a store that does not answer (its host stopped) is
itself the clue, and no rank waits on it forever. Failure records carry a MAC under a token
only the ranks know, so another client of the store cannot stop the job by writing one.

The store is torch.distributed's own (the one the process group was initialized with).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from gpipe.runtime.transport import Aborted

__all__ = ["Failure", "FaultChannel", "PipelineFailure", "StoreSilent", "brief", "wait_for"]

_REARM = datetime.timedelta(hours=1)
BEAT = 1.0  # seconds between a busy rank's beats
ASK = 3.0  # seconds a store request may take before the store counts as silent
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


class StoreSilent(RuntimeError):
    """The store did not answer within its bound (its host is stopped or gone)."""


class FaultChannel:
    """Publish this rank's failure; hear any rank's; beat while busy; name who stopped.

    Args:
        store: the c10d store every rank shares.
        prefix: keys are ``prefix + "/failure"``, ``prefix + "/wake/<rank>"`` and
            ``prefix + "/alive/<rank>"``: one set per pipe, so pipes never mix.
        rank: this rank.
        on_failure: called (in the watcher thread) with the first failure any rank reports.
        world: how many ranks watch (a failure wakes each).
        token: a secret only the ranks share; failure records without its MAC are ignored.
        beat: seconds between beats while busy.
        ask: seconds a store request may take before the store counts as silent.
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
        self._token = token
        self._beat = beat
        self._ask_within = ask
        self._on_failure = on_failure
        self._stop = threading.Event()
        self._left = threading.Event()  # wakes the beats: the rank left its step, or closed
        self._lock = threading.Lock()
        self._silent = False  # the store did not answer once: ask it nothing more
        self._asking: set[threading.Thread] = set()  # store requests in flight (see _ask)
        self._busy = 0
        self._entered = 0  # steps (and constructions) entered: the same count on every rank
        self._beats = 0
        self.failure: Failure | None = None
        # what this rank is doing, for its beats: set by the pipe
        self.progress: Callable[[], dict[str, Any]] = dict
        self._thread = threading.Thread(
            target=self._watch, name=f"gpipe-faults-rank{rank}", daemon=True
        )
        self._thread.start()
        self._beating = threading.Thread(
            target=self._beat_while_busy, name=f"gpipe-beats-rank{rank}", daemon=True
        )
        self._beating.start()

    def publish(self, failure: Failure) -> Failure:
        """Report ``failure`` unless another rank already reported one; return the first.

        NOTE: compare_set makes the first report win, so every rank names the same cause
        even when a failure on one rank makes its neighbours fail too. A record that is not
        ours (no valid MAC: written by another client of the store) is overwritten.
        """
        payload = self._signed(failure)
        try:
            first = self._ask(self._store.compare_set, self._key, b"", payload)
            winner = self._verified(first) if first else failure
            if winner is None:  # a forged record sits there: ours replaces it
                self._ask(self._store.set, self._key, payload)
                winner, first = failure, payload
            if not first or first == payload:  # this report won: wake every watcher
                for rank in range(self._world):
                    self._ask(self._store.set, self._wake(rank), b"failure")
        except Exception:  # the store is gone or silent: keep our own account
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
                if self._ask(self._store.check, [self._key]):
                    found = self._verified(self._ask(self._store.get, self._key))
                    if found is not None:
                        self._heard(found)
            except StoreSilent:
                pass
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
            count = self._ask(self._store.add, key, 1)
            while count < ranks and time.monotonic() < deadline:
                time.sleep(0.02)
                count = self._ask(self._store.add, key, 0)
        except Exception:
            return

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Beat while inside (a step, building the pipe): a rank that stops beating while
        others wait for it is the one :meth:`culprit` names."""
        with self._lock:
            self._busy += 1
            if self._busy == 1:
                self._entered += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                if not self._busy:
                    self._left.set()

    def culprit(self, suspect: int, what: str, ranks: Sequence[int] | None = None) -> Failure:
        """Whom to name when this rank's wait for ``suspect`` failed (``what`` happened).

        The failure some rank reported, if one comes while the beats of ``ranks`` are
        watched for ``3 * beat`` s; else the first rank whose beats stopped (stopped, or
        dead), else the first that beats but made no progress outside a wait (stuck in an
        action or a hook), else ``suspect``. A store that does not answer names rank 0,
        which hosts it when launched by hand (torchrun's agent hosts it otherwise).
        """
        if ranks is None:
            ranks = range(self._world)
        others = [r for r in ranks if r != self._rank]
        try:
            before = self._records(others)
            deadline = time.monotonic() + 3 * self._beat
            while time.monotonic() < deadline:
                if self.check() is not None:
                    return self.failure  # type: ignore[return-value]
                time.sleep(min(0.25, self._beat / 4))
            after = self._records(others)
        except StoreSilent:
            return _silent_store(what, "is silent too (rank 0 stopped, or its host hung)")
        except Exception as error:  # NOTE: the store's host is gone (connection broken)
            return _silent_store(what, f"is gone too ({brief(error)}: rank 0 died or left)")
        reported = self.check()
        if reported is not None:
            return reported
        seconds = f"{3 * self._beat:g}"
        # NOTE: a rank that left this very step (its part done) is no suspect until the
        # others are cleared; one whose last record is an earlier step's is
        idle = [
            r
            for r in others
            if (record := after[r] or {}).get("busy") is False
            and record.get("entered", 0) >= self._entered
        ]
        for rank in others:
            now = after[rank]
            if rank not in idle and (now is None or now == before[rank]):
                return Failure(
                    rank,
                    f"it stopped answering (no sign of life in {seconds} s: stopped or killed, "
                    f"or held up before this step); {what}",
                )
        for rank in others:
            then, now = before[rank] or {}, after[rank] or {}
            if rank not in idle and now.get("done") == then.get("done") and not now.get("waiting"):
                doing = now.get("doing") or "its step"
                return Failure(
                    rank,
                    f"it made no progress in {doing} for {seconds} s while the others waited "
                    f"(a hung kernel, or a deadlocked hook?); {what}",
                )
        if idle:  # NOTE: last: a rank between steps may simply have finished its part
            return Failure(
                idle[0],
                f"it is outside the pipe's step (its part done, or held up in your own code) "
                f"while the others wait; {what}",
            )
        if suspect < 0:
            return Failure(-1, what)
        return Failure(
            suspect, f"{what}: that rank died, hung past the timeout, or its network failed"
        )

    def close(self) -> None:
        """Stop watching and beating: wake this rank's watcher, and wait until it, the beats
        and every store request in flight have ended (``ask`` s and one more at most).

        NOTE: a thread whose store request returns once the interpreter is finalizing aborts
        the process ("terminate called without an active exception": Python ends the thread
        as it takes the GIL back, inside torch's C++ frames; any daemon thread returning from
        a torch call then does, 6 exits in 6). Pipes close at exit, and this close waited a
        second for the beats, not for a beat's request still in flight: a healthy 4-rank
        job on 2 cores aborted so at exit now and then (4 runs in about 200). A store found
        silent is waited for no more: a request it never answers never returns.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        self._left.set()
        with contextlib.suppress(Exception):  # the store is gone: the watcher has ended
            self._ask(self._store.set, self._wake(self._rank), b"closed")
        deadline = time.monotonic() + self._ask_within + 1.0
        for thread in (self._thread, self._beating):
            if thread is not threading.current_thread() and not self._silent:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        for thread in list(self._asking):  # NOTE: after the threads that may ask
            if not self._silent:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _wake(self, rank: int) -> str:
        return f"{self._prefix}/wake/{rank}"

    def _alive(self, rank: int) -> str:
        return f"{self._prefix}/alive/{rank}"

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
            # NOTE: woken with no valid record (a forged one, or none): wait again
            with contextlib.suppress(Exception):
                self._ask(self._store.delete_key, self._wake(self._rank))

    def _beat_while_busy(self) -> None:
        """Every ``beat`` s while busy, write this rank's beat count and progress; once more
        on leaving, saying it is idle (so a rank between steps is not taken for a stopped
        one while another is stuck)."""
        beating = False
        while True:
            self._left.wait(self._beat)
            self._left.clear()
            if self._stop.is_set() or self.failure is not None or self._silent:
                return  # NOTE: nobody waits for this rank any more, or the store is gone
            busy = self._busy > 0
            if not busy and not beating:
                continue
            beating = busy
            self._beats += 1
            record = {"beat": self._beats, "busy": busy, "entered": self._entered}
            record.update(self.progress())
            try:
                self._ask(self._store.set, self._alive(self._rank), json.dumps(record))
            except Exception:
                return

    def _records(self, ranks: Sequence[int]) -> dict[int, dict[str, Any] | None]:
        """Each of ``ranks``' last beat record (None where it never beat)."""
        keys = [self._alive(r) for r in ranks]
        present = self._ask(self._store.check, keys) if keys else True
        records: dict[int, dict[str, Any] | None] = {}
        for rank, key in zip(ranks, keys):
            records[rank] = None
            if present or self._ask(self._store.check, [key]):
                with contextlib.suppress(ValueError):
                    records[rank] = json.loads(self._ask(self._store.get, key))
        return records

    def _ask(self, request: Callable[..., Any], *args: Any) -> Any:
        """``request(*args)`` on the store, or StoreSilent if no answer comes within ``ask`` s.

        NOTE: a TCPStore client waits for a stopped server forever, whatever its timeout;
        the request runs in a thread of its own, left behind if the store never answers.
        """
        if self._silent:
            raise StoreSilent("the store did not answer before")
        answer: list[Any] = []
        done = threading.Event()

        def run() -> None:
            try:
                answer.append((True, request(*args)))
            except BaseException as error:
                answer.append((False, error))
            done.set()
            self._asking.discard(threading.current_thread())

        thread = threading.Thread(target=run, name="gpipe-store-request", daemon=True)
        self._asking.add(thread)
        thread.start()
        deadline = time.monotonic() + self._ask_within
        while not done.wait(0.05):
            if self._silent or time.monotonic() > deadline:  # NOTE: or another request found
                self._silent = True
                raise StoreSilent(f"the store did not answer within {self._ask_within:g} s")
        ok, value = answer[0]
        if not ok:
            raise value
        return value

    def _signed(self, failure: Failure) -> bytes:
        body = json.dumps(asdict(failure), sort_keys=True)
        return json.dumps({"failure": body, "mac": self._mac(body)}).encode()

    def _verified(self, payload: bytes) -> Failure | None:
        """The failure in ``payload``, or None if its MAC is not ours (a forged record)."""
        try:
            record = json.loads(payload.decode())
            body, mac = record["failure"], record["mac"]
            if not hmac.compare_digest(mac, self._mac(body)):
                return None
            return Failure(**json.loads(body))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None

    def _mac(self, body: str) -> str:
        return hmac.new(self._token, body.encode(), hashlib.sha256).hexdigest()

    def _heard(self, failure: Failure) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = failure
        self._on_failure(failure)


def _silent_store(what: str, how: str) -> Failure:
    """A failure naming the store's host, when the store itself stopped answering (``how``)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return Failure(
            -1,
            f"the job's store (torchrun's agent) stopped answering: its node hung or died; {what}",
        )
    return Failure(0, f"it stopped answering, and the job's store, which it hosts, {how}; {what}")


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


def wait_for(
    work: Any,
    faults: FaultChannel,
    failed: Callable[[], Failure | None],
    rank: int,
    ranks: Sequence[int] | None = None,
) -> None:
    """Wait for a torch.distributed ``work``, or for a failure anywhere, whichever comes first.

    NOTE: a gloo wait cannot be interrupted, and a timed-out one breaks the link, so a
    thread waits for the work while this one watches for a failure (``failed()``, which the
    fault channel sets): a rank that fails while the others sit in a collective still ends
    them all at once.

    Args:
        ranks: the collective's ranks, among which a silent one is looked for if a link
            breaks with no report (default: every rank).

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
    done = threading.Event()
    broke: list[BaseException] = []
    # NOTE: the helper lets go of the work before saying it is done, so the work is freed on
    # this thread, never on the helper: torch frees a work with the GIL released, and a
    # daemon thread taking the GIL back as the interpreter finalizes aborts the process.
    handed = [work]

    def wait() -> None:
        held = handed.pop()
        try:
            held.wait()
        except BaseException as error:
            broke.append(error)
        finally:
            del held
            done.set()

    threading.Thread(target=wait, name="gpipe-collective", daemon=True).start()
    while not done.wait(0.05):
        failure = failed()
        if failure is not None:
            raise PipelineFailure(failure, rank)
    if broke:
        raise PipelineFailure(_cause(broke[0], faults, failed, ranks), rank) from broke[0]


def _cause(
    error: BaseException,
    faults: FaultChannel,
    failed: Callable[[], Failure | None],
    ranks: Sequence[int] | None,
) -> Failure:
    """Why a collective's link broke: a reported failure, else the rank that fell silent."""
    failure = failed()
    if failure is not None:
        return failure
    what = f"a link of a collective broke ({brief(error)})"
    return faults.culprit(-1, what, ranks)
