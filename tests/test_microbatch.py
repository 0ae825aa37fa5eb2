"""scatter splits like torch.tensor_split along dim 0; gather undoes it."""

from __future__ import annotations

import pytest
import torch

from gpipe import gather, scatter


def test_scatter_uneven_sizes_follow_tensor_split() -> None:
    x = torch.arange(10).view(10, 1)
    parts = scatter(x, 4)
    assert [p.shape[0] for p in parts] == [3, 3, 2, 2]
    assert torch.equal(torch.cat(parts), x)


def test_fewer_samples_than_chunks_gives_one_microbatch_per_sample() -> None:
    parts = scatter(torch.randn(3, 2), 8)
    assert [p.shape[0] for p in parts] == [1, 1, 1]


def test_tuple_dict_and_non_tensor_values_pass_through() -> None:
    inputs = {"x": torch.randn(6, 2), "pair": (torch.randn(6), "tag"), "scale": 2.5}
    parts = scatter(inputs, 3)
    assert len(parts) == 3
    for i, part in enumerate(parts):
        assert torch.equal(part["x"], inputs["x"][2 * i : 2 * i + 2])
        assert part["pair"][1] == "tag" and part["scale"] == 2.5
    merged = gather(parts)
    assert torch.equal(merged["x"], inputs["x"]) and torch.equal(
        merged["pair"][0], inputs["pair"][0]
    )
    assert merged["pair"][1] == "tag"


def test_zero_dim_tensor_is_not_split() -> None:
    temperature = torch.tensor(0.5)
    parts = scatter((torch.randn(4, 2), temperature), 2)
    assert all(part[1] is temperature for part in parts)


def test_scatter_keeps_autograd_to_the_callers_tensor() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    sum(p.sum() * (i + 1) for i, p in enumerate(scatter(x, 2))).backward()
    assert torch.equal(x.grad, torch.tensor([[1.0] * 3] * 2 + [[2.0] * 3] * 2))


@pytest.mark.parametrize(
    ("inputs", "error", "match"),
    [
        (torch.randn(0, 3), ValueError, "empty"),
        ((torch.randn(4, 2), torch.randn(5, 2)), ValueError, "same batch size"),
        ("text", TypeError, "tensor"),
    ],
)
def test_bad_batches_are_rejected(inputs: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        scatter(inputs, 2)


def test_chunks_below_one_is_rejected() -> None:
    with pytest.raises(ValueError, match="chunks must be >= 1, got 0"):
        scatter(torch.randn(4), 0)


def test_gather_rejects_scalars_and_names_train_step() -> None:
    with pytest.raises(ValueError, match="train_step"):
        gather([torch.tensor(1.0), torch.tensor(2.0)])
