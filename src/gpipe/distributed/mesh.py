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

import contextlib
import datetime
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Groups", "Layout", "device", "everyone", "groups_for", "retire"]


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
    column: Any = None  # the replicas' group even without dp (the mesh holds it), to end it
    retired: bool = False  # a step over them failed: see retire


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
        _CACHE[key] = Groups(
            pipeline, control, replicas if layout.dp > 1 else None, mesh, column=replicas
        )
    return _CACHE[key]


def retire(groups: Groups, extra: Sequence[Any] = ()) -> None:
    """End a failed step's groups (and ``extra`` ones): no pipe uses them again.

    A step that failed can leave work posted on its groups (a broadcast of the loss, a
    receive from the failed rank), which would meet the next pipe's first messages, and
    threads of this rank still waiting in it. Every rank of a failed step retires its groups
    alike, so every rank makes new ones; each group's links are closed (which fails the
    work still waiting on them, ending those threads now) and the group is destroyed, so a
    job that retries keeps its threads and sockets flat.
    """
    for key, cached in list(_CACHE.items()):
        if cached is groups:
            del _CACHE[key]
    groups.retired = True
    end([groups.pipeline, groups.control, groups.column, *extra])
    # NOTE: a destroyed group's threads and sockets go only with its last reference: the
    # pipe keeps its mesh, whose registry (torch's own) names the groups
    groups.pipeline = groups.control = groups.replicas = groups.column = None
    with contextlib.suppress(AttributeError):
        groups.mesh._pg_registry.clear()


def end(groups: Sequence[Any]) -> None:
    """Close every link of each of ``groups`` and destroy it (each once; None skipped)."""
    unique = {id(g): g for g in groups if g is not None}
    for group in unique.values():
        # NOTE: NCCL: abort drops a receive that will never match (else the watchdog kills
        # the process). gloo: a receive that times out closes its pair, failing every wait
        # on it; gloo's abort could stop another group's sends from posting.
        if str(dist.get_backend(group)) == "nccl":
            with contextlib.suppress(Exception):
                group.abort()
        else:
            close_links(group)
    for group in unique.values():
        with contextlib.suppress(Exception):  # already destroyed with the default group
            dist.destroy_process_group(group)


def close_links(group: Any) -> None:
    """Close this rank's gloo pair to every other rank of ``group``: what waits on them fails."""
    me = dist.get_rank(group)
    for peer in range(dist.get_world_size(group)):
        if peer == me:
            continue
        with contextlib.suppress(Exception):  # timed out, as meant (or closed already)
            group.recv([torch.empty(1)], peer, _CLOSE_TAG).wait(_AT_ONCE)


_AT_ONCE = datetime.timedelta(milliseconds=1)
_CLOSE_TAG = 3  # never sent: a receive on it times out, closing its pair (see close_links)
_EVERYONE: dict[float, tuple[Any, bytes]] = {}


def everyone(timeout: float) -> tuple[Any, bytes]:
    """A gloo group of every rank, for the pipe's own collectives while it is being built,
    and a secret token every rank of it shares.

    Not the default group: a rank that fails mid-construction leaves the others' collective
    posted, and retiring a group of our own (see :func:`end`) keeps the user's default group
    clean. The token (rank 0's random bytes, broadcast over the group, never through the
    store) signs the fault channel's records, so another client of the store cannot forge
    one. Made once per process and timeout; every rank must ask, in the same order.
    """
    if timeout not in _EVERYONE:
        limit = datetime.timedelta(seconds=timeout)
        group = dist.new_group(timeout=limit, backend="gloo")
        token = torch.zeros(32, dtype=torch.uint8)
        if dist.get_rank() == 0:
            token = torch.frombuffer(bytearray(secrets.token_bytes(32)), dtype=torch.uint8)
        dist.broadcast(token, 0, group=group)
        _EVERYONE[timeout] = (group, bytes(token.tolist()))
    return _EVERYONE[timeout]


def retire_everyone(group: Any) -> None:
    """End ``group`` (from :func:`everyone`) after a failure; the next pipe makes a new one."""
    for key, (cached, _) in list(_EVERYONE.items()):
        if cached is group:
            del _EVERYONE[key]
    end([group])
