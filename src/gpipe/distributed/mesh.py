"""Where each rank sits: data-parallel replicas of a pipeline, as a DeviceMesh ("dp", "pp").

The world's ranks are laid out row by row: rank ``r`` is stage position ``r % pp`` of
replica ``r // pp``. So the ranks of one pipeline are consecutive (on a node, neighbours
talk to neighbours), and the ranks that hold the same stages in every replica, which
all-reduce their gradients, are ``pp`` apart::

    dp=2, pp=4:      pp 0  pp 1  pp 2  pp 3
        replica 0:      0     1     2     3
        replica 1:      4     5     6     7

Process groups are made once per layout and timeout and shared by every pipe over them
(making one connects every pair of its ranks, which costs more than a step).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Groups", "Layout", "device", "groups_for"]


@dataclass(frozen=True)
class Layout:
    """``dp`` replicas of a ``pp``-stage pipeline, and this rank's place in them."""

    dp: int
    pp: int
    rank: int

    @property
    def replica(self) -> int:
        """This rank's replica: its index along "dp"."""
        return self.rank // self.pp

    @property
    def position(self) -> int:
        """This rank's pipeline device: its index along "pp"."""
        return self.rank % self.pp

    @property
    def pipeline(self) -> list[int]:
        """The global ranks of this rank's pipeline, device by device."""
        return [self.replica * self.pp + k for k in range(self.pp)]

    @property
    def replicas(self) -> list[int]:
        """The global ranks holding this rank's stages, replica by replica."""
        return [d * self.pp + self.position for d in range(self.dp)]

    def grid(self) -> list[list[int]]:
        """Every rank, as the mesh lays them out: ``grid()[replica][position]``."""
        return [[d * self.pp + k for k in range(self.pp)] for d in range(self.dp)]


@dataclass
class Groups:
    """The process groups a pipe's traffic travels in, for this rank.

    Attributes:
        pipeline: tensors between this replica's stages (gloo on CPU, NCCL on CUDA).
        control: headers, signatures and the step's small collectives (always gloo).
        replicas: gradients between the replicas of this rank's stages; None without dp.
        mesh: the DeviceMesh ("dp", "pp") over the whole job.
    """

    pipeline: Any
    control: Any
    replicas: Any
    mesh: DeviceMesh


def collective_device(group: Any) -> torch.device:
    """Where a tensor for a collective on ``group`` must be: NCCL takes CUDA tensors only
    (this rank's GPU), gloo CPU tensors."""
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` with CUDA, else the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")


_CACHE: dict[tuple[int, int, float], Groups] = {}


def groups_for(layout: Layout, timeout: float, device_type: str) -> Groups:
    """This rank's groups for ``layout``: every rank must ask, in the same order.

    Raises:
        ValueError: the world does not hold ``dp x pp`` ranks.
    """
    world = dist.get_world_size()
    if layout.dp * layout.pp != world:
        raise ValueError(
            f"the job has {world} ranks but dp_size={layout.dp} x {layout.pp} pipeline "
            f"devices = {layout.dp * layout.pp}: launch {layout.dp * layout.pp} processes, or "
            f"make dp_size x (stages / virtual_stages) = {world}"
        )
    key = (layout.dp, layout.pp, timeout)
    if key not in _CACHE:
        limit = datetime.timedelta(seconds=timeout)
        rows, columns = layout.grid(), [list(c) for c in zip(*layout.grid())]
        # NOTE: every rank creates every group, in the same order, as torch requires.
        pipeline, _ = dist.new_subgroups_by_enumeration(rows, timeout=limit)
        if dist.get_backend() == "gloo":
            control = pipeline
        else:
            control, _ = dist.new_subgroups_by_enumeration(rows, timeout=limit, backend="gloo")
            # NOTE: a batch of point-to-point ops between two ranks (a message of several
            # tensors, see transport._Link) may be a group's first NCCL call only if every
            # rank of the group joins it: one collective first makes the group's
            # communicator, after which any pair may batch.
            dist.all_reduce(torch.zeros(1, device=device()), group=pipeline)
        replicas, _ = dist.new_subgroups_by_enumeration(columns, timeout=limit)
        mesh = DeviceMesh.from_group(
            [replicas, pipeline],
            device_type,
            mesh=torch.tensor(layout.grid()),
            mesh_dim_names=("dp", "pp"),
        )
        _CACHE[key] = Groups(pipeline, control, replicas if layout.dp > 1 else None, mesh)
    return _CACHE[key]


def forget(groups: Groups) -> None:
    """Drop ``groups`` from the cache, so the next pipe of their layout makes its own.

    A step that failed can leave work posted on its groups (a broadcast of the loss, a
    receive from the failed rank), which would meet the next pipe's first messages; every
    rank of a failed step forgets its groups alike, so every rank makes new ones.
    """
    for key, cached in list(_CACHE.items()):
        if cached is groups:
            del _CACHE[key]
    # NOTE: on NCCL a receive that will never match stays on the group's stream, and the
    # watchdog would kill the process over it: aborting the failed step's groups drops it
    # (gloo's abort cannot wake a wait, and its pending work ends with its links).
    for group in {id(g): g for g in (groups.pipeline, groups.replicas) if g is not None}.values():
        if str(dist.get_backend(group)) == "nccl":
            group.abort()
