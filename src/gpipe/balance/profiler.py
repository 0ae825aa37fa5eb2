"""Profiling: what each layer of an nn.Sequential costs in time and memory, measured."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe.arguments import NOT_A_CHAIN
from gpipe.balance.layer_profile import Profile
from gpipe.balance.layer_timing import (
    Cost,
    fresh,
    pooled,
    signatures,
    summarize,
    time_rounds,
    total,
)
from gpipe.balance.optimizer_state import OptimizerSpec, optimizer_state_factor
from gpipe.runtime.saved import SavedBytes, gradient_bytes, storage_keys, tensor_bytes
from gpipe.runtime.split_backward import backward_input
from gpipe.structure import leaves, map_tensors

__all__ = ["preserved", "profile", "profile_samples"]


def profile(
    module: nn.Sequential,
    sample: Any,
    *,
    device: str | torch.device = "cpu",
    repeats: int = 5,
    warmup: int = 2,
    optimizer: OptimizerSpec = None,
    split_backward: bool = False,
    pool: bool = True,
) -> Profile:
    """Measure every layer of ``module`` on ``sample``, one layer at a time.

    The sample flows as in ``nn.Sequential``: each layer's output is the next layer's input.
    Saved bytes come from one more pass through all layers as one graph, as a stage runs, so
    a tensor that neighbouring layers both save counts once, for the first (they add up).
    Each layer runs forward on a fresh copy of its input (floating tensors requiring grad),
    then backward from a gradient of ones for every floating output that requires grad. The
    model runs in train mode; afterwards its modes, parameter gradients, buffers (BatchNorm
    statistics) and the random number generators are as they were.

    Times hold on a busy host (see :func:`profile_samples`): the repeats run in rounds over
    all layers, each layer keeps its fastest run, and identical layers share one cost.

    Args:
        module: the model; layers not on ``device`` are profiled on a copy moved there.
        sample: one micro-batch of input (a tensor, or tensors in tuples, lists, dicts).
        device: where to run.
        repeats: timed runs per layer; the fastest is kept, the first quartile sets the
            spread.
        warmup: untimed runs before them.
        optimizer: which optimizer's state to count, see
            :func:`gpipe.balance.optimizer_state.optimizer_state_factor`.
        split_backward: also time each layer's input gradient alone, to split its backward
            into B and W for zero-bubble schedules (``Profile.weight``).
        pool: give identical layers (same class, configuration, parameter shapes and input
            shapes) one cost, the median of their own: noise cannot then tell them apart.

    Returns:
        The per-layer :class:`Profile`.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: an empty module or sample, ``repeats < 1``, ``warmup < 0``, or an unknown
            optimizer.
    """
    return profile_samples(
        module,
        [sample],
        device=device,
        repeats=repeats,
        warmup=warmup,
        optimizer=optimizer,
        split_backward=split_backward,
        pool=pool,
    )[0]


def profile_samples(
    module: nn.Sequential,
    samples: Sequence[Any],
    *,
    device: str | torch.device = "cpu",
    repeats: int = 5,
    warmup: int = 2,
    optimizer: OptimizerSpec = None,
    split_backward: bool = False,
    pool: bool = True,
) -> list[Profile]:
    """One :class:`Profile` per sample (a micro-batch size each), timed in shared rounds.

    On a shared machine other work comes in bursts, and a burst that covers every repeat
    of a layer moves its cost however the repeats are summarized. So the repeats run in
    rounds: each round times every layer on every sample once, and each layer keeps its
    fastest round. Other work only ever adds time, so the fastest run is the layer's own
    cost, and a burst hits one round of every layer and sample alike, not all of one. The
    first quartile of the rounds, relative to the fastest, is the layer's ``spread``: how
    far this host's noise could move the fastest.

    Identical layers (with ``pool``) share one cost, the median of their fastest runs, so
    a balance over six equal blocks does not follow which of them a burst hit.

    On a CPU with several intra-op threads each layer is also timed on one thread, and the
    faster way kept: while other work holds a core, every parallel op waits for its
    threads, which no number of rounds gets past (see :mod:`gpipe.balance.layer_timing`).

    ``module``, ``device``, ``repeats``, ``warmup``, ``optimizer``, ``split_backward`` and
    ``pool`` are as :func:`profile` takes them.

    Args:
        samples: micro-batches of input, one profile each.

    Raises:
        ValueError: no samples; and what :func:`profile` raises.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"profile needs an nn.Sequential, got {type(module).__name__}; wrap layers that "
            f"run one after the other: nn.Sequential(*layers); {NOT_A_CHAIN}"
        )
    if len(module) == 0:
        raise ValueError("profile needs a module with at least one layer, got an empty one")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats=}, {warmup=}")
    if not samples:
        raise ValueError("profile_samples needs at least one sample")
    for sample in samples:
        _check_sample(sample)
    factor = optimizer_state_factor(optimizer)
    device = torch.device(device)

    with preserved(module, device):
        module.train()
        layers = [_on_device(layer, device) for layer in module]
        given = [map_tensors(lambda t: t.detach().to(device), sample) for sample in samples]
        inputs = [_layer_inputs(layers, value) for value in given]
        timings = time_rounds(layers, inputs, device, repeats, warmup, split_backward)
        profiles = []
        for s, value in enumerate(given):
            chain = _attribute(layers, value)
            costs = [
                min((summarize(way[s][i]) for way in timings), key=total)
                for i in range(len(layers))
            ]
            if pool:
                costs = pooled(costs, signatures(layers, inputs[s]))
            profiles.append(
                _assemble(module, layers, inputs[s], chain, costs, factor, split_backward)
            )
    return profiles


