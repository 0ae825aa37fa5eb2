"""Layouts: how the planner's devices and batch are laid out into replicas of a pipeline.

Without a job size, one layout: ``dp`` replicas (1 for a local pipe), each pipelining
``batch_size / dp`` samples on up to ``len(devices)`` stages. With ``world_size`` (the
processes of a ``DistributedGPipe`` job, one device each), every way to lay them out: a
pipeline of K stages and ``world_size / K`` replicas, for each K that divides the job and
leaves each replica a whole share of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpipe.planning.candidates import Replicas
from gpipe.planning.plan_arguments import check_int, chunk_counts

__all__ = ["layouts"]


def layouts(
    batch_size: int,
    devices: int,
    units: int,
    *,
    dp: int,
    zero: bool,
    bandwidth: float | None,
    chunks: Sequence[int] | None,
    world_size: int | None,
    engine: str = "replicate",
) -> list[Replicas]:
    """The layouts to plan: one for a given ``dp``, or every (pp, dp) of ``world_size``.

    Raises:
        TypeError: ``world_size`` that is not an int.
        ValueError: ``world_size`` below 1, with ``dp`` other than 1, or one no stage count
            up to ``min(len(devices), units)`` divides with a whole batch per replica.
    """
    if world_size is None:
        batch = batch_size // dp
        each = tuple(chunk_counts(batch, chunks))
        return [Replicas(dp, zero, bandwidth, batch, each, engine=engine)]
    check_int("world_size", world_size)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 processes, got {world_size}")
    if dp != 1:
        raise ValueError(
            f"pass world_size={world_size} or dp={dp}, not both: with world_size the planner "
            "weighs every pipeline depth and replica count whose product it is"
        )
    found = []
    for stages in range(1, min(devices, units, world_size) + 1):
        replicas = world_size // stages
        if world_size % stages or batch_size % replicas:
            continue
        batch = batch_size // replicas
        counts = [m for m in chunks if m <= batch] if chunks is not None else None
        if counts == []:
            continue
        found.append(
            Replicas(
                replicas,
                zero,
                bandwidth,
                batch,
                tuple(chunk_counts(batch, counts)),
                stages=stages,
                world_size=world_size,
                engine=engine,
            )
        )
    if not found:
        raise ValueError(
            f"no layout of world_size={world_size} processes fits: a pipeline of K stages "
            f"(K up to {min(devices, units)}: the devices given and the model's units) needs "
            f"K to divide {world_size}, and batch_size={batch_size} to split evenly over the "
            f"{world_size} / K replicas; give more devices or a batch size the replica counts "
            "divide"
        )
    return found
