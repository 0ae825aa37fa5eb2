"""A distributed pipe's failure wiring: its fault channel, waits that wake on a failure, and
a build or a step that fails on any rank failing on every rank, all naming the same cause.

The channel exists before the pipe's first collective, so a rank that fails while building
(a bad ``init_fn``, out of memory) ends every rank at once, naming itself, instead of
leaving the others in a collective until the timeout.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from gpipe.distributed.blame import broken_link
from gpipe.distributed.failure import Failure, PipelineFailure, brief
from gpipe.distributed.fault_channel import FaultChannel
from gpipe.distributed.mesh import Groups, collective_device, everyone, retire, retire_everyone
from gpipe.distributed.waiting import WaitHelpers, wait_for
from gpipe.runtime.state import StepState

__all__ = ["PipeGuard", "close_all"]

_COUNTER = itertools.count()
_OPEN: weakref.WeakSet[PipeGuard] = weakref.WeakSet()


def close_all() -> bool:
    """Stop every open pipe's threads; whether none of them saw a failure.

    A pipe that failed may have threads still waiting in gloo: its groups are retired, so
    they end now, not as the interpreter finalizes (see mesh.end).
    """
    healthy = True
    for guard in list(_OPEN):
        if guard.transport is None or guard.transport.failure is None:
            guard.close()
        else:
            healthy = False
            guard.release()
    return healthy


class PipeGuard:
    """The fault channel of one pipe and everything a failure must end.

    The pipe hands it what it builds as it builds it (``groups``, ``tie_groups``,
    ``transport``) and each step's state, so a failure heard on the channel stops the
    step's workers and wakes its transport, and :meth:`release` ends all of it.

    Args:
        timeout: seconds a rank waits for the others before declaring one lost.

    Raises:
        RuntimeError: not every rank began building a pipe within ``timeout``.
    """

    def __init__(self, timeout: float) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # Making a group waits for every rank, and nothing could wake a rank waiting there:
        # so first, before any check that could fail on one rank alone.
        try:
            self.everyone, token = everyone(timeout)
        except RuntimeError as error:  # DistStoreError and gloo's errors alike
            raise RuntimeError(
                f"gpipe: not every rank began building the pipe within timeout={timeout:g} s "
                f"(a rank died, hung, or does not construct DistributedGPipe): {brief(error)}"
            ) from error
        self.groups: Groups | None = None
        self.tie_groups: list[Any] = []
        self.transport: Any = None  # the Executor, once built
        self.state: StepState | None = None  # the step under way
        self._waits = 0  # collectives this rank waits in now (see progress)
        self._working: str | None = None  # local work inside a wait (see working)
        self._helpers = WaitHelpers()  # the threads :meth:`wait` waits on
        # The default store is the one every rank already shares (torchrun's agent's or
        # rank 0's); torch offers no public accessor for it.
        store = dist.distributed_c10d._get_default_store()
        self.faults = FaultChannel(
            store,
            f"gpipe/pipe{next(_COUNTER)}",
            self.rank,
            self._on_failure,
            self.world,
            token=token,
        )
        self.faults.progress = self._progress
        _OPEN.add(self)

    @property
    def failure(self) -> Failure | None:
        """The failure this pipe heard of, if any."""
        if self.transport is not None:
            return self.transport.failure
        return self.faults.failure

    # -- building and stepping ---------------------------------------------------------

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Build under the channel: a rank that fails says so, and every rank ends.

        A link that broke while building (torch.distributed's error) is a symptom: the rank
        named is the fault channel's culprit (a reported failure, or the rank that fell
        silent), raised here as a PipelineFailure like on every other rank.
        """
        try:
            with self.faults.busy():
                yield
        except BaseException as error:
            named = None  # the failure to raise instead of ``error``, if any
            if not isinstance(error, PipelineFailure):
                first = next(iter(str(error).splitlines()), "")
                own = Failure(self.rank, f"{type(error).__name__} while building the pipe: {first}")
                if broken_link(error):
                    what = f"rank {self.rank} lost a link while building the pipe ({brief(error)})"
                    named = self.faults.publish(self.faults.culprit(-1, what, fallback=own))
                else:
                    self.faults.publish(own)
            self.faults.acknowledge(self.world)
            self.faults.close()
            # A collective of construction may still be posted here (the others' barrier
            # when this rank failed, or ours when another did).
            if self.groups is not None:
                retire(self.groups, self.tie_groups)
            retire_everyone(self.everyone)
            _OPEN.discard(self)
            if named is not None:
                raise PipelineFailure(named, self.rank) from error
            raise

    @contextlib.contextmanager
    def stepping(self, ran: Callable[[], bool]) -> Iterator[None]:
        """Run a step (or a save, a load) so that a failure on any rank fails it on every
        rank. ``ran()`` says whether this rank's actions ran: an error raised on this rank
        alone before them (a bad target given to the last rank) must be told to the
        others, who wait for its messages; one after them is this rank's own."""
        assert self.groups is not None
        if self.groups.retired:
            raise RuntimeError(
                "this pipe's process groups were ended after a step of another pipe over "
                "them failed: build a new DistributedGPipe"
            )
        try:
            with self.faults.busy():
                yield
        except BaseException as error:
            if self.transport.failure is None and not ran():
                self.transport.abort(error)
            failure = self.transport.failure
            if failure is not None or isinstance(error, PipelineFailure):
                self.faults.acknowledge(self.world)
                self.release()
            # NOTE: a link that broke inside this rank's own compute (a collective of FSDP or
            # DDP, whose peer failed) is a symptom: name the culprit, as a wait would
            if failure is not None and failure.rank != self.rank and broken_link(error):
                raise PipelineFailure(failure, self.rank) from error
            raise

    @contextlib.contextmanager
    def running(self, what: str) -> Iterator[None]:
        """Run a save or a load (``what``: "saving", "committing", "loading") so that a
        failure on any rank ends it on every rank within the timeout, naming the rank and
        ``what``. This rank's own error is told to the others (who may be waiting in a
        collective for it) and raised here as it is; another rank's comes as a
        PipelineFailure. Either way the pipe is released: build a new one to go on."""
        assert self.groups is not None
        if self.groups.retired:
            raise RuntimeError(
                "this pipe's process groups were ended after a call of another pipe over "
                "them failed: build a new DistributedGPipe"
            )
        try:
            with self.faults.busy():
                yield
        except BaseException as error:
            if getattr(error, "gpipe_alike", False):
                raise  # raised alike on every rank (see checkpoint_calls.agreed): no failure
            if not isinstance(error, PipelineFailure) and self.failure is None:
                first = next(iter(str(error).splitlines()), "") or type(error).__name__
                self.transport.fail(
                    Failure(self.rank, f"{type(error).__name__} while {what}: {first}")
                )
            if self.failure is not None:
                self.faults.acknowledge(self.world)
                self.release()
                # NOTE: a checkpoint's collectives run on this group: one may still be
                # posted, on this rank or another
                retire_everyone(self.everyone)
            raise

    @contextlib.contextmanager
    def working(self, what: str) -> Iterator[None]:
        """This rank does its own work (``what``: writing a checkpoint's files) in a thread
        its main thread waits for: while it does, its beats say it is not waiting for the
        others, so a rank stuck there is the one named when the others' waits fail."""
        self._working = what
        try:
            yield
        finally:
            self._working = None

    def fail(self, reason: str) -> PipelineFailure:
        """Fail the step on every rank for ``reason`` (found on this rank); the error to raise."""
        return PipelineFailure(self.transport.fail(Failure(self.rank, reason)), self.rank)

    # -- waiting -----------------------------------------------------------------------

    def wait(self, work: Any) -> None:
        """Wait for a collective's ``work``, or raise once any rank failed."""
        self._waits += 1
        try:
            wait_for(work, self.faults, lambda: self.failure, self.rank, helpers=self._helpers)
        finally:
            self._waits -= 1

    def summed(self, scalar: torch.Tensor, group: Any) -> torch.Tensor:
        """``scalar`` summed over ``group``'s ranks, on the device its backend takes (a CUDA
        tensor on NCCL), back on the CPU."""
        here = scalar.to(collective_device(group))
        self.wait(dist.all_reduce(here, group=group, async_op=True))
        return here.cpu()

    # -- ending ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the channel's and the transport's threads (a healthy pipe's end)."""
        self.faults.close()
        if self.transport is not None:  # none if building the pipe failed
            self.transport.close()
        self._helpers.close()
        _OPEN.discard(self)

    def release(self) -> None:
        """After a failure: end everything the pipe made (threads, process groups), so a
        job that builds a new pipe and retries leaks nothing (see mesh.retire)."""
        self.faults.close()
        if self.groups is not None:
            retire(self.groups, self.tie_groups)
        if self.transport is not None:
            self.transport.release()
        self._helpers.close()  # NOTE: after the groups are retired, which ends their waits
        _OPEN.discard(self)

    # -- what the channel's threads call -----------------------------------------------

    def _progress(self) -> dict[str, Any]:
        """How far this rank got, for the channel's beats (read from their thread)."""
        transport = self.transport
        done = 0 if transport is None else transport.done
        waiting = self._waits > 0 or (transport is not None and transport.waiting)
        doing = "a step" if transport else "building"
        if self._working is not None:  # NOTE: its own work, though a wait holds its main thread
            waiting, doing = False, self._working
        return {"done": done, "waiting": waiting, "doing": doing}

    def _on_failure(self, failure: Failure) -> None:
        state = self.state
        if state is not None:
            state.failed = True  # the worker stops before its next action
        if self.transport is not None:  # none yet while the pipe is being built
            self.transport.fail(failure)
