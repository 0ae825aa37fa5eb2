"""What the ranks of the meta-init tests run: a split model built on meta, against plain.

The model's norms read ``self.weight`` in their forward, as GPT-2's ``Conv1D`` and Llama's
``RMSNorm`` do, so torch.fx traces into them; and the model's own forward reads a parameter
of its own (``pos``), as a ViT reads its ``pos_embed``.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gpipe
import gpipe.distributed as gd

WIDTH = 8


class Norm(nn.Module):
    """An RMSNorm that reads its weight itself: torch.fx traces into it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = Norm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class Net(nn.Module):
    def __init__(self, width: int = WIDTH, blocks: int = 4) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(width))
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(blocks)])
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def seeded_init(model: nn.Module, skip: type[nn.Module] | None = None) -> Callable:
    """An init_fn that seeds each of ``model``'s modules by its name, so a model built on
    meta and one built normally get the same values; it finds only the user's own modules
    (a module it does not know, it leaves alone)."""
    names = {id(m): name for name, m in model.named_modules()}

    def init_fn(module: nn.Module) -> None:
        name = names.get(id(module))
        if name is None or (skip is not None and isinstance(module, skip)):
            return
        torch.manual_seed(zlib.crc32(name.encode()))
        with torch.no_grad():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, 0.3)
                module.bias.normal_(0.0, 0.1)
            elif isinstance(module, Norm):
                module.weight.normal_(1.0, 0.1)
            elif isinstance(module, Net):
                module.pos.normal_(0.0, 0.1)

    return init_fn


def batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, WIDTH, generator=generator, dtype=torch.float64)
    return x, torch.randn(8, WIDTH, generator=generator, dtype=torch.float64)


def _plain(init_fn: Callable | None = None) -> tuple[nn.Module, torch.Tensor]:
    model = Net().double()
    model.apply(init_fn or seeded_init(model))
    x, y = batch()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return model, loss.detach()


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max())


def trains_like_plain(split_points: list[str]) -> Any:
    """A split Net built on meta, materialized with a seeded init_fn, against the same
    init on a model built normally: loss, and every gradient this rank holds, read from the
    user's own model."""
    with torch.device("meta"):
        model = Net().double()
    x, y = batch()
    stages = gpipe.split(model, split_points=split_points, example_inputs=(x,))
    pipe = gd.DistributedGPipe(stages, chunks=2, init_fn=seeded_init(model), timeout=30)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    plain, plain_loss = _plain()
    reference = dict(plain.named_parameters())
    trained, frozen, grad = [], [], 0.0
    for name, param in model.named_parameters():
        if param.is_meta:
            frozen.append(name)
            continue
        assert param.grad is not None, f"{name}: the user's parameter got no gradient"
        trained.append(name)
        grad = max(grad, _diff(param.grad, reference[name].grad))
    own = {id(p) for p in pipe.parameters()} == {id(p) for p in model.parameters() if not p.is_meta}
    pipe.close()
    return {
        "loss": _diff(loss, plain_loss),
        "grad": grad,
        "trained": trained,
        "frozen": frozen,
        "pipe_lists_the_users_tensors": own,
    }


def refuses_unwritten(how: str) -> Any:
    """An init_fn that skips the norms: the first step fails on every rank, unless the
    weights are written before it (``how``: "nothing", "copy" by name, or "load" of a
    checkpoint saved by a pipe over a model built normally)."""
    x, y = batch()
    points = ["blocks.2"]
    path = os.path.join(os.environ["GPIPE_TEST_DIR"], "checkpoint")
    plain = Net().double()
    plain.apply(seeded_init(plain))
    if how == "load":
        first = gd.DistributedGPipe(
            gpipe.split(plain, split_points=points, example_inputs=(x,)), chunks=2, timeout=30
        )
        first.save(path)
        first.close()
    with torch.device("meta"):
        model = Net().double()
    stages = gpipe.split(model, split_points=points, example_inputs=(x,))
    pipe = gd.DistributedGPipe(stages, chunks=2, init_fn=seeded_init(model, skip=Norm), timeout=30)
    if how == "copy":
        weights = plain.state_dict()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if not param.is_meta:
                    param.copy_(weights[name])
    elif how == "load":
        pipe.load(path)
    try:
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        pipe.close()
    _, plain_loss = _plain()
    return {"error": "", "loss": _diff(loss, plain_loss)}


def save_with_whole_model_optimizer() -> Any:
    """An optimizer over the whole model, not pipe.parameters(): pipe.save names the fix."""
    model = Net().double()
    x, y = batch()
    stages = gpipe.split(model, split_points=["blocks.2"], example_inputs=(x,))
    pipe = gd.DistributedGPipe(stages, chunks=2, timeout=30)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pipe.train_step(x, y, nn.functional.mse_loss)
    optimizer.step()
    try:
        pipe.save(os.path.join(os.environ["GPIPE_TEST_DIR"], "checkpoint"), optimizer=optimizer)
    except ValueError as error:
        return {"error": str(error)}
    finally:
        pipe.close()
    return {"error": ""}
