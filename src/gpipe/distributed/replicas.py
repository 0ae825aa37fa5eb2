"""Data parallel: each stage's gradients summed over its replicas, as soon as they are final.

Every replica runs the whole pipeline on its part of the batch; the micro-batch losses are
weighted over the whole batch (see :mod:`gpipe.loss`), so the gradients of the whole batch
are the *sum* of the replicas' gradients (exact for uneven parts too, where an average of
per-replica means is not). A stage's gradients are final after its last backward (or last W,
in zero-bubble schedules): its all-reduce starts right then, in buckets, asynchronously, and
runs while the other stages drain. The step waits for all of them at its end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gpipe.schedule import BACKWARD, WEIGHT, Action, Schedule

__all__ = ["GradientSync", "gradient_sync", "last_gradient_actions"]

BUCKET_BYTES = 25 * 2**20  # as DDP's default bucket: large enough to amortize each call


def last_gradient_actions(schedule: Schedule, device: int) -> dict[int, Action]:
    """For each stage on ``device``: the action after which its gradients are final."""
    kind = WEIGHT if schedule.split_backward else BACKWARD
    last: dict[int, Action] = {}
    for action in schedule.actions[device]:
        for unit in action.units:  # a fused action finishes its backward's stage
            if unit.kind == kind:
                last[unit.stage] = action
    return last


class GradientSync:
    """One step's gradient all-reduces over the replicas, started stage by stage.

    Args:
        parameters: per local stage, its parameters that take gradients.
        last: per local stage, the action after which to start (see
            :func:`last_gradient_actions`).
        group: the replicas' process group for this rank's stages.
    """

    def __init__(
        self,
        parameters: Mapping[int, Sequence[torch.Tensor]],
        last: Mapping[int, Action],
        group: Any,
    ) -> None:
        self._parameters = parameters
        self._last = {action: stage for stage, action in last.items()}
        self._group = group
        self._pending: list[tuple[Any, list[torch.Tensor], torch.Tensor]] = []

    def after(self, action: Action) -> None:
        """Called by the worker after each action: start a stage whose gradients are final."""
        stage = self._last.get(action)
        if stage is not None:
            for bucket in _buckets(self._parameters[stage]):
                self.start(bucket)

    def start(self, bucket: list[torch.Tensor]) -> None:
        """Sum one bucket's gradients over the replicas, asynchronously.

        A parameter with no gradient on this replica sends zeros and a 0 flag; after the
        sum, it takes a gradient only if some replica had one (as a parameter unused by the
        whole batch has none in plain training).
        """
        device, dtype = bucket[0].device, bucket[0].dtype
        grads = [
            p.grad.reshape(-1)
            if p.grad is not None
            else torch.zeros(p.numel(), dtype=dtype, device=device)
            for p in bucket
        ]
        flags = torch.tensor([p.grad is not None for p in bucket], dtype=dtype, device=device)
        flat = torch.cat([*grads, flags])
        work = dist.all_reduce(flat, group=self._group, async_op=True)
        self._pending.append((work, bucket, flat))

    def finish(self, wait: Callable[[Any], None]) -> None:
        """Wait (with ``wait``, which watches for failures) and write the sums back."""
        for work, bucket, flat in self._pending:
            wait(work)
            offset = 0
            flags = flat[-len(bucket) :]
            for p, had in zip(bucket, flags.tolist()):
                n = p.numel()
                if had > 0:
                    summed = flat[offset : offset + n].view_as(p).to(p.device)
                    if p.grad is None:
                        p.grad = summed.clone()
                    else:
                        p.grad.copy_(summed)
                offset += n
        self._pending = []


def _buckets(parameters: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters in order, cut into buckets of one dtype and at most ``BUCKET_BYTES``."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for p in parameters:
        nbytes = p.numel() * p.element_size()
        if not buckets or buckets[-1][0].dtype != p.dtype or size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def gradient_sync(
    modules: Callable[[int], torch.nn.Module],
    stages: Sequence[int],
    schedule: Schedule,
    device: int,
    group: Any,
) -> GradientSync:
    """The gradient all-reduces of one step over the replicas, for the ``stages`` on
    pipeline ``device`` (``modules(stage)`` is a stage's module)."""
    parameters = {
        stage: [p for p in modules(stage).parameters() if p.requires_grad] for stage in stages
    }
    return GradientSync(parameters, last_gradient_actions(schedule, device), group)
