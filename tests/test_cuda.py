"""On GPUs: stages on several CUDA devices give the gradients of plain training.

These need CUDA; on a machine without a GPU they are skipped (CPU runs cover the rest).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch.nn import functional as F
from torch.testing import assert_close

from conftest import make_mlp, reference_step
from gpipe import GPipe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _devices() -> list[str]:
    count = torch.cuda.device_count()
    return [f"cuda:{i % count}" for i in range(4)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_cuda_stages_match_plain_training(schedule: str) -> None:
    x = torch.randn(10, 6, dtype=torch.float64)
    target = torch.randn(10, 6, dtype=torch.float64)
    _, expected_loss, expected_grads, _ = reference_step(make_mlp(), x, target, F.mse_loss)
    model = make_mlp()
    pipe = GPipe(model, [4, 4, 4, 4], devices=_devices(), chunks=4, schedule=schedule)
    loss = pipe.train_step(x.cuda(), target.to(pipe.devices[-1]), F.mse_loss)
    assert_close(loss.cpu(), expected_loss)
    for param, grad in zip(model.parameters(), expected_grads):
        assert_close(param.grad.cpu(), grad)


def test_cuda_output_lands_on_last_device_and_backward_reaches_input() -> None:
    model = make_mlp()
    pipe = GPipe(model, [8, 8], devices=_devices()[:2], chunks=3)
    x = torch.randn(6, 6, dtype=torch.float64, device=pipe.devices[0], requires_grad=True)
    y = pipe(x)
    assert y.device == pipe.devices[-1]
    y.sum().backward()
    assert x.grad is not None and x.grad.device == x.device


@pytest.mark.parametrize("devices", [["cpu", "cuda:0"], ["cuda:0", "cpu"]])
def test_output_lands_on_the_last_device_of_a_mixed_pipe(devices: list[str]) -> None:
    # NOTE: one GPU suffices: with a CPU stage beside it, a wrong device cannot pass.
    x = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    target = torch.randn(6, 6, dtype=torch.float64)
    expected, _, expected_grads, _ = reference_step(make_mlp(), x, target, F.mse_loss)
    model = make_mlp()
    pipe = GPipe(model, [8, 8], devices=devices, chunks=3)
    y = pipe(x.detach().to(devices[0]).requires_grad_())
    assert y.device == torch.device(devices[-1]) != torch.device(devices[0])
    assert_close(y.cpu(), expected)
    F.mse_loss(y, target.to(y.device)).backward()
    for param, grad in zip(model.parameters(), expected_grads):
        assert_close(param.grad.cpu(), grad)


def test_cuda_caller_current_device_is_restored() -> None:
    before = torch.cuda.current_device()
    pipe = GPipe(make_mlp(), [8, 8], devices=_devices()[-2:], chunks=2)
    pipe(torch.randn(4, 6, dtype=torch.float64, device=pipe.devices[0]))
    assert torch.cuda.current_device() == before


class _Stream(torch.nn.Module):
    """The identity, noting the current CUDA stream each time it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.cuda.current_stream(x.device).stream_id)
        return x


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_every_stage_runs_on_the_callers_stream(schedule: str) -> None:
    layers = [_Stream() for _ in range(4)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())])
    pipe = GPipe(model, [2, 2, 2, 2], devices=_devices(), chunks=4, schedule=schedule)
    x = torch.randn(8, 6, device=pipe.devices[0])
    side = torch.cuda.Stream(pipe.devices[0])
    with torch.cuda.stream(side):
        pipe.train_step(x, torch.zeros(8, 6, device=pipe.devices[-1]), F.mse_loss)
    torch.cuda.synchronize()
    assert {s for layer in layers for s in layer.seen} == {side.stream_id}


@pytest.mark.parametrize("devices", [["cuda:0", "cpu"], ["cpu", "cuda:0"]])
def test_large_hand_offs_between_cpu_and_gpu_match_plain_training(devices: list[str]) -> None:
    # NOTE: 64 MiB per hand-off: a CPU stage reading a copy before it lands reads garbage.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh()
    ).double()
    plain = copy.deepcopy(model).cuda()
    x = torch.randn(4 * 32768, 256, dtype=torch.float64, device="cuda")
    F.mse_loss(plain(x), torch.zeros_like(x)).backward()
    pipe = GPipe(model, [2, 2], devices=devices, chunks=4)
    y = pipe(x.to(devices[0]))
    F.mse_loss(y, torch.zeros_like(y)).backward()
    assert_close(y.cuda(), plain(x).detach())
    for param, expected in zip(model.parameters(), plain.parameters()):
        assert_close(param.grad.cuda(), expected.grad)


