"""A distributed step's header: what every rank agrees on before its actions run.

The rank of the first stage that reads the inputs knows the batch; it broadcasts the
micro-batch count, the samples, a number standing for the micro-batches' shapes, the step's
seed, a number standing for the settings the step runs under, and which call this is. A rank
whose settings differ fails the step on every rank, naming what to set alike.

Every call of a pipe that runs collectives (a step, a save, a load, clipping, the timeline)
begins with this header, the same collective of the same size: so ranks that disagree on
which call they make (one evaluates while the others train) meet here, where the call is
compared, and never in a collective of another size (which gloo ends by aborting the
process: "Received data size doesn't match").
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gpipe.distributed.guard import PipeGuard
from gpipe.microbatch import Batch
from gpipe.schedule import Schedule

__all__ = ["CALLS", "Header", "LossBroadcast", "agree", "settings_code"]

#: The calls of a pipe that every rank of it makes together, in the same order.
CALLS = ("train_step", "eval_step", "save", "load", "clip_grad_norm_", "timeline", "generate")

_LOSS_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Header:
    """What a step's ranks agreed on.

    Attributes:
        microbatches: M of this step (a batch smaller than ``chunks`` gives fewer).
        total: the samples of this replica's batch.
        shapes: a number standing for the micro-batches' structure, shapes and dtypes.
        seed: the step's random seed.
        announced: the broadcast of this rank's own header while it may be in flight
            (only on the rank that sent it; wait for it with :meth:`settle`).
    """

    microbatches: int
    total: int
    shapes: int
    seed: int
    announced: Any = None

    def settle(self, guard: PipeGuard) -> None:
        """Make sure this rank's own header has gone (the source waits after its step)."""
        if self.announced is not None:
            guard.wait(self.announced)


def agree(
    guard: PipeGuard,
    batch: Batch | None,
    seed: int,
    settings: tuple[str | Schedule, str, int],
    source: int,
    group: Any,
    call: str = "train_step",
) -> Header:
    """The header of the call about to run, from rank ``source`` (which holds ``batch``).

    ``settings`` is (schedule, checkpoint, chunks) as this rank has them; ``call`` is one of
    :data:`CALLS`. Any call but a step waits for the header (the source too).

    Raises:
        PipelineFailure: this rank makes another call than ``source``, or its settings
            differ (on every rank).
    """
    known = [0, 0, 0] if batch is None else [batch.microbatches, batch.total, batch.shapes]
    code = settings_code(*settings)
    mine = CALLS.index(call)
    header = torch.tensor([*known, seed, code, mine], dtype=torch.int64)
    work = dist.broadcast(header, source, group, async_op=True)
    announced = None
    if guard.rank == source and call in ("train_step", "eval_step"):
        # The source knows the header already: it starts its actions at once and makes
        # sure of the broadcast after the step, so the first stage never waits on it.
        announced = work
    else:
        guard.wait(work)
    count, total, shapes, seed, theirs, their_call = header.tolist()
    if their_call != mine:
        raise guard.fail(
            f"rank {guard.rank} called {call}() while rank {source}, which reads the pipe's "
            f"inputs, called {CALLS[their_call]}(): every rank of a pipe makes the same calls "
            "in the same order (train_step, eval_step, save, load, clip_grad_norm_, timeline, "
            "generate)"
        )
    if theirs != code:
        schedule, checkpoint, chunks = settings
        named = schedule if isinstance(schedule, str) else f"a Schedule ({schedule.name})"
        raise guard.fail(
            f"rank {guard.rank} runs schedule={named!r}, checkpoint={checkpoint!r}, "
            f"chunks={chunks}, unlike rank {source}: set pipe.schedule, pipe.checkpoint and "
            "pipe.chunks alike on every rank"
        )
    return Header(count, total, shapes, seed, announced)


def settings_code(schedule: str | Schedule, checkpoint: str, chunks: int) -> int:
    """A number standing for the settings every rank's step must share."""
    named = schedule if isinstance(schedule, str) else _described(schedule)
    return zlib.crc32(f"{named}|{checkpoint}|{chunks}".encode())


@functools.lru_cache(maxsize=4)
def _described(schedule: Schedule) -> str:
    """A custom schedule as text (long: made once per schedule, not per step)."""
    return repr(schedule.actions)


class LossBroadcast:
    """The batch's loss, from the last stage's rank to every rank of the pipeline.

    Sent in float64 for precision, with its dtype's code beside it, so every rank returns
    the dtype plain training returns. The other ranks post their receive before the step
    (:meth:`__init__`), so the loss goes out the moment the last stage has it.
    """

    def __init__(self, guard: PipeGuard, source: int, group: Any, device: torch.device) -> None:
        self._guard, self._source, self._group, self._device = guard, source, group, device
        self._value = torch.zeros(2, dtype=torch.float64)
        self._heard = None
        if guard.rank != source:
            self._heard = dist.broadcast(self._value, source, group, async_op=True)

    def send(self, loss: torch.Tensor, replicas: Any = None) -> None:
        """On the source: the loss to send, summed over ``replicas`` first if given."""
        self._value[0] = loss.detach().double().cpu()
        if replicas is not None:
            self._value[0] = self._guard.summed(self._value[0], replicas)
        if loss.dtype in _LOSS_DTYPES:
            self._value[1] = _LOSS_DTYPES.index(loss.dtype)

    def result(self) -> torch.Tensor:
        """The loss on every rank (the source sends it now), in its own dtype."""
        heard = self._heard
        if heard is None:
            heard = dist.broadcast(self._value, self._source, self._group, async_op=True)
        self._guard.wait(heard)
        dtype = _LOSS_DTYPES[int(self._value[1])]
        return self._value[0].to(device=self._device, dtype=dtype)
