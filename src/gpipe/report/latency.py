"""Pipelines of known latency: stages that sleep, so a bubble is measured, not guessed.

A :class:`~gpipe.models.SleepLayer` sleeps F ms forward and B ms backward (W ms for the
weight gradient), releasing the GIL as an accelerator kernel would. On such stages every
stage costs exactly what it says, on any machine, however loaded: what the runtime measures
beyond the sleeps is its own cost, hand-offs and waits.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from gpipe.analysis import Timeline
from gpipe.models import sleep_stages
from gpipe.pipe import GPipe

__all__ = ["SleptStep", "sleep_pipeline"]

WIDTH = 64  # floats per sample: small, so hand-offs cost what the runtime costs


@dataclass(frozen=True)
class SleptStep:
    """Medians over the timed steps, and the last step's timeline."""

    seconds: float
    bubble: float
    timeline: Timeline


def mean_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss that keeps nothing for its backward, so every stage holds only its input."""
    return output.mean() + 0 * target.mean()


def sleep_pipeline(
    stages: int,
    microbatches: int,
    forward_ms: float,
    backward_ms: float,
    *,
    weight_ms: float = 0.0,
    schedule: str = "gpipe",
    virtual_stages: int = 1,
    steps: int = 3,
    rows_per_microbatch: int = 1,
) -> SleptStep:
    """Train ``steps`` steps (after one warm-up) of K sleeping stages; medians of them.

    Each device's share of the model costs ``forward_ms`` forward, ``backward_ms``
    backward and ``weight_ms`` weight gradient, whether it holds one stage or
    ``virtual_stages`` stages of proportionally shorter layers.
    """
    v = virtual_stages
    model = sleep_stages(stages * v, forward_ms / v, backward_ms / v, weight_ms / v)
    pipe = GPipe(
        model,
        [1] * (stages * v),
        devices=["cpu"] * stages,
        chunks=microbatches,
        checkpoint="never",
        schedule=schedule,
        virtual_stages=v,
    )
    # NOTE: the input requires grad so stage 0 runs B and W apart like every other stage.
    x = torch.randn(microbatches * rows_per_microbatch, WIDTH, requires_grad=True)
    target = torch.zeros(len(x), WIDTH)
    pipe.train_step(x, target, mean_loss)  # warm-up: threads started, schedule validated
    seconds, bubbles = [], []
    for _ in range(steps):
        began = time.perf_counter()
        pipe.train_step(x, target, mean_loss)
        seconds.append(time.perf_counter() - began)
        bubbles.append(pipe.timeline.bubble)
    return SleptStep(statistics.median(seconds), statistics.median(bubbles), pipe.timeline)
