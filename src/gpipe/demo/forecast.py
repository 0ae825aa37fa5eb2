"""The demo's stages and the simulator's prediction of their step, before training.

The four transformer blocks are alike, so the demo cuts the model by parameter count (timing
layers on a busy 2-core machine is noisier than the differences it would find). The
prediction times each layer alone on one micro-batch (:func:`gpipe.balance.profile`, the
least of three profiles), sums the layers of each stage, adds the forward that
re-materialization repeats in the backward, and simulates the schedule with those costs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from torch import nn

from gpipe.analysis import Costs, Timeline, simulate
from gpipe.balance import balance_by_params
from gpipe.bench.measure import layer_times
from gpipe.demo.recipe import Corpus, DemoSettings
from gpipe.demo.training import virtual_stages
from gpipe.models import windows
from gpipe.schedule import make_schedule

__all__ = ["Partition", "partition"]


@dataclass(frozen=True)
class Partition:
    """Layers per stage, and the simulated step of the demo's schedule on them."""

    balance: list[int]
    predicted: Timeline


def partition(settings: DemoSettings, corpus: Corpus, model: nn.Sequential) -> Partition:
    """Balance ``model`` by parameters and predict the step from profiled layer costs."""
    v = virtual_stages(settings.schedule)
    balance = balance_by_params(model, settings.stages * v)
    size = max(1, settings.batch // settings.chunks)
    microbatch, _ = windows(corpus.train, size, corpus.config.context)
    layer_forward, layer_backward = layer_times(model, microbatch)
    bounds = [sum(balance[:stage]) for stage in range(len(balance) + 1)]
    spans = list(itertools.pairwise(bounds))
    forward = [sum(layer_forward[a:b]) for a, b in spans]
    m = settings.chunks
    recomputed = {"always": 1.0, "except_last": (m - 1) / m, "never": 0.0}[settings.checkpoint]
    backward = [sum(layer_backward[a:b]) + recomputed * f for (a, b), f in zip(spans, forward)]
    schedule = make_schedule(settings.schedule, settings.stages, m, virtual_stages=v)
    return Partition(balance, simulate(schedule, Costs(forward=forward, backward=backward)))
