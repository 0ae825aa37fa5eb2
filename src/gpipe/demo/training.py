"""The demo's training loop: on a local pipe, or on one process per stage (``--distributed``)."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe.analysis import Timeline
from gpipe.demo.recipe import Corpus, DemoSettings, learning_rate
from gpipe.models import gpt, gpt_loss
from gpipe.schedule import default_virtual_stages

__all__ = ["Run", "build_model", "train_distributed", "train_local", "validation_loss"]


@dataclass
class Run:
    """What training left: per step its loss, seconds and bubble; the last step's timeline
    and the simulator's account of it; the trained parameters, keyed as in the model."""

    losses: list[float]
    seconds: list[float]
    bubbles: list[float]
    timeline: Timeline
    predicted: Timeline
    state: dict[str, torch.Tensor]


def build_model(settings: DemoSettings, corpus: Corpus) -> nn.Sequential:
    """The untrained model, the same in every process for the same seed."""
    torch.manual_seed(settings.seed)
    return gpt(corpus.config)


@torch.no_grad()
def validation_loss(model: nn.Module, corpus: Corpus) -> float:
    """Mean next-character loss on the held-out windows (nats)."""
    training = model.training
    model.eval()
    ids, targets = corpus.validation
    try:
        return float(gpt_loss(model(ids), targets))
    finally:
        model.train(training)


def virtual_stages(schedule: str) -> int:
    """Model stages per device: two for the schedules that interleave or fold a V."""
    return default_virtual_stages(schedule)


def train_local(settings: DemoSettings, corpus: Corpus, balance: list[int]) -> Run:
    """Train with :class:`gpipe.GPipe`, every stage a worker thread of this process."""
    from gpipe.pipe import GPipe

    # NOTE: one intra-op thread per stage worker: the workers are the parallelism, and more
    # threads than cores make every stage slower.
    torch.set_num_threads(1)
    model = build_model(settings, corpus)
    pipe = GPipe(
        model,
        balance,
        devices=["cpu"] * settings.stages,
        chunks=settings.chunks,
        checkpoint=settings.checkpoint,
        schedule=settings.schedule,
        virtual_stages=virtual_stages(settings.schedule),
    )
    losses, seconds, bubbles = _loop(settings, corpus, pipe, lambda: pipe.timeline, show=True)
    return Run(
        losses, seconds, bubbles, pipe.timeline, pipe.predicted_timeline(), model.state_dict()
    )


def train_distributed(settings: DemoSettings, corpus: Corpus, balance: list[int]) -> Run:
    """Train in ``settings.distributed`` processes (torch's elastic launcher), one stage each.

    Each process returns its own stages' parameters; rank 0 also the losses and timelines.
    """
    gd = _distributed()
    results = gd.spawn(_train_rank, settings.distributed, settings, balance, threads=1)
    state: dict[str, torch.Tensor] = {}
    for result in results.values():
        state.update(result["state"])
    first = results[0]
    del corpus  # every process loads its own copy of the text
    return Run(
        first["losses"],
        first["seconds"],
        first["bubbles"],
        first["timeline"],
        first["predicted"],
        state,
    )


def _train_rank(settings: DemoSettings, balance: list[int]) -> dict[str, Any]:
    """One process of the distributed demo (module level, so the launcher can pickle it)."""
    gd = _distributed()
    rank, _ = gd.init()
    torch.set_num_threads(1)
    corpus = Corpus.load(settings.seed)
    model = build_model(settings, corpus)
    pipe = gd.DistributedGPipe(
        model,
        balance,
        chunks=settings.chunks,
        checkpoint=settings.checkpoint,
        schedule=settings.schedule,
        virtual_stages=virtual_stages(settings.schedule),
    )
    losses, seconds, bubbles = _loop(settings, corpus, pipe, lambda: pipe.timeline, show=rank == 0)
    timeline, predicted = pipe.timeline, pipe.predicted_timeline()  # collectives: every rank
    # Each process holds only its own stages, whose keys read as in the whole model.
    state = {
        key: value.detach().cpu()
        for partition in pipe.partitions
        for key, value in partition.state_dict().items()
    }
    pipe.close()
    if rank != 0:
        return {"state": state}
    return {
        "state": state,
        "losses": losses,
        "seconds": seconds,
        "bubbles": bubbles,
        "timeline": timeline,
        "predicted": predicted,
    }


def _distributed() -> Any:
    """``gpipe.distributed``, imported when a distributed demo runs."""
    # NOTE: by name, so this module also type-checks where the package is not installed.
    return importlib.import_module("gpipe.distributed")


def _loop(
    settings: DemoSettings,
    corpus: Corpus,
    pipe: Any,
    timeline: Callable[[], Timeline],
    *,
    show: bool,
) -> tuple[list[float], list[float], list[float]]:
    """Train ``settings.steps`` steps; a progress bar shows loss, samples/s and the bubble."""
    from tqdm import tqdm

    optimizer = torch.optim.AdamW(pipe.parameters(), lr=settings.lr, betas=(0.9, 0.99))
    losses: list[float] = []
    seconds: list[float] = []
    bubbles: list[float] = []
    batches = corpus.batches(settings)
    with tqdm(batches, desc="training", unit="step", disable=not show, leave=True) as bar:
        for step, (ids, targets) in enumerate(bar):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(settings, step)
            began = time.perf_counter()
            loss = pipe.train_step(ids, targets, gpt_loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds.append(time.perf_counter() - began)
            losses.append(float(loss))
            bubbles.append(timeline().bubble)
            bar.set_postfix(
                loss=f"{losses[-1]:.3f}",
                samples_s=f"{settings.batch / seconds[-1]:.0f}",
                bubble=f"{bubbles[-1]:.0%}",
            )
    return losses, seconds, bubbles
