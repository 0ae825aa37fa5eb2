"""A save or a load under the same guarantee as a step: whatever fails on one rank ends
every rank within the pipe's timeout, naming the rank and what it was doing.

Three pieces make a checkpoint's collectives safe (see :meth:`PipeGuard.running` for the
fourth, which tells a rank's own error to the others):

- :func:`agreed`: the checks before anything is written or read (a missing checkpoint, a
  model that does not match it) run on every rank and the ranks agree on the outcome. The
  same error on every rank is the user's to handle (a script that starts afresh when there
  is nothing to load): it is raised on every rank as it is, and the pipe stays usable. An
  error on some ranks only means the ranks see different things (a file system one rank
  cannot read): it fails the pipe on every rank, naming the first of them.
- :func:`in_thread`: torch.distributed.checkpoint's own collectives block in gloo, where
  nothing could wake them; they run in a thread this rank waits for as for any collective
  of the pipe's, waking on a failure anywhere. Their group is the pipe's own ``everyone``
  group, retired after a failure so the thread ends.
- :func:`checkpoint_failure`: DCP reports a rank's error to every rank as its
  ``CheckpointException`` (not an ``Exception``: ``except Exception`` misses it); it
  becomes a failure naming that rank, raised as a :class:`PipelineFailure`.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from gpipe.distributed.checkpoint_reader import SafeReader
from gpipe.distributed.failure import Failure, PipelineFailure
from gpipe.distributed.guard import PipeGuard
from gpipe.distributed.json_collectives import all_gather_json, broadcast_json

__all__ = [
    "TrackedReader",
    "TrackedWriter",
    "agreed",
    "checkpoint_failure",
    "in_checkpoint_thread",
    "in_thread",
]

T = TypeVar("T")

# What a check may raise and the ranks then compare: the errors the checks document.
_CHECKED = (OSError, ValueError, TypeError, pickle.UnpicklingError)


def agreed(
    guard: PipeGuard,
    what: str,
    check: Callable[[], T],
    source: int | None = None,
    shared: bool = False,
) -> T:
    """``check()`` on every rank, once every rank knows how it went on every other (or,
    with ``source``, on that rank: then only its outcome counts, and every rank raises its
    error alike). With ``shared``, the ranks share one check (each its part): the first
    error any rank found is raised alike on every rank.

    Raises:
        OSError, ValueError, TypeError: ``check`` raised it, alike on every rank (or on
            ``source``): the pipe stays usable.
        PipelineFailure: it failed on some ranks only (or not alike), on every rank; the
            failing rank raises its own error (and the pipe is released).
    """
    value: Any = None
    mine: list[str] | None = None
    kept: BaseException | None = None
    try:
        value = check()
    except _CHECKED as error:
        mine, kept = [type(error).__name__, str(error)], error
    if source is not None:
        told = broadcast_json(mine, source, guard.everyone, wait=guard.wait)
        if told is None:
            return value
        raise _alike(kept if guard.rank == source else _rebuilt(*told))
    outcomes = all_gather_json(mine, guard.everyone, wait=guard.wait)
    failed = [rank for rank, outcome in enumerate(outcomes) if outcome is not None]
    if not failed:
        return value
    if shared:
        raise _alike(kept if failed[0] == guard.rank else _rebuilt(*outcomes[failed[0]]))
    if len(failed) == len(outcomes) and all(o == outcomes[0] for o in outcomes):
        raise _alike(kept)  # the same on every rank: the user's to handle
    first = failed[0]
    kind, message = outcomes[first]
    others = [rank for rank in range(len(outcomes)) if rank not in failed]
    unlike = f"; ranks {others} did not" if others else "; the ranks' errors differ"
    failure = Failure(first, f"{kind} while {what}: {_first_line(message)}{unlike}")
    reported = guard.transport.fail(failure)
    if kept is not None:
        raise kept
    raise PipelineFailure(reported, guard.rank)


def _alike(error: BaseException | None) -> BaseException:
    """``error``, marked as raised alike on every rank: :meth:`PipeGuard.running` lets it
    through without failing the pipe."""
    assert error is not None
    error.gpipe_alike = True  # type: ignore[attr-defined]
    return error


# The errors a check's outcome may be told as, by name (never unpickled: JSON text only).
_KINDS: dict[str, type[BaseException]] = {
    kind.__name__: kind
    for kind in (
        OSError,
        FileNotFoundError,
        FileExistsError,
        PermissionError,
        IsADirectoryError,
        NotADirectoryError,
        ValueError,
        TypeError,
    )
}


def _rebuilt(kind: str, message: str) -> BaseException:
    """The error another rank told, as this rank raises it."""
    return _KINDS.get(kind, OSError)(message)


def in_thread(guard: PipeGuard, run: Callable[[], T]) -> T:
    """``run()`` (which runs collectives no failure could wake) in a thread, waited for as
    a collective of the pipe: a failure anywhere ends the wait at once.

    Raises:
        PipelineFailure: another rank failed, or a link broke (the culprit named).
        CheckpointException: DCP's report of a rank's error (see :func:`checkpoint_failure`).
    """
    job = _Job(run)
    guard.wait(job)
    if job.checkpoint_error is not None:
        raise job.checkpoint_error
    return cast(T, job.value)


def in_checkpoint_thread(guard: PipeGuard, what: str, run: Callable[[], Any]) -> None:
    """``run()``, a call of torch.distributed.checkpoint, in a thread (see :func:`in_thread`):
    its report of a rank's error raised as a failure naming that rank and ``what``."""
    try:
        in_thread(guard, run)
    except CheckpointException as error:
        raise checkpoint_failure(guard, error, what) from error


