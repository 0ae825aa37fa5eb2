"""Blame: the failure a rank reports, in words that name who failed and what to do.

A rank's own error names the stage, micro-batch and action that raised it. A wait for
another rank that fails (nothing came within the timeout, or the link broke) names the
fault channel's culprit when there is a fault channel (a reported failure, or the rank that
fell silent), else the rank waited for.
"""

from __future__ import annotations

from collections.abc import Callable

from gpipe.distributed.failure import Failure, brief
from gpipe.runtime.step import unplaced
from gpipe.runtime.transport import Tag

__all__ = ["Blame"]


class Blame:
    """The failures one rank reports.

    Args:
        rank: this rank (global).
        timeout: the pipe's timeout, in seconds, which a failed wait names.
        culprit: whom to name when a wait for a rank failed: ``culprit(rank, what
            happened)`` (the fault channel's); None names the rank waited for.
    """

    def __init__(
        self, rank: int, timeout: float, culprit: Callable[[int, str], Failure] | None
    ) -> None:
        self._rank = rank
        self._timeout = timeout
        self._culprit = culprit

    def own(self, error: BaseException | None) -> Failure:
        """This rank's own ``error`` (None: interrupted), with the action that raised it."""
        action = getattr(error, "gpipe_action", None)
        if error is None or isinstance(error, KeyboardInterrupt):
            text = "KeyboardInterrupt: interrupted (Ctrl-C or SIGINT)"
        else:  # NOTE: the failure names the stage, micro-batch and action itself
            first = next(iter(str(error).splitlines()), "")
            text = f"{type(error).__name__}: {unplaced(first)}"
        return Failure(
            self._rank,
            text,
            stage=None if action is None else action.stage,
            microbatch=None if action is None else action.microbatch,
            action=None if action is None else str(action),
        )

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

    def no_signature(self) -> Failure:
        """A first step's signature round heard nothing within the timeout."""
        return Failure(self._rank, f"no message signature came within {self._timeout:g} s")

    def unsent(self, error: TimeoutError) -> Failure:
        """A send did not complete within the timeout (``error`` says which)."""
        return Failure(self._rank, f"a send did not complete: {error}")

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
