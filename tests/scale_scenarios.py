"""What the ranks of the scale-out tests run: replicas, tied weights, clipping, checkpoints."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import gpipe.distributed as gd
from dist_scenarios import mlp

WIDTH = 6


def batch(step: int, size: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(size, WIDTH, dtype=torch.float64, generator=generator)
    return x, torch.randn(size, WIDTH, dtype=torch.float64, generator=generator)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().cpu() - b.detach().cpu()).abs().max())


def replicas(dp: int, schedule: str, zero: bool, steps: int = 3, size: int = 11) -> Any:
    """pp x dp against plain AdamW training on the whole (uneven) batch."""
    model, plain = mlp(4), mlp(4)
    pipe = gd.DistributedGPipe(model, chunks=2, schedule=schedule, dp_size=dp, zero=zero)
    optimizer = pipe.make_optimizer(torch.optim.AdamW, lr=0.05)
    reference = torch.optim.AdamW(plain.parameters(), lr=0.05)
    worst = {"loss": 0.0, "weight": 0.0, "norm": 0.0}
    for step in range(steps):
        x, y = batch(step, size)
        loss = pipe.train_step(x, y, F.mse_loss)
        norm = pipe.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        expected = F.mse_loss(plain(x), y)
        expected.backward()
        plain_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        reference.step()
        reference.zero_grad()
        worst["loss"] = max(worst["loss"], _max_diff(loss, expected))
        worst["norm"] = max(worst["norm"], _max_diff(norm, plain_norm))
    for p, q in zip(model.parameters(), plain.parameters()):
        if not p.is_meta:
            worst["weight"] = max(worst["weight"], _max_diff(p, q))
    pipe.close()
    return {"worst": worst, "mesh": pipe.mesh.mesh.tolist(), "zero": type(optimizer).__name__}


def padded_tokens(dp: int) -> Any:
    """microbatch_weight normalized over the whole batch of every replica."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(10, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 10)
    ).double()
    plain = nn.Sequential(
        nn.Embedding(10, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 10)
    ).double()
    plain.load_state_dict(model.state_dict())
    pipe = gd.DistributedGPipe(model, chunks=3, dp_size=dp)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 10, (9, 5), generator=generator)
    target = torch.randint(0, 10, (9, 5), generator=generator)
    target[:4, 2:] = -100  # padding, unevenly spread over replicas and micro-batches

    def loss_fn(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), t.flatten(), ignore_index=-100)

    loss = pipe.train_step(ids, target, loss_fn, microbatch_weight=lambda t: (t != -100).sum())
    expected = loss_fn(plain(ids), target)
    expected.backward()
    grad = 0.0
    for p, q in zip(model.parameters(), plain.parameters()):
        if not p.is_meta:
            grad = max(grad, _max_diff(p.grad, q.grad))
    pipe.close()
    return {"loss": _max_diff(loss, expected), "grad": grad}


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Embedding(12, WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.token(ids)


class Head(nn.Module):
    """The LM head, tied to the embedding: the same Parameter object."""

    def __init__(self, embed: Embed) -> None:
        super().__init__()
        self.weight = embed.token.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight.t()


def tied_gpt(blocks: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    embed = Embed()
    layers: list[nn.Module] = [embed]
    for _ in range(blocks):
        layers += [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())]
    layers.append(Head(embed))
    return nn.Sequential(*layers).double()


def tied(steps: int = 20, dp: int = 1) -> Any:
    """A tied embedding/head across ranks: plain training for 20 AdamW steps, copies equal."""
    model, plain = tied_gpt(), tied_gpt()
    pipe = gd.DistributedGPipe(model, chunks=2, schedule="1f1b", dp_size=dp)
    optimizer = pipe.make_optimizer(torch.optim.AdamW, lr=0.02)
    reference = torch.optim.AdamW(plain.parameters(), lr=0.02)

    def loss_fn(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), t.flatten())

    worst = 0.0
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 12, (8, 4), generator=generator)
        target = torch.randint(0, 12, (8, 4), generator=generator)
        loss = pipe.train_step(ids, target, loss_fn)
        optimizer.step()
        optimizer.zero_grad()
        expected = loss_fn(plain(ids), target)
        expected.backward()
        reference.step()
        reference.zero_grad()
        worst = max(worst, _max_diff(loss, expected))
    names = dict(pipe.user_view().named_parameters(remove_duplicate=False))
    copies = {
        name: names[name].detach().cpu() for name in ("0.token.weight", "7.weight") if name in names
    }
    plain_names = dict(plain.named_parameters(remove_duplicate=False))
    weight = max(_max_diff(t, plain_names[n]) for n, t in copies.items()) if copies else 0.0
    pipe.close()
    return {"loss": worst, "weight": weight, "copies": copies, "ties": len(pipe.ties)}


