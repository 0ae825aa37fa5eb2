"""What the ranks of the data-parallel engine tests run (see test_data_parallel_engines.py).

Each scenario trains a DistributedGPipe under one engine ("replicate", "ddp", "fsdp") and
plain PyTorch on the same model and whole batch, computed by every rank itself, and returns
the largest differences: loss, every gradient this rank holds (FSDP's gathered to full
tensors), the eval output, and the parameters after optimizer steps; or, with dropout, the
differences from "replicate", which draws the same streams (plain training draws others).
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import gpipe.distributed as gd
import gpipe.distributed.data_parallel as engines
from gpipe.distributed.failure import PipelineFailure
from gpipe.planning.candidates import stages_per_device
from gpipe.schedule import Action, Schedule

WIDTH = 6


class SquaredLinear(nn.Linear):
    """A Linear of its squared weight: its weight gradient reads the weight (a Linear's
    reads only its input), so a W given freed parameters would be wrong."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight * self.weight, self.bias)


def mlp(
    layers: int = 4, seed: int = 0, dropout: float = 0.0, squared: bool = False
) -> nn.Sequential:
    torch.manual_seed(seed)
    linear = SquaredLinear if squared else nn.Linear
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [linear(WIDTH, WIDTH), nn.Tanh()]
        if dropout:
            blocks.append(nn.Dropout(dropout))
    return nn.Sequential(*blocks).double()


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered (a collective over its mesh), a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((_full(a).detach().double() - b.detach().double()).abs().max())


def _grad_diff(model: nn.Module, reference: nn.Module) -> tuple[float, int]:
    """The largest gradient difference over this rank's parameters, and how many it held."""
    worst, held = 0.0, 0
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if param.device.type == "meta":
            continue
        assert param.grad is not None, f"{name} on rank {dist.get_rank()} has no gradient"
        worst = max(worst, _diff(param.grad, ref[name].grad))
        held += 1
    return worst, held


def _param_diff(model: nn.Module, reference: nn.Module) -> float:
    ref = dict(reference.named_parameters())
    return max(
        (_diff(p, ref[n]) for n, p in model.named_parameters() if p.device.type != "meta"),
        default=0.0,
    )


# A zero-bubble schedule of 4 micro-batches whose W runs after a forward of its stage with
# no B between: the forward frees the parameters B gathered (under reshard_after_forward).
_W_AFTER_F_ROWS = (
    "0F0 0F1 0B0 0F2 0W0 0B1 0F3 0W1 0B2 0B3 0W2 0W3",
    "1F0 1B0 1F1 1W0 1B1 1F2 1W1 1B2 1F3 1W2 1B3 1W3",
)
W_AFTER_F = Schedule(
    "w-after-f", [[Action.parse(a) for a in row.split()] for row in _W_AFTER_F_ROWS], 4
)


def _schedule(name: str) -> tuple[str | Schedule, int]:
    """A schedule the pipe takes for ``name``, and its stages per device."""
    if name == W_AFTER_F.name:
        return W_AFTER_F, 1
    return name, stages_per_device(name)


COUNTS: Counter[str] = Counter()
COUNTING: list[bool] = []


def _counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        COUNTS[name] += 1
        return fn(*args, **kwargs)

    return counted


def _count_collectives() -> None:
    """Count FSDP's all-gathers and reduce-scatters and DDP's bucket reductions."""
    if not COUNTING:
        COUNTING.append(True)
        dist.all_gather_single = _counted("all_gather", dist.all_gather_single)
        dist.reduce_scatter_single = _counted("reduce_scatter", dist.reduce_scatter_single)
        engines._summed = _counted("ddp_bucket", engines._summed)  # type: ignore[assignment]


