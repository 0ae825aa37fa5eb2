"""A pipelined step equals plain training: outputs, loss and every gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

from conftest import make_mlp, reference_step
from gpipe import GPipe

BALANCES = {"one_stage": [16], "even": [4, 4, 4, 4], "uneven": [1, 6, 2, 7]}


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("balance", list(BALANCES))
@pytest.mark.parametrize("batch", [8, 11])
def test_transparency_forward_backward(
    checkpoint: str, chunks: int, balance: str, batch: int
) -> None:
    torch.manual_seed(1)
    x = torch.randn(batch, 6, dtype=torch.float64, requires_grad=True)
    target = torch.randn(batch, 6, dtype=torch.float64)
    expected, expected_loss, expected_grads, expected_xgrad = reference_step(
        make_mlp(), x, target, F.mse_loss
    )

    model = make_mlp()
    pipe = GPipe(model, BALANCES[balance], chunks=chunks, checkpoint=checkpoint)
    output = pipe(x)
    loss = F.mse_loss(output, target)
    loss.backward()

    assert_close(output, expected)
    assert_close(loss, expected_loss)
    for param, grad in zip(model.parameters(), expected_grads):
        assert_close(param.grad, grad)
    assert_close(x.grad, expected_xgrad)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 3, 4, 8])
@pytest.mark.parametrize("balance", list(BALANCES))
@pytest.mark.parametrize("batch", [8, 11])
def test_transparency_train_step(checkpoint: str, chunks: int, balance: str, batch: int) -> None:
    torch.manual_seed(2)
    x = torch.randn(batch, 6, dtype=torch.float64)
    target = torch.randn(batch, 6, dtype=torch.float64)
    _, expected_loss, expected_grads, _ = reference_step(make_mlp(), x, target, F.mse_loss)

    model = make_mlp()
    pipe = GPipe(model, BALANCES[balance], chunks=chunks, checkpoint=checkpoint)
    loss = pipe.train_step(x, target, F.mse_loss)

    assert_close(loss, expected_loss)
    for param, grad in zip(model.parameters(), expected_grads):
        assert_close(param.grad, grad)


def test_train_step_sum_reduction_equals_whole_batch_sum() -> None:
    x = torch.randn(10, 6, dtype=torch.float64)
    target = torch.randn(10, 6, dtype=torch.float64)

    def loss_fn(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(y, t, reduction="sum")

    _, expected_loss, expected_grads, _ = reference_step(make_mlp(), x, target, loss_fn)
    model = make_mlp()
    pipe = GPipe(model, [8, 8], chunks=3)
    loss = pipe.train_step(x, target, loss_fn, reduction="sum")
    assert_close(loss, expected_loss)
    for param, grad in zip(model.parameters(), expected_grads):
        assert_close(param.grad, grad)


def test_train_step_equals_forward_then_backward() -> None:
    x = torch.randn(12, 6, dtype=torch.float64)
    target = torch.randint(0, 6, (12,))
    a, b = make_mlp(), make_mlp()
    pipe_a = GPipe(a, [5, 5, 6], chunks=4)
    pipe_b = GPipe(b, [5, 5, 6], chunks=4)
    loss_a = pipe_a.train_step(x, target, F.cross_entropy)
    loss_b = F.cross_entropy(pipe_b(x), target)
    loss_b.backward()
    assert_close(loss_a, loss_b.detach())
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_close(pa.grad, pb.grad)


def test_twenty_sgd_steps_follow_plain_training() -> None:
    torch.manual_seed(3)
    data = [
        (torch.randn(9, 6, dtype=torch.float64), torch.randn(9, 6, dtype=torch.float64))
        for _ in range(20)
    ]
    plain, piped = make_mlp(), make_mlp()
    pipe = GPipe(piped, [4, 4, 4, 4], chunks=4)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt_pipe = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    plain_losses, pipe_losses = [], []
    for x, target in data:
        opt_plain.zero_grad()
        loss = F.mse_loss(plain(x), target)
        loss.backward()
        opt_plain.step()
        plain_losses.append(loss.item())

        opt_pipe.zero_grad()
        pipe_losses.append(pipe.train_step(x, target, F.mse_loss).item())
        opt_pipe.step()
    assert_close(torch.tensor(pipe_losses), torch.tensor(plain_losses))
    assert pipe_losses[-1] < pipe_losses[0]


def test_gradients_accumulate_across_steps_like_plain_backward() -> None:
    x = torch.randn(6, 6, dtype=torch.float64)
    target = torch.randn(6, 6, dtype=torch.float64)
    plain, piped = make_mlp(), make_mlp()
    for _ in range(2):
        F.mse_loss(plain(x), target).backward()
    pipe = GPipe(piped, [8, 8], chunks=3)
    for _ in range(2):
        pipe.train_step(x, target, F.mse_loss)
    for pa, pb in zip(plain.parameters(), piped.parameters()):
        assert_close(pb.grad, pa.grad)


def test_frozen_layers_get_no_gradient_and_others_match() -> None:
    x = torch.randn(8, 6, dtype=torch.float64)
    target = torch.randn(8, 6, dtype=torch.float64)
    plain, piped = make_mlp(), make_mlp()
    for model in (plain, piped):
        for p in model[0].parameters():
            p.requires_grad_(False)
    F.mse_loss(plain(x), target).backward()
    GPipe(piped, [4, 4, 4, 4], chunks=4).train_step(x, target, F.mse_loss)
    assert piped[0].weight.grad is None
    for pa, pb in zip(plain.parameters(), piped.parameters()):
        if pa.requires_grad:
            assert_close(pb.grad, pa.grad)


def test_module_with_buffers_and_batchnorm_in_eval_matches() -> None:
    torch.manual_seed(4)

    def build() -> nn.Sequential:
        torch.manual_seed(4)
        return nn.Sequential(
            nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2)
        ).double()

    plain, piped = build().eval(), build().eval()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = GPipe(piped, [2, 2], chunks=4).eval()
    with torch.no_grad():
        assert_close(pipe(x), plain(x))
