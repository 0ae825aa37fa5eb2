"""Posting: how one batch of a lowered program goes on the wire, and how it is waited for.

The executor (:mod:`gpipe.distributed.executor`) decides *what* to post and in which order,
the same on every backend; a poster only puts a batch's messages on the wire:

- :class:`NcclPoster`: one ``batch_isend_irecv`` group per batch. Waiting on a receive
  makes the worker's current CUDA stream wait for it; the host never blocks.
- :class:`GlooPoster`: each tensor posted straight on the group (gloo runs a batch op by
  op anyway); one completion thread waits the works in posting order and files each
  finished receive in the mailbox, where the worker waits for it, so a failure anywhere
  wakes the worker at once (a gloo wait cannot be interrupted).
- :class:`NcclRulesPoster`: gloo under NCCL's rules, for the test suite, since no machine
  here has two GPUs: a batch goes on the wire only once the rank's previous batch has
  completed (one stream per rank), and a send completes only once the receiver's stream
  has reached the batch holding its receive (the receiver acknowledges each message).
  A program that could hang on NCCL hangs here too.
"""

from __future__ import annotations

import inspect
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gpipe.runtime.mailbox import Mailbox

__all__ = [
    "POSTER",
    "GlooPoster",
    "Message",
    "NcclPoster",
    "NcclRulesPoster",
    "peer_of",
    "poster_for",
]

# Which poster a pipe on gloo uses: "gloo" (the default), "nccl-rules" (the test suite's
# default, see tests/conftest.py) or "batched" (NcclPoster's path, one batch_isend_irecv per
# batch, run on gloo). A pipe on NCCL always uses NcclPoster.
POSTER = "GPIPE_POSTER"
_POSTERS = ("gloo", "nccl-rules", "batched")
_ACK = 1  # gloo tag of NcclRulesPoster's acknowledgements; data goes on tag 0, as on NCCL


@dataclass(eq=False)
class Message:
    """One message's tensors to or from one peer (global rank), posted as part of a batch.

    ``posted_ns`` and ``done_ns`` (``perf_counter_ns``) say when it went on the wire and
    when it was known to be done; ``works`` are its torch.distributed works, if any.
    """

    send: bool
    peer: int
    tensors: list[torch.Tensor]
    posted_ns: int = 0
    done_ns: int = 0
    works: list[Any] = field(default_factory=list)


class Poster:
    """Puts batches on the wire; see the module docstring for the three kinds."""

    # Whether a wait is the GPU stream's, not the host's (the host's clock then says when a
    # message was queued, not when it moved)
    stream_waits = False

    def __init__(self, group: Any, timeout: float, on_error: Callable[[int, BaseException], None]):
        self.group = group
        self.timeout = timeout
        # NOTE: held weakly: the executor holds the poster, and a cycle between them would
        # keep a closed pipe's process groups (threads, sockets) until the collector runs
        self._on_error = (
            weakref.WeakMethod(on_error) if inspect.ismethod(on_error) else lambda: on_error
        )
        self.box = Mailbox()  # finished receives, keyed by id(message)
        self._peers: dict[int, int] = {}

    def on_error(self, peer: int, error: BaseException) -> None:
        """A link to ``peer`` failed: tell the executor (if it still exists)."""
        handler = self._on_error()
        if handler is not None:
            handler(peer, error)

    def post(self, batch: list[Message]) -> None:
        """Put ``batch`` on the wire, in order; never waits for it."""
        raise NotImplementedError

    def wait(self, message: Message) -> None:
        """Wait for a received ``message`` (raises Aborted, TimeoutError)."""
        raise NotImplementedError

    def drain(self, failed: Callable[[], bool]) -> None:
        """Wait until everything posted so far is done, or ``failed()``.

        Raises:
            TimeoutError: something posted did not complete within the timeout.
        """
        raise NotImplementedError

    def abort(self) -> None:
        """Wake the worker waiting in :meth:`wait`."""
        self.box.abort()

    def reset(self) -> None:
        self.box.clear()

    def close(self) -> None:
        """End any thread of the poster's (between steps, at once)."""

    def threads(self) -> list[threading.Thread]:
        return []

    def join(self, seconds: float) -> None:
        """Wait until the poster's threads have ended, ``seconds`` at most in all."""
        deadline = time.monotonic() + seconds
        for thread in self.threads():
            thread.join(max(0.0, deadline - time.monotonic()))

    def _group_rank(self, peer: int) -> int:
        known = self._peers.get(peer)
        if known is None:
            known = self._peers[peer] = dist.get_group_rank(self.group, peer)
        return known


