"""The in-process transport: tagged mailboxes between the stage workers of one process."""

from __future__ import annotations

import threading
from typing import Any

import torch

from gpipe.runtime.transport import ACTIVATION, GRADIENT, Aborted, Tag, to_device

__all__ = ["LocalTransport", "Mailbox"]


class Mailbox:
    """Messages for one receiver, keyed by tag, so any schedule's receive order works.

    A receiver whose message has not arrived parks on a lock of its own, which the sender
    (or :meth:`abort`) releases. NOTE: this runs for every message; a ``threading.Condition``
    costs about 16 Python calls per message (its wait builds a lock and re-enters an RLock),
    this about 6, and it wakes only the receiver whose message came.
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

    Args:
        placement: ``placement[s]`` is the device of model stage ``s``.
        devices: the ``torch.device`` of each pipeline device; tensors are moved there on
            receipt, unless they come from a stage on the same ``torch.device``.
    """

    def __init__(self, placement: tuple[int, ...], devices: list[torch.device]) -> None:
        self._placement = placement
        self._devices = devices
        self._boxes = [Mailbox() for _ in devices]
        self._caller = Mailbox()
        # (kind, receiving stage) of the messages sent by a stage on the receiver's own
        # torch.device. NOTE: those need no move, and skipping it saves a tensor op per
        # message (one that releases the GIL, inviting a hand-off to another worker).
        count = len(placement)
        self._local = {
            (kind, stage)
            for stage in range(count)
            for kind, sender in ((ACTIVATION, stage - 1), (GRADIENT, stage + 1))
            if 0 <= sender < count and devices[placement[sender]] == devices[placement[stage]]
        }

    def _box(self, stage: int) -> Mailbox:
        if 0 <= stage < len(self._placement):
            return self._boxes[self._placement[stage]]
        return self._caller

    def reset(self) -> None:
        """Empty every mailbox and forget an abort: a new step begins."""
        for box in self._boxes:
            box.clear()
        self._caller.clear()

    def send(self, tag: Tag, value: Any) -> None:
        """Deliver ``value`` to the receiver of ``tag``; never blocks."""
        self._box(tag[1]).put(tag, value)

    def recv(self, tag: Tag) -> Any:
        """Wait for the message ``tag`` and return it on the receiving stage's device."""
        value = self._box(tag[1]).take(tag)
        if (tag[0], tag[1]) in self._local:
            return value
        return to_device(value, self._devices[self._placement[tag[1]]])

    def collect(self, tag: Tag) -> Any:
        """Take a message addressed to the caller (stage -1 or S) once a phase is over."""
        return self._caller.take_ready(tag)

    def abort(self, error: BaseException | None = None) -> None:
        """Wake every waiting receiver with :class:`Aborted` (``error`` needs no report here)."""
        for box in self._boxes:
            box.abort()
        self._caller.abort()
