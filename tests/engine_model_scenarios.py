"""What the ranks of test_data_parallel_models.py run: models other than a plain chain under
torch's engines ("ddp", "fsdp") on pp=2 x dp=2, against plain training on the whole batch.

Each case trains a DistributedGPipe two steps (an AdamW step of ``pipe.make_optimizer``
between and after) and plain PyTorch on the same model, computed by every rank itself, and
returns the largest differences of the loss, every gradient this rank holds (FSDP's gathered
to full tensors; before and after clipping), the clipped norm and the parameters after the
steps, read from the user's own model:

- ``"split"``: :mod:`meta_scenarios`' Net cut by :func:`gpipe.split` inside a residual
  block, so the block's input skips from stage 0 to stage 1 (a dataflow model);
- ``"meta"``: the same split Net built on the meta device, each rank materializing only its
  own stage with a seeded ``init_fn`` (equal to the plain model's init);
- ``"tied"``: a Sequential whose first and last Linear are one Parameter, used by stages on
  different ranks (each holder keeps a copy; their gradients are summed);
- ``"declared"``: the same tie declared by name (``tied=``) over two Parameters.

:func:`shared_on_one_rank` is what stays refused: one Parameter in two stages of one rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import gpipe
import gpipe.distributed as gd
from engine_scenarios import _diff, mlp
from gpipe.distributed.failure import PipelineFailure
from meta_scenarios import Net, batch, seeded_init

SPLIT = ["blocks.1.fc"]  # inside block 1: its residual input crosses to stage 1


def _net(meta: bool) -> tuple[nn.Module, Any]:
    """A Net (on meta, or built and seeded), and the Stages of its split."""
    if meta:
        with torch.device("meta"):
            model = Net().double()
    else:
        model = Net().double()
        model.apply(seeded_init(model))
    return model, gpipe.split(model, split_points=SPLIT, example_inputs=(batch()[0],))


def _tied() -> nn.Sequential:
    model = mlp()
    model[6].weight = model[0].weight  # one Parameter, on stage 0 and stage 1
    return model


def _plain(case: str) -> nn.Module:
    if case in ("tied", "declared"):
        return _tied()
    model = Net().double()
    model.apply(seeded_init(model))
    return model


def _batches(case: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if case in ("tied", "declared"):
        torch.manual_seed(1)
        return [(torch.randn(7, 6).double(), torch.randn(7, 6).double()) for _ in range(2)]
    return [batch(0), batch(1)]


def _trained(pipe: gd.DistributedGPipe, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The user's parameters (by name) that this rank trains: those of pipe.parameters().

    NOTE: under FSDP, a Parameter two ranks share (a tie) is replaced by a DTensor where
    this rank uses it; the other stage's place in the user's model keeps the old one.
    """
    mine = {id(p) for p in pipe.parameters()}
    return [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if id(p) in mine]


def models(runs: list[list[str]]) -> dict[str, dict[str, Any]]:
    """Per ``[engine, case]`` of ``runs``, as ``"engine case"``: the largest differences
    from plain training, and the names of the user's parameters this rank trains."""
    results: dict[str, dict[str, Any]] = {}
    loss_fn = nn.functional.mse_loss
    for engine, case in runs:
        reference = _plain(case)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
        kwargs: dict[str, Any] = {}
        if case in ("tied", "declared"):
            model: nn.Module = _tied() if case == "tied" else mlp()
            pipeline: Any = model
            if case == "declared":  # two Parameters; the copies start from 0.weight's
                kwargs["tied"] = [("0.weight", "6.weight")]
                with torch.no_grad():
                    model[6].weight.normal_()
        else:
            model, pipeline = _net(meta=case == "meta")
            if case == "meta":
                kwargs["init_fn"] = seeded_init(model)
        pipe = gd.DistributedGPipe(
            pipeline,
            chunks=2,
            schedule="1f1b",
            dp_size=2,
            data_parallel=engine,
            timeout=30,
            **kwargs,
        )
        opt = pipe.make_optimizer(torch.optim.AdamW, lr=0.05)
        diffs = {"loss": 0.0, "grad": 0.0, "norm": 0.0}
        for x, y in _batches(case):
            ref_opt.zero_grad()
            ref_loss = loss_fn(reference(x), y)
            ref_loss.backward()
            opt.zero_grad()
            loss = pipe.train_step(x, y, loss_fn)
            diffs["loss"] = max(diffs["loss"], _diff(loss, ref_loss))
            ref = dict(reference.named_parameters(remove_duplicate=False))
            for name, param in _trained(pipe, model):
                assert param.grad is not None, f"{case}: {name} has no gradient"
                diffs["grad"] = max(diffs["grad"], _diff(param.grad, ref[name].grad))
            # a tied weight's copies count once in the norm, over pp and dp
            norm = pipe.clip_grad_norm_(0.1)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
            assert ref_norm > 0.1, ref_norm  # so the gradients were scaled
            diffs["norm"] = max(diffs["norm"], _diff(norm, ref_norm))
            for name, param in _trained(pipe, model):
                diffs["grad"] = max(diffs["grad"], _diff(param.grad, ref[name].grad))
            opt.step()
            ref_opt.step()
        ref = dict(reference.named_parameters(remove_duplicate=False))
        trained = _trained(pipe, model)
        diffs["params"] = max(_diff(p, ref[n]) for n, p in trained)
        diffs["sharded"] = float(all(isinstance(p, DTensor) for _, p in trained))
        results[f"{engine} {case}"] = {**diffs, "trained": sorted(n for n, _ in trained)}
        pipe.close()
    return results


def shared_on_one_rank(engine: str) -> str:
    """One Parameter in stages 0 and 2, both on rank 0 (interleaved): the error raised."""
    model = mlp()
    model[4].weight = model[0].weight
    try:
        gd.DistributedGPipe(
            model,
            chunks=2,
            schedule="interleaved",
            virtual_stages=2,
            dp_size=2,
            data_parallel=engine,
            timeout=30,
        ).close()
    except (ValueError, PipelineFailure) as error:
        return f"{type(error).__name__}: {error}"
    return ""
