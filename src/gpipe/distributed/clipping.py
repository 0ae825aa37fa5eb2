"""The gradient norm of the whole model, across every rank, and clipping by it.

Under ``data_parallel="fsdp"`` each gradient is a DTensor whose shards lie on the replicas:
each rank takes the norm of its own shards, and the norms are combined over the replicas
too, so the total is the whole model's; the clip factor then scales every shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gpipe.distributed.mesh import collective_device

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    counted: Sequence[torch.Tensor],
    parameters: Sequence[torch.Tensor],
    max_norm: float,
    group: Any,
    *,
    shards_over: Any = None,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip ``parameters``' gradients by the norm of every gradient in the pipeline.

    Each rank of ``group`` (one pipeline: every stage once) gives the parameters it counts
    (a weight held on several ranks is counted by one), their norms are combined as
    ``torch.nn.utils.clip_grad_norm_`` would over the whole model, and every rank scales its
    gradients by the same factor.

    Args:
        shards_over: the replicas' group when the gradients are DTensors sharded over it
            (FSDP): their local shards' norms are combined over it as well.

    Returns:
        The total norm, the same on every rank.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf (on every rank).
    """
    norm_type = float(norm_type)
    grads = [_local(p.grad) for p in counted if p.grad is not None]
    if grads:
        local = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
    else:
        local = torch.zeros(())
    infinite = norm_type == float("inf")
    combined = local.double() if infinite else local.double() ** norm_type
    for each in [group] if shards_over is None else [group, shards_over]:
        combined = combined.to(collective_device(each))
        dist.all_reduce(combined, dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM, group=each)
    total = (combined if infinite else combined ** (1.0 / norm_type)).cpu()
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
    grads = [_local(p.grad) for p in parameters if p.grad is not None]
    if grads:
        total = total.to(grads[0].device)
        # NOTE: torch.nn.utils.clip_grads_with_norm_'s factor, applied to the local tensors:
        # it would scale a DTensor gradient by a plain tensor, a mixed op DTensor refuses
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if foreach is False:
            for grad in grads:
                grad.mul_(factor)
        else:
            torch._foreach_mul_(grads, factor)
    return total


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor gradient (a view: scaling it scales the DTensor); a
    plain gradient as it is."""
    return grad.to_local() if isinstance(grad, DTensor) else grad
