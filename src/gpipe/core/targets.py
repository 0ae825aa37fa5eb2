"""A step's targets: cut like the input, and the loss each micro-batch weighs in the batch's.

A loss that is a mean over samples is exact when each micro-batch's loss is weighted by its
share of the batch's samples (see :mod:`gpipe.loss`); in a data-parallel pipe the share is
of the whole batch, every replica's part together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from gpipe.arguments import check_target_size
from gpipe.loss import check_loss_arguments, microbatch_weights, normalized
from gpipe.microbatch import BatchDims, check_batch_dims, split_batch
from gpipe.runtime.state import Loss
from gpipe.structure import map_tensors

__all__ = ["LossFn", "check_train_arguments", "weighted_loss"]

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, target) -> scalar`` for one micro-batch."""


def check_train_arguments(
    loss_fn: Any,
    reduction: str,
    microbatch_weight: Callable[[Any], Any] | None,
    target_batch_dims: BatchDims,
) -> None:
    """Refuse a ``train_step`` call that cannot run, before anything of the step runs.

    Raises:
        RuntimeError: autograd is off (``torch.no_grad()``).
        ValueError, TypeError: see :func:`gpipe.loss.check_loss_arguments`.
    """
    check_loss_arguments(loss_fn, reduction, microbatch_weight)
    check_batch_dims(target_batch_dims, "target_batch_dims")
    if not torch.is_grad_enabled():
        raise RuntimeError("train_step needs autograd: call it outside torch.no_grad()")


def weighted_loss(
    target: Any,
    dims: BatchDims,
    sizes: Sequence[int],
    loss_fn: LossFn,
    reduction: str,
    microbatch_weight: Callable[[Any], Any] | None,
    device: torch.device,
    *,
    replicas: int = 1,
    replica: int = 0,
    whole: Callable[[float], float] = float,
) -> Loss:
    """The loss the last stage computes: ``target`` cut like the input's micro-batches of
    ``sizes`` samples, each micro-batch's loss weighted by its share of the batch.

    Args:
        target: the targets of the batch (of this replica's part, where ``replicas`` is 1
            for a batch given to each replica alone).
        dims: where ``target`` is batched.
        sizes: the samples in each of the input's micro-batches.
        loss_fn, reduction, microbatch_weight: as ``train_step`` takes them.
        device: where the last stage runs: the targets go there.
        replicas, replica: cut ``target`` into ``replicas`` parts and keep part ``replica``.
        whole: the sum of the weights over every replica's part (the identity with one).

    Raises:
        ValueError: a target batch that does not match the input's, or weights that sum
            to zero over the whole batch.
    """
    cut = split_batch(target, len(sizes), dims, what="target", replicas=replicas, replica=replica)
    check_target_size(cut.total, sum(sizes))
    weights = microbatch_weights(cut.parts, sizes, reduction, microbatch_weight)
    if reduction == "mean":
        weights = normalized(weights, whole(sum(weights)))
    targets = [map_tensors(lambda t: t.to(device), t) for t in cut.parts]
    return Loss(loss_fn, targets, weights)
