"""Waiting for a collective of the pipe's own, or for a failure anywhere, whichever comes
first: a rank that fails while the others sit in a collective still ends them all at once."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

from gpipe.distributed.failure import Failure, PipelineFailure, brief
from gpipe.distributed.fault_channel import FaultChannel

__all__ = ["wait_for"]


def wait_for(
    work: Any,
    faults: FaultChannel | None,
    failed: Callable[[], Failure | None],
    rank: int,
    ranks: Sequence[int] | None = None,
) -> None:
    """Wait for a torch.distributed ``work``, or for a failure anywhere, whichever comes first.

    A thread waits for the work, since a gloo wait cannot be interrupted and a timed-out one
    (``Work.wait(timeout)``) breaks the link; this one blocks until the work is done or
    ``faults`` hears a failure (``failed()`` then names it).

    Args:
        faults: the channel whose failures end the wait (None: only the work ends it).
        failed: the failure this rank knows of, if any.
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
    woken = threading.Event()  # the work is done, or a failure was heard
    done = threading.Event()
    broke: list[BaseException] = []
    # NOTE: the helper lets go of the work before saying it is done, so the work is freed on
    # this thread, never on the helper: torch frees a work with the GIL released, and a
    # daemon thread taking the GIL back as the interpreter finalizes aborts the process.
    handed = [work]
    del work

    def wait() -> None:
        held = handed.pop()
        try:
            held.wait()
        except BaseException as error:
            broke.append(error)
        finally:
            del held
            done.set()
            woken.set()

    helper = threading.Thread(target=wait, name="gpipe-collective", daemon=True)
    with _woken_by(faults, woken):
        helper.start()
        woken.wait()
    if not done.is_set():  # woken by the channel, which heard a failure
        failure = failed() or (faults.failure if faults is not None else None)
        assert failure is not None
        raise PipelineFailure(failure, rank)
    if broke:
        raise PipelineFailure(_cause(broke[0], faults, failed, ranks), rank) from broke[0]


def _woken_by(
    faults: FaultChannel | None, event: threading.Event
) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if faults is None else faults.wakes(event)


def _cause(
    error: BaseException,
    faults: FaultChannel | None,
    failed: Callable[[], Failure | None],
    ranks: Sequence[int] | None,
) -> Failure:
    """Why a collective's link broke: a reported failure, else the rank that fell silent."""
    failure = failed()
    if failure is not None:
        return failure
    what = f"a link of a collective broke ({brief(error)})"
    if faults is None:
        return Failure(-1, what)
    return faults.culprit(-1, what, ranks)
