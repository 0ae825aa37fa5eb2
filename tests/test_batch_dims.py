"""Inputs and outputs whose batch is not dim 0 (an LSTM's (h, c), a sequence-first input) are
declared with input_batch_dims / output_batch_dims, and refused clearly when undeclared."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

from gpipe import GPipe, gather, scatter


class LSTMOutput(nn.Module):
    """An LSTM whose output sequence feeds the next layer."""

    def __init__(self, batch_first: bool = True) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 5, num_layers=2, batch_first=batch_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


class LSTMState(nn.Module):
    """An LSTM returning everything: (out, (h, c)), h and c shaped (layers, batch, hidden)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(5, 4, num_layers=3, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        return self.lstm(x)


def _state_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(LSTMOutput(), nn.Linear(5, 5), LSTMState()).double()


def _state_loss(output: tuple) -> torch.Tensor:
    out, (h, c) = output
    return out.pow(2).mean() + h.sum() + 0.5 * c.pow(2).sum()


@pytest.mark.parametrize("dims", [(0, (1, 1)), (0, 1)], ids=["full", "prefix"])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_lstm_returning_its_state_equals_plain_with_the_declaration(
    dims: tuple, checkpoint: str
) -> None:
    torch.manual_seed(1)
    x = torch.randn(7, 6, 3, dtype=torch.float64)
    plain = _state_model()
    expected = plain(x)
    _state_loss(expected).backward()

    model = _state_model()
    pipe = GPipe(model, [2, 1], chunks=3, checkpoint=checkpoint, output_batch_dims=dims)
    output = pipe(x)
    _state_loss(output).backward()
    assert_close(output, expected)
    for param, reference in zip(model.parameters(), plain.parameters()):
        assert_close(param.grad, reference.grad)


def test_lstm_state_without_the_declaration_names_the_output_and_the_fix() -> None:
    pipe = GPipe(_state_model(), [2, 1], chunks=4)
    x = torch.randn(8, 6, 3, dtype=torch.float64)
    with pytest.raises(ValueError) as info:
        pipe(x)
    message = str(info.value)
    assert "output[1][0]" in message and "(3, 2, 4)" in message
    assert "output_batch_dims=(0, (1, 1))" in message


def test_a_coincidental_size_is_caught_when_micro_batches_differ() -> None:
    # h has 3 layers; micro-batches of 3, 2, 2 samples: the first matches, the others do not
    pipe = GPipe(_state_model(), [2, 1], chunks=3)
    with pytest.raises(ValueError, match=r"output\[1\]\[0\]"):
        pipe(torch.randn(7, 6, 3, dtype=torch.float64))


def test_sequence_first_lstm_input_and_output_declared_equal_plain() -> None:
    torch.manual_seed(2)

    def build() -> nn.Sequential:
        torch.manual_seed(3)
        return nn.Sequential(LSTMOutput(batch_first=False), nn.Linear(5, 2)).double()

    x = torch.randn(6, 9, 3, dtype=torch.float64)  # (time, batch, features)
    target = torch.randn(6, 9, 2, dtype=torch.float64)
    plain = build()
    expected_loss = F.mse_loss(plain(x), target)
    expected_loss.backward()

    model = build()
    pipe = GPipe(model, [1, 1], chunks=3, input_batch_dims=1, output_batch_dims=1)
    loss = F.mse_loss(pipe(x), target)
    loss.backward()
    assert_close(loss, expected_loss)
    for param, reference in zip(model.parameters(), plain.parameters()):
        assert_close(param.grad, reference.grad)

    model.zero_grad()
    loss = pipe.train_step(x, target, F.mse_loss, target_batch_dims=1)
    assert_close(loss, expected_loss)
    for param, reference in zip(model.parameters(), plain.parameters()):
        assert_close(param.grad, reference.grad)


def test_undeclared_sequence_first_target_is_refused_naming_the_fix() -> None:
    model = nn.Sequential(LSTMOutput(batch_first=False), nn.Linear(5, 2))
    pipe = GPipe(model, [1, 1], chunks=3, input_batch_dims=1)
    with pytest.raises(ValueError, match=r"target has batch size 6 but input has 9.*target_batch"):
        pipe.train_step(torch.randn(6, 9, 3), torch.randn(6, 9, 2), F.mse_loss)


def test_mismatched_input_batch_sizes_name_each_input() -> None:
    pipe = GPipe(nn.Sequential(nn.Identity()), [1], chunks=2)
    with pytest.raises(ValueError, match=r"input\['mask'\] has batch size 3.*input\['x'\] has 4"):
        pipe({"x": torch.randn(4, 2), "mask": torch.ones(3, 3)})


def test_an_input_declared_not_batched_reaches_every_micro_batch_whole() -> None:
    seen = []

    class Masked(nn.Module):
        def forward(self, batch: dict) -> torch.Tensor:
            seen.append(batch["mask"].shape)
            return batch["x"] @ batch["mask"]

    pipe = GPipe(
        nn.Sequential(Masked()),
        [1],
        chunks=2,
        checkpoint="never",
        input_batch_dims={"x": 0, "mask": None},
    )
    x, mask = torch.randn(4, 3), torch.randn(3, 3, requires_grad=True)
    out = pipe({"x": x, "mask": mask})
    out.sum().backward()
    assert seen == [(3, 3), (3, 3)]
    assert_close(out, x @ mask)
    assert_close(mask.grad, x.sum(0)[:, None].expand(3, 3))


def test_an_output_declared_not_batched_is_returned_once_if_every_micro_batch_agrees() -> None:
    class WithScale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor([2.0, 3.0]))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * self.scale, self.scale * 10

    model = nn.Sequential(WithScale())
    pipe = GPipe(model, [1], chunks=3, output_batch_dims=(0, None))
    x = torch.randn(6, 2)
    out, scale = pipe(x)
    (out.sum() + scale.sum()).backward()
    assert_close(scale, torch.tensor([20.0, 30.0]))
    assert_close(model[0].scale.grad, x.sum(0) + 10)  # the replicated output counted once


