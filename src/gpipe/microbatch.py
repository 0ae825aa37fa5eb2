"""Micro-batches: scatter a mini-batch along dim 0, gather the outputs back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["batch_size", "gather", "scatter"]


def _is_batched(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0


def batch_size(inputs: Any) -> int:
    """The common size of dim 0 of every tensor in ``inputs`` (a tensor, tuple, list or dict).

    Raises:
        TypeError: ``inputs`` holds no tensor with a batch dimension.
        ValueError: the batch is empty, or two tensors disagree on dim 0.
    """
    leaves, _ = pytree.tree_flatten(inputs)
    sizes = {leaf.shape[0] for leaf in leaves if _is_batched(leaf)}
    if not sizes:
        raise TypeError(
            "expected a tensor, or a tuple/list/dict holding tensors with a batch dimension, "
            f"got {type(inputs).__name__}"
        )
    if len(sizes) > 1:
        shapes = [tuple(leaf.shape) for leaf in leaves if _is_batched(leaf)]
        raise ValueError(
            f"every input tensor must have the same batch size (dim 0), got shapes {shapes}; "
            "split or pad the inputs so they agree"
        )
    (size,) = sizes
    if size == 0:
        raise ValueError("the batch is empty (dim 0 has size 0): give at least one sample")
    return size


def scatter(inputs: Any, chunks: int) -> list[Any]:
    """Split ``inputs`` into at most ``chunks`` micro-batches along dim 0.

    Splits follow :func:`torch.tensor_split`: sizes differ by at most one, larger first.
    A batch smaller than ``chunks`` gives one micro-batch per sample, never an empty one.
    Values that are not batched tensors (numbers, strings, 0-dim tensors...) are passed
    unchanged to every micro-batch. The splits are views, so autograd flows back through
    them to the caller's tensors.

    Args:
        inputs: a tensor, or a (nested) tuple/list/dict of tensors and other values.
        chunks: the number of micro-batches wanted, >= 1.

    Returns:
        The micro-batches, each with the structure of ``inputs``.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    count = min(chunks, batch_size(inputs))
    leaves, spec = pytree.tree_flatten(inputs)
    split = [
        torch.tensor_split(leaf, count) if _is_batched(leaf) else (leaf,) * count for leaf in leaves
    ]
    return [pytree.tree_unflatten([parts[i] for parts in split], spec) for i in range(count)]


def gather(outputs: Sequence[Any]) -> Any:
    """Concatenate micro-batch outputs along dim 0 into one output of the same structure.

    Non-tensor values are taken from the first micro-batch.

    Raises:
        ValueError: the outputs disagree in structure, or hold a 0-dim tensor (a scalar
            cannot be concatenated; compute a loss with ``GPipe.train_step`` instead).
    """
    if not outputs:
        raise ValueError("nothing to gather: no micro-batch outputs")
    flat = [pytree.tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    for _, other in flat[1:]:
        if other != spec:
            raise ValueError(f"micro-batch outputs differ in structure: {spec} vs {other}")
    merged = []
    for position, first in enumerate(flat[0][0]):
        if not isinstance(first, torch.Tensor):
            merged.append(first)
            continue
        if first.dim() == 0:
            raise ValueError(
                "the last stage returned a 0-dim tensor, which cannot be gathered along the "
                "batch dimension; return per-sample outputs, or compute the loss inside the "
                "pipeline with pipe.train_step(x, target, loss_fn)"
            )
        merged.append(torch.cat([leaves[position] for leaves, _ in flat]))
    return pytree.tree_unflatten(merged, spec)
