"""Data-parallel engines: how each stage's gradients are summed over its replicas.

``DistributedGPipe(..., data_parallel=...)`` picks one per pipe:

- ``"replicate"`` (the default): gpipe's own bucketed all-reduce, started as soon as a
  stage's gradients are final (see :mod:`gpipe.distributed.replicas`).
- ``"ddp"``: each held stage module under torch's ``DistributedDataParallel`` over its
  replicas' group. The micro-batches' backwards accumulate without it; its reducer is armed
  (``reducer.prepare_for_backward``, as ``torch.distributed.pipelining`` does) only for the
  stage's last backward (or last W), whose gradient hooks all-reduce the accumulated
  gradients in DDP's buckets. A comm hook sums instead of DDP's average.
- ``"fsdp"``: each held stage module through torch's ``fully_shard`` over the mesh's "dp"
  dimension, one FSDP unit per stage: parameters, gradients and optimizer state are
  sharded. Every backward runs with ``set_requires_gradient_sync(False)`` and
  ``set_reshard_after_backward(False)``, so the gradients accumulate unsharded and the
  parameters stay gathered for the next backward; after the stage's last backward (or W),
  ``set_is_last_backward(True)`` and FSDP's own post-backward reduce-scatter the gradients
  once, and reshard (torch.distributed.pipelining's ``perform_reduce_grad``). The
  gradients are DTensors sharded on dim 0. Under a zero-bubble schedule, B and W run
  with the stage's parameters gathered, as torch.distributed.pipelining's runtime
  unshards before them: W resumes a graph whose leaves are FSDP's unsharded parameters,
  which a forward between B and W frees under ``reshard_after_forward`` (see
  :class:`~gpipe.distributed.data_parallel_fsdp.ShardReductions`).

The micro-batch losses are weighted over the whole batch (see :mod:`gpipe.loss`), so the
whole batch's gradient is the *sum* over the replicas: every engine sums (DDP through its
comm hook, FSDP with a divide factor of 1), exact for uneven replica parts too.

The pipe's other methods need nothing from the engine but :attr:`DataParallel.shards_over`:
``clip_grad_norm_`` combines the norms of FSDP's gradient shards over the replicas too (see
:mod:`gpipe.distributed.clipping`), and checkpoints hold FSDP's parameters and optimizer
state as the DTensors they are, which torch.distributed.checkpoint saves shard by shard
under the user's names and loads into any engine and layout (DDP's modules are the user's
layers, unwrapped). What still runs under "replicate" only is refused, naming the fix.

Every model the pipe takes runs under each engine: a dataflow model's stage modules are
wrapped like a chain's (the workers call the stage module either way, so FSDP's hooks run);
a model built on meta is materialized (this rank's stages only) before the engine wraps
it; a weight tied between stages on different ranks is summed over the replicas by each
holder's engine (under FSDP, shard by shard: a replica's holders hold the same rows) and
then over the holders.
"""

# NOTE: no `from __future__ import annotations`: DDP checks its comm hook's annotations as
# objects (the bucket must be annotated dist.GradBucket itself, not a string).

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpipe.distributed.replicas import gradient_sync, last_gradient_actions
from gpipe.runtime.stage_set import StageSet
from gpipe.schedule import Action, Schedule

__all__ = ["ENGINES", "DataParallel", "Ddp", "check_data_parallel", "check_untied"]

ENGINES = ("replicate", "ddp", "fsdp")


def check_data_parallel(
    name: Any,
    reshard_after_forward: Any,
    *,
    dp: int,
    zero: bool,
) -> None:
    """Refuse an engine that is not one, and what does not run yet under ``"ddp"`` or
    ``"fsdp"`` (every rank alike: the same arguments and model).

    Raises:
        TypeError: ``name`` is not a string, or ``reshard_after_forward`` not a bool.
        ValueError: ``name`` is not one of :data:`ENGINES`; or a combination the engine
            does not run yet, and the engine that runs it.
    """
    if not isinstance(name, str):
        raise TypeError(
            f"data_parallel must be one of {', '.join(map(repr, ENGINES))}, got "
            f"{type(name).__name__} {name!r}"
        )
    if name not in ENGINES:
        raise ValueError(
            f"data_parallel must be one of {', '.join(map(repr, ENGINES))}, got {name!r}"
        )
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"fsdp_reshard_after_forward must be True or False, got {reshard_after_forward!r}"
        )
    if name == "replicate" or dp == 1:
        return
    if zero:
        hint = "; FSDP shards the optimizer state itself" if name == "fsdp" else ""
        raise ValueError(f"zero=True with data_parallel={name!r} is not supported{hint}: {_FIX}")


_FIX = "use data_parallel='replicate' (the default), which runs it"


def check_untied(name: str, dp: int, rank: Any) -> None:
    """Refuse one Parameter used by two stages this rank holds under ``"ddp"`` or
    ``"fsdp"``: each stage's engine would reduce (or shard) it on its own.

    Weights tied between stages on different ranks run under every engine: each holder's
    engine sums its copy's gradient over the replicas (FSDP: its shard), and the
    :class:`~gpipe.distributed.ties.TiedWeights` sum the copies over the holders.

    Args:
        name: the engine.
        dp: the replicas.
        rank: this rank's :class:`~gpipe.distributed.construction.RankStages`.

    Raises:
        ValueError: a weight two stages of this rank use, and the engine that runs it.
    """
    if name == "replicate" or dp == 1:
        return
    if _shared([rank.stage_set.module(s) for s in rank.local]):
        raise ValueError(
            f"a Parameter that two stages of one rank use (tied weights placed on the same "
            f"rank) with data_parallel={name!r} is not supported: each stage's engine would "
            f"reduce it on its own; place the tied stages on different ranks (another "
            f"balance or schedule), or {_FIX}"
        )