def checkpointed(
    path: str,
    balance: list[int],
    dp: int,
    start: int,
    stop: int,
    save_at: int | None,
    zero: bool = False,
) -> Any:
    """Train steps start..stop-1 (loading ``path`` first if start > 0), saving after save_at."""
    model = mlp(4)
    pipe = gd.DistributedGPipe(model, balance, chunks=2, schedule="1f1b", dp_size=dp, zero=zero)
    optimizer = pipe.make_optimizer(torch.optim.AdamW, lr=0.05)
    if start:
        extra = pipe.load(path, optimizer=optimizer)
        assert extra["step"] == start, extra
    losses = []
    for step in range(start, stop):
        x, y = batch(step)
        losses.append(float(pipe.train_step(x, y, F.mse_loss)))
        optimizer.step()
        optimizer.zero_grad()
        if save_at is not None and step + 1 == save_at:
            pipe.save(path, optimizer=optimizer, extra={"step": step + 1, "note": "mid-run"})
    pipe.close()
    return {"losses": losses}


def killed_while_saving(path: str) -> Any:
    """Save once; then a rank dies in the middle of the second save."""
    model = mlp(4)
    pipe = gd.DistributedGPipe(model, chunks=2)
    x, y = batch(0)
    pipe.train_step(x, y, F.mse_loss)
    pipe.save(path, extra={"step": 1})
    import gpipe.distributed.checkpoint as checkpoint

    real = checkpoint.dcp.save

    def dying(*args: Any, **kwargs: Any) -> Any:
        # NOTE: before its part is written: once DCP's save returns, the checkpoint is whole
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    checkpoint.dcp.save = dying
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_meta:
                p.add_(1.0)  # the second save would hold different weights
    pipe.save(path, extra={"step": 2})
    return {}


def reads(path: str) -> Any:
    """The checkpoint's extra and first weight, loaded into a fresh pipe."""
    model = mlp(4)
    pipe = gd.DistributedGPipe(model, chunks=2)
    extra = pipe.load(path)
    first = next(p for p in model.parameters() if not p.is_meta).detach().clone()
    pipe.close()
    return {"extra": extra, "first": first}


def mismatched(path: str) -> Any:
    """Load a checkpoint of another model: the error names the keys."""
    model = mlp(5)
    pipe = gd.DistributedGPipe(model, chunks=2)
    try:
        pipe.load(path)
    except ValueError as error:
        return {"error": str(error)}
    return {"error": ""}


def gpt_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(200 + step)
    idx = torch.randint(0, 64, (8, 12), generator=generator)
    return idx, torch.roll(idx, -1, dims=1)


def split_gpt(
    path: str,
    split_points: list[str],
    start: int,
    stop: int,
    save_at: int | None,
    dp: int = 1,
    zero: bool = False,
) -> Any:
    """A GPT cut by gpipe.split, trained steps start..stop-1 (loading ``path`` first if
    start > 0, from weights it did not start with) and saved after ``save_at``; with what
    ``pipe.parameters()`` lists against this rank's own stages."""
    import gpipe
    from gpipe.models import GPT2Config, gpt2, gpt_loss

    model = gpt2(GPT2Config(n_layer=4), seed=1 if start else 0).double()
    stages = gpipe.split(model, split_points=split_points, example_inputs=(gpt_batch(0)[0],))
    pipe = gd.DistributedGPipe(stages, chunks=2, schedule="1f1b", dp_size=dp, zero=zero)
    listed = {id(p) for p in pipe.parameters()}
    own = {id(p) for p in pipe.partitions.parameters()}
    meta = sum(p.is_meta for p in pipe.parameters())
    optimizer = pipe.make_optimizer(torch.optim.AdamW, lr=1e-2)
    if start:
        assert pipe.load(path, optimizer=optimizer)["step"] == start
    losses = []
    for step in range(start, stop):
        idx, target = gpt_batch(step)
        losses.append(float(pipe.train_step(idx, target, gpt_loss)))
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == save_at:
            pipe.save(path, optimizer=optimizer, extra={"step": step + 1})
    pipe.close()
    return {"losses": losses, "only_own": listed == own, "meta": meta}
