"""When this rank's messages moved in a step, as the timeline shows them.

Each hand-over to another rank and each arrival from one is timed on this rank's
``perf_counter_ns``. On NCCL the host never waits for a message (a wait is the stream's), so
its clock says when a message was queued, not when it moved: there each hand-over and
arrival is also marked on this rank's GPU stream, and :meth:`TransferLog.settle` reads the
marks once the step is over.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from gpipe.distributed.posting import Message
from gpipe.runtime.copies import GpuClock
from gpipe.runtime.transport import Tag

__all__ = ["Transfer", "TransferLog"]


@dataclass(frozen=True)
class Transfer:
    """One message received from another rank, as the timeline shows it.

    Times are this rank's ``perf_counter_ns``: ``posted`` when its receive was posted,
    ``done`` when its tensors were known to have arrived (on NCCL, when the GPU's stream had
    them: see :meth:`TransferLog.settle`).
    """

    tag: Tag
    source: int
    posted_ns: int
    done_ns: int
    nbytes: int


class TransferLog:
    """This step's messages: each one received, and each one handed over.

    Args:
        torch_device: where this rank's stages run.
        stream_waits: whether a wait is the GPU stream's, not the host's (NCCL): then the
            messages are also marked on the stream, and timed by it on :meth:`settle`.
    """

    def __init__(self, torch_device: torch.device, stream_waits: bool) -> None:
        self.received: list[Transfer] = []
        self.sent: list[tuple[Tag, int, int]] = []  # (tag, peer, perf_counter_ns)
        self._clock = (
            GpuClock(torch_device) if torch_device.type == "cuda" and stream_waits else None
        )
        self._marks: list[tuple[bool, int, Any]] = []  # (sent?, index, GPU mark)

    def reset(self) -> None:
        """A new step: nothing received or handed over yet."""
        self.received = []
        self.sent = []
        self._marks = []
        if self._clock is not None:
            self._clock.start()

    def arrived(self, tag: Tag, message: Message) -> None:
        """The received ``message`` ``tag`` was waited for: it is here (or, on NCCL, the
        stream will have it before the next action)."""
        if self._clock is not None:
            self._marks.append((False, len(self.received), self._clock.mark()))
        nbytes = sum(t.numel() * t.element_size() for t in message.tensors)
        self.received.append(
            Transfer(tag, message.peer, message.posted_ns, message.done_ns, nbytes)
        )

    def handed(self, outgoing: list[tuple[Tag, int, Any, Any]]) -> None:
        """The messages ``outgoing`` ((tag, peer, ...) each) were just posted."""
        if not outgoing:
            return
        now = time.perf_counter_ns()
        if self._clock is not None:
            mark = self._clock.mark()
            self._marks += [(True, len(self.sent) + i, mark) for i in range(len(outgoing))]
        self.sent.extend((tag, peer, now) for tag, peer, _, _ in outgoing)

    def settle(self) -> None:
        """Time this step's messages by the GPU's stream, where it carried them (NCCL):
        each hand-over when the sender's stream had the message ready, each arrival when
        the receiver's stream had it (waiting for the GPU to get there).

        NOTE: marked on the stream the stage runs on, after its wait for NCCL's, so a
        receiver still busy with earlier work shows the arrival late by as much (as a GPU
        still busy shows its actions late); NCCL's own stream is not ours to mark.
        """
        clock, marks, self._marks = self._clock, self._marks, []
        if clock is None:
            return
        for sent, index, mark in marks:
            at = clock.ns(mark)
            if sent:
                tag, peer, _ = self.sent[index]
                self.sent[index] = (tag, peer, at)
            else:
                self.received[index] = dataclasses.replace(self.received[index], done_ns=at)