def test_gpu_timeline_shows_when_the_gpu_ran_each_action() -> None:
    pipe = GPipe(make_mlp(width=512), [8, 8], devices=_devices()[:2], chunks=4)
    x = torch.randn(4096, 512, dtype=torch.float64, device=pipe.devices[0])
    pipe.train_step(x, torch.zeros(4096, 512, dtype=torch.float64, device=pipe.devices[-1]),
                    F.mse_loss)  # fmt: skip
    timeline = pipe.timeline
    events = [event for device in timeline.events for event in device]
    assert len(events) == 16
    assert all(0 <= event.start <= event.end for event in events)
    for device in timeline.events:  # one stream per GPU: its actions never overlap
        assert all(a.end <= b.start + 1e-6 for a, b in itertools.pairwise(device))


def test_the_timeline_of_a_forward_then_a_backward_keeps_each_gpus_order() -> None:
    """pipe(x), then loss.backward(): two runs of one step, each timed from its own start."""
    pipe = GPipe(make_mlp(width=512), [8, 8], devices=_devices()[:2], chunks=4)
    x = torch.randn(4096, 512, dtype=torch.float64, device=pipe.devices[0], requires_grad=True)
    y = pipe(x)
    F.mse_loss(y, torch.zeros_like(y)).backward()
    events = pipe.timeline.events
    assert sum(len(device) for device in events) == 16
    for device in events:
        assert all(0 <= a.start <= a.end <= b.start + 1e-6 for a, b in itertools.pairwise(device))


def test_cuda_memory_is_the_allocators_peak_of_the_last_step() -> None:
    pipe = GPipe(make_mlp(width=512), [8, 8], devices=_devices()[:2], chunks=4)
    x = torch.randn(4096, 512, dtype=torch.float64, device=pipe.devices[0])
    pipe.train_step(x, torch.zeros(4096, 512, dtype=torch.float64, device=pipe.devices[-1]),
                    F.mse_loss)  # fmt: skip
    held = max(event.memory for device in pipe.timeline.events for event in device)
    peaks = pipe.cuda_memory
    assert set(peaks) == {torch.device(d) for d in _devices()[:2]}
    assert sum(peaks.values()) >= held > 0


def test_the_stages_of_one_gpu_run_on_the_calling_thread_in_one_stream_order() -> None:
    """Four stages on cuda:0 are one lane: no thread of the pipe's own, and their actions,
    timed on the GPU, never overlap."""
    model = make_mlp(width=512)
    pipe = GPipe(model, [4, 4, 4, 4], devices=["cuda:0"] * 4, chunks=4, schedule="1f1b")
    x = torch.randn(4096, 512, dtype=torch.float64, device="cuda:0")
    target = torch.zeros(4096, 512, dtype=torch.float64, device="cuda:0")
    _, expected_loss, expected_grads, _ = reference_step(
        copy.deepcopy(model), x, target, F.mse_loss
    )
    loss = pipe.train_step(x, target, F.mse_loss)
    assert not pipe._stages.threads._threads
    assert_close(loss, expected_loss)
    assert_close([p.grad for p in model.parameters()], expected_grads)
    events = sorted((e for device in pipe.timeline.events for e in device), key=lambda e: e.start)
    assert all(a.end <= b.start + 1e-6 for a, b in itertools.pairwise(events))


def test_a_mixed_pipes_hand_offs_are_timed_by_the_gpu_that_copied_them() -> None:
    pipe = GPipe(make_mlp(width=512), [8, 8], devices=["cpu", "cuda:0"], chunks=4)
    x = torch.randn(4096, 512, dtype=torch.float64)
    pipe.train_step(x, torch.zeros(4096, 512, dtype=torch.float64, device="cuda:0"), F.mse_loss)
    timeline = pipe.timeline
    assert len(timeline.transfers) == 8  # 4 activations up, 4 gradients down
    received = {(e.action.kind, e.action.microbatch): e for e in timeline.events[1]}
    for transfer in timeline.transfers:
        assert 0 <= transfer.start <= transfer.end
        if transfer.kind == "F":  # the GPU stage's forward waited, on the GPU, for its copy
            assert transfer.end <= received["F", transfer.microbatch].start + 1e-3
