"""Pipeline x data parallel on 4 processes: gpipe's engines against torch's PipelineStage + FSDP2.

Four gloo processes on CPU, one intra-op thread each, hold 2 replicas of a 2-stage pipeline
(pp=2 x dp=2; rank ``r`` is stage ``r % 2`` of replica ``r // 2``) of compute.py's
transformer (4 encoder layers, d=256), global batch 64 x 32 tokens, M=8 micro-batches per
replica, AdamW. The sides, all in turns in the same processes (each figure the median of
every timed step over ``--rounds`` turns; each step ends at a barrier, rank 0's clock):

- ours: ``DistributedGPipe(..., dp_size=2, data_parallel=...)`` with "replicate" (gpipe's
  own all-reduce), "ddp" (torch's DDP per stage), "fsdp" (``fully_shard`` per stage,
  resharded after each forward) and "fsdp_gathered" (``fsdp_reshard_after_forward=False``);
- torch: the composition torchtitan uses, on a ("dp", "pp") DeviceMesh: each layer and then
  each stage through ``fully_shard`` over "dp", the stage in a ``PipelineStage`` over "pp",
  run by ``Schedule1F1B`` (``ScheduleGPipe`` for the gpipe rows), which calls FSDP's
  no-sync and final reduce-scatter itself (``PipelineStage.perform_reduce_grad``);
  "torch_fsdp" reshards after forward, "torch_fsdp_gathered" does not.

Both sides start from the same weights on the same batch, so their first losses must agree
(printed): the comparison is of equal work. Model state per rank is what the rank holds
after an optimizer step, counted as the distinct storages of its parameters, gradients and
AdamW state (a DTensor's local shard under FSDP; DDP's own gradient buckets are not
counted); "in step" is the most it held at any layer's forward during a step (gathered
parameters and unsharded gradients too: under the gpipe schedule every forward precedes the
backwards, so there it misses the gradients). Under "fsdp" it is checked against
``(parameters + gradients + AdamW's 2 moments of the stage) / dp``; ``formula_ratio`` is
measured over that (goal: within 10 %).

    python benchmarks/scale_out.py
    python benchmarks/scale_out.py --quick          # a smoke run: 1 turn of 2 steps, 1f1b
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import gpipe.distributed as gd
from compute import MODELS, transformer

DP, PP = 2, 2
# label: (side, data_parallel or None, reshard_after_forward)
SIDES = {
    "replicate": ("ours", "replicate", True),
    "ddp": ("ours", "ddp", True),
    "fsdp": ("ours", "fsdp", True),
    "fsdp_gathered": ("ours", "fsdp", False),
    "torch_fsdp": ("torch", None, True),
    "torch_fsdp_gathered": ("torch", None, False),
}
# the sides also timed under the gpipe (fill-drain) schedule, unless --quick
GPIPE_SIDES = ("fsdp", "torch_fsdp")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    shape = MODELS["transformer"][1]
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def held_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The bytes of the distinct storages of ``params``, their gradients and ``optimizer``'s
    state, as this rank holds them (DTensors by their local shard; a freed storage is 0)."""
    params = list(params)
    seen: set[int] = set()

    def count(tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            storage = _local(t).untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "params": count(params),
        "grads": count(p.grad for p in params if p.grad is not None),
        "optimizer": count(state),
    }


# a side's step (returning the whole batch's loss), this rank's parameters as the optimizer
# holds them, the optimizer, and this rank's layers (as the stage module holds them)
Side = tuple[Callable[[], float], list[torch.Tensor], torch.optim.Optimizer, list[nn.Module]]


def _share(model: nn.Sequential) -> list[nn.Module]:
    """This rank's layers of ``model`` cut into PP equal stages (rank r holds stage r % PP)."""
    per, position = len(model) // PP, dist.get_rank() % PP
    return list(model)[position * per : (position + 1) * per]


def peak_bytes(
    step: Callable[[], float], layers: list[nn.Module], optimizer: torch.optim.Optimizer
) -> tuple[float, int]:
    """Run ``step`` once; also the most bytes of model state held at any layer's forward:
    the parameters the layers hold then (gathered ones too, under FSDP) and the optimizer's
    (their shards), their gradients (unsharded ones accumulating between reductions) and
    the optimizer's state."""
    peak = 0

    def sample(*_: Any) -> None:
        nonlocal peak
        held = [p for layer in layers for p in layer.parameters()]
        held += [p for group in optimizer.param_groups for p in group["params"]]
        peak = max(peak, sum(held_bytes(held, optimizer).values()))

    # NOTE: on a submodule, so that the sample runs inside an FSDP unit's forward (its
    # pre-forward hook, which gathers the parameters, has run)
    hooks = [next(layer.children()).register_forward_pre_hook(sample) for layer in layers]
    loss = step()
    for hook in hooks:
        hook.remove()
    return loss, peak