def checkpoint_failure(guard: PipeGuard, error: CheckpointException, what: str) -> PipelineFailure:
    """DCP's report of a rank's error as a failure naming that rank (the lowest one, if
    several failed); every rank reports the same one."""
    failures = error.failures
    rank = min(failures) if failures else guard.rank
    cause = failures[rank][0] if failures else error
    text = _first_line(str(cause)) or type(cause).__name__
    reported = guard.transport.fail(Failure(rank, f"{type(cause).__name__} while {what}: {text}"))
    return PipelineFailure(reported, guard.rank)


class _Job:
    """A function running in a thread, with the torch ``Work`` interface a guard waits on:
    a broken link inside it surfaces from :meth:`wait`, so the culprit is named."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self.value: Any = None
        self.checkpoint_error: CheckpointException | None = None
        self._error: BaseException | None = None
        self._run = run
        self._thread = threading.Thread(target=self._body, name="gpipe-checkpoint", daemon=True)
        self._thread.start()

    def _body(self) -> None:
        try:
            self.value = self._run()
        except CheckpointException as error:
            self.checkpoint_error = error
        except BaseException as error:
            self._error = error

    def is_completed(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _first_line(text: str) -> str:
    return next(iter(text.strip().splitlines()), "")


class TrackedWriter(FileSystemWriter):
    """DCP's file writer, telling the pipe's beats while it writes (see
    :meth:`PipeGuard.working`): a rank stuck writing is then told from one waiting."""

    def __init__(self, path: Path, guard: PipeGuard) -> None:
        super().__init__(path)
        self._guard = guard

    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        with self._guard.working("writing its checkpoint files"):
            return super().write_data(*args, **kwargs)


class TrackedReader(SafeReader):
    """The safe reader (see :mod:`gpipe.distributed.checkpoint_reader`), telling the pipe's
    beats while it reads, as :class:`TrackedWriter` does."""

    def __init__(self, path: Path, guard: PipeGuard) -> None:
        super().__init__(path)
        self._guard = guard

    def read_data(self, *args: Any, **kwargs: Any) -> Any:
        with self._guard.working("reading its checkpoint files"):
            return super().read_data(*args, **kwargs)