class DataParallel:
    """One pipe's data-parallel engine, over this rank's stages (``"replicate"`` as is).

    Args:
        name: the engine, one of :data:`ENGINES`.
        stages: this rank's stages.
        local: the stages this rank holds.
        position: this rank's pipeline device.
        group: the replicas' process group (None without replicas).
    """

    def __init__(
        self, name: str, stages: StageSet, local: Sequence[int], position: int, group: Any
    ) -> None:
        self.name = name
        self._stages = stages
        self._local = list(local)
        self._position = position
        self._group = group
        # the group whose ranks each hold a shard of every gradient (FSDP's replicas)
        self.shards_over: Any = None

    def sync(self, schedule: Schedule) -> Any:
        """What sums one training step's gradients: an object with ``after(action)``,
        called after each action the worker ran, and ``finish(wait)``; None without replicas."""
        if self._group is None:
            return None
        return gradient_sync(
            self._stages.module, self._local, schedule, self._position, self._group
        )

    def settle(self) -> None:
        """After a step without backward: nothing to put back."""

    def check_microbatches(self, count: int, wait: Callable[[Any], None]) -> None:
        """Before a step of ``count`` micro-batches on this replica: nothing to agree on."""

    def refuse(self, call: str) -> None:
        """Refuse a pipe method that does not run under this engine yet.

        Raises:
            ValueError: this engine does not run ``call``; the message names the fix.
        """
        if self._group is None or call not in _REFUSED.get(self.name, ()):
            return
        raise ValueError(
            f"pipe.{call} with data_parallel={self.name!r} is not supported yet: use "
            "data_parallel='replicate' (the default), which runs it"
        )


_REFUSED = {
    "fsdp": ("generate",),
}


# -- DDP -------------------------------------------------------------------------------------


class _Summed:
    """The state of :func:`_summed` for one stage: its group, and whether the step reduced
    its last bucket."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.reduced_last = False


def _summed(state: _Summed, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that sums a bucket over the replicas (DDP's own averages)."""
    if bucket.is_last():
        state.reduced_last = True
    work = dist.all_reduce(bucket.buffer(), group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class Ddp(DataParallel):
    def __init__(self, stages: StageSet, local: Sequence[int], position: int, group: Any) -> None:
        super().__init__("ddp", stages, local, position, group)
        from torch.nn.parallel import DistributedDataParallel

        self._wrapped: dict[int, Any] = {}
        self._hooks: dict[int, _Summed] = {}
        for stage in self._local:
            module = stages.module(stage)
            if not any(p.requires_grad for p in module.parameters()):
                continue  # NOTE: DDP refuses a module with nothing to reduce
            device = stages.device_of(stage)
            wrapped = DistributedDataParallel(
                module,
                device_ids=[device] if device.type == "cuda" else None,
                process_group=group,
                # NOTE: its forward is never called (the workers call the stage module):
                # buffers (batch norm statistics) stay per replica, as under "replicate"
                forward_sync_buffers=False,
            )
            self._hooks[stage] = _Summed(group)
            wrapped.register_comm_hook(self._hooks[stage], _summed)
            self._wrapped[stage] = wrapped

    def sync(self, schedule: Schedule) -> Any:
        return _ArmedReducers(self._wrapped, self._hooks, schedule, self._position)


class _ArmedReducers:
    """One step's DDP reductions: each stage's reducer armed for its last backward alone.

    NOTE: armed after the action before the stage's last gradient action (no backward of
    the stage runs between), so the worker needs no hook before an action.
    """

    def __init__(
        self,
        wrapped: dict[int, Any],
        hooks: dict[int, _Summed],
        schedule: Schedule,
        device: int,
    ) -> None:
        self._wrapped = wrapped
        self._hooks = hooks
        self._armed: list[int] = []
        self._arm_after: dict[Action, list[int]] = {}
        actions = list(schedule.actions[device])
        for stage, last in last_gradient_actions(schedule, device).items():
            if stage not in wrapped:
                continue
            index = actions.index(last)
            if index == 0:
                self._arm(stage)
            else:
                self._arm_after.setdefault(actions[index - 1], []).append(stage)

    def _arm(self, stage: int) -> None:
        wrapped = self._wrapped[stage]
        self._hooks[stage].reduced_last = False
        # NOTE: DDP's forward would rebuild its buckets in gradient order after the first
        # step, and records every gradient until it does: done here, on every replica alike.
        wrapped.reducer._rebuild_buckets()
        wrapped.reducer.prepare_for_backward([])
        self._armed.append(stage)

    def after(self, action: Action) -> None:
        for stage in self._arm_after.get(action, ()):
            self._arm(stage)

    def finish(self, wait: Callable[[Any], None]) -> None:
        """Check that every armed stage reduced all its buckets (DDP waited for them)."""
        for stage in self._armed:
            if not self._hooks[stage].reduced_last:
                raise RuntimeError(
                    f"stage {stage}'s last backward did not give every parameter a gradient, "
                    "so DDP could not reduce them (a parameter the stage does not use, or a "
                    "last micro-batch of loss weight 0): freeze such parameters "
                    "(requires_grad=False), or use data_parallel='replicate'"
                )


def _shared(modules: Sequence[nn.Module]) -> bool:
    """Whether two of ``modules`` hold one Parameter (weights tied on one rank)."""
    seen: set[int] = set()
    for module in modules:
        mine = {id(p) for p in module.parameters()}
        if seen & mine:
            return True
        seen |= mine
    return False
