"""Beats: while a rank is inside a step it writes how far it got, every second, so a rank
whose wait for a peer fails can name the rank that stopped answering.

A rank that stops answering (stopped with SIGSTOP, a hung kernel, a deadlocked hook) reports
nothing itself. Its beats say it instead: the rank that fell silent, or the one that beats
but is stuck in an action, is named rather than the neighbour whose link happened to break
first. A broken link is a symptom: the rank at its other end is named once its silence is
established, and before any other rank found silent.

Beats are sealed under the ranks' token, bound to their key, and a rank counts as alive
only if its beat count grew: a client of the store that is not a rank cannot forge a beat,
nor write what a rank is doing (what it can do is said in docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from gpipe.distributed.failure import Failure, brief, opened, sealed
from gpipe.distributed.store_requests import StoreRequests, StoreSilent

__all__ = ["BEAT", "Heartbeat"]

BEAT = 1.0  # seconds between a busy rank's beats


class Heartbeat:
    """This rank's beats while busy, and the others' beats read back to name a culprit.

    Args:
        ask: the store requests the beats go through.
        prefix: beats are written to ``prefix + "/alive/<rank>"``.
        rank: this rank.
        world: how many ranks beat.
        beat: seconds between beats while busy.
        name: the beating thread's name.
        token: the secret the ranks share; beats not sealed under it are not read.
    """

    def __init__(
        self,
        ask: StoreRequests,
        prefix: str,
        rank: int,
        world: int,
        beat: float,
        name: str,
        token: bytes = b"",
    ) -> None:
        self._ask = ask
        self._prefix = prefix
        self._rank = rank
        self._world = world
        self.beat = beat
        self._token = token
        self._lock = threading.Lock()
        self._left = threading.Event()  # wakes the beats: the rank left its step, or stopped
        self._stopped = False
        self._busy = 0
        self._entered = 0  # steps (and constructions) entered: the same count on every rank
        self._beats = 0
        # what this rank is doing, for its beats: set by the pipe
        self.progress: Callable[[], dict[str, Any]] = dict
        self._thread = threading.Thread(target=self._beat_while_busy, name=name, daemon=True)
        self._thread.start()

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

    def stop(self) -> threading.Thread:
        """Stop beating (nobody waits for this rank any more); the thread to join."""
        self._stopped = True
        self._left.set()
        return self._thread

    def culprit(
        self,
        suspect: int,
        what: str,
        ranks: Sequence[int] | None,
        reported: Callable[[float], Failure | None],
        fallback: Failure | None = None,
    ) -> Failure:
        """Whom to name when this rank's wait for ``suspect`` failed (``what`` happened).

        The failure some rank reported (``reported(seconds)`` waits that long for one), if one
        comes while the beats of ``ranks`` are watched for ``3 * beat`` s; else the first rank
        whose beats stopped (stopped, or dead), else the first that beats but made no progress
        outside a wait (stuck in an action or a hook), ``suspect`` first among them; else
        ``fallback`` if given, else ``suspect`` (-1: none). A store that does not answer names
        rank 0, which hosts it when launched by hand (torchrun's agent hosts it otherwise).
        """
        others = [r for r in (range(self._world) if ranks is None else ranks) if r != self._rank]
        try:
            before = self._records(others)
            heard = reported(3 * self.beat)
            if heard is not None:
                return heard
            after = self._records(others)
        except StoreSilent:
            return _silent_store(what, "is silent too (rank 0 stopped, or its host hung)")
        except Exception as error:  # NOTE: the store's host is gone (connection broken)
            return _silent_store(what, f"is gone too ({brief(error)}: rank 0 died or left)")
        heard = reported(0.0)
        if heard is not None:
            return heard
        seconds = f"{3 * self.beat:g}"
        # NOTE: the rank at the other end first: the link that broke, or the wait that failed,
        # is its doing if it fell silent, whatever else is found
        others.sort(key=lambda r: r != suspect)
        # NOTE: a rank that left this very step (its part done) is no suspect until the
        # others are cleared; one whose last record is an earlier step's is
        idle = [
            r
            for r in others
            if (record := after[r] or {}).get("busy") is False
            and record.get("entered", 0) >= self._entered
        ]
        for rank in others:
            if rank not in idle and not _beat_since(before[rank], after[rank]):
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
        if fallback is not None:
            return fallback
        if suspect < 0:
            return Failure(-1, what)
        return Failure(
            suspect, f"{what}: that rank died, hung past the timeout, or its network failed"
        )

    def _alive(self, rank: int) -> str:
        return f"{self._prefix}/alive/{rank}"

    def _beat_while_busy(self) -> None:
        """Every ``beat`` s while busy, write this rank's beat count and progress; once more
        on leaving, saying it is idle (so a rank between steps is not taken for a stopped
        one while another is stuck)."""
        beating = False
        while True:
            self._left.wait(self.beat)
            self._left.clear()
            if self._stopped or self._ask.silent:
                return
            busy = self._busy > 0
            if not busy and not beating:
                continue
            beating = busy
            self._beats += 1
            record = {"beat": self._beats, "busy": busy, "entered": self._entered}
            record.update(self.progress())
            key = self._alive(self._rank)
            try:
                self._ask("set", key, sealed(json.dumps(record), key, self._token))
            except Exception:
                return

    def _records(self, ranks: Sequence[int]) -> dict[int, dict[str, Any] | None]:
        """Each of ``ranks``' last beat record (None where it never beat, or where what the
        key holds is not sealed under the token: not a rank's)."""
        keys = [self._alive(r) for r in ranks]
        present = self._ask("check", keys) if keys else True
        records: dict[int, dict[str, Any] | None] = {}
        for rank, key in zip(ranks, keys):
            records[rank] = None
            if present or self._ask("check", [key]):
                body = opened(self._ask("get", key), key, self._token)
                with contextlib.suppress(ValueError, TypeError):
                    records[rank] = None if body is None else dict(json.loads(body))
        return records


def _beat_since(then: dict[str, Any] | None, now: dict[str, Any] | None) -> bool:
    """Whether a rank beat between two readings of its record: its count grew (an older
    record written back, by a client that is not a rank, is no beat)."""
    if now is None:
        return False
    return int(now.get("beat", 0)) > int((then or {}).get("beat", 0))


def _silent_store(what: str, how: str) -> Failure:
    """A failure naming the store's host, when the store itself stopped answering (``how``)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return Failure(
            -1,
            f"the job's store (torchrun's agent) stopped answering: its node hung or died; {what}",
        )
    return Failure(0, f"it stopped answering, and the job's store, which it hosts, {how}; {what}")
