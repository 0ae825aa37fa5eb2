"""A dropout module the model calls twice draws two independent masks in a split model, as
in plain PyTorch (T5's ``T5Stack.dropout``), the same whatever the layout, schedule and
checkpoint mode, and replayed exactly by recomputation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gpipe
from ranks import check, launch

WIDTH = 64


class TwiceDropped(nn.Module):
    """``drop`` runs after ``first`` and again after ``second``."""

    def __init__(self, identity: bool = False) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.5)
        self.second = nn.Linear(WIDTH, WIDTH)
        if identity:
            with torch.no_grad():
                for linear in (self.first, self.second):
                    linear.weight.copy_(torch.eye(WIDTH))
                    linear.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.first(x))
        return self.drop(self.second(h))


def _model(identity: bool = False) -> TwiceDropped:
    torch.manual_seed(0)
    return TwiceDropped(identity).double()


def _input() -> torch.Tensor:
    return torch.rand(8, WIDTH, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _pipe(model: nn.Module, points: list[str], **options) -> gpipe.GPipe:
    stages = gpipe.split(model, split_points=points, example_inputs=(_input(),))
    return gpipe.GPipe(stages, chunks=2, **options)


def _dropped(output: torch.Tensor) -> float:
    return float((output == 0).double().mean())


@pytest.mark.parametrize("points", [[], ["second"]], ids=["one stage", "two stages"])
def test_two_calls_of_one_dropout_draw_independent_masks_as_in_plain_pytorch(points) -> None:
    # identity layers: the output is zero where either call dropped; one mask drawn twice
    # would drop half, two independent masks drop three quarters
    torch.manual_seed(3)
    plain = _dropped(_model(identity=True)(_input()))
    torch.manual_seed(3)
    piped = _dropped(_pipe(_model(identity=True), points)(_input()))
    assert 0.68 < plain < 0.82
    assert 0.68 < piped < 0.82, piped


def two_ranks(schedule: str) -> dict[str, torch.Tensor]:
    """On each of 2 ranks (see ranks.py): one call of ``drop`` per rank."""
    import gpipe.distributed as gd

    model = _model()
    stages = gpipe.split(model, split_points=["second"], example_inputs=(_input(),))
    pipe = gd.DistributedGPipe(stages, chunks=2, schedule=schedule, timeout=30)
    torch.manual_seed(5)
    pipe.train_step(_input(), torch.zeros(8, WIDTH, dtype=torch.float64), F.mse_loss)
    grads = {n: p.grad for n, p in model.named_parameters() if not p.is_meta}
    pipe.close()
    return grads


@pytest.mark.timeout(240)
def test_two_ranks_draw_the_masks_of_a_twice_called_dropout_as_one_process_does() -> None:
    expected = dict(
        zip([n for n, _ in _model().named_parameters()], _gradients([], "gpipe", "never"))
    )
    results = check(launch("test_split_dropout:two_ranks", 2, schedule="1f1b"))
    assert set(results[0]) == {"first.weight", "first.bias"}
    for result in results:
        for name, grad in result.items():
            assert torch.equal(grad, expected[name]), name


def _gradients(points: list[str], schedule: str, checkpoint: str) -> list[torch.Tensor]:
    model = _model()
    pipe = _pipe(model, points, schedule=schedule, checkpoint=checkpoint)
    target = torch.zeros(8, WIDTH, dtype=torch.float64)
    torch.manual_seed(5)
    pipe.train_step(_input(), target, F.mse_loss)
    return [p.grad for p in model.parameters()]


def test_a_twice_called_dropout_draws_the_same_masks_under_every_layout() -> None:
    expected = _gradients([], "gpipe", "never")
    for points, schedule, checkpoint in [
        (["second"], "gpipe", "always"),
        (["second"], "1f1b", "except_last"),
        (["drop", "second"], "zb-h1", "always"),
    ]:
        got = _gradients(points, schedule, checkpoint)
        for ours, theirs in zip(got, expected):
            assert torch.equal(ours, theirs), (points, schedule, checkpoint)