def _ours(label: str, schedule: str, m: int) -> Side:
    _, engine, reshard = SIDES[label]
    model = transformer()
    x, y = _batch()
    pipe = gd.DistributedGPipe(
        model, [len(model) // PP] * PP, chunks=m, schedule=schedule, checkpoint="never",
        dp_size=DP, data_parallel=engine, fsdp_reshard_after_forward=reshard,
    )  # fmt: skip
    optimizer = pipe.make_optimizer(torch.optim.AdamW, lr=1e-4)

    def step() -> float:
        loss = pipe.train_step(x, y, F.mse_loss)
        optimizer.step()
        return float(loss)

    return step, list(pipe.parameters()), optimizer, _share(model)


def _theirs(label: str, schedule: str, m: int, mesh: Any) -> Side:
    """torch.distributed.pipelining over FSDP2, as torchtitan composes them."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    _, _, reshard = SIDES[label]
    position, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    model = transformer()
    stage_module = nn.Sequential(*_share(model))
    for layer in stage_module:
        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=reshard)
    fully_shard(stage_module, mesh=mesh["dp"], reshard_after_forward=reshard)
    stage = PipelineStage(
        stage_module, position, PP, torch.device("cpu"), group=mesh["pp"].get_group()
    )
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    runner = kind(stage, m, loss_fn=F.mse_loss)  # scale_grads: the mean over micro-batches
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=1e-4)
    x, y = (t.tensor_split(DP)[replica] for t in _batch())
    first, last = position == 0, position == PP - 1

    def step() -> float:
        losses: list[torch.Tensor] = []
        if first:
            runner.step(x)
        else:
            runner.step(target=y, losses=losses)
        optimizer.step()
        # NOTE: the whole batch's loss: each last stage's mean over its micro-batches,
        # averaged over the replicas (equal parts), so every rank can print it
        mine = torch.stack(losses).detach().mean() if last else torch.zeros(())
        dist.all_reduce(mine)
        return float(mine) / DP

    return step, list(stage_module.parameters()), optimizer, list(stage_module)


def turns(m: int, schedules: list[str], steps: int, rounds: int) -> dict[str, Any]:
    """On every rank: every side, in turns; per (label, schedule) the median step (rank 0's
    clock), the first step's loss, this rank's held bytes after a step, and the most held
    at a forward during one."""
    from torch.distributed.device_mesh import init_device_mesh

    gd.init()
    mesh = init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))
    keys = [(label, "1f1b") for label in SIDES]
    if "gpipe" in schedules:
        keys += [(label, "gpipe") for label in GPIPE_SIDES]
    steps_of: dict[Any, Callable[[], float]] = {}
    optimizers: dict[Any, torch.optim.Optimizer] = {}
    loss: dict[Any, float] = {}
    held: dict[Any, dict[str, int]] = {}
    peak: dict[Any, int] = {}
    stage_bytes = 0
    for key in keys:
        label, schedule = key
        if SIDES[label][0] == "ours":
            step, params, optimizer, layers = _ours(label, schedule, m)
        else:
            step, params, optimizer, layers = _theirs(label, schedule, m, mesh)
        dist.barrier()
        loss[key] = step()  # the first step, from the initial weights: the losses agree
        optimizer.zero_grad()
        _, peak[key] = peak_bytes(step, layers, optimizer)  # with AdamW's state made
        held[key] = held_bytes(params, optimizer)
        optimizer.zero_grad()
        steps_of[key], optimizers[key] = step, optimizer
        stage_bytes = sum(p.numel() * p.element_size() for p in params)  # DTensors: full size
    times: dict[Any, list[float]] = {key: [] for key in keys}
    for _ in range(rounds):
        for key in keys:
            for i in range(steps + 1):
                dist.barrier()
                began = time.perf_counter()
                steps_of[key]()
                optimizers[key].zero_grad()
                dist.barrier()
                if i:
                    times[key].append(time.perf_counter() - began)
    return {
        "step": {key: statistics.median(t) for key, t in times.items()},
        "loss": loss,
        "held": held,
        "peak": peak,
        "stage_bytes": stage_bytes,
    }


def run(args: argparse.Namespace) -> None:
    """Every side in turns on 4 processes: a table, the losses, and a RESULT line."""
    m = args.microbatches
    schedules = ["1f1b"] if args.quick else ["1f1b", "gpipe"]
    steps, rounds = (2, 1) if args.quick else (args.steps, args.rounds)
    ranks = gd.spawn(turns, DP * PP, m, schedules, steps, rounds, threads=1)
    step, loss = ranks[0]["step"], ranks[0]["loss"]
    keys = list(step)
    held = {key: max(sum(r["held"][key].values()) for r in ranks.values()) for key in keys}
    peak = {key: max(r["peak"][key] for r in ranks.values()) for key in keys}
    formula = {r: 4 * ranks[r]["stage_bytes"] / DP for r in ranks}  # p + g + 2 moments
    ratios = [sum(ranks[r]["held"]["fsdp", "1f1b"].values()) / formula[r] for r in ranks]
    ratio = max(ratios, key=lambda x: abs(x - 1))
    print(
        f"transformer (4 layers, d=256), global batch 64, pp{PP} x dp{DP}, {DP * PP} processes "
        f"x 1 thread, M={m} per replica, AdamW, {rounds} turns x {steps} steps"
    )
    print(
        f"{'side':>20} {'schedule':>8} {'step ms':>9} {'of replicate':>13} "
        f"{'state MiB/rank':>15} {'params':>7} {'grads':>7} {'adamw':>7} "
        f"{'in step MiB':>12} {'first loss':>11}"
    )
    base = step["replicate", "1f1b"]
    for key in keys:
        label, schedule = key
        parts = max(ranks.values(), key=lambda r: sum(r["held"][key].values()))["held"][key]
        print(
            f"{label:>20} {schedule:>8} {step[key] * 1e3:9.1f} {step[key] / base:13.3f} "
            f"{held[key] / 2**20:15.2f} {parts['params'] / 2**20:7.2f} "
            f"{parts['grads'] / 2**20:7.2f} {parts['optimizer'] / 2**20:7.2f} "
            f"{peak[key] / 2**20:12.2f} {loss[key]:11.6f}"
        )
    spread = max(loss.values()) - min(loss.values())
    print(f"first losses: ours fsdp {loss['fsdp', '1f1b']!r}, torch {loss['torch_fsdp', '1f1b']!r}")
    print(
        f"fsdp formula: (params + grads + 2 AdamW moments of the stage) / dp = "
        f"{formula[0] / 2**20:.2f} MiB per rank; measured / formula per rank: "
        + " ".join(f"{x:.4f}" for x in ratios)
    )
    pairs = [("fsdp", "torch_fsdp"), ("fsdp_gathered", "torch_fsdp_gathered")]
    fields = [f"{label}_ms={step[label, '1f1b'] * 1e3:.1f}" for label in SIDES]
    fields = [("ours_" + f if not f.startswith("torch") else f) for f in fields]
    for ours, theirs in pairs:
        fields.append(f"torch_over_ours_{ours}={step[theirs, '1f1b'] / step[ours, '1f1b']:.3f}")
    if ("fsdp", "gpipe") in step:
        fields += [
            f"ours_fsdp_gpipe_ms={step['fsdp', 'gpipe'] * 1e3:.1f}",
            f"torch_fsdp_gpipe_ms={step['torch_fsdp', 'gpipe'] * 1e3:.1f}",
            f"torch_over_ours_gpipe={step['torch_fsdp', 'gpipe'] / step['fsdp', 'gpipe']:.3f}",
        ]
    fields += [f"state_mib_{label}={held[label, '1f1b'] / 2**20:.2f}" for label in SIDES]
    fields += [f"peak_mib_{label}={peak[label, '1f1b'] / 2**20:.2f}" for label in SIDES]
    fields += [f"formula_ratio={ratio:.4f}", f"loss_spread={spread:.2e}"]
    print("RESULT pp=2 dp=2 microbatches=" + str(m) + " " + " ".join(fields))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8, help="M per replica")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per turn")
    parser.add_argument("--rounds", type=int, default=3, help="turns of every side")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 turn, 2 steps")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
