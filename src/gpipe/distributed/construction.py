"""Building one rank's part of a distributed pipe: which stages it keeps, checked alike on
every rank, materialized, and connected to the other ranks.

Every rank runs the same construction from the same arguments; only the stages placed on
its pipeline device are kept (materialized from meta if the model was built there), every
other stage is freed.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gpipe.arguments import check_stages_balance
from gpipe.balance import balance_by_params
from gpipe.dataflow import Stages
from gpipe.distributed.clock import offsets_to_rank0
from gpipe.distributed.data_parallel import DataParallel, Ddp
from gpipe.distributed.data_parallel_fsdp import Fsdp
from gpipe.distributed.executor import Executor
from gpipe.distributed.fingerprint import check_same_everywhere
from gpipe.distributed.guard import PipeGuard
from gpipe.distributed.link import measure_link
from gpipe.distributed.materialize import keep_only
from gpipe.distributed.mesh import Groups, Layout, groups_for
from gpipe.distributed.naming import state_names, under_stage, user_view
from gpipe.distributed.programs import Programs
from gpipe.distributed.ties import Tie, TiedWeights, find_ties, tie_groups
from gpipe.partition import check_balance, split_module
from gpipe.runtime.routes import Routes
from gpipe.runtime.stage_set import StageSet
from gpipe.skip import has_skippables
from gpipe.skip import stages as skip_stages

__all__ = [
    "Connections",
    "RankStages",
    "barrier",
    "build_stages",
    "check_alike",
    "connect",
    "data_parallel_for",
    "first_reader",
    "job_layout",
    "model_balance",
    "planned",
]

_LINKS: dict[tuple[int, ...], tuple[float, float]] = {}  # measured once per pipeline a job has


def model_balance(
    module: nn.Sequential | Stages,
    balance: Sequence[int] | str | None,
    layout: Layout,
    virtual_stages: int,
) -> tuple[nn.Sequential | Stages, list[int]]:
    """The model as the ranks will cut it, and its layers per stage (``pp * v`` stages).

    A Sequential with skips becomes :class:`~gpipe.Stages`, as in the local pipe, so each
    skip goes straight to the rank popping it.

    Raises:
        ValueError: a balance that does not fit the model or the job's ranks.
    """
    stages = layout.pp * virtual_stages
    if not isinstance(module, Stages) and has_skippables(module) and stages <= len(module):
        module = skip_stages(module, check_balance(module, _balance(module, balance, stages)))
        balance = None
    if isinstance(module, Stages):
        check_stages_balance(balance, module.balance)
        if len(module) != stages:
            raise ValueError(
                f"the Stages hold {len(module)} stages but the job has {layout.pp} pipeline "
                f"ranks x {virtual_stages} virtual stages = {stages}: launch "
                f"{len(module) // virtual_stages * layout.dp} processes (one stage per rank, "
                f"{virtual_stages} per rank interleaved), or split the model into {stages} "
                "stages"
            )
        return module, list(module.balance)
    if stages > len(module):
        raise ValueError(
            f"{layout.pp} pipeline ranks x {virtual_stages} virtual stages = {stages} stages, "
            f"but the model has {len(module)} layers: launch at most "
            f"{len(module) // virtual_stages * layout.dp} processes, or split the model "
            "into more layers"
        )
    checked = check_balance(module, _balance(module, balance, stages))
    if len(checked) != stages:
        raise ValueError(
            f"balance lists {len(checked)} stages but the job has {layout.pp} pipeline ranks "
            f"x {virtual_stages} virtual stages = {stages}: give one entry per stage, or "
            f"launch {len(checked) // virtual_stages * layout.dp} processes"
        )
    return module, checked


def check_alike(module: nn.Sequential | Stages, settings: dict[str, Any], guard: PipeGuard) -> None:
    """Refuse, on every rank, arguments or a model that differ between ranks."""
    flow = module if isinstance(module, Stages) else None
    check_same_everywhere(
        {
            **settings,
            "layers": [type(layer).__name__ for layer in module],
            "tensors": _tensor_kinds(module),
            "dataflow": None if flow is None else repr(flow.dataflow),
        },
        guard.wait,
        guard.everyone,
    )


@dataclass
class RankStages:
    """This rank's stages, among every stage of the model.

    Attributes:
        modules: every stage's module; those of other ranks freed (on meta).
        held: the same list with None for the stages this rank does not hold.
        local: the stages this rank holds.
        ties: the weights stages on different ranks share.
        by_stage: whether names are told apart as "stage.name" (two stage modules use
            one name for different tensors).
        stage_set: the held stages as the workers see them.
    """

    modules: list[nn.Module]
    held: list[nn.Module | None]
    local: list[int]
    ties: list[Tie]
    by_stage: bool
    stage_set: StageSet

    def user_view(self) -> nn.Module:
        """This rank's layers under their names in the user's model."""
        local = [self.stage_set.module(stage) for stage in self.local]
        return user_view(local, self.local, self.by_stage)


def build_stages(
    module: nn.Sequential | Stages,
    balance: list[int],
    placement: Sequence[int],
    layout: Layout,
    device: torch.device,
    tied: Sequence[tuple[str, str]],
    init_fn: Callable[[nn.Module], None] | None,
    routes: Routes | None,
) -> RankStages:
    """Cut the model into its stages, keep this rank's on ``device``, free the others."""
    flow = isinstance(module, Stages)
    modules = list(module) if flow else list(split_module(module, balance))  # type: ignore[arg-type]
    # The stage modules of gpipe.split and gpipe.skip.stages hold the user's layers under
    # their names in the user's model, so ties and checkpoints read those names; only stage
    # modules whose names clash are told apart as "stage.name" (see user_view).
    by_stage = flow and state_names(modules) is None
    named = [under_stage(s, p) for s, p in enumerate(modules)] if by_stage else modules
    ties = find_ties(named, placement, tied)
    local = [s for s in range(len(modules)) if placement[s] == layout.position]
    held = [p if s in local else None for s, p in enumerate(modules)]
    keep_only(modules, held, device, init_fn)
    stage_set = StageSet(
        held, [device] * layout.pp, tuple(placement), routes=routes, balance=balance
    )
    return RankStages(modules, held, local, ties, by_stage, stage_set)