def parity(
    engine: str,
    schedules: list[str],
    batch: int = 7,
    chunks: int = 2,
    checkpoint: str = "except_last",
    reshard: bool = True,
    optimizer: str = "AdamW",
    clip: bool = False,
    squared: bool = False,
) -> dict[str, Any]:
    """Per schedule: two training steps (an eval and an optimizer step between, another
    after) under ``engine`` on pp=2 x dp=2, against plain training on the whole batch
    (of :func:`mlp`'s model, ``squared`` or not)."""
    world = dist.get_world_size()
    torch.manual_seed(1)
    xs = [torch.randn(batch, WIDTH, dtype=torch.float64) for _ in range(2)]
    ys = [torch.randn(batch, WIDTH, dtype=torch.float64) for _ in range(2)]
    loss_fn = nn.functional.mse_loss
    make: Any = getattr(torch.optim, optimizer)
    settings: dict[str, Any] = {"lr": 0.05}
    results: dict[str, Any] = {}
    _count_collectives()
    for schedule in schedules:
        reference = mlp(squared=squared)
        ref_opt = make(reference.parameters(), **settings)
        model = mlp(squared=squared)
        runs, virtual_stages = _schedule(schedule)
        pipe = gd.DistributedGPipe(
            model,
            chunks=chunks,
            schedule=runs,
            checkpoint=checkpoint,
            virtual_stages=virtual_stages,
            dp_size=2,
            data_parallel=engine,
            fsdp_reshard_after_forward=reshard,
            timeout=30,
        )
        opt = pipe.make_optimizer(make, **settings)
        diffs: dict[str, float] = {"loss": 0.0, "grad": 0.0, "eval": 0.0, "norm": 0.0}
        for step, (x, y) in enumerate(zip(xs, ys)):
            ref_opt.zero_grad()
            ref_loss = loss_fn(reference(x), y)
            ref_loss.backward()
            opt.zero_grad()
            COUNTS.clear()
            loss = pipe.train_step(x, y, loss_fn)
            diffs.update({f"step {step} {k}": float(n) for k, n in COUNTS.items()})
            diffs["loss"] = max(diffs["loss"], _diff(loss, ref_loss))
            grad, held = _grad_diff(model, reference)
            diffs["grad"] = max(diffs["grad"], grad)
            diffs["held"] = held
            if clip:  # the 2-norm after the first step, the max-norm after the second
                kind = 2.0 if step == 0 else float("inf")
                norm = pipe.clip_grad_norm_(0.1, norm_type=kind)
                ref_norm = torch.nn.utils.clip_grad_norm_(
                    reference.parameters(), 0.1, norm_type=kind
                )
                assert ref_norm > 0.1, ref_norm  # so the gradients were scaled
                diffs["norm"] = max(diffs["norm"], _diff(norm, ref_norm))
                diffs["grad"] = max(diffs["grad"], _grad_diff(model, reference)[0])
            if step == 0:  # an eval between the backward and the optimizer step
                out = pipe.eval_step(x)
                replica = dist.get_rank() // (world // 2)
                part = x[:4] if replica == 0 else x[4:]
                if out is not None:
                    diffs["eval"] = _diff(out, reference(part).detach())
            opt.step()
            ref_opt.step()
        diffs["params"] = _param_diff(model, reference)
        diffs["sharded"] = float(any(isinstance(p, DTensor) for p in pipe.parameters()))
        results[schedule] = diffs
        pipe.close()
    return results


def _batches(batch: int = 7) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(1)
    xs = [torch.randn(batch, WIDTH, dtype=torch.float64) for _ in range(2)]
    ys = [torch.randn(batch, WIDTH, dtype=torch.float64) for _ in range(2)]
    return xs, ys


def resumed(saves: list[str], loads: list[list[Any]], batch: int = 7) -> dict[str, float]:
    """A checkpoint saved after one optimizer step on pp=2 x dp=2 under each engine of
    ``saves``, loaded (model and AdamW state) into fresh pipes of other weights under each
    ``[engine, dp_size]`` of ``loads``, each trained one more step: the largest parameter
    difference from plain training's two steps, per ``"saved -> loaded dp"``."""
    xs, ys = _batches(batch)
    loss_fn = nn.functional.mse_loss
    reference = mlp()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for x, y in zip(xs, ys):
        ref_opt.zero_grad()
        loss_fn(reference(x), y).backward()
        ref_opt.step()
    folder = os.environ["GPIPE_TEST_DIR"]
    results: dict[str, float] = {}
    for saved in saves:
        path = f"{folder}/{saved}"
        model = mlp()
        pipe = gd.DistributedGPipe(
            model, chunks=2, schedule="1f1b", dp_size=2, data_parallel=saved, timeout=30
        )
        opt = pipe.make_optimizer(torch.optim.AdamW, lr=0.05)
        pipe.train_step(xs[0], ys[0], loss_fn)
        opt.step()
        pipe.save(path, optimizer=opt, extra={"step": 1})
        pipe.close()
        for engine, dp in loads:
            model = mlp(seed=7)
            pipe = gd.DistributedGPipe(
                model, chunks=2, schedule="1f1b", dp_size=dp, data_parallel=engine, timeout=30
            )
            opt = pipe.make_optimizer(torch.optim.AdamW, lr=0.05)
            assert pipe.load(path, optimizer=opt) == {"step": 1}
            opt.zero_grad()
            pipe.train_step(xs[1], ys[1], loss_fn)
            opt.step()
            results[f"{saved} -> {engine} dp={dp}"] = _param_diff(model, reference)
            pipe.close()
    return results


