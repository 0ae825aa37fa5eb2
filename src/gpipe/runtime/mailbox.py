"""The in-process transport: tagged mailboxes between the stage workers of one process."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from gpipe.analysis import Transfer
from gpipe.runtime.copies import CopyStreams, GpuClock, Span, arrive, stamp
from gpipe.runtime.routes import Routes
from gpipe.runtime.transport import ACTIVATION, GRADIENT, Aborted, Tag, sending_stage
from gpipe.schedule import BACKWARD, FORWARD
from gpipe.structure import leaves

_now = time.perf_counter_ns

__all__ = ["LocalTransport", "Mailbox"]


class Mailbox:
    """Messages for one receiver, keyed by tag, so any schedule's receive order works.

    A receiver whose message has not arrived parks on a lock of its own, which the sender
    (or :meth:`abort`) releases. NOTE: this runs for every message, so not a
    ``threading.Condition``, whose wait builds a lock and re-enters an RLock: a lock per
    receiver is fewer Python calls, and wakes only the receiver whose message came.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[Tag, Any] = {}
        self._waiting: dict[Tag, threading.Lock] = {}
        self._aborted = False

    def put(self, tag: Tag, value: Any) -> None:
        with self._lock:
            self._items[tag] = value
            waiter = self._waiting.pop(tag, None)
        if waiter is not None:
            waiter.release()

    def take(self, tag: Tag, timeout: float | None = None) -> Any:
        """Wait for ``tag``'s message and take it.

        Raises:
            Aborted: the mailbox was aborted while waiting.
            TimeoutError: nothing came within ``timeout`` seconds.
        """
        with self._lock:
            if tag in self._items:
                return self._items.pop(tag)
            if self._aborted:
                raise Aborted
            waiter = threading.Lock()
            waiter.acquire()
            self._waiting[tag] = waiter
        # until put() or abort() releases it
        arrived = waiter.acquire() if timeout is None else waiter.acquire(timeout=timeout)
        with self._lock:
            if tag in self._items:
                self._waiting.pop(tag, None)
                return self._items.pop(tag)
            if not arrived and not self._aborted:
                self._waiting.pop(tag, None)
                raise TimeoutError(f"no message {tag} within {timeout:g} s")
        raise Aborted

    def take_ready(self, tag: Tag) -> Any:
        """Take a message that must already be there (the caller's side, after a phase)."""
        with self._lock:
            return self._items.pop(tag)

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            waiters = list(self._waiting.values())
            self._waiting.clear()
        for waiter in waiters:
            waiter.release()

    def clear(self) -> None:
        """Drop every message and the abort: ready for a new step."""
        with self._lock:
            self._items.clear()
            self._waiting.clear()
            self._aborted = False


