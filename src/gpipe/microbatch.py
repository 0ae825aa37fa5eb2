"""Micro-batches: scatter a mini-batch along its batch dimension, gather the outputs back.

The batch dimension is dim 0 unless declared otherwise: a *batch-dims* declaration is an int,
None (not batched) or a tuple/list/dict of them shaped like the value, or like a prefix of it
(``(0, 1)`` covers ``(out, (h, c))``: ``out`` on dim 0, ``h`` and ``c`` on dim 1).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "Batch",
    "BatchDims",
    "batch_size",
    "check_batch_dims",
    "gather",
    "microbatch_sizes",
    "scatter",
    "split_batch",
]

BatchDims: TypeAlias = (
    "int | tuple[BatchDims, ...] | list[BatchDims] | Mapping[str, BatchDims] | None"
)
"""Where a value is batched: a dim, None (not batched), or a tree of them shaped like it."""


def check_batch_dims(dims: BatchDims, name: str) -> BatchDims:
    """Return ``dims`` if it is a batch-dims declaration, else raise a TypeError naming ``name``."""
    for leaf in pytree.tree_leaves(dims):
        if leaf is not None and (isinstance(leaf, bool) or not isinstance(leaf, int)):
            raise TypeError(
                f"{name} must be an int (the batch dim), None (not batched), or a "
                f"tuple/list/dict of them shaped like the value; got {dims!r}"
            )
    return dims


def _declaring(what: str) -> str:
    """Where the batch dims of ``what`` ("input", "target", "output") are declared."""
    if what == "target":
        return "train_step(..., target_batch_dims=...)"
    return f"GPipe(..., {what}_batch_dims=...)"


def _path(value: Any, index: int) -> str:
    """The path of ``value``'s ``index``-th leaf, as in ``[1]['mask']`` (for messages only)."""
    return pytree.keystr(pytree.tree_flatten_with_path(value)[0][index][0])


def _misfit(dims: BatchDims, what: str, spec: Any, count: int) -> str:
    shape = pytree.tree_unflatten(["*"] * count, spec)
    return (
        f"{what}_batch_dims={dims!r} does not fit the {what}, shaped {shape!r} (* a value): "
        f"give one entry per value, or one for a whole tuple/list/dict, with {_declaring(what)}"
    )


def _broadcast(dims: BatchDims, spec: Any, count: int, what: str) -> list[Any]:
    """``dims`` broadcast to one entry per leaf of a value of structure ``spec``."""
    if dims is None or isinstance(dims, int):
        return [dims] * count
    flat = pytree._broadcast_to_and_flatten(dims, spec)
    if flat is None:
        raise ValueError(_misfit(dims, what, spec, count))
    return flat


def _axes(value: Any, leaves: list[Any], spec: Any, dims: BatchDims, what: str) -> list[Any]:
    """Each leaf's batch dim (None: not batched), ``dims`` broadcast over ``value``."""
    flat = _broadcast(dims, spec, len(leaves), what)
    axes: list[int | None] = []
    for index, (leaf, dim) in enumerate(zip(leaves, flat)):
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or dim is None:
            axes.append(None)
        elif not -leaf.dim() <= dim < leaf.dim():
            raise ValueError(
                f"{what}{_path(value, index)} has shape {tuple(leaf.shape)}, which has no dim "
                f"{dim}; fix its batch dim in {_declaring(what)}"
            )
        else:
            axes.append(dim % leaf.dim())
    return axes


def _flatten(value: Any, dims: BatchDims, what: str) -> tuple[list[Any], Any, list[Any], int]:
    """``value``'s leaves, structure, batch dims and batch size, checked."""
    leaves, spec = pytree.tree_flatten(value)
    axes = _axes(value, leaves, spec, dims, what)
    first: int | None = None
    for index, (leaf, dim) in enumerate(zip(leaves, axes)):
        if dim is None:
            continue
        if first is None:
            first = index
        elif leaf.shape[dim] != leaves[first].shape[axes[first]]:
            size, expected = leaf.shape[dim], leaves[first].shape[axes[first]]
            raise ValueError(
                f"every batched {what} tensor must have the same batch size: "
                f"{what}{_path(value, index)} has batch size {size} (dim {dim}) but "
                f"{what}{_path(value, first)} has {expected} (dim {axes[first]}); split or pad "
                f"them to agree, or declare each one's batch dim with {_declaring(what)} "
                "(None: not batched, given whole to every micro-batch)"
            )
    if first is None:
        raise TypeError(
            f"expected the {what} to be a tensor, or a tuple/list/dict holding tensors with a "
            f"batch dimension, got {type(value).__name__}"
        )
    size = leaves[first].shape[axes[first]]
    if size == 0:
        raise ValueError(
            f"the batch is empty (dim {axes[first]} has size 0): give at least one sample"
        )
    return leaves, spec, axes, size


