"""In-place ops on a stage's input, anywhere in the stage, train exactly like plain PyTorch.

A stage whose forward writes into its input gets a private copy of it: its first forward in
each mode runs on a copy and watches the copy's version counter. Without that, a checkpointed
micro-batch would recompute from an input its first forward already changed (wrong
gradients, silently), and micro-batches cut from one batch, which share a version counter,
would trip each other's saved tensors.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

from gpipe import GPipe


class AddInPlace(nn.Module):
    """``x += b``: not idempotent, so applying it twice shows."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.linspace(-1, 1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x += self.b
        return x


class View(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], 2, 2)


class ScaleInPlace(nn.Module):
    """Writes through a view of the stage input: ``x.mul_(1.5)`` on a reshaped input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(1.5).flatten(1)


def _block(where: str) -> list[nn.Module]:
    """A stage's opening layers that write into the stage input: as its first layer, or in
    its second layer through a view made by the first."""
    if where == "first":
        return [AddInPlace(), nn.Linear(4, 4)]
    return [View(), ScaleInPlace(), nn.Linear(4, 4)]


def _model(where: str) -> nn.Sequential:
    torch.manual_seed(0)
    # NOTE: no Tanh right before a writing block: Tanh saves its output for its backward, so
    # plain PyTorch itself would fail when the next layer writes into it
    layers = [*_block(where), nn.Linear(4, 4), *_block(where), nn.Tanh(), nn.Linear(4, 2)]
    return nn.Sequential(*layers).double()


def _balance(where: str) -> list[int]:
    # each of the two stages starts with the writing block
    return [3, 4] if where == "first" else [4, 5]


def _plain(where: str, x: torch.Tensor, target: torch.Tensor, input_grad: bool) -> tuple:
    model = _model(where)
    x = x.detach().clone().requires_grad_(input_grad)
    start = x * 1 if x.requires_grad else x  # plain PyTorch refuses in-place ops on a leaf
    loss = F.mse_loss(model(start), target)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], x.grad if input_grad else None


@pytest.mark.parametrize("where", ["first", "middle"])
@pytest.mark.parametrize("input_grad", [False, True], ids=["batch", "batch_requires_grad"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("call", ["pipe", "train_step"])
def test_in_place_op_on_a_stage_input_equals_plain_training(
    where: str, input_grad: bool, checkpoint: str, call: str
) -> None:
    torch.manual_seed(1)
    x = torch.randn(9, 4, dtype=torch.float64)
    target = torch.randn(9, 2, dtype=torch.float64)
    expected_loss, expected_grads, expected_x_grad = _plain(where, x, target, input_grad)

    model = _model(where)
    pipe = GPipe(model, _balance(where), chunks=3, checkpoint=checkpoint)
    leaf = x.clone().requires_grad_(input_grad)
    for _ in range(2):  # the first step learns which stages write; the second copies
        model.zero_grad()
        leaf.grad = None
        batch = leaf * 1 if input_grad else leaf
        if call == "pipe":
            loss = F.mse_loss(pipe(batch), target)
            loss.backward()
        else:
            loss = pipe.train_step(batch, target, F.mse_loss)
        assert_close(loss.detach(), expected_loss)
        for param, grad in zip(model.parameters(), expected_grads):
            assert_close(param.grad, grad)
        if input_grad:
            assert_close(leaf.grad, expected_x_grad)
        assert torch.equal(batch, x)  # the pipe never writes into the caller's batch


def test_stage_that_writes_gets_a_copy_and_others_do_not() -> None:
    model = _model("first")
    pipe = GPipe(model, [2, 1, 4], chunks=2)
    pipe.train_step(torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2), F.mse_loss)
    # stages: [AddInPlace, Linear], [Linear], [AddInPlace, Linear, Tanh, Linear]
    assert pipe._stages.copies_input == {(0, True): True, (1, True): False, (2, True): True}


def test_in_place_op_on_the_input_under_no_grad_leaves_the_batch_alone() -> None:
    model = _model("first")
    pipe = GPipe(model, [3, 4], chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    kept = x.clone()
    with torch.no_grad():
        out = pipe(x)
        assert_close(out, model(kept.clone()))
    assert torch.equal(x, kept)


def test_torchgpipe_incorrect_gradient_case_is_correct() -> None:
    """torchgpipe's known bug (its test_inplace_incorrect_grad, an xfail): a non-idempotent
    in-place op on an input that needs no gradient was applied twice under checkpointing."""

    class M(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            foo, bar = pair
            bar.add_(1)
            return foo * bar

    foo = torch.tensor([1.0], requires_grad=True)
    bar = torch.tensor([1.0])
    GPipe(nn.Sequential(M()), [1], checkpoint="always")((foo, bar)).backward()
    assert foo.grad.item() == 2.0


def test_a_write_that_only_some_inputs_trigger_stops_the_step_clearly() -> None:
    class WritesNegatives(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if (x < 0).any():
                x.clamp_(min=0)
            return x * 2

    class Half(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x / 2

    pipe = GPipe(nn.Sequential(Half(), WritesNegatives()), [1, 1], checkpoint="always")
    positive = torch.ones(2, 2, requires_grad=True)
    pipe(positive).sum().backward()  # first forward: no write, so stage 1 is not copied
    with pytest.raises(RuntimeError, match=r"stage 1 wrote into its input.*run the step again"):
        pipe.train_step(torch.full((2, 2), -5.0), torch.zeros(2, 2), F.mse_loss)
    assert pipe._stages.copies_input[(1, True)]


def test_a_first_forward_under_inference_mode_teaches_nothing() -> None:
    """Inference tensors keep no version counter: the next forward must still probe."""
    x = torch.randn(6, 4, dtype=torch.float64)
    target = torch.randn(6, 2, dtype=torch.float64)
    expected_loss, expected_grads, _ = _plain("first", x, target, False)
    model = _model("first")
    pipe = GPipe(model, [7], chunks=2, checkpoint="always")  # stage 0 runs on this thread
    with torch.inference_mode():
        pipe(torch.randn(6, 4, dtype=torch.float64))
    assert pipe._stages.copies_input == {}
    assert_close(pipe.train_step(x, target, F.mse_loss), expected_loss)
    for param, grad in zip(model.parameters(), expected_grads):
        assert_close(param.grad, grad)