@dataclass
class Connections:
    """How this rank reaches the others: tied weights, clocks, the link, the transport."""

    groups: Groups
    tied: TiedWeights
    clock_offset_ns: int
    link: tuple[float, float]
    transport: Executor
    programs: Programs


def connect(
    guard: PipeGuard,
    stages: RankStages,
    layout: Layout,
    device: torch.device,
    timeout: float,
    overlap: bool,
    routes: Routes | None,
) -> Connections:
    """Make this rank's process groups (handed to ``guard`` as they are made, so a failure
    ends them) and everything that talks over them."""
    placement = stages.stage_set.placement
    guard.groups = groups = groups_for(layout, timeout, device.type)
    guard.tie_groups = tie_groups(stages.ties, layout.grid(), datetime.timedelta(seconds=timeout))
    tied = TiedWeights(
        stages.ties,
        guard.tie_groups,
        stages.local,
        layout.position,
        layout.pipeline,
        stages.user_view(),
    )
    tied.start_alike()
    pipeline = layout.pipeline
    offset = offsets_to_rank0(pipeline, groups.control)
    if tuple(pipeline) not in _LINKS:
        _LINKS[tuple(pipeline)] = measure_link(pipeline, groups.pipeline, device)
    transport = Executor(
        placement,
        layout.position,
        pipeline,
        device,
        groups.pipeline,
        timeout,
        guard.faults.publish,
        overlap,
        partial(guard.faults.culprit, ranks=pipeline),
    )
    guard.transport = transport
    programs = Programs(routes, layout.position)
    return Connections(groups, tied, offset, _LINKS[tuple(pipeline)], transport, programs)