class LocalTransport:
    """Routes messages to the mailbox of the device holding the receiving stage.

    Every message between stages on two different pipeline devices is recorded as a
    :class:`~gpipe.analysis.Transfer` (see :meth:`transfers`), so a local timeline shows
    each hand-off, a dataflow's skips included. A message that changes ``torch.device`` is
    ordered by CUDA events on copy streams (see :mod:`gpipe.runtime.copies`).

    Args:
        placement: ``placement[s]`` is the device of model stage ``s``.
        devices: the ``torch.device`` of each pipeline device; tensors are moved there on
            receipt, unless they come from a stage on the same ``torch.device``.
        routes: a dataflow's routes (its tags name the sending stage); None for a chain.
    """

    def __init__(
        self, placement: tuple[int, ...], devices: list[torch.device], routes: Routes | None = None
    ) -> None:
        self._placement = placement
        self._devices = devices
        self._boxes = [Mailbox() for _ in devices]
        self._caller = Mailbox()
        # Routes by key: (kind, receiving stage), in a dataflow (kind, receiving stage,
        # sending stage), i.e. the tag without its micro-batch. _local: both stages on one
        # torch.device. NOTE: those messages need no move, and skipping it saves a tensor op
        # per message (one that releases the GIL, inviting a hand-off to another worker).
        # _crossing: the two stages' pipeline devices (sending, receiving), when they differ.
        self._local: set[tuple[Any, ...]] = set()
        self._crossing: dict[tuple[Any, ...], tuple[int, int]] = {}
        # _sources: the sending stage's torch.device, when it differs from the receiver's;
        # _stamped: those among them sent from a GPU (see gpipe.runtime.copies).
        self._sources: dict[tuple[Any, ...], torch.device] = {}
        self._stamped: dict[tuple[Any, ...], torch.device] = {}
        self._copies = CopyStreams()
        count = len(placement)
        for kind, stage, sender in _stage_pairs(count, routes):
            if not (0 <= sender < count and 0 <= stage < count):
                continue  # the caller's side
            key = (kind, stage) if routes is None else (kind, stage, sender)
            source, target = placement[sender], placement[stage]
            if devices[source] == devices[target]:
                self._local.add(key)
            else:
                self._sources[key] = devices[source]
                if devices[source].type == "cuda":
                    self._stamped[key] = devices[source]
            if source != target:
                self._crossing[key] = (source, target)
        # NOTE: recording a message costs three builtin calls (a clock, an isinstance, an
        # append); the devices, stages and times are worked out only when asked for.
        self._sent: list[tuple[Tag, int, int]] = []  # (tag, when sent, bytes)
        self._arrived: dict[Tag, int] = {}  # messages moved on receipt: when they arrived
        # Copies a GPU ran: when, by its clock (see Span), read on the host's clock by a
        # GpuClock per GPU, started as the step begins.
        moving = {(self._sources[key], devices[placement[key[1]]]) for key in self._sources}
        gpus = {d for pair in moving for d in pair if d.type == "cuda"}
        self._spans: dict[Tag, Span] = {}
        self._clocks = {gpu: GpuClock(gpu) for gpu in sorted(gpus, key=str)}

    def _box(self, stage: int) -> Mailbox:
        if 0 <= stage < len(self._placement):
            return self._boxes[self._placement[stage]]
        return self._caller

    def reset(self) -> None:
        """Empty every mailbox, forget an abort and the transfers: a new step begins."""
        for box in self._boxes:
            box.clear()
        self._caller.clear()
        self._sent = []
        self._arrived = {}
        self._spans = {}
        for clock in self._clocks.values():
            clock.start()

    def send(self, tag: Tag, value: Any) -> None:
        """Deliver ``value`` to the receiver of ``tag``; never blocks."""
        key = tag[:2] + tag[3:]
        if key in self._crossing:
            size = value.nbytes if isinstance(value, torch.Tensor) else _nbytes(value)
            self._sent.append((tag, _now(), size))
            if key in self._stamped:
                value = stamp(value, self._stamped[key])
        self._box(tag[1]).put(tag, value)

    def recv(self, tag: Tag) -> Any:
        """Wait for the message ``tag`` and return it on the receiving stage's device."""
        value = self._box(tag[1]).take(tag)
        key = tag[:2] + tag[3:]
        if key in self._local:
            return value
        target = self._devices[self._placement[tag[1]]]
        value, span = arrive(value, self._sources.get(key), target, self._copies)
        if key in self._crossing:
            self._arrived[tag] = _now()
            if span is not None:
                self._spans[tag] = span
        return value

    def collect(self, tag: Tag) -> Any:
        """Take a message addressed to the caller (stage -1 or S) once a phase is over."""
        return self._caller.take_ready(tag)

    def abort(self, error: BaseException | None = None) -> None:
        """Wake every waiting receiver with :class:`Aborted` (``error`` needs no report here)."""
        for box in self._boxes:
            box.abort()
        self._caller.abort()

    def transfers(self, origin_ns: int) -> list[Transfer]:
        """The messages between pipeline devices since the last :meth:`reset`, in seconds
        from ``origin_ns``: each from its send to its arrival (its move to the receiving
        device; a hand-off within one torch.device arrives as it is sent). A copy a GPU ran
        spans the time the GPU ran it (waiting for it to), as the timeline's actions do."""
        transfers = []
        for tag, sent, nbytes in list(self._sent):
            source, target = self._crossing[tag[:2] + tag[3:]]
            start = (sent - origin_ns) / 1e9
            end = (self._arrived.get(tag, sent) - origin_ns) / 1e9
            span = self._spans.get(tag)
            if span is not None:  # NOTE: a span's device is a GPU a message moved to or from
                clock = self._clocks[span.device]
                start = (clock.ns(span.start) - origin_ns) / 1e9
                end = (clock.ns(span.end) - origin_ns) / 1e9
            transfers.append(
                Transfer(
                    FORWARD if tag[0] == ACTIVATION else BACKWARD,
                    tag[1],
                    tag[2],
                    source,
                    target,
                    start,
                    end,
                    nbytes,
                    sending_stage(tag),
                )
            )
        return transfers


def _stage_pairs(count: int, routes: Routes | None) -> list[tuple[str, int, int]]:
    """(kind, receiving stage, sending stage) of every message a step may send to a stage."""
    if routes is None:
        return [
            (kind, stage, sender)
            for stage in range(count)
            for kind, sender in ((ACTIVATION, stage - 1), (GRADIENT, stage + 1))
        ]
    pairs = [
        (ACTIVATION, stage, source) for stage in range(count) for source, _ in routes.sources[stage]
    ]
    pairs += [
        (GRADIENT, stage, reader) for stage in range(count) for reader, _ in routes.readers[stage]
    ]
    return [*pairs, (GRADIENT, count - 1, count)]


def _nbytes(value: Any) -> int:
    """The bytes of the tensors in a message that is not a lone tensor."""
    total = 0
    for leaf in value if type(value) is list else leaves(value):
        if isinstance(leaf, torch.Tensor):
            total += leaf.nbytes
    return total
