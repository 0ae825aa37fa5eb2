"""Plain training beside the pipe: the same model, the same micro-batches, one after another.

Plain gradient accumulation runs the M micro-batches one after another in one thread of
control: no hand-offs, no recomputation, no idle stages. The pipe runs its stages at once
but recomputes checkpointed forwards and pays a hand-off per action. Which wins depends on
the cores: here the stages share the machine's few cores, so the pipe can at best tie.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from gpipe.bench.turns import LoadMeter, Verdict, judge
from gpipe.demo.recipe import Corpus, DemoSettings
from gpipe.demo.training import build_model, virtual_stages
from gpipe.models import gpt_loss

__all__ = ["Comparison", "compare", "comparison_rows"]


@dataclass(frozen=True)
class Comparison:
    """Median seconds per training step (forward, backward, optimizer) of each way to train.

    Attributes:
        plain: plain gradient accumulation at its best thread count.
        plain_threads: that thread count.
        pipe: the pipe as the demo ran it.
        never: the same pipe with ``checkpoint="never"`` (no recomputation); None when the
            demo ran without checkpointing or in several processes.
        pipe_measured_in_training: ``pipe`` comes from the training steps (several
            processes) rather than from rounds alternating with plain training.
        verdict: the pipe's step times against plain training's; it says whether this
            run can tell them apart, and why not.
    """

    plain: float
    plain_threads: int
    pipe: float
    never: float | None
    pipe_measured_in_training: bool
    verdict: Verdict


def compare(
    settings: DemoSettings,
    corpus: Corpus,
    balance: list[int],
    state: dict[str, torch.Tensor],
    training_seconds: list[float],
    *,
    rounds: int = 5,
) -> Comparison:
    """Time plain training and the pipe on the trained model, in alternating rounds.

    Alternating (one step of each per round, medians over the rounds) keeps a machine whose
    load changes from favouring whichever ran first.
    """
    batch = corpus.batches(settings)[-1]
    cores = os.cpu_count() or 1
    contenders: dict[str, tuple[Callable[[], None], int]] = {
        "plain1": (_plain_step(settings, corpus, state, batch), 1),
    }
    if cores > 1:
        contenders[f"plain{cores}"] = (_plain_step(settings, corpus, state, batch), cores)
    local = not settings.distributed
    if local:
        contenders["pipe"] = (_pipe_step(settings, corpus, state, balance, batch), 1)
        if settings.checkpoint != "never":
            never = _pipe_step(settings, corpus, state, balance, batch, checkpoint="never")
            contenders["never"] = (never, 1)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    previous = torch.get_num_threads()
    meter = LoadMeter()
    try:
        for round_ in range(rounds + 1):
            for name, (step, threads) in contenders.items():
                torch.set_num_threads(threads)
                began = time.perf_counter()
                step()
                if round_:  # the first round warms up
                    times[name].append(time.perf_counter() - began)
    finally:
        torch.set_num_threads(previous)
    load = meter.stop()
    medians = {name: statistics.median(values) for name, values in times.items()}
    plains = {n: t for n, t in medians.items() if n.startswith("plain")}
    best = min(plains, key=plains.__getitem__)
    half = training_seconds[len(training_seconds) // 2 :] or training_seconds
    pipe_times = times["pipe"] if local else half
    return Comparison(
        plain=plains[best],
        plain_threads=int(best.removeprefix("plain")),
        pipe=medians["pipe"] if local else statistics.median(half),
        never=medians.get("never"),
        pipe_measured_in_training=not local,
        verdict=judge("plain training", times[best], "the pipe", pipe_times, load),
    )


def _trained(
    settings: DemoSettings, corpus: Corpus, state: dict[str, torch.Tensor]
) -> nn.Sequential:
    model = build_model(settings, corpus)
    model.load_state_dict(state)
    return model


def _plain_step(
    settings: DemoSettings,
    corpus: Corpus,
    state: dict[str, torch.Tensor],
    batch: tuple[torch.Tensor, torch.Tensor],
) -> Callable[[], None]:
    """One step of plain gradient accumulation over the demo's micro-batches."""
    model = _trained(settings, corpus, state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-9)
    ids, targets = batch
    pieces = list(zip(ids.chunk(settings.chunks), targets.chunk(settings.chunks)))

    def step() -> None:
        for x, y in pieces:
            (gpt_loss(model(x), y) * (len(x) / len(ids))).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _pipe_step(
    settings: DemoSettings,
    corpus: Corpus,
    state: dict[str, torch.Tensor],
    balance: list[int],
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    checkpoint: str | None = None,
) -> Callable[[], None]:
    """One step of a local pipe shaped as the demo's, with its own copy of the model."""
    from gpipe.pipe import GPipe

    pipe = GPipe(
        _trained(settings, corpus, state),
        balance,
        devices=["cpu"] * settings.stages,
        chunks=settings.chunks,
        checkpoint=checkpoint or settings.checkpoint,
        schedule=settings.schedule,
        virtual_stages=virtual_stages(settings.schedule),
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-9)
    ids, targets = batch

    def step() -> None:
        pipe.train_step(ids, targets, gpt_loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def comparison_rows(s: DemoSettings, comparison: Comparison) -> list[tuple[str, float, str]]:
    """(name, seconds, what it costs) for plain training and each pipe timed."""
    threads = comparison.plain_threads
    rows = [
        (
            f"plain training, {threads} thread{'s' if threads > 1 else ''}",
            comparison.plain,
            "the micro-batches one after another: nothing recomputed, no hand-offs, no idle stage",
        ),
        (
            f"pipe, checkpoint {s.checkpoint}",
            comparison.pipe,
            _pipe_note(s.checkpoint, s.stages)
            + (" (timed during training)" if comparison.pipe_measured_in_training else ""),
        ),
    ]
    if comparison.never is not None:
        rows.append(("pipe, checkpoint never", comparison.never, _pipe_note("never", s.stages)))
    return rows


def _pipe_note(checkpoint: str, stages: int) -> str:
    costs = {
        "never": "keeps every micro-batch's activations instead of recomputing them",
        "except_last": "recomputes each stage's forward in its backward, but for the last "
        "micro-batch",
        "always": "recomputes each stage's forward in its backward",
    }
    return f"{stages} stages at once, a hand-off per action; {costs[checkpoint]}"