def _balance(module: nn.Sequential, balance: Any, stages: int) -> Any:
    """Layers per stage: as given, or evened out by parameter count."""
    if balance is None or balance == "params":
        return balance_by_params(module, stages)
    if isinstance(balance, str):
        raise ValueError(
            f"DistributedGPipe takes balance=None, 'params' or a list of layers per stage, got "
            f"{balance!r}; measure one in a single process (gpipe.balance_by_time(model, "
            f"sample, {stages})) and pass the list it returns to every rank"
        )
    return balance


def _tensor_kinds(module: nn.Module) -> list[list[Any]]:
    """Every parameter's and buffer's name, shape and dtype (meta ones too): ranks built with
    another width or dtype differ here."""
    tensors = itertools.chain(module.named_parameters(), module.named_buffers())
    return [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in tensors]


def first_reader(routes: Routes | None) -> int:
    """The first stage that reads the pipe's inputs (its rank tells the others the batch)."""
    if routes is None:
        return 0
    if not routes.reading_input:
        raise ValueError(
            f"no stage of the dataflow reads the pipe's inputs {routes.dataflow.inputs}: "
            "a pipe needs at least one stage that does"
        )
    return min(routes.reading_input)


def barrier(guard: PipeGuard) -> None:
    """Every rank has built its stages (``init_fn`` ran): a rank that failed has said so,
    and the others hear it here, before any makes groups."""
    guard.wait(dist.barrier(guard.everyone, async_op=True))


def job_layout(dp_size: int) -> Layout:
    """This rank's place in a job of ``dp_size`` replicas of the pipeline.

    Raises:
        ValueError: ``dp_size`` is not a whole number >= 1 that divides the world size.
    """
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be a whole number >= 1, got {dp_size!r}")
    world = dist.get_world_size()
    if world % dp_size:
        raise ValueError(
            f"the job has {world} ranks, which dp_size={dp_size} replicas cannot share "
            f"equally: launch a multiple of {dp_size} processes"
        )
    return Layout(dp_size, world // dp_size, dist.get_rank())


def planned(module: nn.Module, plan: Any) -> tuple[nn.Sequential | Stages, dict[str, Any]]:
    """What ``DistributedGPipe.from_plan`` builds: the module to pipe (``module`` itself,
    its Stages grouped, or the model split at the plan's points) and the settings.

    Raises:
        ValueError: a plan laid out for another number of processes than this job's.
    """
    chosen = getattr(plan, "best", plan)
    processes = chosen.stages * chosen.dp
    world = dist.get_world_size()
    if world != processes:
        raise ValueError(
            f"the plan ({chosen.describe()}) lays out {chosen.stages} stages x dp="
            f"{chosen.dp} = {processes} processes; this job has {world}: launch it with "
            f"torchrun --nproc-per-node {processes} (or plan with world_size={world})"
        )
    settings = chosen.pipe_kwargs()
    del settings["devices"]  # each rank runs on its own device
    settings.update(dp_size=chosen.dp, zero=chosen.zero)
    if chosen.dp > 1 and chosen.data_parallel != "replicate":
        settings["data_parallel"] = chosen.data_parallel
    return cast("nn.Sequential | Stages", chosen.pipe_module(module)), settings


def data_parallel_for(
    name: str, reshard_after_forward: bool, rank: Any, layout: Any, groups: Any
) -> DataParallel:
    """This rank's engine ``name`` over its stages, wrapping them as it needs.

    Args:
        name: one of :data:`ENGINES` (checked by :func:`check_data_parallel`).
        reshard_after_forward: under ``"fsdp"``, free the gathered parameters after each
            forward (gathering them again for the next), rather than keep them to the end
            of the step's forwards and backwards.
        rank: this rank's :class:`~gpipe.distributed.construction.RankStages`; under
            ``"fsdp"`` their modules become FSDP modules.
        layout: this rank's :class:`~gpipe.distributed.mesh.Layout`.
        groups: this rank's :class:`~gpipe.distributed.mesh.Groups`.
    """
    group = groups.replicas
    stages, local, position = rank.stage_set, rank.local, layout.position
    if group is None or name == "replicate":
        return DataParallel(name, stages, local, position, group)
    if name == "ddp":
        return Ddp(stages, local, position, group)
    return Fsdp(stages, local, position, group, groups.mesh["dp"], reshard_after_forward)
