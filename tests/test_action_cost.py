"""What the runtime does per action: the bookkeeping each action pays stays what it needs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe import GPipe
from gpipe.randomness import streams as streams_module
from gpipe.randomness.generators import WorkerGenerators
from gpipe.runtime import backward as backward_module


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())


def _count(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    calls = [0]
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_each_stage_forward_reads_the_generators_once_after_a_runs_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe = GPipe(_model(), [2, 2], devices=["cpu", "cpu"], chunks=4, checkpoint="never")
    pipe.train_step(x, y, F.mse_loss)  # the first step probes every layer
    reads = _count(monkeypatch, WorkerGenerators, "read")
    pipe.train_step(x, y, F.mse_loss)
    # 8 stage forwards, each watched: one read after each, and one before each device's
    # first forward of the run (later ones start from where the last one ended)
    assert reads[0] == 8 + 2


def test_a_draw_between_runs_is_not_taken_for_a_layer_that_started_drawing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(8, 4, requires_grad=True)
    pipe = GPipe(_model(), [2, 2], devices=["cpu", "cpu"], chunks=4, checkpoint="always")
    pipe(x).sum().backward()  # probes
    redos = [0]
    settled = streams_module.StageForward.settled

    def counted(self: Any) -> bool:
        stands = settled(self)
        redos[0] += not stands
        return stands

    monkeypatch.setattr(streams_module.StageForward, "settled", counted)
    output = pipe(x)
    torch.rand(3)  # the caller draws between the forwards and the recomputations
    output.sum().backward()
    assert redos[0] == 0


def test_a_stage_backward_of_plain_tensors_calls_the_engine_directly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _model()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    model.double()
    pipe = GPipe(model, [2, 2], devices=["cpu", "cpu"], chunks=4, checkpoint="never")
    wrapper = _count(monkeypatch, backward_module.torch.autograd, "backward")
    loss = pipe.train_step(x, y, F.mse_loss)
    assert wrapper[0] == 0
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    monkeypatch.undo()
    expected = F.mse_loss(model(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(grads, [p.grad for p in model.parameters()])


def test_a_loss_that_is_not_a_scalar_is_refused_naming_loss_fn_and_the_fix() -> None:
    # plain backward refuses it too, but from inside an action, in torch's words
    pipe = GPipe(_model(), [2, 2], devices=["cpu", "cpu"], chunks=2, checkpoint="never")
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar.*\(2, 4\).*'none'"):
        pipe.train_step(x, y, lambda out, target: (out - target) ** 2)
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar.*'none'"):
        pipe.train_step(x, y, nn.MSELoss(reduction="none"))
