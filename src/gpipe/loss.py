"""How micro-batch losses add up to the batch's loss: the weight each one carries.

A loss that is a mean over samples is exact when each micro-batch's loss is weighted by its
share of the batch's samples; a mean over something else (the real tokens of padded
sequences) needs its own measure (``microbatch_weight``); a sum needs no weight. The weights
are normalized over the whole batch: in a data-parallel pipe, over every replica's part.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["check_loss_arguments", "microbatch_weights", "normalized", "weighted_total"]


def check_loss_arguments(
    loss_fn: Any, reduction: str, microbatch_weight: Callable[[Any], Any] | None
) -> None:
    """Raise a clear error for a ``train_step`` loss that cannot be computed as asked."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if microbatch_weight is not None and reduction != "mean":
        raise ValueError(
            "microbatch_weight weights micro-batch losses that are means, as "
            "reduction='mean' does; with a summed loss drop it (reduction='sum' adds them)"
        )
    if isinstance(loss_fn, type):
        raise TypeError(
            f"loss_fn is the class {loss_fn.__name__}, not a loss: pass an instance, "
            f"loss_fn={loss_fn.__name__}(), or a function such as "
            "torch.nn.functional.mse_loss"
        )
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be a function loss_fn(output, target) -> scalar, such as "
            f"torch.nn.functional.mse_loss; got {loss_fn!r}"
        )


def microbatch_weights(
    targets: Sequence[Any],
    sizes: Sequence[int],
    reduction: str,
    microbatch_weight: Callable[[Any], Any] | None,
) -> list[float]:
    """What each micro-batch's loss counts for, before normalizing over the batch.

    Its samples (``reduction="mean"``), the user's measure of what its loss averages over
    (``microbatch_weight(target)``), or 1 for losses that are summed.
    """
    if microbatch_weight is not None:
        return [_weight(microbatch_weight, target, i) for i, target in enumerate(targets)]
    if reduction == "mean":
        return [float(size) for size in sizes]
    return [1.0] * len(targets)


def normalized(weights: Sequence[float], total: float) -> list[float]:
    """``weights`` divided by ``total``, their sum over the whole batch.

    Raises:
        ValueError: the whole batch weighs nothing (every target is padding, say).
    """
    if total == 0:
        raise ValueError(
            "every micro-batch has weight 0 (every target is padding?): the loss of the batch "
            "is a mean over nothing; skip this batch"
        )
    return [w / total for w in weights]


def weighted_total(weights: Sequence[float], losses: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The batch's loss from its micro-batches' losses.

    NOTE: a micro-batch of weight 0 is left out, not multiplied by 0: its loss may be nan (a
    mean over no tokens), and 0 * nan is nan.
    """
    terms = [w * value for w, value in zip(weights, losses) if w and value is not None]
    return torch.stack(terms).sum()


def _weight(microbatch_weight: Callable[[Any], Any], target: Any, index: int) -> float:
    """One micro-batch's weight, checked: a finite number >= 0."""
    value = microbatch_weight(target)
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise TypeError(
                "microbatch_weight must return a number or a 0-dim tensor, got a tensor of "
                f"shape {tuple(value.shape)} for micro-batch {index}; reduce it to one number, "
                "e.g. (target != -100).sum()"
            )
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            "microbatch_weight must return a number or a 0-dim tensor, got "
            f"{value!r} for micro-batch {index}"
        )
    weight = float(value)
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(
            f"microbatch_weight gave micro-batch {index} the weight {weight}; each weight "
            "must be a finite number >= 0 (what its loss is a mean over, e.g. its real tokens)"
        )
    return weight
