"""Blame: the failure a rank reports, in words that name who failed and what to do.

A rank's own error names the stage, micro-batch and action that raised it. A wait for
another rank that fails (nothing came within the timeout, a send never completed, or the
link broke) names the fault channel's culprit when there is a fault channel (a reported
failure, or the rank that fell silent), else the rank waited for. A broken link is a
symptom, never a cause: raised inside this rank's own action (a send posted on a link a
dead peer closed), it still goes to the culprit, and this rank names itself only if no rank
reported a failure and none fell silent.
"""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist

from gpipe.distributed.failure import Failure, brief
from gpipe.runtime.step import unplaced
from gpipe.runtime.transport import Tag

__all__ = ["Blame", "Culprit", "broken_link"]

# what gloo, NCCL and the store say when the other end of a link is gone or silent
_LINK_WORDS = (
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "timed out",
    "gloo/transport",
    "nccl communicator was aborted",
)


def broken_link(error: BaseException | None) -> bool:
    """Whether ``error`` is torch.distributed saying a link or the store failed (a peer
    died, stopped, or its network failed), rather than this rank's own code failing."""
    if error is None or isinstance(error, KeyboardInterrupt):
        return False
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(word in text for word in _LINK_WORDS)


class Culprit(Protocol):
    """The fault channel's culprit (see :meth:`FaultChannel.culprit`), for a pipe's ranks."""

    def __call__(self, suspect: int, what: str, *, fallback: Failure | None = None) -> Failure:
        """Whom to name when a wait for ``suspect`` failed (``what`` happened)."""
        ...


class Blame:
    """The failures one rank reports.

    Args:
        rank: this rank (global).
        timeout: the pipe's timeout, in seconds, which a failed wait names.
        culprit: whom to name when a wait for a rank failed: ``culprit(rank, what
            happened)`` (the fault channel's); None names the rank waited for.
    """

    def __init__(self, rank: int, timeout: float, culprit: Culprit | None) -> None:
        self._rank = rank
        self._timeout = timeout
        self._culprit = culprit

    def own(self, error: BaseException | None) -> Failure:
        """This rank's own ``error`` (None: interrupted), with the action that raised it; a
        broken link raised inside the action goes to the culprit first (see the module)."""
        action = getattr(error, "gpipe_action", None)
        if error is None or isinstance(error, KeyboardInterrupt):
            text = "KeyboardInterrupt: interrupted (Ctrl-C or SIGINT)"
        else:  # NOTE: the failure names the stage, micro-batch and action itself
            first = next(iter(str(error).splitlines()), "")
            text = f"{type(error).__name__}: {unplaced(first)}"
        failure = Failure(
            self._rank,
            text,
            stage=None if action is None else action.stage,
            microbatch=None if action is None else action.microbatch,
            action=None if action is None else str(action),
        )
        if error is None or not broken_link(error) or self._culprit is None:
            return failure
        where = "" if action is None else f" in {action}"
        what = f"rank {self._rank} lost a link{where} ({_link_cause(error, self._timeout)})"
        return self._culprit(-1, what, fallback=failure)

    def silent(self, sender: int, tag: Tag) -> Failure:
        """Nothing came for ``tag`` from rank ``sender`` within the timeout."""
        what = (
            f"rank {self._rank} got no {tag[0]} for stage {tag[1]}, micro-batch {tag[2]} "
            f"from rank {sender} within {self._timeout:g} s"
        )
        return self._named(sender, what)

    def lost_link(self, peer: int, error: BaseException) -> Failure:
        """The link to rank ``peer`` broke with ``error``."""
        what = (
            f"rank {self._rank} lost its link to rank {peer} ({_link_cause(error, self._timeout)})"
        )
        return self._named(peer, what)

    def no_signature(self, peer: int) -> Failure:
        """A first step's signature round heard nothing from rank ``peer`` (-1: unknown)
        within the timeout."""
        what = f"rank {self._rank} got no message signature within {self._timeout:g} s"
        return self._named(peer, what if peer < 0 else f"{what} from rank {peer}")

    def unsent(self, error: TimeoutError, peer: int) -> Failure:
        """A send to rank ``peer`` (-1: unknown) did not complete within the timeout."""
        to = "" if peer < 0 else f" to rank {peer}"
        return self._named(peer, f"rank {self._rank}'s send{to} did not complete: {error}")

    def _named(self, suspect: int, what: str) -> Failure:
        """Whom a failed wait for ``suspect`` blames: the fault channel's culprit (a reported
        failure, or the rank that fell silent), else ``suspect``."""
        if self._culprit is not None:
            return self._culprit(suspect, what)
        return Failure(
            suspect, f"{what}: that rank died, hung past the timeout, or its network failed"
        )


def _link_cause(error: BaseException, timeout: float) -> str:
    """Why a link failed, in one short clause; a timeout named with the pipe's own."""
    text = brief(error)
    if "timeout" in text.lower() or "timed out" in text.lower():
        return f"nothing came within the timeout of {timeout:g} s: DistributedGPipe(timeout=...)"
    return text
