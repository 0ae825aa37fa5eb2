"""train_step's microbatch_weight: losses that are not a plain mean over samples (padded tokens
ignored by cross_entropy) equal plain training on the whole batch."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

from gpipe import GPipe

VOCAB, WIDTH, PAD = 11, 6, -100


class Tokens(nn.Module):
    """A tiny token model: embedding, a mixing layer, a head; (N, T) -> (N, T, VOCAB)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        Tokens(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCAB)
    ).double()


def token_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=PAD)


def real_tokens(target: torch.Tensor) -> torch.Tensor:
    return (target != PAD).sum()


def _padded_batch(all_padding_rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """8 sequences of length 5 with 1 to 5 real tokens each (the rest is padding)."""
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (8, 5))
    target = torch.randint(0, VOCAB, (8, 5))
    lengths = torch.tensor([5, 1, 2, 5, 3, 1, 4, 2])
    target[torch.arange(5).expand(8, 5) >= lengths[:, None]] = PAD
    if all_padding_rows is not None:
        target[all_padding_rows] = PAD
    return ids, target


def _plain(ids: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = _model()
    loss = token_loss(model(ids), target)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("chunks", [2, 4, 8])
def test_token_weighted_micro_batches_equal_plain_training_on_padded_sequences(
    schedule: str, chunks: int
) -> None:
    ids, target = _padded_batch()
    expected_loss, expected_grads = _plain(ids, target)
    model = _model()
    pipe = GPipe(model, [2, 2], chunks=chunks, schedule=schedule)
    loss = pipe.train_step(ids, target, token_loss, microbatch_weight=real_tokens)
    assert_close(loss, expected_loss)
    for param, grad in zip(model.parameters(), expected_grads):
        assert_close(param.grad, grad)
    # why the argument exists: weighting by samples is another loss on padded batches
    by_samples = GPipe(_model(), [2, 2], chunks=chunks).train_step(ids, target, token_loss)
    assert not torch.allclose(by_samples, expected_loss)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_micro_batch_of_padding_only_contributes_nothing_and_no_nan(checkpoint: str) -> None:
    ids, target = _padded_batch(all_padding_rows=slice(2, 4))  # micro-batch 1 of 4: all padding
    assert math.isnan(token_loss(_model()(ids[2:4]), target[2:4]).item())
    expected_loss, expected_grads = _plain(ids, target)
    model = _model()
    pipe = GPipe(model, [2, 2], chunks=4, checkpoint=checkpoint)
    loss = pipe.train_step(ids, target, token_loss, microbatch_weight=real_tokens)
    assert_close(loss, expected_loss)
    for param, grad in zip(model.parameters(), expected_grads):
        assert_close(param.grad, grad)


def test_python_number_weights_are_accepted() -> None:
    ids, target = _padded_batch()
    expected_loss, _ = _plain(ids, target)
    loss = GPipe(_model(), [2, 2], chunks=4).train_step(
        ids, target, token_loss, microbatch_weight=lambda t: int((t != PAD).sum())
    )
    assert_close(loss, expected_loss)


@pytest.mark.parametrize(
    ("weight", "error", "match"),
    [
        (lambda t: -1.0, ValueError, r"micro-batch 0 .* -1\.0.*>= 0"),
        (lambda t: float("nan"), ValueError, "finite"),
        (lambda t: float("inf"), ValueError, "finite"),
        (lambda t: 0, ValueError, "every micro-batch has weight 0"),
        (lambda t: (t != PAD).sum(1), TypeError, r"a number or a 0-dim tensor.*shape \(2,\)"),
        (lambda t: "two", TypeError, "a number or a 0-dim tensor"),
    ],
)
def test_bad_weights_name_the_fix(weight, error: type, match: str) -> None:
    ids, target = _padded_batch()
    model = _model()
    pipe = GPipe(model, [2, 2], chunks=4)
    with pytest.raises(error, match=match):
        pipe.train_step(ids, target, token_loss, microbatch_weight=weight)
    assert all(p.grad is None for p in model.parameters())  # refused before any work


def test_weight_with_sum_reduction_is_refused() -> None:
    ids, target = _padded_batch()
    pipe = GPipe(_model(), [2, 2], chunks=4)
    with pytest.raises(ValueError, match="reduction='mean'"):
        pipe.train_step(ids, target, token_loss, reduction="sum", microbatch_weight=real_tokens)