def peer_of(error: BaseException) -> int:
    """The rank at the other end of the message whose posting or wait raised ``error``
    (-1: not known)."""
    return int(getattr(error, "gpipe_peer", -1))


def _mark(error: BaseException, peer: int) -> None:
    """Mark ``error`` with the rank at the other end of its message (see :func:`peer_of`)."""
    error.gpipe_peer = peer  # type: ignore[attr-defined]


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """What goes on the wire: a complex tensor as its real view (as torch's own isend does)."""
    return torch.view_as_real(tensor) if tensor.dtype.is_complex else tensor


class NcclPoster(Poster):
    """NCCL: a batch is one group call; waits are stream waits, never host waits."""

    stream_waits = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._sends: list[Message] = []

    def post(self, batch: list[Message]) -> None:
        ops, owners = [], []
        for message in batch:
            op = dist.isend if message.send else dist.irecv
            peer = self._group_rank(message.peer)
            for tensor in message.tensors:
                ops.append(dist.P2POp(op, _wire(tensor), group=self.group, group_peer=peer))
                owners.append(message)
        now = time.perf_counter_ns()
        try:  # NOTE: a link whose other end is gone may refuse the batch at once
            works = dist.batch_isend_irecv(ops) if ops else []
        except Exception as error:
            _mark(error, batch[0].peer)
            raise
        if len(works) == len(ops):
            for message, work in zip(owners, works):
                message.works.append(work)
        else:  # NOTE: NCCL coalesces a batch into one work: every message waits on it
            shared = list(works)
            for message in batch:
                message.works = shared
        for message in batch:
            message.posted_ns = now
            if message.send:
                self._sends.append(message)

    def wait(self, message: Message) -> None:
        _wait_once(message.works)  # NOTE: the current stream waits; the host goes on
        message.done_ns = time.perf_counter_ns()

    def drain(self, failed: Callable[[], bool]) -> None:
        sends, self._sends = self._sends, []
        for message in sends:
            _wait_once(message.works)


def _wait_once(works: list[Any]) -> None:
    """Wait for ``works`` and forget them (the list may be a whole batch's, shared by its
    messages): a gloo work waited twice would wait for a second completion forever."""
    while works:
        works.pop(0).wait()


