"""Hand-offs between devices are ordered by CUDA events on copy streams, and no worker's
backward needs one of autograd's device threads: checked on CPU, with a fake GPU where the
check is about which stream a call is issued on.

NOTE: the hang these guard against cannot happen on a CPU: autograd runs a CPU node on the
thread that called backward, and makes a thread of its own only per accelerator. So on CPU
the tests check the cause instead: every worker's backward runs with autograd's
multithreading off (each node on the worker's own thread), and the caller's setting is
left as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import types
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from conftest import make_mlp
from gpipe import Action, Event, GPipe
from gpipe.runtime import copies
from gpipe.runtime.context import CallerContext
from gpipe.runtime.copies import CopyStreams, GpuClock, Stamped, arrive
from gpipe.runtime.mailbox import LocalTransport
from gpipe.runtime.state import StepState
from gpipe.runtime.transport import ACTIVATION, GRADIENT
from gpipe.runtime.worker import StageWorker

GPU = torch.device("cuda:0")
GPU1 = torch.device("cuda:1")
CPU = torch.device("cpu")


class _Multithreading(torch.autograd.Function):
    """The identity, noting whether autograd's multithreading was on in its backward."""

    seen: ClassVar[list[bool]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _Multithreading.seen.append(torch._C._is_multithreading_enabled())
        return grad


class _Noting(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Multithreading.apply(x)


def _noting_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 6), _Noting(), nn.Linear(6, 6), _Noting(), nn.Linear(6, 6), _Noting()
    ).double()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_workers_run_their_backward_nodes_on_their_own_thread(schedule: str) -> None:
    pipe = GPipe(_noting_model(), [2, 2, 2], devices=["cpu"] * 3, chunks=3, schedule=schedule)
    x, target = torch.randn(6, 6, dtype=torch.float64), torch.zeros(6, 6, dtype=torch.float64)
    _Multithreading.seen.clear()
    pipe.train_step(x, target, F.mse_loss)
    assert _Multithreading.seen == [False] * 9
    assert torch._C._is_multithreading_enabled()


def test_pipe_backward_runs_every_stage_without_autograd_device_threads() -> None:
    pipe = GPipe(_noting_model(), [2, 2, 2], devices=["cpu"] * 3, chunks=3)
    x = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    _Multithreading.seen.clear()
    pipe(x).sum().backward()
    assert _Multithreading.seen == [False] * 9
    assert x.grad is not None
    assert torch._C._is_multithreading_enabled()  # the caller's setting, as it was


def test_pipe_backward_matches_plain_with_caller_multithreading_off() -> None:
    model, plain = make_mlp(), make_mlp()
    pipe = GPipe(model, [8, 8], devices=["cpu", "cpu"], chunks=3)
    x = torch.randn(6, 6, dtype=torch.float64)
    with torch.autograd.set_multithreading_enabled(False):
        pipe(x).square().sum().backward()
        assert not torch._C._is_multithreading_enabled()
    plain(x).square().sum().backward()
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad)


# -- a fake GPU: which stream each call is issued on ------------------------------------


@dataclasses.dataclass(frozen=True)
class _Stream:
    name: str


@dataclasses.dataclass(frozen=True)
class _Event:
    stream: _Stream
    number: int


class _FakeCuda:
    """Logs each CUDA call a hand-off makes, with the stream current at the time."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.current: dict[torch.device, _Stream] = {}
        self.events = 0

    def current_stream(self, device: torch.device) -> _Stream:
        return self.current.get(device, _Stream(f"compute {device}"))

    def new_stream(self, device: torch.device) -> _Stream:
        return _Stream(f"copy {device}")

    def record(self, stream: _Stream, timing: bool = False) -> _Event:
        self.events += 1
        event = _Event(stream, self.events)
        self.log.append(("record", stream.name, event.number))
        return event

    @contextlib.contextmanager
    def on_stream(self, stream: _Stream) -> Iterator[None]:
        device = torch.device(stream.name.split(" ")[1])
        before = self.current.get(device)
        self.current[device] = stream
        try:
            yield
        finally:
            if before is None:
                del self.current[device]
            else:
                self.current[device] = before

    def move(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        streams = sorted(stream.name for stream in self.current.values())
        self.log.append(("move", str(device), *streams))
        return tensor.clone()

    def record_stream(self, tensor: torch.Tensor, stream: _Stream) -> None:
        self.log.append(("record_stream", stream.name))

    def wait(self, stream: _Stream, event: _Event) -> None:
        self.log.append(("wait", stream.name, event.number))

    def synchronize(self, event: _Event) -> None:
        self.log.append(("synchronize", event.number))

    def elapsed_ms(self, start: _Event, end: _Event) -> float:
        """The fake GPU's clock: 10 ms between one event and the next."""
        return 10.0 * (end.number - start.number)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> _FakeCuda:
    cuda = _FakeCuda()
    monkeypatch.setattr(copies, "cuda", cuda)
    return cuda


