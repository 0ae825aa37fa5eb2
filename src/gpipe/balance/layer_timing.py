"""Timing layers on a busy host: rounds over every layer and size, the fastest run kept.

What :func:`gpipe.balance.profiler.profile_samples` times with. Each round runs every layer
on every sample once (and on a CPU with several intra-op threads, once more on one thread);
each layer keeps its fastest run and a spread that says how far that estimate might move;
identical layers share one cost. See the profiler for why each of these holds on a shared
machine.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe.structure import leaves, map_tensors

__all__ = [
    "Cost",
    "Samples",
    "fresh",
    "pooled",
    "run_once",
    "signatures",
    "summarize",
    "synchronize",
    "time_rounds",
    "total",
]


@dataclass
class Samples:
    """One layer's timed runs on one sample."""

    forward: list[float]
    backward: list[float]
    input_only: list[float]
    cpu: list[float]


def time_rounds(
    layers: list[nn.Module],
    inputs: list[list[Any]],
    device: torch.device,
    repeats: int,
    warmup: int,
    split: bool,
) -> list[list[list[Samples]]]:
    """``[way][sample][layer]`` timed runs: ``warmup`` untimed rounds, then ``repeats``
    timed, each round every layer on every sample once, each way (see :func:`_thread_ways`)."""
    ways = _thread_ways(device)
    found = [[[Samples([], [], [], []) for _ in layers] for _ in inputs] for _ in ways]
    for run in range(warmup + repeats):
        for way, threads in enumerate(ways):
            with _intra_op_threads(threads):
                for s, received in enumerate(inputs):
                    for i, layer in enumerate(layers):
                        timed = run_once(layer, received[i], device, split)
                        if run >= warmup:
                            into = found[way][s][i]
                            into.forward.append(timed[0])
                            into.backward.append(timed[1])
                            into.cpu.append(timed[2])
                            if split:
                                into.input_only.append(timed[3])
    for layer in layers:
        for p in layer.parameters():
            p.grad = None
    return found


def _thread_ways(device: torch.device) -> list[int]:
    """The intra-op thread counts each layer is timed with: torch's, and on a CPU with more
    than one, also one thread alone.

    NOTE: a parallel op waits for all its threads; while other work holds a core, one of
    them waits for it, and every op of the layer takes milliseconds, for as long as the
    other work lasts (a profile 30x slow was seen on a 2-core host with one core busy). A
    single thread waits for nobody. The faster of the two ways is kept for each layer: on
    a quiet host the parallel one (or a tie), on a busy one the other, at most ``threads``
    times the quiet cost instead of unbounded.
    """
    threads = torch.get_num_threads()
    return [threads, 1] if device.type == "cpu" and threads > 1 else [threads]


@contextmanager
def _intra_op_threads(threads: int) -> Iterator[None]:
    """Run with ``threads`` intra-op threads, then torch's count as it was."""
    before = torch.get_num_threads()
    if threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def run_once(
    layer: nn.Module, value: Any, device: torch.device, split: bool
) -> tuple[float, float, float, float]:
    """One forward and backward of ``layer`` on a fresh copy of ``value``: (forward,
    backward, CPU seconds of this thread, input gradient alone or 0) in seconds."""
    inputs = fresh(value)
    for p in layer.parameters():
        p.grad = None
    synchronize(device)
    start_cpu = time.thread_time()
    start = time.perf_counter()
    output = layer(inputs)
    synchronize(device)
    middle = time.perf_counter()
    roots = [t for t in leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    begin = time.perf_counter()
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(root) for root in roots])
    synchronize(device)
    end = time.perf_counter()
    cpu = time.thread_time() - start_cpu
    differentiable = bool(roots)
    del inputs, output, roots
    input_only = _input_gradient_seconds(layer, value, device) if split else 0.0
    return middle - start, (end - begin) if differentiable else 0.0, cpu, input_only


@dataclass(frozen=True)
class Cost:
    """One layer's summarized times: the fastest run of each, and the spread."""

    forward: float
    backward: float
    cpu: float
    weight: float
    spread: float


