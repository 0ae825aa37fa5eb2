"""Zero-bubble's split backward: B then W give exactly the gradients of one backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe.runtime.split_backward import backward_input, backward_weight


class Tied(nn.Module):
    """One weight used twice, once before and once after another layer."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(5, 5)
        self.middle = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(torch.tanh(self.middle(torch.tanh(self.shared(x)))))


class ParamOnlyOutput(nn.Module):
    """Two outputs, one of which depends on parameters alone."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 5)
        self.bias = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), self.bias.exp() * 2


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 5), nn.LayerNorm(5))


@pytest.mark.parametrize("build", [_mlp, Tied, ParamOnlyOutput], ids=["mlp", "tied", "param_only"])
def test_b_then_w_equals_one_backward(build: type) -> None:
    torch.manual_seed(0)
    module = build().double()
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    outputs = module(x)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = [torch.randn_like(o) for o in outputs]
    torch.autograd.backward(outputs, grads, retain_graph=True)
    expected = [p.grad.clone() for p in module.parameters()]
    expected_x = x.grad.clone()
    module.zero_grad(set_to_none=True)

    params = list(module.parameters())
    found, later = backward_input(list(zip(outputs, grads)), [x], params)
    assert all(p.grad is None for p in params)  # B touched no weight gradient
    torch.testing.assert_close(found[0], expected_x)
    backward_weight(later)
    for param, grad in zip(params, expected):
        torch.testing.assert_close(param.grad, grad)


def test_w_does_no_work_b_already_did() -> None:
    calls = {"input": 0}

    class Count(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            calls["input"] += 1
            return grad

    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    second(first(x)).sum().backward()  # the plain backward, for reference
    expected = [p.grad.clone() for p in (*first.parameters(), *second.parameters())]
    first.zero_grad(set_to_none=True)
    second.zero_grad(set_to_none=True)
    out = second(Count.apply(first(x)))
    _, later = backward_input(
        [(out, torch.ones_like(out))], [x], [*first.parameters(), *second.parameters()]
    )
    assert calls["input"] == 1
    backward_weight(later)
    assert calls["input"] == 1  # W resumed at the forks; the input path did not run again
    for param, grad in zip((*first.parameters(), *second.parameters()), expected):
        torch.testing.assert_close(param.grad, grad)


def test_stage_without_input_gradient_leaves_everything_to_w() -> None:
    linear = nn.Linear(3, 3)
    out = linear(torch.randn(2, 3))
    found, later = backward_input([(out, torch.ones_like(out))], [], list(linear.parameters()))
    assert found == [] and linear.weight.grad is None
    backward_weight(later)
    torch.testing.assert_close(linear.bias.grad, torch.full((3,), 2.0))
