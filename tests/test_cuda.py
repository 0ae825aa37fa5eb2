"""On GPUs: stages on several CUDA devices give the gradients of plain training.

These need CUDA; on a machine without a GPU they are skipped (CPU runs cover the rest).
"""

from __future__ import annotations

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