def test_an_output_declared_not_batched_that_differs_is_refused() -> None:
    class Varies(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x.sum(0)

    pipe = GPipe(nn.Sequential(Varies()), [1], chunks=2, output_batch_dims=(0, None))
    with pytest.raises(ValueError, match=r"output\[1\] differs between micro-batches"):
        pipe(torch.randn(4, 2))


def test_a_zero_dim_output_names_its_path() -> None:
    class Stat(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x.mean()

    pipe = GPipe(nn.Sequential(Stat()), [1], chunks=2)
    with pytest.raises(ValueError, match=r"output\[1\] is a 0-dim tensor.*train_step"):
        pipe(torch.randn(4, 2))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"output_batch_dims": "0"}, TypeError, "output_batch_dims must be"),
        ({"input_batch_dims": (0, 1.5)}, TypeError, "input_batch_dims must be"),
        ({"input_batch_dims": True}, TypeError, "input_batch_dims must be"),
    ],
)
def test_bad_declarations_are_refused_at_construction(
    kwargs: dict, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        GPipe(nn.Sequential(nn.Identity()), [1], **kwargs)


def test_a_declaration_that_does_not_fit_the_output_names_both() -> None:
    pipe = GPipe(nn.Sequential(nn.Identity()), [1], chunks=2, output_batch_dims=(0, 0, 0))
    with pytest.raises(ValueError, match=r"output_batch_dims=\(0, 0, 0\) does not fit"):
        pipe((torch.randn(4, 2), torch.randn(4, 2)))


def test_scatter_and_gather_along_a_declared_dim() -> None:
    x = torch.arange(24.0).view(2, 6, 2)
    parts = scatter(x, 3, dims=1)
    assert [tuple(p.shape) for p in parts] == [(2, 2, 2)] * 3
    assert torch.equal(gather(parts, dims=1), x)