def summarize(t: Samples) -> Cost:
    """The fastest runs (other work only adds time), and how far the estimate might move."""
    forward, backward = min(t.forward), min(t.backward)
    fastest = forward + backward
    in_order = [f + b for f, b in zip(t.forward, t.backward)]
    totals = sorted(in_order)
    # NOTE: the first quartile, not the median: a burst may cover half the rounds, and the
    # spread stands for how far the fastest run itself might move, not for the bursts
    typical = fastest
    if len(totals) > 1:
        typical = statistics.quantiles(totals, n=4, method="inclusive")[0]
    # NOTE: a host's speed also drifts over seconds (other tenants, clocks), which no
    # round-to-round spread shows: the fastest of the first half of the rounds against the
    # fastest of the second half says how far the estimate itself moved while it was taken
    half = len(in_order) // 2
    drift = abs(min(in_order[:half]) - min(in_order[half:])) if half else 0.0
    weight = max(0.0, backward - min(t.input_only)) if t.input_only else 0.0
    # NOTE: the CPU share of the fastest run, not the median: the share a quiet host shows
    runs = sorted(zip(t.forward, t.backward, t.cpu), key=lambda r: r[0] + r[1])
    cpu = runs[0][2]
    spread = max(typical - fastest, drift) / fastest if fastest > 0 else 0.0
    return Cost(forward, backward, cpu, weight, spread)


def total(cost: Cost) -> float:
    return cost.forward + cost.backward


def signatures(layers: list[nn.Module], received: list[Any]) -> list[tuple[Any, ...]]:
    """What makes two layers cost the same: class, configuration, parameters, inputs."""

    def tensors(value: Any) -> tuple[Any, ...]:
        return tuple(
            (tuple(t.shape), t.dtype, t.device.type) if isinstance(t, torch.Tensor) else repr(t)
            for t in leaves(value)
        )

    return [
        (
            repr(layer),
            tuple((tuple(p.shape), p.dtype, p.requires_grad) for p in layer.parameters()),
            tuple((tuple(b.shape), b.dtype) for b in layer.buffers()),
            tensors(value),
        )
        for layer, value in zip(layers, received)
    ]


def pooled(costs: list[Cost], signatures: list[tuple[Any, ...]]) -> list[Cost]:
    """Each group of identical layers given one cost: the median of the group's."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, signature in enumerate(signatures):
        groups.setdefault(signature, []).append(i)
    pooled = list(costs)
    for members in groups.values():
        if len(members) > 1:
            mine = [costs[i] for i in members]
            shared = Cost(
                *(
                    statistics.median(getattr(c, f.name) for c in mine)
                    for f in dataclasses.fields(Cost)
                )
            )
            for i in members:
                pooled[i] = shared
    return pooled


def _input_gradient_seconds(layer: nn.Module, value: Any, device: torch.device) -> float:
    """Seconds of the input gradient alone (what a zero-bubble B runs): no weight gradient."""
    inputs = fresh(value)
    output = layer(inputs)
    roots = [t for t in leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    wanted = [t for t in leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    synchronize(device)
    start = time.perf_counter()
    if roots and wanted:
        grads = [torch.ones_like(r) for r in roots]
        torch.autograd.grad(roots, wanted, grads, allow_unused=True)
    synchronize(device)
    return time.perf_counter() - start


def fresh(value: Any) -> Any:
    """A new input: leaves that take gradients if floating, cloned off those leaves."""

    def fresh(tensor: torch.Tensor) -> torch.Tensor:
        differentiable = tensor.is_floating_point() or tensor.is_complex()
        leaf = tensor.detach().requires_grad_(differentiable)
        # NOTE: an in-place layer (ReLU(inplace=True)) may not write into a leaf that requires
        # grad, nor into the value every repeat starts from; a clone is neither.
        return leaf.clone()

    return map_tensors(fresh, value)


def synchronize(device: torch.device) -> None:
    # CUDA runs asynchronously: without this the clock would time the launch, not the work.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
