"""Dropout in a pipeline: one random stream per (stage, micro-batch), replayed exactly."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from conftest import make_mlp
from gpipe import GPipe
from gpipe.randomness import draw_step_seed, stream_seed


def _grads_after_step(checkpoint: str, seed: int, *, via: str = "train_step") -> list[torch.Tensor]:
    model = make_mlp(6, width=16, dropout=0.5)
    pipe = GPipe(model, [3, 6, 6, 3], chunks=4, checkpoint=checkpoint)
    x = torch.linspace(-1, 1, 32 * 16, dtype=torch.float64).view(32, 16)
    target = torch.zeros(32, 16, dtype=torch.float64)
    torch.manual_seed(seed)
    if via == "train_step":
        pipe.train_step(x, target, F.mse_loss)
    else:
        F.mse_loss(pipe(x), target).backward()
    return [p.grad.clone() for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_same_seed_gives_bitwise_identical_gradients_across_runs() -> None:
    runs = [_grads_after_step("never", seed=7) for _ in range(4)]
    assert all(_equal(runs[0], run) for run in runs[1:])


def test_different_seeds_draw_different_masks() -> None:
    assert not _equal(_grads_after_step("never", seed=7), _grads_after_step("never", seed=8))


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_recomputation_replays_the_same_dropout_masks(checkpoint: str) -> None:
    assert _equal(_grads_after_step(checkpoint, seed=3), _grads_after_step("never", seed=3))


def test_forward_backward_and_train_step_draw_the_same_masks() -> None:
    torch.testing.assert_close(
        _grads_after_step("always", seed=5, via="call"), _grads_after_step("never", seed=5)
    )


def test_only_stages_that_draw_random_numbers_are_serialized() -> None:
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 4), nn.Tanh())
    pipe = GPipe(model, [2, 2], chunks=2)
    pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), F.mse_loss)
    assert pipe._stages.draws_random == {(0, True): True, (1, True): False}


def test_pipeline_leaves_the_global_stream_as_one_seed_draw_would() -> None:
    pipe = GPipe(make_mlp(4, dropout=0.5), [6, 6], chunks=3)
    torch.manual_seed(11)
    pipe.train_step(
        torch.randn(6, 6, dtype=torch.float64), torch.zeros(6, 6, dtype=torch.float64), F.mse_loss
    )
    after_step = torch.rand(3)
    torch.manual_seed(11)
    torch.randn(6, 6, dtype=torch.float64)
    draw_step_seed()
    assert torch.equal(after_step, torch.rand(3))


def test_stream_seeds_differ_per_stage_and_microbatch() -> None:
    seeds = {stream_seed(123, stage, mb) for stage in range(8) for mb in range(64)}
    assert len(seeds) == 8 * 64
    assert all(0 <= s < 2**63 for s in seeds)
