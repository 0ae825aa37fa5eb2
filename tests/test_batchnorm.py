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
