"""The gradient norm of the whole model, across every rank, and clipping by it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gpipe.distributed.mesh import collective_device

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    counted: Sequence[torch.Tensor],
    parameters: Sequence[torch.Tensor],
    max_norm: float,
    group: Any,
    *,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip ``parameters``' gradients by the norm of every gradient in the pipeline.

    Each rank of ``group`` (one pipeline: every stage once) gives the parameters it counts
    (a weight held on several ranks is counted by one), their norms are combined as
    ``torch.nn.utils.clip_grad_norm_`` would over the whole model, and every rank scales its
    gradients by the same factor.

    Returns:
        The total norm, the same on every rank.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf (on every rank).
    """
    norm_type = float(norm_type)
    grads = [p.grad for p in counted if p.grad is not None]
    if grads:
        local = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
    else:
        local = torch.zeros(())
    local = local.double().to(collective_device(group))
    if norm_type == float("inf"):
        dist.all_reduce(local, dist.ReduceOp.MAX, group=group)
        total = local
    else:
        power = local**norm_type
        dist.all_reduce(power, group=group)
        total = power ** (1.0 / norm_type)
    total = total.cpu()
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {total.item()}, so "
            "they cannot be clipped; pass error_if_nonfinite=False to clip anyway"
        )
    # NOTE: combined in float64, returned in the parameters' dtype as torch's is (a float32
    # model's norm compared with torch's must not fail on dtype).
    floating = [p for p in parameters if p.is_floating_point()]
    dtype = floating[0].dtype if floating else torch.get_default_dtype()
    total = total.to(dtype)
    with_grads = [p for p in parameters if p.grad is not None]
    if with_grads:
        total = total.to(with_grads[0].device)
        torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, total, foreach)
    return total
