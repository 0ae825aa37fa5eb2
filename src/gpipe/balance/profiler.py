"""Profiling: what each layer of an nn.Sequential costs in time and memory, measured."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe.arguments import NOT_A_CHAIN
from gpipe.balance.layer_profile import Profile
from gpipe.balance.optimizer_state import OptimizerSpec, optimizer_state_factor
from gpipe.runtime.saved import SavedBytes, gradient_bytes, storage_keys, tensor_bytes
from gpipe.runtime.split_backward import backward_input
from gpipe.structure import leaves, map_tensors

__all__ = ["profile"]


def profile(
    module: nn.Sequential,
    sample: Any,
    *,
    device: str | torch.device = "cpu",
    repeats: int = 5,
    warmup: int = 2,
    optimizer: OptimizerSpec = None,
    split_backward: bool = False,
) -> Profile:
    """Measure every layer of ``module`` on ``sample``, one layer at a time.

    The sample flows as in ``nn.Sequential``: each layer's output is the next layer's input.
    Saved bytes come from one more pass through all layers as one graph, as a stage runs, so
    a tensor that neighbouring layers both save counts once, for the first (they add up).
    Each layer runs forward on a fresh copy of its input (floating tensors requiring grad),
    then backward from a gradient of ones for every floating output that requires grad. The
    model runs in train mode; afterwards its modes, parameter gradients, buffers (BatchNorm
    statistics) and the random number generators are as they were.

    Args:
        module: the model; layers not on ``device`` are profiled on a copy moved there.
        sample: one micro-batch of input (a tensor, or tensors in tuples, lists, dicts).
        device: where to run.
        repeats: timed runs per layer; the median is kept.
        warmup: untimed runs before them.
        optimizer: which optimizer's state to count, see
            :func:`gpipe.balance.optimizer_state.optimizer_state_factor`.
        split_backward: also time each layer's input gradient alone, to split its backward
            into B and W for zero-bubble schedules (``Profile.weight``).

    Returns:
        The per-layer :class:`Profile`.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: an empty module or sample, ``repeats < 1``, ``warmup < 0``, or an unknown
            optimizer.
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
    _check_sample(sample)
    factor = optimizer_state_factor(optimizer)
    device = torch.device(device)

    measured: list[_LayerCost] = []
    with _preserved(module, device):
        module.train()
        value = map_tensors(lambda t: t.detach().to(device), sample)
        for layer in module:
            cost, value = _measure(
                _on_device(layer, device), value, device, repeats, warmup, split_backward
            )
            measured.append(cost)
        layers = [_on_device(layer, device) for layer in module]
        chain = _attribute(layers, map_tensors(lambda t: t.detach().to(device), sample))

    return Profile(
        names=[type(layer).__name__ for layer in module],
        forward=[c.forward for c in measured],
        backward=[c.backward for c in measured],
        output_bytes=[c.output_bytes for c in measured],
        activation_bytes=chain.saved,
        parameter_bytes=[c.parameter_bytes for c in measured],
        gradient_bytes=[c.trainable_bytes for c in measured],
        optimizer_bytes=[factor * c.trainable_bytes for c in measured],
        input_bytes=chain.inputs,
        saved_input_bytes=chain.saved_inputs,
        cpu=[c.cpu for c in measured],
        weight=[c.weight for c in measured] if split_backward else [],
        deferred_bytes=[c.deferred_bytes for c in measured] if split_backward else [],
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
class _LayerCost:
    forward: float
    backward: float
    output_bytes: int
    parameter_bytes: int
    trainable_bytes: int
    cpu: float
    weight: float
    deferred_bytes: int


@dataclass(frozen=True)
class _Chain:
    saved: list[int]
    inputs: list[int]
    saved_inputs: list[int]


def _attribute(layers: list[nn.Module], sample: Any) -> _Chain:
    """Saved bytes per layer when the layers run as one graph, each storage to its first saver.

    This is how a stage runs in the pipeline, so per-layer numbers add up to the stage's, and
    they follow the runtime's rule (:mod:`gpipe.runtime.saved`).
    """
    # Parameters saved for backward (Linear saves its weight) are not activations.
    own = [t for layer in layers for t in (*layer.parameters(), *layer.buffers())]
    counter = SavedBytes(storage_keys(own))
    saved, inputs, saved_inputs = [], [], []
    value = _fresh(sample)
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
    return _Chain(saved, inputs, saved_inputs)


def _measure(
    layer: nn.Module, value: Any, device: torch.device, repeats: int, warmup: int, split: bool
) -> tuple[_LayerCost, Any]:
    """One layer's cost on input ``value``, and its output (detached) for the next layer."""
    params = list({id(p): p for p in layer.parameters()}.values())
    inputs = _fresh(value)
    output = layer(inputs)
    output_bytes = sum(
        leaf.numel() * leaf.element_size()
        for leaf in {id(x): x for x in leaves(output) if isinstance(x, torch.Tensor)}.values()
    )
    next_value = map_tensors(torch.Tensor.detach, output)
    del inputs, output

    forward: list[float] = []
    backward: list[float] = []
    input_only: list[float] = []
    cpu: list[float] = []
    for run in range(warmup + repeats):
        inputs = _fresh(value)
        for p in params:
            p.grad = None
        _synchronize(device)
        start_cpu = time.thread_time()
        start = time.perf_counter()
        output = layer(inputs)
        _synchronize(device)
        middle = time.perf_counter()
        roots = [
            leaf for leaf in leaves(output) if isinstance(leaf, torch.Tensor) and leaf.requires_grad
        ]
        grads = [torch.ones_like(root) for root in roots]
        begin = time.perf_counter()
        if roots:
            torch.autograd.backward(roots, grads)
        _synchronize(device)
        end = time.perf_counter()
        if run >= warmup:
            forward.append(middle - start)
            backward.append(end - begin if roots else 0.0)
            cpu.append(time.thread_time() - start_cpu)
            if split:
                input_only.append(_input_gradient_seconds(layer, value, device))
        del inputs, output, roots, grads
    for p in params:
        p.grad = None

    cost = _LayerCost(
        forward=statistics.median(forward),
        backward=statistics.median(backward),
        output_bytes=output_bytes,
        parameter_bytes=sum(_nbytes(p) for p in params),
        trainable_bytes=sum(_nbytes(p) for p in params if p.requires_grad),
        cpu=statistics.median(cpu),
        weight=max(0.0, statistics.median(backward) - statistics.median(input_only))
        if split
        else 0.0,
        deferred_bytes=_deferred_bytes(layer, value) if split else 0,
    )
    return cost, next_value


def _input_gradient_seconds(layer: nn.Module, value: Any, device: torch.device) -> float:
    """Seconds of the input gradient alone (what a zero-bubble B runs): no weight gradient."""
    inputs = _fresh(value)
    output = layer(inputs)
    roots = [t for t in leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    wanted = [t for t in leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    _synchronize(device)
    start = time.perf_counter()
    if roots and wanted:
        grads = [torch.ones_like(r) for r in roots]
        torch.autograd.grad(roots, wanted, grads, allow_unused=True)
    _synchronize(device)
    return time.perf_counter() - start


def _deferred_bytes(layer: nn.Module, value: Any) -> int:
    """What a zero-bubble B of ``layer`` keeps for its W: the gradients at its forks."""
    inputs = _fresh(value)
    output = layer(inputs)
    roots = [t for t in leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    wanted = [t for t in leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    params = [p for p in layer.parameters() if p.requires_grad]
    if not roots or not wanted:
        return 0
    _, later = backward_input([(r, torch.ones_like(r)) for r in roots], wanted, params)
    return gradient_bytes([grads for _, grads, _ in later.parts])


def _fresh(value: Any) -> Any:
    """A new input: leaves that take gradients if floating, cloned off those leaves."""

    def fresh(tensor: torch.Tensor) -> torch.Tensor:
        differentiable = tensor.is_floating_point() or tensor.is_complex()
        leaf = tensor.detach().requires_grad_(differentiable)
        # NOTE: an in-place layer (ReLU(inplace=True)) may not write into a leaf that requires
        # grad, nor into the value every repeat starts from; a clone is neither.
        return leaf.clone()

    return map_tensors(fresh, value)


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
def _preserved(module: nn.Module, device: torch.device) -> Iterator[None]:
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


def _synchronize(device: torch.device) -> None:
    # CUDA runs asynchronously: without this the clock would time the launch, not the work.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor_bytes(tensor)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value) if len(repr(value)) < 60 else type(value).__name__
