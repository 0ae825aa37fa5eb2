"""What the ranks of a multi-process routing test run: a dataflow on DistributedGPipe.

Every rank builds the same :mod:`route_models` stages from a seed, computes plain training
of them itself, and returns the largest differences of its own loss, output and gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

import gpipe.distributed as gd
from route_models import batch, unet


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max())


def parity(runs: list[tuple[str, int, str]], chunks: int, size: int, tied: bool) -> Any:
    """For each (schedule, virtual stages, checkpoint): differences from plain training."""
    x, mask, target = batch(size)
    reference = unet(tied=tied)
    output = reference(x, mask=mask)
    loss = F.mse_loss(output, target)
    loss.backward()
    grads = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}
    results: dict[str, Any] = {}
    for schedule, virtual, checkpoint in runs:
        stages = unet(tied=tied)
        pipe = gd.DistributedGPipe(
            stages,
            chunks=chunks,
            schedule=schedule,
            virtual_stages=virtual,
            checkpoint=checkpoint,
            input_batch_dims={"mask": None},
        )
        got = pipe.train_step(x, target, F.mse_loss, kwargs={"mask": mask})
        diffs = {"loss": _diff(got, loss), "grad": 0.0, "checked": 0.0, "output": -1.0}
        for stage in pipe.local_stages:
            for name, param in stages[stage].named_parameters(remove_duplicate=False):
                assert param.grad is not None, f"{stage}.{name} has no grad"
                diffs["grad"] = max(diffs["grad"], _diff(param.grad, grads[f"{stage}.{name}"]))
                diffs["checked"] += 1
        mine = {id(p) for s in pipe.local_stages for p in stages[s].parameters()}
        diffs["foreign"] = float(  # tensors of other ranks' stages this rank still holds
            sum(
                1
                for s in range(len(stages))
                if s not in pipe.local_stages
                for p in stages[s].parameters()
                if not p.is_meta and id(p) not in mine
            )
        )
        out = pipe.eval_step(x, kwargs={"mask": mask})
        if out is not None:
            diffs["output"] = _diff(out, output)
        transfers = pipe.timeline.transfers
        diffs["skips"] = float(
            sum(1 for t in transfers if t.kind == "F" and t.stage - (t.sender or 0) > 1)
        )
        diffs["rank"] = float(dist.get_rank())
        results[f"{schedule}/{virtual}/{checkpoint}"] = diffs
        pipe.close()
    return results


def skippable_sequential(schedule: str, virtual_stages: int) -> Any:
    """A torchgpipe-style Sequential with a skip from the first layer to the last, on
    DistributedGPipe: differences from plain training, and the skip transfers seen."""
    import copy

    from torch import nn

    from gpipe.skip import pop, skippable, stash

    @skippable(stash=["skip"])
    class Keep(nn.Linear):
        def forward(self, x: torch.Tensor) -> Any:
            yield stash("skip", x)
            return super().forward(x)

    @skippable(pop=["skip"])
    class AddBack(nn.Linear):
        def forward(self, x: torch.Tensor) -> Any:
            skip = yield pop("skip")
            return super().forward(x) + skip

    torch.manual_seed(0)
    model = nn.Sequential(Keep(5, 5), nn.Tanh(), nn.Linear(5, 5), AddBack(5, 5)).double()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    target = torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    balance = [2, 2] if virtual_stages == 1 else [1, 1, 1, 1]
    pipe = gd.DistributedGPipe(
        model, balance, chunks=4, schedule=schedule, virtual_stages=virtual_stages
    )
    loss = pipe.train_step(x, target, F.mse_loss)
    expected = F.mse_loss(plain(x), target)
    expected.backward()
    grads = [
        _diff(mine.grad, theirs.grad)
        for mine, theirs in zip(model.parameters(), plain.parameters())
        if mine.grad is not None
    ]
    last = len(balance) - 1
    skips = sum(1 for t in pipe.timeline.transfers if {t.sender, t.stage} == {0, last} and last > 1)
    pipe.close()
    return {"loss": _diff(loss, expected), "grad": max(grads), "held": len(grads), "skips": skips}