def dropout_alike(engines_run: list[str], checkpoint: str = "always") -> dict[str, float]:
    """A model with dropout, one training step under each engine (the same step seed):
    the largest difference of each engine's gradients from ``"replicate"``'s."""
    xs, ys = _batches()
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for engine in ["replicate", *engines_run]:
        model = mlp(dropout=0.3)
        pipe = gd.DistributedGPipe(
            model,
            chunks=2,
            schedule="1f1b",
            checkpoint=checkpoint,
            dp_size=2,
            data_parallel=engine,
            timeout=30,
        )
        torch.manual_seed(5)
        pipe.train_step(xs[0], ys[0], nn.functional.mse_loss)
        grads[engine] = {
            name: _full(p.grad).detach().clone()
            for name, p in model.named_parameters()
            if p.device.type != "meta" and p.grad is not None
        }
        pipe.close()
    reference = mlp(dropout=0.3).eval()  # the same model, dropping nothing
    nn.functional.mse_loss(reference(xs[0]), ys[0]).backward()
    kept = dict(reference.named_parameters())
    results = {
        "held": float(len(grads["replicate"])),
        "dropped": max(_diff(g, kept[n].grad) for n, g in grads["replicate"].items()),
    }
    for engine in engines_run:
        assert grads[engine].keys() == grads["replicate"].keys(), engine
        results[engine] = max(_diff(grads[engine][n], g) for n, g in grads["replicate"].items())
    return results


# In the order run: refused before any group is made, then by a built pipe's methods (a
# refusal while building a pipe's groups would end them: see engine_model_scenarios).
REFUSALS = [
    "unknown",
    "not_a_string",
    "reshard_not_a_bool",
    "ddp_zero",
    "fsdp_zero",
    "fsdp_generate",
    "fsdp_uneven_microbatches",
]


def refusals() -> dict[str, str]:
    """Every case of :data:`REFUSALS`: the error it raised, on this rank."""
    return {case: _refused(case) for case in REFUSALS}


def _refused(case: str) -> str:
    engine = "fsdp" if case.startswith("fsdp") else "ddp"
    kwargs: dict[str, Any] = {"dp_size": 2, "timeout": 30, "data_parallel": engine}
    model = mlp()
    call: Callable[[gd.DistributedGPipe], Any] | None = None
    if case == "unknown":
        kwargs["data_parallel"] = "zero3"
    elif case == "not_a_string":
        kwargs["data_parallel"] = 3
    elif case == "reshard_not_a_bool":
        kwargs["fsdp_reshard_after_forward"] = "yes"
    elif case.endswith("zero") and case != "unknown":
        kwargs["zero"] = True
    elif case == "fsdp_generate":
        call = lambda pipe: pipe.generate(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=1)  # noqa: E731
    elif case == "fsdp_uneven_microbatches":  # 3 samples over 2 replicas: 2 and 1 micro-batches
        kwargs["chunks"] = 2
        x = torch.randn(3, WIDTH, dtype=torch.float64)
        call = lambda pipe: pipe.train_step(x, x, nn.functional.mse_loss)  # noqa: E731
    try:
        pipe = gd.DistributedGPipe(model, **kwargs)
        if call is not None:
            try:
                call(pipe)
            finally:
                pipe.close()
    except (ValueError, TypeError, PipelineFailure) as error:
        return f"{type(error).__name__}: {error}"
    return ""
