"""The in-process transport: tagged mailboxes between the stage workers of one process."""

from __future__ import annotations

import threading
from typing import Any

import torch

from gpipe.runtime.transport import Aborted, Tag, to_device

__all__ = ["LocalTransport", "Mailbox"]


class Mailbox:
    """Messages for one receiver, keyed by tag, so any schedule's receive order works."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._items: dict[Tag, Any] = {}
        self._aborted = False

    def put(self, tag: Tag, value: Any) -> None:
        with self._ready:
            self._items[tag] = value
            self._ready.notify_all()

    def take(self, tag: Tag) -> Any:
        with self._ready:
            while tag not in self._items:
                if self._aborted:
                    raise Aborted
                self._ready.wait()
            return self._items.pop(tag)

    def take_ready(self, tag: Tag) -> Any:
        """Take a message that must already be there (the caller's side, after a phase)."""
        with self._ready:
            return self._items.pop(tag)

    def abort(self) -> None:
        with self._ready:
            self._aborted = True
            self._ready.notify_all()

    def clear(self) -> None:
        """Drop every message and the abort: ready for a new step."""
        with self._ready:
            self._items.clear()
            self._aborted = False


class LocalTransport:
    """Routes messages to the mailbox of the device holding the receiving stage.

    Args:
        placement: ``placement[s]`` is the device of model stage ``s``.
        devices: the ``torch.device`` of each pipeline device; tensors are moved there on
            receipt.
    """

    def __init__(self, placement: tuple[int, ...], devices: list[torch.device]) -> None:
        self._placement = placement
        self._devices = devices
        self._boxes = [Mailbox() for _ in devices]
        self._caller = Mailbox()

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
        return to_device(value, self._devices[self._placement[tag[1]]])

    def collect(self, tag: Tag) -> Any:
        """Take a message addressed to the caller (stage -1 or S) once a phase is over."""
        return self._caller.take_ready(tag)

    def abort(self) -> None:
        """Wake every waiting receiver with :class:`Aborted`."""
        for box in self._boxes:
            box.abort()
        self._caller.abort()
