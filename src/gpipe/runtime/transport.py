"""The Transport protocol: how stage workers hand activations and gradients to each other.

A worker only ever sends and receives tagged messages; what carries them is injected. The
mailboxes of :mod:`gpipe.runtime.mailbox` carry them between threads of one process; the
point-to-point transport of :mod:`gpipe.distributed` carries them between processes. A
transport lives as long as its pipe (a distributed one caches message signatures across
steps); :meth:`Transport.reset` readies it for the next step.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from gpipe.structure import map_tensors

__all__ = ["ACTIVATION", "GRADIENT", "Aborted", "Tag", "Transport", "sending_stage", "to_device"]

ACTIVATION = "act"
GRADIENT = "grad"

# (what, receiving stage, micro-batch). Stage -1 and stage S (one past the last) are the
# caller's side: inputs come from stage -1 and outputs go to stage S; gradients the reverse.
# A dataflow's tags add the stage at the other end (see gpipe.runtime.routes):
# (what, receiving stage, micro-batch, sending stage).
Tag = tuple[str, int, int] | tuple[str, int, int, int]


class Aborted(Exception):
    """Raised in a worker waiting for a message when another worker failed."""


class Transport(Protocol):
    """Moves pytrees of tensors (and other values) between the stages of one pipeline."""

    def reset(self) -> None:
        """Forget the last step's messages and any abort: a new step begins."""

    def send(self, tag: Tag, value: Any) -> None:
        """Hand ``value`` to the receiver of ``tag``; never waits for it to be received."""

    def recv(self, tag: Tag) -> Any:
        """Wait for the message ``tag``; its tensors arrive on the receiving stage's device.

        Raises:
            Aborted: another worker failed while this one waited.
        """

    def collect(self, tag: Tag) -> Any:
        """Take a message addressed to the caller's side (stage -1 or S) after a phase."""

    def abort(self, error: BaseException | None = None) -> None:
        """Wake every waiting receiver with :class:`Aborted`; ``error`` is what failed."""


def to_device(value: Any, device: torch.device) -> Any:
    """Move every tensor in ``value`` to ``device`` (no copy when already there)."""
    return map_tensors(lambda t: t.to(device, non_blocking=True), value)


def sending_stage(tag: Tag) -> int:
    """The stage that sent the message ``tag``: a dataflow's tag names it; in a chain it is
    the previous stage (an activation) or the next (a gradient)."""
    if len(tag) == 4:
        return tag[3]
    return tag[1] - 1 if tag[0] == ACTIVATION else tag[1] + 1
