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


def test_split_batch_gives_the_micro_batches_their_sizes_and_the_total_in_one_pass() -> None:
    from gpipe.microbatch import split_batch

    x = {"a": torch.arange(10.0).reshape(5, 2), "mask": torch.ones(2, 5), "n": 3}
    batch = split_batch(x, 3, {"a": 0, "mask": 1, "n": None})
    assert batch.sizes == [2, 2, 1] and batch.total == 5 and batch.microbatches == 3
    assert [part["a"].tolist() for part in batch.parts] == [
        [[0.0, 1.0], [2.0, 3.0]],
        [[4.0, 5.0], [6.0, 7.0]],
        [[8.0, 9.0]],
    ]
    assert [tuple(part["mask"].shape) for part in batch.parts] == [(2, 2), (2, 2), (2, 1)]
    assert all(part["n"] == 3 for part in batch.parts)


def test_a_replicas_share_is_cut_as_scatter_cuts_the_whole_batch_then_its_part() -> None:
    from gpipe.microbatch import split_batch

    x = torch.arange(22.0).reshape(11, 2)
    for replica in range(3):
        batch = split_batch(x, 2, replicas=3, replica=replica)
        expected = scatter(scatter(x, 3)[replica], 2)
        assert len(batch.parts) == len(expected)
        for got, want in zip(batch.parts, expected):
            assert torch.equal(got, want)
        assert batch.total == scatter(x, 3)[replica].shape[0]
    with pytest.raises(ValueError, match="the input batch has 2 samples for 3 replicas"):
        split_batch(x[:2], 2, replicas=3)


def test_the_shapes_number_changes_with_shape_dtype_and_requires_grad_only() -> None:
    from gpipe.microbatch import split_batch

    def shapes(x: torch.Tensor) -> int:
        return split_batch(x, 2).shapes

    base = shapes(torch.zeros(4, 3))
    assert shapes(torch.ones(4, 3)) == base  # values do not count
    assert shapes(torch.zeros(4, 5)) != base
    assert shapes(torch.zeros(4, 3, dtype=torch.float64)) != base
    assert shapes(torch.zeros(4, 3, requires_grad=True)) != base
