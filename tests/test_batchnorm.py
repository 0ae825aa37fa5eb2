"""Deferred batch norm: running statistics as plain training on the whole mini-batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

from gpipe import GPipe
from gpipe.batchnorm import DeferredBatchNorm


def _model(momentum: float | None = 0.1) -> nn.Sequential:
    # NOTE: one BatchNorm layer: a later one would see inputs normalized per micro-batch,
    # which differ from the whole batch's, so only the first can match plain training.
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8), nn.BatchNorm1d(8, momentum=momentum), nn.Tanh(), nn.Linear(8, 8)]
    return nn.Sequential(*layers, nn.Tanh()).double()


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_running_statistics_equal_plain_training_on_the_whole_batch(
    checkpoint: str, schedule: str, momentum: float | None
) -> None:
    plain, piped = _model(momentum), _model(momentum)
    pipe = GPipe(
        piped, [2, 3], chunks=4, checkpoint=checkpoint, schedule=schedule, deferred_batch_norm=True
    )
    assert isinstance(piped[1], DeferredBatchNorm)
    for step in range(3):
        x = torch.randn(12, 6, dtype=torch.float64) * (step + 1)
        target = torch.randn(12, 8, dtype=torch.float64)
        F.mse_loss(plain(x), target).backward()
        pipe.train_step(x, target, F.mse_loss)
    assert_close(piped[1].running_mean, plain[1].running_mean)
    assert_close(piped[1].running_var, plain[1].running_var)
    assert int(piped[1].num_batches_tracked) == 3


def test_forward_call_commits_once_per_batch_and_eval_uses_the_running_statistics() -> None:
    plain, piped = _model(), _model()
    pipe = GPipe(piped, [2, 3], chunks=3, deferred_batch_norm=True)
    x = torch.randn(9, 6, dtype=torch.float64)
    plain(x)
    pipe(x).sum().backward()  # the backward recomputes: it must count nothing more
    assert_close(piped[1].running_mean, plain[1].running_mean)
    assert_close(piped[1].running_var, plain[1].running_var)
    plain.eval()
    pipe.eval()
    with torch.no_grad():
        assert_close(pipe(x), plain(x))


def test_without_deferral_running_statistics_update_per_micro_batch_and_recomputation() -> None:
    x, target = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    for checkpoint, updates in (("never", 4), ("except_last", 4 + 3)):
        pipe = GPipe(_model(), [2, 3], chunks=4, checkpoint=checkpoint)
        pipe.train_step(x, target, F.mse_loss)
        assert int(pipe[1].num_batches_tracked) == updates


class _FailsAt(nn.Module):
    """Raises in the forward (or the backward) of one micro-batch, while ``armed``."""

    def __init__(self, microbatch: int, when: str = "forward") -> None:
        super().__init__()
        self.microbatch, self.when, self.armed, self.calls = microbatch, when, True, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index, self.calls = self.calls, self.calls + 1
        if self.armed and index == self.microbatch:
            if self.when == "forward":
                raise ArithmeticError("planned failure")
            return _RaiseInBackward.apply(x)
        return x


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise ArithmeticError("planned failure")


def _clean_run(batches: list[torch.Tensor]) -> nn.Sequential:
    plain = _model()
    for x in batches:
        plain(x)
    return plain


@pytest.mark.parametrize("when", ["forward", "backward"])
@pytest.mark.parametrize("call", ["pipe", "train_step"])
def test_a_step_that_raised_leaves_no_partial_statistics_behind(when: str, call: str) -> None:
    model = nn.Sequential(*_model(), _FailsAt(2, when))
    pipe = GPipe(model, [2, 4], chunks=4, checkpoint="never", deferred_batch_norm=True)
    failed, clean = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    target = torch.zeros(8, 8, dtype=torch.float64)
    with pytest.raises(ArithmeticError, match="planned failure"):
        if call == "pipe":
            pipe(failed).sum().backward()
        else:
            pipe.train_step(failed, target, F.mse_loss)
    model[-1].armed = False
    pipe.train_step(clean, target, F.mse_loss)
    # pipe(x) commits after its forwards, as plain training updates them in the forward: a
    # failed backward comes too late to undo that; a failed forward commits nothing
    committed = [failed, clean] if (call, when) == ("pipe", "backward") else [clean]
    plain = _clean_run(committed)
    assert_close(model[1].running_mean, plain[1].running_mean)
    assert_close(model[1].running_var, plain[1].running_var)
    assert int(model[1].num_batches_tracked) == len(committed)


def test_forward_without_backward_and_eval_steps_keep_the_statistics_of_plain_training() -> None:
    model = _model()
    pipe = GPipe(model, [2, 3], chunks=3, deferred_batch_norm=True)
    batches = [torch.randn(9, 6, dtype=torch.float64) for _ in range(2)]
    pipe(batches[0])  # interrupted: no backward ever runs
    pipe.eval()
    with torch.no_grad():
        pipe(torch.randn(9, 6, dtype=torch.float64) * 100)
    pipe.train()
    pipe(batches[1]).sum().backward()
    plain = _clean_run(batches)
    assert_close(model[1].running_mean, plain[1].running_mean)
    assert_close(model[1].running_var, plain[1].running_var)
    assert int(model[1].num_batches_tracked) == 2