def test_gpu_to_cpu_is_copied_after_the_senders_event_and_waited_for(fake: _FakeCuda) -> None:
    sent = Stamped(torch.ones(3), _Event(_Stream(f"compute {GPU}"), 0), GPU)
    received, span = arrive(sent, GPU, CPU, CopyStreams())
    assert fake.log == [
        ("wait", f"copy {GPU}", 0),  # the copy stream waits for the sender's work
        ("record", f"copy {GPU}", 1),  # the copy's start, timed
        ("move", "cpu", f"copy {GPU}"),  # the copy runs on it
        ("record", f"copy {GPU}", 2),
        ("synchronize", 2),  # the CPU stage reads it only once it has landed
    ]
    assert received.tolist() == [1, 1, 1]
    assert span is not None and (span.device, span.start.number, span.end.number) == (GPU, 1, 2)


def test_cpu_to_gpu_is_copied_on_a_copy_stream_the_consumer_waits_for(fake: _FakeCuda) -> None:
    _, span = arrive([torch.ones(2), torch.zeros(2)], CPU, GPU, CopyStreams())
    copy, consumer = f"copy {GPU}", f"compute {GPU}"
    assert fake.log == [
        ("record", copy, 1),
        ("move", str(GPU), copy),
        ("record_stream", consumer),  # allocated on the copy stream, used on the consumer's
        ("move", str(GPU), copy),
        ("record_stream", consumer),
        ("record", copy, 2),
        ("wait", consumer, 2),  # on the GPU: no host sync
    ]
    assert span is not None and (span.device, span.start.number, span.end.number) == (GPU, 1, 2)


def test_gpu_to_gpu_copies_on_both_copy_streams_after_the_senders_event(
    fake: _FakeCuda,
) -> None:
    on_gpu = torch.ones(2, device="meta")  # NOTE: stands for a tensor on the GPU
    sent = Stamped(on_gpu, _Event(_Stream(f"compute {GPU}"), 0), GPU)
    _, span = arrive(sent, GPU, GPU1, CopyStreams())
    assert fake.log == [
        ("wait", f"copy {GPU}", 0),
        ("wait", f"copy {GPU1}", 0),  # NOTE: so the copy is timed on one device, the target
        ("record", f"copy {GPU1}", 1),
        ("move", str(GPU1), f"copy {GPU}", f"copy {GPU1}"),  # both devices' current streams
        ("record_stream", f"copy {GPU}"),  # the sender may free its tensor before the copy
        ("record_stream", f"compute {GPU1}"),
        ("record", f"copy {GPU1}", 2),
        ("wait", f"compute {GPU1}", 2),
    ]
    assert span is not None and span.device == GPU1


def test_copy_streams_are_made_once_per_device(fake: _FakeCuda) -> None:
    streams = CopyStreams()
    assert streams(GPU) is streams(GPU)
    assert streams(GPU) != streams(GPU1)


def test_transport_stamps_messages_leaving_a_gpu_and_moves_them_on_arrival(
    fake: _FakeCuda,
) -> None:
    transport = LocalTransport((0, 1), [CPU, GPU])
    fake.current[GPU] = _Stream(f"caller {GPU}")
    transport.send((GRADIENT, 0, 0), torch.ones(2))  # from stage 1, on the GPU
    assert fake.log == [("record", f"caller {GPU}", 1)]  # on the sender's stream
    fake.log.clear()
    received = transport.recv((GRADIENT, 0, 0))
    assert isinstance(received, torch.Tensor)
    assert fake.log[0] == ("wait", f"copy {GPU}", 1) and fake.log[-1][0] == "synchronize"
    fake.log.clear()
    transport.send((ACTIVATION, 1, 0), torch.ones(2))  # from stage 0, on the CPU
    assert fake.log == []  # nothing to wait for: the CPU finished it
    transport.recv((ACTIVATION, 1, 0))
    assert fake.log == [
        ("record", f"copy {GPU}", 4),
        ("move", str(GPU), f"copy {GPU}"),
        ("record_stream", f"caller {GPU}"),
        ("record", f"copy {GPU}", 5),
        ("wait", f"caller {GPU}", 5),  # the receiving stage's stream: the caller's
    ]


def test_stages_on_one_gpu_hand_off_without_events(fake: _FakeCuda) -> None:
    transport = LocalTransport((0, 1), [GPU, GPU])
    transport.reset()
    value = torch.ones(2)
    transport.send((ACTIVATION, 1, 0), value)
    assert transport.recv((ACTIVATION, 1, 0)) is value
    assert fake.log == []  # one stream orders them; no copy to time