class GlooPoster(Poster):
    """gloo: ops posted straight; receives and sends each waited, in posting order, by a
    completion thread of their own.

    NOTE: gloo moves every posted op on its own, so a receive need not wait for the sends
    posted before it (as it would on NCCL's stream); one thread waiting both in posting
    order would delay each receive by the sends before it.
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()  # receives (or all)
        self._sends: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._open = 0  # messages posted and not yet done
        self._pending: dict[int, int] = {}  # the same messages' peers, by id, oldest first
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="gpipe-receives", daemon=True)
        self._thread.start()
        self._sending = threading.Thread(
            target=self._run, args=(self._sends,), name="gpipe-sends", daemon=True
        )
        self._sending.start()

    def post(self, batch: list[Message]) -> None:
        group = self.group
        for message in batch:
            peer = self._group_rank(message.peer)
            message.posted_ns = time.perf_counter_ns()
            op = group.send if message.send else group.recv
            try:  # NOTE: gloo refuses at once a link whose other end is gone
                message.works = [op([_wire(t)], peer, 0) for t in message.tensors]
            except Exception as error:
                _mark(error, message.peer)
                raise
        self._opened(batch)
        self._jobs.put([message for message in batch if not message.send])
        self._sends.put([message for message in batch if message.send])

    def wait(self, message: Message) -> None:
        try:
            self.box.take(id(message), self.timeout)  # type: ignore[arg-type]
        except TimeoutError as error:
            _mark(error, message.peer)
            raise

    def drain(self, failed: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while self._open:
                if failed():
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    late = TimeoutError(f"sends still open after {self.timeout:g} s")
                    _mark(late, next(iter(self._pending.values()), -1))
                    raise late
                self._idle.wait(min(left, 0.1))

    def close(self) -> None:
        self._jobs.put(None)
        self._sends.put(None)

    def threads(self) -> list[threading.Thread]:
        return [self._thread, self._sending]

    def join(self, seconds: float) -> None:
        super().join(seconds)
        if any(thread.is_alive() for thread in self.threads()):
            return
        # A thread that ended on a failure leaves batches queued, whose works would keep
        # the gloo backend (its sockets and thread) alive after the pipe is closed.
        for jobs in (self._jobs, self._sends):
            while True:
                try:
                    batch = jobs.get_nowait()
                except queue.Empty:
                    break
                for message in batch or ():
                    message.works = []

    def _run(self, jobs: queue.SimpleQueue[Any] | None = None) -> None:
        jobs = self._jobs if jobs is None else jobs
        while (batch := jobs.get()) is not None:
            failed = False
            for message in batch:
                try:
                    if not failed:
                        self._complete(message)
                except Exception as error:
                    failed = True
                    self.on_error(message.peer, error)
                finally:
                    message.works = []  # NOTE: a work ends here, not as the thread ends
                    self._closed([message])
            del batch
            if failed:
                return

    def _opened(self, batch: list[Message]) -> None:
        with self._lock:
            self._open += len(batch)
            self._pending.update((id(message), message.peer) for message in batch)

    def _closed(self, batch: list[Message]) -> None:
        with self._lock:
            self._open -= len(batch)
            for message in batch:
                self._pending.pop(id(message), None)
            if not self._open:
                self._idle.notify_all()

    def _complete(self, message: Message) -> None:
        for work in message.works:
            work.wait()
        message.done_ns = time.perf_counter_ns()
        if not message.send:
            self.box.put(id(message), None)  # type: ignore[arg-type]


class NcclRulesPoster(GlooPoster):
    """gloo under NCCL's rules: one stream per rank, sends that wait for their receiver.

    The completion thread is the rank's stream: it posts a batch only once the one before
    has completed, and a batch completes once every receive has its data and every send
    has its receiver's acknowledgement, which the receiver gives when its own stream
    reaches the receive.
    """

    def post(self, batch: list[Message]) -> None:
        now = time.perf_counter_ns()
        for message in batch:
            message.posted_ns = now
        self._opened(batch)
        self._jobs.put(batch)

    def _run(self, jobs: queue.SimpleQueue[Any] | None = None) -> None:
        if jobs is not None:  # NOTE: the rank's one stream carries sends too: idle till closed
            while jobs.get() is not None:
                pass
            return
        group = self.group
        while (batch := self._jobs.get()) is not None:
            if not batch:
                continue
            at = batch[0]  # the message under way: its peer is the one a failure is about
            try:
                for at in batch:
                    peer = self._group_rank(at.peer)
                    op = group.send if at.send else group.recv
                    at.works = [op([_wire(t)], peer, 0) for t in at.tensors]
                    if at.send:
                        at.works.append(group.recv([torch.empty(1)], peer, _ACK))
                for at in batch:
                    if not at.send:  # the data is here: the sender may complete
                        for work in at.works:
                            work.wait()
                        at.works = [group.send([torch.ones(1)], self._group_rank(at.peer), _ACK)]
                for at in batch:
                    for work in at.works:
                        work.wait()
                    at.done_ns = time.perf_counter_ns()
            except Exception as error:
                self.on_error(at.peer, error)
                with self._lock:
                    self._open = 0
                    self._pending.clear()
                    self._idle.notify_all()
                return
            for message in batch:
                message.works = []
                if not message.send:
                    self.box.put(id(message), None)  # type: ignore[arg-type]
            self._closed(batch)
            del batch


def poster_for(
    group: Any, timeout: float, on_error: Callable[[int, BaseException], None]
) -> Poster:
    """The poster for ``group``'s backend (on gloo, the one :data:`POSTER` names).

    Raises:
        ValueError: :data:`POSTER` names no poster.
    """
    if str(dist.get_backend(group)) == "nccl":
        return NcclPoster(group, timeout, on_error)
    chosen = os.environ.get(POSTER, "gloo")
    if chosen not in _POSTERS:
        raise ValueError(f"{POSTER}={chosen!r}: set it to one of {', '.join(_POSTERS)}")
    kinds = {"gloo": GlooPoster, "nccl-rules": NcclRulesPoster, "batched": NcclPoster}
    return kinds[chosen](group, timeout, on_error)