def _layer_inputs(layers: list[nn.Module], value: Any) -> list[Any]:
    """What each layer receives when the sample flows through them all (detached)."""
    received = []
    with torch.no_grad():
        for layer in layers:
            received.append(value)
            value = map_tensors(torch.Tensor.detach, layer(fresh(value)))
    return received


def _assemble(
    module: nn.Sequential,
    layers: list[nn.Module],
    received: list[Any],
    chain: _Chain,
    costs: list[Cost],
    factor: int,
    split: bool,
) -> Profile:
    """The profile of one sample from its timings, bytes and chain attribution."""
    parameters = [list({id(p): p for p in layer.parameters()}.values()) for layer in layers]
    return Profile(
        names=[type(layer).__name__ for layer in module],
        forward=[c.forward for c in costs],
        backward=[c.backward for c in costs],
        output_bytes=chain.outputs,
        activation_bytes=chain.saved,
        parameter_bytes=[sum(_nbytes(p) for p in params) for params in parameters],
        gradient_bytes=[
            sum(_nbytes(p) for p in params if p.requires_grad) for params in parameters
        ],
        optimizer_bytes=[
            factor * sum(_nbytes(p) for p in params if p.requires_grad) for params in parameters
        ],
        input_bytes=chain.inputs,
        saved_input_bytes=chain.saved_inputs,
        cpu=[c.cpu for c in costs],
        weight=[c.weight for c in costs] if split else [],
        deferred_bytes=[_deferred_bytes(layer, value) for layer, value in zip(layers, received)]
        if split
        else [],
        spread=[c.spread for c in costs],
    )


def _check_sample(sample: Any) -> None:
    """Raise ValueError unless ``sample`` holds at least one tensor and no empty tensor."""
    tensors = [leaf for leaf in leaves(sample) if isinstance(leaf, torch.Tensor)]
    if not tensors or any(t.numel() == 0 for t in tensors):
        raise ValueError(
            "the sample must be a non-empty batch the size of one micro-batch, e.g. "
            f"torch.randn(8, 512); got {_describe(sample)}"
        )


@dataclass(frozen=True)
class _Chain:
    saved: list[int]
    inputs: list[int]
    saved_inputs: list[int]
    outputs: list[int]


def _attribute(layers: list[nn.Module], sample: Any) -> _Chain:
    """Saved bytes per layer when the layers run as one graph, each storage to its first saver.

    This is how a stage runs in the pipeline, so per-layer numbers add up to the stage's, and
    they follow the runtime's rule (:mod:`gpipe.runtime.saved`).
    """
    # Parameters saved for backward (Linear saves its weight) are not activations.
    own = [t for layer in layers for t in (*layer.parameters(), *layer.buffers())]
    counter = SavedBytes(storage_keys(own))
    saved, inputs, saved_inputs, outputs = [], [], [], []
    value = fresh(sample)
    # NOTE: every output stays referenced, so no counted storage is freed (a graph cut by an
    # argmax would be) and its address reused by a later tensor that would then go uncounted.
    kept = [value]
    with (
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack),
    ):
        for layer in layers:
            given = [leaf for leaf in leaves(value) if isinstance(leaf, torch.Tensor)]
            before, counted_before = counter.nbytes, [counter.counted(t) for t in given]
            value = layer(value)
            kept.append(value)
            outputs.append(
                sum(
                    t.numel() * t.element_size()
                    for t in {
                        id(x): x for x in leaves(value) if isinstance(x, torch.Tensor)
                    }.values()
                )
            )
            saved.append(counter.nbytes - before)
            inputs.append(gradient_bytes(given))
            # what this layer counted for its own input, which a stage starting here keeps
            # anyway (each storage once)
            newly = {
                next(iter(storage_keys([t])), id(t)): counter.counted(t) - was
                for t, was in zip(given, counted_before)
                if counter.counted(t) > was
            }
            saved_inputs.append(sum(newly.values()))
    return _Chain(saved, inputs, saved_inputs, outputs)


def _deferred_bytes(layer: nn.Module, value: Any) -> int:
    """What a zero-bubble B of ``layer`` keeps for its W: the gradients at its forks."""
    inputs = fresh(value)
    output = layer(inputs)
    roots = [t for t in leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    wanted = [t for t in leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    params = [p for p in layer.parameters() if p.requires_grad]
    if not roots or not wanted:
        return 0
    _, later = backward_input([(r, torch.ones_like(r)) for r in roots], wanted, params)
    return gradient_bytes([grads for _, grads, _ in later.parts])


def _on_device(layer: nn.Module, device: torch.device) -> nn.Module:
    """``layer`` itself if it lives on ``device``, else a copy moved there (never the user's)."""
    tensors = [*layer.parameters(), *layer.buffers()]
    if all(_same_device(t.device, device) for t in tensors):
        return layer
    return copy.deepcopy(layer).to(device)


def _same_device(actual: torch.device, wanted: torch.device) -> bool:
    if actual.type != wanted.type:
        return False
    return wanted.index is None or actual.index == wanted.index


@contextmanager
def preserved(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Restore ``module``'s train/eval modes, gradients and buffers, and the RNG, on exit."""
    modes = [(m, m.training) for m in module.modules()]
    grads = [(p, p.grad) for p in module.parameters()]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    for p, _ in grads:
        p.grad = None
    rng_devices = []
    if device.type == "cuda":
        rng_devices = [device.index if device.index is not None else torch.cuda.current_device()]
    try:
        with torch.random.fork_rng(devices=rng_devices):
            yield
    finally:
        for m, training in modes:
            m.training = training
        for p, grad in grads:
            p.grad = grad
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor_bytes(tensor)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value) if len(repr(value)) < 60 else type(value).__name__