def test_a_copy_a_gpu_ran_spans_the_time_the_gpu_ran_it(fake: _FakeCuda) -> None:
    """Placed by the event each GPU recorded as the step began, 10 ms per fake event."""
    transport = LocalTransport((0, 1), [CPU, GPU])
    transport.reset()
    origin_event, origin_ns = transport._clocks[GPU]._origin
    assert fake.log == [("record", f"compute {GPU}", origin_event.number)]
    transport.send((ACTIVATION, 1, 0), torch.ones(2))  # CPU to GPU: copied at the receiver
    transport.recv((ACTIVATION, 1, 0))
    transport.send((GRADIENT, 0, 0), torch.ones(2))  # GPU to CPU
    transport.recv((GRADIENT, 0, 0))
    forward, backward = transport.transfers(origin_ns)
    assert (forward.start, forward.end) == pytest.approx((0.010, 0.020))
    assert (backward.start, backward.end) == pytest.approx((0.040, 0.050))
    assert (forward.source, forward.target, backward.source, backward.target) == (0, 1, 1, 0)


def test_a_gpu_clock_reads_its_marks_on_the_hosts_clock(fake: _FakeCuda) -> None:
    """A mark is the GPU's time since the origin (10 ms per fake event), after the host's
    time at the origin; it is recorded on the device's current stream, whichever that is."""
    clock = GpuClock(GPU)
    with pytest.raises(RuntimeError, match="before start"):
        clock.ns(fake.record(_Stream(f"compute {GPU}")))
    clock.start()
    origin_event, origin_ns = clock._origin
    with fake.on_stream(_Stream(f"copy {GPU}")):
        mark = clock.mark()
    assert fake.log[-1] == ("record", f"copy {GPU}", mark.number)
    assert clock.ns(mark) == origin_ns + 10_000_000 * (mark.number - origin_event.number)


def test_worker_threads_enter_the_callers_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    entered: list[tuple[str, Any]] = []

    @contextlib.contextmanager
    def stream(s: Any) -> Iterator[None]:
        entered.append((threading.current_thread().name, s))
        yield

    monkeypatch.setattr(torch.cuda, "stream", stream)
    context = dataclasses.replace(CallerContext.capture([CPU]), streams=("s0", "s1"))
    with context.entered():  # the caller's own thread: already on them
        pass
    worker = threading.Thread(target=lambda: context.entered().__enter__(), name="worker")
    worker.start()
    worker.join()
    assert entered == [("worker", "s0"), ("worker", "s1")]
    assert context.autocast_only().streams == ()


def test_gpu_action_times_come_from_their_events_when_the_timeline_is_read(
    fake: _FakeCuda,
) -> None:
    """Read by the GPU's clock: 10 ms per fake event after the origin, which the host saw
    a second after the step began."""
    state = StepState(1, 1, grad=True, checkpoint="never", seed=0)
    state.events[0].append(Event(Action("F", 0, 0), 0.001, 0.002, 5))
    clock = GpuClock(GPU)
    clock.start()
    assert clock._origin is not None
    clock._origin = (clock._origin[0], state.origin_ns + 10**9)
    start, end = clock.mark(), clock.mark()
    state.timed.append((0, 0, clock, start, end))
    state.settle()
    (event,) = state.events[0]
    assert (event.start, event.end, event.memory) == (pytest.approx(1.010), pytest.approx(1.020), 5)
    assert state.timed == []


def test_each_run_of_a_gpu_worker_reads_its_actions_by_its_own_clock(fake: _FakeCuda) -> None:
    """pipe(x), then loss.backward(): two runs of one step, each timed from its own start."""
    stages = types.SimpleNamespace(devices=[GPU], routes=None, last=0)
    state = StepState(1, 1, grad=True, checkpoint="never", seed=0)
    worker = StageWorker(stages, 0, None, state)  # type: ignore[arg-type]
    clocks = []
    for action in (Action("F", 0, 0), Action("B", 0, 0)):
        worker.prepare()
        assert worker._clock is not None
        clocks.append(worker._clock)
        worker._record(action, worker._begin())
    first, second = clocks
    assert first is not second
    assert [entry[2] for entry in state.timed] == [first, second]
    state.settle()
    forward, backward = state.events[0]
    for event, clock in ((forward, first), (backward, second)):  # 10 ms per fake event
        assert clock._origin is not None
        assert event.start == pytest.approx((clock._origin[1] + 10**7 - state.origin_ns) / 1e9)
        assert event.end == pytest.approx(event.start + 0.010)


def test_cuda_memory_is_empty_on_cpu() -> None:
    pipe = GPipe(make_mlp(), [8, 8], devices=["cpu", "cpu"], chunks=2)
    pipe(torch.randn(4, 6, dtype=torch.float64))
    assert pipe.cuda_memory == {}