def batch_size(inputs: Any, dims: BatchDims = 0, *, what: str = "input") -> int:
    """The common size of every batched tensor in ``inputs`` along its batch dim.

    Args:
        inputs: a tensor, or a (nested) tuple/list/dict of tensors and other values.
        dims: the batch dims (see the module docstring); 0-dim tensors are never batched.
        what: what ``inputs`` is called in error messages ("input", "target").

    Raises:
        TypeError: ``inputs`` holds no tensor with a batch dimension.
        ValueError: the batch is empty, two tensors disagree on the batch size, or ``dims``
            does not fit ``inputs``.
    """
    return _flatten(inputs, dims, what)[3]


def microbatch_sizes(total: int, chunks: int) -> list[int]:
    """The sizes :func:`scatter` cuts a batch of ``total`` samples into (larger first)."""
    count = min(chunks, total)
    return [total // count + (1 if i < total % count else 0) for i in range(count)]


@dataclass(frozen=True)
class Batch:
    """A mini-batch cut into micro-batches, with what a step needs to know of it.

    Attributes:
        parts: the micro-batches themselves, each shaped like the batch (views of its
            tensors); ``microbatches`` elsewhere is always their count, M.
        sizes: the samples in each micro-batch.
    """

    parts: list[Any]
    sizes: list[int]
    _split: list[Any] = field(repr=False, compare=False)  # each leaf's parts, or its copies

    @property
    def microbatches(self) -> int:
        """M, the number of micro-batches (fewer than asked when there are fewer samples)."""
        return len(self.sizes)

    @property
    def total(self) -> int:
        """The samples in the whole batch."""
        return sum(self.sizes)

    @functools.cached_property
    def shapes(self) -> int:
        """A number standing for the micro-batches' structure, shapes, dtypes and
        requires_grad: what the shape of every message of a step follows from."""
        described = [
            (tuple(leaf.shape), str(leaf.dtype), leaf.requires_grad)
            if isinstance(leaf, torch.Tensor)
            else repr(leaf)
            for i in range(len(self.parts))
            for leaf in (cut[i] for cut in self._split)
        ]
        return zlib.crc32(repr(described).encode())


def split_batch(
    value: Any,
    chunks: int,
    dims: BatchDims = 0,
    *,
    what: str = "input",
    replicas: int = 1,
    replica: int = 0,
) -> Batch:
    """Cut ``value`` into at most ``chunks`` micro-batches in one pass over its leaves.

    With ``replicas`` > 1 the batch is first cut into that many parts the same way, and
    only part ``replica`` is split into micro-batches (a data-parallel replica's share).

    Raises:
        ValueError: ``chunks`` < 1, fewer samples than ``replicas``, or the checks of
            :func:`batch_size`.
        TypeError: ``value`` holds no batched tensor.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    leaves, spec, axes, size = _flatten(value, dims, what)
    if replicas > 1:
        if size < replicas:
            raise ValueError(
                f"the {what} batch has {size} samples for {replicas} replicas: give each "
                "replica at least one"
            )
        leaves = [
            leaf if dim is None else torch.tensor_split(leaf, replicas, dim=dim)[replica]
            for leaf, dim in zip(leaves, axes)
        ]
        size = microbatch_sizes(size, replicas)[replica]
    sizes = microbatch_sizes(size, chunks)
    count = len(sizes)
    split = [
        (leaf,) * count if dim is None else torch.tensor_split(leaf, count, dim=dim)
        for leaf, dim in zip(leaves, axes)
    ]
    parts = [pytree.tree_unflatten([cut[i] for cut in split], spec) for i in range(count)]
    return Batch(parts, sizes, split)


def scatter(inputs: Any, chunks: int, dims: BatchDims = 0, *, what: str = "input") -> list[Any]:
    """Split ``inputs`` into at most ``chunks`` micro-batches along their batch dims.

    Splits follow :func:`torch.tensor_split`: sizes differ by at most one, larger first.
    A batch smaller than ``chunks`` gives one micro-batch per sample, never an empty one.
    Values that are not batched tensors (numbers, strings, 0-dim tensors, tensors declared
    None) are passed unchanged to every micro-batch. The splits are views, so autograd flows
    back through them to the caller's tensors.

    Args:
        inputs: a tensor, or a (nested) tuple/list/dict of tensors and other values.
        chunks: the number of micro-batches wanted, >= 1.
        dims: the batch dims (see the module docstring); 0 for every tensor by default.
        what: what ``inputs`` is called in error messages ("input", "target").

    Returns:
        The micro-batches, each with the structure of ``inputs``.
    """
    return split_batch(inputs, chunks, dims, what=what).parts


def gather(
    outputs: Sequence[Any], dims: BatchDims = 0, *, sizes: Sequence[int] | None = None
) -> Any:
    """Concatenate micro-batch outputs along their batch dims into one output.

    Non-tensor values, and tensors declared not batched (None), are taken from the first
    micro-batch; the latter must be equal in every micro-batch.

    Args:
        outputs: one output per micro-batch, all of one structure.
        dims: the batch dims (see the module docstring); 0 for every tensor by default.
        sizes: the samples in each micro-batch; if given, every batched tensor must have
            that size along its batch dim (an output whose batch is elsewhere, such as an
            LSTM's ``(h, c)``, is caught here instead of being concatenated wrongly).

    Raises:
        ValueError: the outputs disagree in structure, a batched tensor has the wrong size
            or is 0-dim (a scalar cannot be concatenated; compute a loss with
            ``GPipe.train_step`` instead), or a tensor declared not batched differs.
    """
    if not outputs:
        raise ValueError("nothing to gather: no micro-batch outputs")
    flat = [pytree.tree_flatten(out) for out in outputs]
    firsts, spec = flat[0]
    for _, other in flat[1:]:
        if other != spec:
            raise ValueError(f"micro-batch outputs differ in structure: {spec} vs {other}")
    axes = _broadcast(dims, spec, len(firsts), "output")
    merged = []
    for position, first in enumerate(firsts):
        parts = [leaves[position] for leaves, _ in flat]
        dim = axes[position]
        if not isinstance(first, torch.Tensor):
            merged.append(first)
        elif dim is None:
            merged.append(_replicated(parts, outputs, position))
        else:
            dim = _output_axis(first, dim, outputs, position)
            if sizes is not None:
                _check_sizes(parts, dim, sizes, flat, spec, outputs, position)
            merged.append(torch.cat(parts, dim=dim))
    return pytree.tree_unflatten(merged, spec)


def _replicated(parts: list[Any], outputs: Sequence[Any], position: int) -> Any:
    for i, part in enumerate(parts[1:], 1):
        if not (isinstance(part, torch.Tensor) and torch.equal(part, parts[0])):
            raise ValueError(
                f"output{_path(outputs[0], position)} differs between micro-batches (0 and "
                f"{i}), but output_batch_dims declares it not batched (None), which returns "
                "one value for the whole batch: declare its batch dim instead, or make it "
                "the same in every micro-batch"
            )
    return parts[0]


def _output_axis(first: torch.Tensor, dim: int, outputs: Sequence[Any], position: int) -> int:
    if first.dim() == 0:
        raise ValueError(
            f"output{_path(outputs[0], position)} is a 0-dim tensor, which cannot be gathered "
            "along a batch dim: return per-sample values, declare it not batched (None) with "
            "GPipe(..., output_batch_dims=...), or compute the loss inside the pipeline with "
            "pipe.train_step(x, target, loss_fn)"
        )
    if not -first.dim() <= dim < first.dim():
        raise ValueError(
            f"output{_path(outputs[0], position)} has shape {tuple(first.shape)}, which has no "
            f"dim {dim}; fix its batch dim in GPipe(..., output_batch_dims=...)"
        )
    return dim % first.dim()


def _check_sizes(
    parts: list[torch.Tensor],
    dim: int,
    sizes: Sequence[int],
    flat: list[tuple[list[Any], Any]],
    spec: Any,
    outputs: Sequence[Any],
    position: int,
) -> None:
    for i, (part, size) in enumerate(zip(parts, sizes)):
        if part.dim() > dim and part.shape[dim] == size:
            continue
        leaf_count = len(flat[0][0])
        guesses = [_guess_axis([leaves[k] for leaves, _ in flat], sizes) for k in range(leaf_count)]
        guess = pytree.tree_unflatten(guesses, spec)
        raise ValueError(
            f"output{_path(outputs[0], position)} of micro-batch {i} has shape "
            f"{tuple(part.shape)}, but the micro-batch has {size} samples and the output's "
            f"batch dim is {dim}: an output whose batch is not dim 0 (an LSTM's (h, c) is "
            "(layers, batch, hidden)) must be declared, e.g. "
            f"GPipe(..., output_batch_dims={guess!r}) from the sizes seen here "
            "(None: not batched, returned once)"
        )


def _guess_axis(parts: list[Any], sizes: Sequence[int]) -> int | None:
    """The first dim along which every micro-batch's tensor has the micro-batch's size."""
    if not all(isinstance(p, torch.Tensor) for p in parts):
        return None
    for dim in range(parts[0].dim()):
        if all(p.dim() > dim and p.shape[dim] == s for p, s in zip(parts, sizes)):
            return dim
    return None
