"""GPipe over a skippable Sequential trains as plain PyTorch, and each skip is sent directly.

Every schedule and checkpoint mode, float64: the loss, the outputs and every gradient equal
plain training of the same model; a skip across three stages is one transfer per micro-batch
from the stage stashing it to the stage popping it; no skip outlives its step.
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

from gpipe import GPipe
from gpipe.skip import Namespace, pop, skippable, stash

WIDTH = 5


@skippable(stash=["down"])
class Down(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("down", x)
        return torch.tanh(self.linear(x))


@skippable(pop=["down"])
class Up(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        down = yield pop("down")
        return self.linear(torch.cat([x, down], dim=-1))


def unet(dropout: float = 0.0) -> nn.Sequential:
    """Eight layers, two nested skips: the outer one from layer 0 to 7, the inner 2 to 5."""
    torch.manual_seed(0)
    outer, inner = Namespace(), Namespace()
    return nn.Sequential(
        Down().isolate(outer),
        nn.Linear(WIDTH, WIDTH),
        Down().isolate(inner),
        nn.Dropout(dropout) if dropout else nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        Up().isolate(inner),
        nn.Linear(WIDTH, WIDTH),
        Up().isolate(outer),
    ).double()


# (schedule, virtual stages, balance): four model stages in every case, so the outer skip
# crosses three stages, the inner one a single cut.
SCHEDULES = [
    ("gpipe", 1, [2, 2, 2, 2]),
    ("1f1b", 1, [2, 2, 2, 2]),
    ("interleaved", 2, [2, 2, 2, 2]),
    ("zb-h1", 1, [2, 2, 2, 2]),
    ("zb-h2", 1, [2, 2, 2, 2]),
    ("zb-v", 2, [2, 2, 2, 2]),
    ("auto", 1, [1, 3, 2, 2]),
]
CHECKPOINTS = ["always", "except_last", "never"]


def _batch(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n, WIDTH, dtype=torch.float64, generator=generator)
    return x, torch.randn(n, WIDTH, dtype=torch.float64, generator=generator)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize(("schedule", "v", "balance"), SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_train_step_equals_plain_training(
    schedule: str, v: int, balance: list[int], checkpoint: str
) -> None:
    model, plain = unet(), unet()
    x, target = _batch()
    expected = F.mse_loss(plain(x), target)
    expected.backward()

    pipe = GPipe(
        model,
        balance,
        devices=["cpu"] * (len(balance) // v),
        chunks=3,
        checkpoint=checkpoint,
        schedule=schedule,
        virtual_stages=v,
    )
    loss = pipe.train_step(x, target, F.mse_loss)

    assert_close(loss, expected.detach())
    assert _grads(model).keys() == _grads(plain).keys() and len(_grads(model)) == 14
    for name, grad in _grads(plain).items():
        assert_close(_grads(model)[name], grad, msg=name)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_forward_and_backward_equal_plain_outputs_and_gradients(checkpoint: str) -> None:
    model, plain = unet(), unet()
    x, _ = _batch()
    x_pipe = x.clone().requires_grad_()
    x_plain = x.clone().requires_grad_()
    expected = plain(x_plain)
    expected.pow(3).sum().backward()

    pipe = GPipe(model, [2, 2, 2, 2], chunks=4, checkpoint=checkpoint)
    output = pipe(x_pipe)
    output.pow(3).sum().backward()

    assert_close(output, expected)
    assert_close(x_pipe.grad, x_plain.grad)
    for name, grad in _grads(plain).items():
        assert_close(_grads(model)[name], grad, msg=name)


def test_dropout_draws_the_same_masks_whatever_the_stages() -> None:
    x, target = _batch()
    results = []
    for balance in ([8], [2, 2, 2, 2], [1, 4, 3]):
        model = unet(dropout=0.5)
        pipe = GPipe(model, balance, chunks=3, checkpoint="always")
        torch.manual_seed(7)  # the step seed
        loss = pipe.train_step(x, target, F.mse_loss)
        results.append((loss, _grads(model)))
    for loss, grads in results[1:]:
        assert_close(loss, results[0][0])
        for name, grad in grads.items():
            assert_close(grad, results[0][1][name], msg=name)


def test_a_skip_across_three_stages_is_one_transfer_per_microbatch() -> None:
    pipe = GPipe(unet(), [2, 2, 2, 2], chunks=3)
    x, target = _batch()
    pipe.train_step(x, target, F.mse_loss)
    sent = Counter(
        (t.kind, t.sender, t.stage)
        for t in pipe.timeline.transfers
        if t.sender is not None and t.sender >= 0
    )
    # Forward: the chain 0 -> 1 -> 2 -> 3 (the inner skip rides with the chain 1 -> 2, the
    # one message stage 2 reads from stage 1) and the outer skip straight 0 -> 3, never
    # through stages 1 and 2: one message per micro-batch each. Backward, the same reversed.
    assert sent == {
        ("F", 0, 1): 3,
        ("F", 1, 2): 3,
        ("F", 2, 3): 3,
        ("F", 0, 3): 3,
        ("B", 3, 2): 3,
        ("B", 2, 1): 3,
        ("B", 1, 0): 3,
        ("B", 3, 0): 3,
    }


stashed: list[weakref.ref[torch.Tensor]] = []


@skippable(stash=["skip"])
class StashDouble(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        skip = x * 2
        stashed.append(weakref.ref(skip))
        yield stash("skip", skip)
        return x


@skippable(pop=["skip"])
class PopAdd(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return x + skip


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_no_skip_outlives_the_step(checkpoint: str) -> None:
    stashed.clear()
    model = nn.Sequential(StashDouble(), nn.Linear(3, 3), PopAdd()).double()
    pipe = GPipe(model, [1, 1, 1], chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 3, dtype=torch.float64)
    pipe(x).norm().backward()
    pipe.train_step(x, x, F.mse_loss)
    with torch.no_grad():
        pipe(x)
    gc.collect()
    assert len(stashed) >= 6
    assert all(ref() is None for ref in stashed)


def test_unpaired_skips_and_a_measured_balance_are_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match="as poppable but stashed"):
        GPipe(nn.Sequential(StashDouble(), nn.Identity()), [1, 1])
    with pytest.raises(ValueError, match=r"balance as a list.*balance_by_params"):
        GPipe(nn.Sequential(StashDouble(), PopAdd()), "time", sample=torch.zeros(2, 3))
