"""Hand-offs between devices, ordered by CUDA events on copy streams, never by a host sync.

Every stage on one GPU runs on the caller's current stream for that GPU (see
:class:`~gpipe.runtime.context.CallerContext`), so a message between two stages on the same
device is ordered by the stream itself. A message that changes device is stamped by its
sender with an event on the sender's stream (:func:`stamp`) and moved by its receiver
(:func:`arrive`) as torchgpipe does (``torchgpipe/copy.py``, ``stream.py``):

- to a GPU (from the CPU or another GPU): the copy runs on a copy stream of the
  destination that first waits for the sender's event; the receiver's stream waits for the
  copy's event, on the GPU, and ``record_stream`` tells the allocator which streams use
  each tensor, so neither side's memory is reused under the other's kernels;
- to the CPU: the copy runs on a copy stream of the source that waits for the sender's
  event, and the receiving thread waits for that copy alone (a CPU stage reads the tensor at
  once: an asynchronous copy into pinned memory returns before it lands).

NOTE: the CUDA calls go through :data:`cuda`, so tests on a machine without a GPU can put
a fake device in its place and check which stream each copy is issued on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from gpipe.structure import map_tensors

__all__ = ["GpuClock", "Span", "Stamped", "arrive", "cuda", "stamp"]


class _Cuda:
    """The CUDA calls a hand-off makes (replaced by a fake in tests)."""

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def record(self, stream: Any, timing: bool = False) -> Any:
        """An event recorded on ``stream`` now (``timing``: one that can be timed)."""
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream)
        return event

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds on the GPU from ``start`` to ``end``, waiting for ``end`` first."""
        end.synchronize()
        return float(start.elapsed_time(end))

    def on_stream(self, stream: Any) -> Any:
        """A context in which ``stream`` is the current stream of its device."""
        return torch.cuda.stream(stream)

    def move(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        # NOTE: to the CPU this lands in pinned memory and returns before the copy does.
        return tensor.to(device, non_blocking=True)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait, on the GPU, for ``event``."""
        stream.wait_event(event)

    def synchronize(self, event: Any) -> None:
        """Block this thread until ``event`` has happened."""
        event.synchronize()


cuda = _Cuda()


@dataclass(frozen=True, slots=True)
class Stamped:
    """A message sent from a GPU to another device, and the event that marks it ready."""

    value: Any
    event: Any
    device: torch.device


def stamp(value: Any, device: torch.device) -> Stamped:
    """Mark ``value``, computed by this thread on ``device`` (a GPU), ready once its stream
    gets here."""
    return Stamped(value, cuda.record(cuda.current_stream(device)), device)


class Span(NamedTuple):
    """When a copy ran on the GPU: timing events on its copy stream, read when asked for."""

    device: torch.device
    start: Any
    end: Any


class GpuClock:
    """Times on a GPU's current stream, placed on the host's clock when read.

    :meth:`start` records an event as a step begins, beside the host's time then; every
    later :meth:`mark` is an event on the stream, and :meth:`ns` reads it as the host's
    ``perf_counter_ns`` at which the GPU got there. NOTE: a mark costs one event record; it
    is read (waiting for the GPU) only when the timeline is.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._origin: tuple[Any, int] | None = None

    def start(self) -> None:
        """The step begins: the origin every later mark is timed from."""
        self._origin = (self.mark(), time.perf_counter_ns())

    def mark(self) -> Any:
        """An event on the device's current stream: when the GPU gets to this point."""
        return cuda.record(cuda.current_stream(self.device), timing=True)

    def ns(self, mark: Any) -> int:
        """When the GPU reached ``mark``, on the host's clock (waits for it to)."""
        if self._origin is None:
            raise RuntimeError("GpuClock.ns before start(): no origin to time from")
        origin, at_ns = self._origin
        return at_ns + round(cuda.elapsed_ms(origin, mark) * 1e6)


class CopyStreams:
    """One copy stream per device, made at its first copy and kept for the pipe's life."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def __call__(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = cuda.new_stream(device)
        return stream

    def __getstate__(self) -> dict[str, Any]:
        return {"_streams": {}}  # NOTE: streams do not pickle; a copy makes its own


def arrive(
    message: Any, source: torch.device | None, target: torch.device, copies: CopyStreams
) -> tuple[Any, Span | None]:
    """``message`` moved to ``target``, ready for this thread to use there, and when a GPU
    copied it (None when no GPU did).

    Args:
        message: what the sender sent: :class:`Stamped` if it came from a GPU stage.
        source: the device of the sending stage; None for the caller's side, whose tensors
            were made on the streams this thread runs on (the caller's), so an ordinary
            copy is ordered after them.
        target: the device this thread runs on.
        copies: the pipe's copy streams.
    """
    if isinstance(message, Stamped):
        if target.type == "cuda":
            return _between_gpus(message, target, copies)
        return _to_cpu(message, target, copies)
    if source is not None and source.type == "cpu" and target.type == "cuda":
        return _to_gpu(message, target, copies)
    # NOTE: blocking to the CPU: an asynchronous copy would be read before it lands.
    moved = map_tensors(lambda t: t.to(target, non_blocking=target.type == "cuda"), message)
    return moved, None


def _to_gpu(message: Any, target: torch.device, copies: CopyStreams) -> tuple[Any, Span]:
    """From a CPU stage: copied on ``target``'s copy stream, which its user waits for."""
    stream, consumer = copies(target), cuda.current_stream(target)

    def move(tensor: torch.Tensor) -> torch.Tensor:
        moved = cuda.move(tensor, target)
        if moved is not tensor:  # NOTE: allocated on the copy stream
            cuda.record_stream(moved, consumer)
        return moved

    start = cuda.record(stream, timing=True)
    with cuda.on_stream(stream):
        moved = map_tensors(move, message)
    end = cuda.record(stream, timing=True)
    cuda.wait(consumer, end)
    return moved, Span(target, start, end)


def _between_gpus(message: Stamped, target: torch.device, copies: CopyStreams) -> tuple[Any, Span]:
    """From another GPU: a copy runs on the current streams of both devices, so both are
    copy streams here, the source's waiting for the sender's event."""
    sending, receiving = copies(message.device), copies(target)
    consumer = cuda.current_stream(target)
    cuda.wait(sending, message.event)

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu":  # a CPU tensor in a GPU stage's message
            return tensor.to(target)
        moved = cuda.move(tensor, target)
        cuda.record_stream(tensor, sending)  # NOTE: the sender may free it before the copy
        cuda.record_stream(moved, consumer)
        return moved

    # NOTE: timed on one device (the target's copy stream), from the sender's event on
    cuda.wait(receiving, message.event)
    start = cuda.record(receiving, timing=True)
    with cuda.on_stream(receiving), cuda.on_stream(sending):
        moved = map_tensors(move, message.value)
    # NOTE: torch's copy between GPUs leaves the destination's current stream waiting for it
    end = cuda.record(receiving, timing=True)
    cuda.wait(consumer, end)
    return moved, Span(target, start, end)


def _to_cpu(message: Stamped, target: torch.device, copies: CopyStreams) -> tuple[Any, Span]:
    """From a GPU to a CPU stage: copied on the source's copy stream, which waits for the
    sender's event; this thread then waits for the copy alone, not for the GPU's other work."""
    stream = copies(message.device)
    cuda.wait(stream, message.event)
    start = cuda.record(stream, timing=True)
    with cuda.on_stream(stream):
        moved = map_tensors(lambda t: cuda.move(t, target), message.value)
    end = cuda.record(stream, timing=True)
    cuda.synchronize(end)
    return moved, Span(message.device, start, end)
