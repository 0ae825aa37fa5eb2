"""A second backward through ``pipe(x)``'s output behaves as in plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from conftest import make_mlp
from gpipe import GPipe

CHECKPOINTS = ["never", "except_last", "always"]


def two_backwards(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Two different losses of one output, the first keeping the graph: grads add up."""
    y = model(x)
    y.sum().backward(retain_graph=True)
    y.pow(2).sum().backward()
    return y.detach()


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_retain_graph_then_a_second_backward_accumulates_as_plain_pytorch(
    checkpoint: str,
) -> None:
    x = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    plain = make_mlp(4)
    expected_y = two_backwards(plain, x)
    expected = [p.grad.clone() for p in plain.parameters()]
    expected_x, x.grad = x.grad.clone(), None

    model = make_mlp(4)
    pipe = GPipe(model, [2, 4, 2], chunks=4, checkpoint=checkpoint)
    assert_close(two_backwards(pipe, x), expected_y)
    for param, grad in zip(model.parameters(), expected):
        assert_close(param.grad, grad)
    assert_close(x.grad, expected_x)


def test_a_retained_graph_replays_dropout_when_it_recomputes() -> None:
    x = torch.randn(8, 6, dtype=torch.float64)
    grads = {}
    for checkpoint in ("never", "always"):
        model = make_mlp(4, dropout=0.5)
        pipe = GPipe(model, [3, 6, 3], chunks=4, checkpoint=checkpoint)
        torch.manual_seed(1)
        two_backwards(pipe, x)
        grads[checkpoint] = [p.grad for p in model.parameters()]
    for kept, recomputed in zip(grads["never"], grads["always"]):
        assert_close(recomputed, kept)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_a_second_backward_without_retain_graph_fails_as_in_plain_pytorch(
    checkpoint: str,
) -> None:
    x = torch.randn(4, 6, dtype=torch.float64)
    plain = make_mlp(2)(x).sum()
    plain.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time") as info:
        plain.backward()
    expected = type(info.value)

    pipe = GPipe(make_mlp(2), [2, 2], chunks=2, checkpoint=checkpoint)
    loss = pipe(x).sum()
    loss.backward()
    with pytest.raises(expected, match="backward through the graph a second time"):
        loss.backward()


def test_after_the_last_backward_nothing_is_kept_for_another() -> None:
    pipe = GPipe(make_mlp(2), [2, 2], chunks=2, checkpoint="never")
    y = pipe(torch.randn(4, 6, dtype=torch.float64))
    step = pipe._last[0] if pipe._last else None
    assert step is not None
    y.sum().backward(retain_graph=True)
    assert sorted(step.state.saved) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # kept for another
    y.sum().backward()
    assert step.state.saved == {}  # freed, as a plain graph is


def test_a_double_backward_is_refused_instead_of_giving_undifferentiable_gradients() -> None:
    x = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    model = make_mlp(2)
    pipe = GPipe(model, [2, 2], chunks=2)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(pipe(x).sum(), x, create_graph=True)  # a gradient penalty's first half
    model.zero_grad()
    (gradient,) = torch.autograd.grad(pipe(x).sum(), x)  # the pipe still works afterwards
    plain = make_mlp(2)
    assert_close(gradient, torch.autograd.grad(plain(x).sum(), x)[0])
