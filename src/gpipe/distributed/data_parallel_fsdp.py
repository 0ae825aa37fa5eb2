"""The ``"fsdp"`` engine: each held stage through torch's ``fully_shard`` over the mesh's
"dp" dimension, its gradients reduce-scattered once per step (see
:mod:`gpipe.distributed.data_parallel` for what each engine runs, and why)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist

from gpipe.distributed.data_parallel import DataParallel
from gpipe.distributed.replicas import last_gradient_actions
from gpipe.runtime.stage_set import StageSet
from gpipe.schedule import BACKWARD, WEIGHT, Action, Schedule
from gpipe.split.stage import SplitStage

__all__ = ["Fsdp", "ShardReductions"]


class Fsdp(DataParallel):
    def __init__(
        self,
        stages: StageSet,
        local: Sequence[int],
        position: int,
        group: Any,
        mesh: Any,
        reshard_after_forward: bool,
    ) -> None:
        super().__init__("fsdp", stages, local, position, group)
        from torch.distributed.fsdp import fully_shard

        self.shards_over = group
        self._reshard_after_forward = reshard_after_forward
        self._sharded: dict[int, Any] = {}
        for stage in self._local:
            module = stages.module(stage)
            if not any(p.requires_grad for p in module.parameters()):
                continue
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
            if isinstance(module, SplitStage):
                # NOTE: the sharded parameters replaced the stand-ins' tensors, so the
                # user's model holds what the stage trains (and its gradients)
                module.write_through()
            sharded: Any = module
            # NOTE: a sum over the replicas, not FSDP's average (see the module docstring)
            sharded.set_gradient_divide_factor(1.0)
            sharded.set_force_sum_reduction_for_comms(True)
            self._sharded[stage] = sharded

    def sync(self, schedule: Schedule) -> Any:
        for module in self._sharded.values():
            _accumulating(module, self._reshard_after_forward)
        last = last_gradient_actions(schedule, self._position)
        gather: dict[Action, list[Any]] = {}
        if schedule.split_backward:
            actions = schedule.actions[self._position]
            for before, action in pairwise(actions):
                for unit in action.units:
                    if unit.kind in (BACKWARD, WEIGHT) and unit.stage in self._sharded:
                        gather.setdefault(before, []).append(self._sharded[unit.stage])
        return ShardReductions(
            {last[s]: m for s, m in self._sharded.items() if s in last},
            gather,
            self._reshard_after_forward,
        )

    def check_microbatches(self, count: int, wait: Callable[[Any], None]) -> None:
        """Refuse a step whose replicas run different numbers of micro-batches.

        NOTE: FSDP gathers a stage's parameters per forward (and per backward), so replicas
        that run more micro-batches would call collectives the others never meet: the job
        would wait out the group's timeout instead of failing.

        Raises:
            ValueError: on every rank, naming the fix.
        """
        counts = torch.tensor([count, -count], dtype=torch.int64)
        wait(dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self._group, async_op=True))
        most, fewest = int(counts[0]), -int(counts[1])
        if most != fewest:
            raise ValueError(
                f"with data_parallel='fsdp' every replica must run the same number of "
                f"micro-batches, but they run {fewest} to {most} (a replica's part of the "
                "batch has fewer samples than chunks): give a batch of at least chunks x "
                "dp_size samples, or use data_parallel='replicate'"
            )

    def settle(self) -> None:
        # NOTE: a forward without reshard_after_forward leaves the parameters gathered; an
        # optimizer step before the next backward would update only the shards under them.
        for module in self._sharded.values():
            module.reshard()


def _accumulating(module: Any, reshard_after_forward: bool) -> None:
    """Every backward accumulates unsharded gradients and keeps the parameters gathered
    (each forward reshards as set, even after a step that failed between a B and a W)."""
    module.set_reshard_after_forward(reshard_after_forward)
    module.set_is_last_backward(False)
    module.set_reshard_after_backward(False)
    module.set_requires_gradient_sync(False)


class ShardReductions:
    """One step's FSDP reduce-scatters: each stage's once its last backward (or W) is done;
    and, under a zero-bubble schedule, each B and W run with the stage's parameters gathered.

    NOTE: B hands W the stage's parameters as the graph's leaves, which are FSDP's
    unsharded parameters only while gathered, and W resumes autograd below FSDP's
    pre-backward hook, so nothing would gather them for W. The action before each B or W
    gathers them (no collective when gathered; every replica runs the same schedule, so
    the all-gathers pair up) and keeps B's recomputed forward from freeing them again, as
    torch.distributed.pipelining's runtime unshards before its B and W.

    Args:
        last: the stage module whose gradients are final after each action.
        gather: the stage modules to gather after each action, for a B or W next.
        reshard_after_forward: the engine's setting, put back after each B or W.
    """

    def __init__(
        self, last: dict[Action, Any], gather: dict[Action, list[Any]], reshard_after_forward: bool
    ) -> None:
        self._last = last
        self._gather = gather
        self._reshard_after_forward = reshard_after_forward
        self._gathered: list[Any] = []

    def after(self, action: Action) -> None:
        for module in self._gathered:
            module.set_reshard_after_forward(self._reshard_after_forward)
        self._gathered = self._gather.get(action, [])
        module = self._last.get(action)
        if module is not None:
            _reduce(module)
        for module in self._gathered:
            module.set_reshard_after_forward(False)
            module.unshard()

    def finish(self, wait: Callable[[Any], None]) -> None:
        """The reduce-scatters ran in :meth:`after` (FSDP waited for them)."""


def _reduce(module: Any) -> None:
    """FSDP's post-backward for ``module`` once: reduce-scatter its gradients, reshard."""
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = module._get_fsdp_state()
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
